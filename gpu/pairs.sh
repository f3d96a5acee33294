#!/usr/bin/env bash
# Issue 8's targets, one device call on nvidia-h200-x2: stock and z3guard alternate in one process
# group, twice per configuration, so each target is checked on two side-by-side pairs:
# offload_param + offload_optimizer (z3guard >= 4 x faster than stock) and offload_param alone
# (z3guard <= 1.15 x the no-offload stock step).
#   bash gpu/pairs.sh <call-name>
. gpu/call.sh "$@"
python3 bench/run.py --device cuda --warmup 3 --steps ${STEPS:-20} --timeout 520 --out "$out/$call.json" \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer \
  --run gpt2:stock:none --run gpt2:z3guard:param --run gpt2:stock:none --run gpt2:z3guard:param 2>&1 | tail -16
