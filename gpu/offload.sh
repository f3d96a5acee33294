#!/usr/bin/env bash
# Issue 8 on 2 GPUs, one device call: bit-identity of the offload fast paths (52 steps, 5 skipped) and
# the offload benchmark with each run in its own process group (so each run's peak host memory is its own).
#   bash gpu/offload.sh <call-name>          # on nvidia-h200-x2, writes under $OUT
. gpu/call.sh "$@"
bit_identity
python3 bench/run.py --device cuda --isolate --warmup 3 --steps ${STEPS:-30} --timeout 300 --out "$out/$call.json" \
  --run gpt2:stock:none --run gpt2:z3guard:param \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer 2>&1 | tail -25
