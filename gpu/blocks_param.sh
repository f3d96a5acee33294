#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2 (at the commit named in docs/benchmarks.md): blocks fetched
# whole, offload_param only against the no-offload stock step (target <= 1.15 x), and without offload:
# stock none, z3guard param, z3guard-noblocks param, z3guard none, stock none; a process group each.
#   bash gpu/blocks_param.sh <call-name>
. gpu/call.sh "$@"
python3 bench/run.py --device cuda --isolate --warmup 8 --steps 15 --timeout 200 --out "$out/$call.json" \
  --run gpt2:stock:none --run gpt2:z3guard:param --run gpt2:z3guard-noblocks:param --run gpt2:z3guard:none \
  --run gpt2:stock:none 2>&1 | tail -9
