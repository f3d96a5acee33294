#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: the stage-3 step's parts under device-synchronised timers
# (gpu/breakdown.sh's first half), z3guard / stock / z3guard with both offloads, 12 warm-up + 20 timed
# steps each, at the code on main (after b24: fast_grad_offload and the fp32 gradients cast on the host).
#   bash gpu/timers.sh <call-name>
. gpu/call.sh "$@"
python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/profile_step.py --offload param+optimizer \
  --device cuda --timers-only --warmup 12 --steps 20 --variants z3guard --variants stock --variants z3guard \
  --out "$out/timers-$call.json" > "$out/timers-$call.log" 2>&1
grep -v "^\s*$" "$out/timers-$call.log" | grep -v Warning | tail -24
