#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: with host threads on, the backward of offload_param +
# offload_optimizer was ~35 ms slower than without (c1, c2). Thread counts side by side in one process
# group, then the same with OpenMP's idle threads sleeping at once (OMP_WAIT_POLICY=PASSIVE).
#   bash gpu/threads.sh <call-name>
. gpu/call.sh "$@"
python3 bench/run.py --device cuda --warmup 3 --steps ${STEPS:-20} --timeout 400 --out "$out/$call-threads.json" \
  --run gpt2:z3guard:param+optimizer --run gpt2:z3guard-threads8:param+optimizer \
  --run gpt2:z3guard-nothreads:param+optimizer --run gpt2:stock:param+optimizer 2>&1 | tail -12
OMP_WAIT_POLICY=PASSIVE python3 bench/run.py --device cuda --warmup 3 --steps ${STEPS:-20} --timeout 150 \
  --out "$out/$call-passive.json" --run gpt2:z3guard:param+optimizer 2>&1 | tail -6
