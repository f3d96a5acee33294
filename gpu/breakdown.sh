#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: where the rest of z3guard's step goes under offload_param +
# offload_optimizer. (1) the stage-3 step's parts, device-synchronised timers only (no profiler inflating
# them), z3guard / stock / z3guard, 12 warm-up + 20 timed steps each; (2) the fused host pass of one
# rank's partition alone, then on two processes at once (as the two ranks run it), 16 and 8 threads.
#   bash gpu/breakdown.sh <call-name>
. gpu/call.sh "$@"
python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/profile_step.py --offload param+optimizer \
  --device cuda --timers-only --warmup 12 --steps 20 --variants z3guard --variants stock --variants z3guard \
  --out "$out/breakdown-$call.json" > "$out/breakdown-$call.log" 2>&1
grep -v "^\s*$" "$out/breakdown-$call.log" | grep -v Warning | tail -24
for threads in 16 8; do
  python3 bench/fused_step.py --numel 88700000 --threads $threads --repeats 5 --chunks 1048576 \
    --out "$out/fused-alone-$threads-$call.json" 2>&1 | tail -5
  for i in 0 1; do
    python3 bench/fused_step.py --numel 88700000 --threads $threads --repeats 5 --chunks 1048576 \
      --out "$out/fused-pair$i-$threads-$call.json" > "$out/fused-pair$i-$threads-$call.log" 2>&1 &
  done
  wait
  tail -5 "$out"/fused-pair*-$threads-$call.log
done
