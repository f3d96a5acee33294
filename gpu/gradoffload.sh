#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after fast_grad_offload (513f3b5): (1) GPU bit-identity of the
# both-offloads pair (52 steps, 5 skipped, GatheredParameters / eval forward / checkpoint right after
# `step`; each step's global gradient norm compared as well as losses, weights and optimizer states);
# (2) the step's parts under device-synchronised timers, z3guard / z3guard-nogradoffload / z3guard,
# 12 warm-up + 20 timed steps each (`partition_grads` in the backward, `_get_norm_groups` in the step).
#   bash gpu/gradoffload.sh <call-name>
. gpu/call.sh "$@"
bit_identity "" --only param+optimizer
timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/profile_step.py \
  --offload param+optimizer --device cuda --timers-only --warmup 12 --steps 20 --variants z3guard \
  --variants z3guard-nogradoffload --variants z3guard --out "$out/timers-$call.json" > "$out/timers-$call.log" 2>&1
grep -v "^\s*$" "$out/timers-$call.log" | grep -v Warning | tail -24
