#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after the fp32 gradients are cast on the host (hostgrads.py):
# (1) GPU bit-identity of the both-offloads pair (52 steps, 5 skipped, reads right after `step`, every
# gradient read with safe_get_full_grad before and after 6 steps and halved with safe_set_full_grad at 3);
# (2) one z3guard engine with fast_grad_offload (now: no fp32 copy to the host, the cast in the fused step)
# on and off on alternate steps, 12 warm-up + 30 timed steps, the step's parts under timers.
#   bash gpu/hostgrads.sh <call-name>
. gpu/call.sh "$@"
bit_identity "" --only param+optimizer
timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/profile_step.py \
  --offload param+optimizer --device cuda --timers-only --alternate --warmup 12 --steps 30 --variants z3guard \
  --out "$out/alternate-$call.json" > "$out/alternate-$call.log" 2>&1
grep -v "^\s*$" "$out/alternate-$call.log" | grep -v Warning | tail -30
