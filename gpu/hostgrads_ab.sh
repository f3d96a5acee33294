#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after b36 (gpu/hostgrads_pairs.sh, on a host whose steps
# moved by 2x within a run): (1) one z3guard engine with fast_grad_offload on and off on alternate steps
# (on: no fp32 gradient copy to the host, the cast in the fused step, the overflow check from the norms),
# 12 warm-up + 30 timed steps; (2) the harness, a process group per run, both offloads: stock, z3guard,
# stock, z3guard (10 warm-up + 12 timed steps).
#   bash gpu/hostgrads_ab.sh <call-name>
. gpu/call.sh "$@"
timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/profile_step.py \
  --offload param+optimizer --device cuda --timers-only --alternate --warmup 12 --steps 30 --variants z3guard \
  --out "$out/alternate-$call.json" > "$out/alternate-$call.log" 2>&1
grep -v "^\s*$" "$out/alternate-$call.log" | grep -v Warning | tail -21
ORDER="${ORDER:-stock z3guard stock z3guard}" STEPS=${STEPS:-12} bash gpu/isolated.sh "$call" | tail -6
