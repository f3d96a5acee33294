#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: which of z3guard's parts costs what under
# offload_param + offload_optimizer (forward / backward / step split), each fast path left out in turn,
# in one process group; then offload_param alone, stock vs z3guard, a process group each (peak host memory).
#   bash gpu/ab.sh <call-name>
. gpu/call.sh "$@"
python3 bench/run.py --device cuda --warmup 3 --steps ${STEPS:-20} --timeout 560 --out "$out/$call-ab.json" \
  --run gpt2:z3guard-nofast:param+optimizer --run gpt2:z3guard-nothreads:param+optimizer \
  --run gpt2:z3guard-nogather:param+optimizer --run gpt2:z3guard:param+optimizer \
  --run gpt2:stock:param+optimizer 2>&1 | tail -14
python3 bench/run.py --device cuda --isolate --warmup 3 --steps ${STEPS:-20} --timeout 200 --out "$out/$call-param.json" \
  --run gpt2:stock:param --run gpt2:z3guard:param 2>&1 | tail -9
