#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: where z3guard's offload_param + offload_optimizer step
# spends its time with every fast path (phase timers, torch.profiler's top ops, cProfile's Python).
#   bash gpu/profile.sh <call-name> [variant ...]
. gpu/call.sh "$@"
shift
variants=""
for v in "${@:-z3guard}"; do variants="$variants --variants $v"; done
Z3GUARD_PRINT_CPROFILE=1 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/profile_step.py \
  --offload param+optimizer --device cuda --steps 3 $variants > "$out/profile-$call.log" 2>&1
cp bench/results/profile-cuda-param-optimizer.json "$out/profile-cuda-$call.json"
grep -v "^\s*$" "$out/profile-$call.log" | head -60
