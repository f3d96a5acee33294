#!/usr/bin/env bash
# Issue 8 on 2 GPUs, one device call: bit-identity of the offload fast paths (52 steps, 5 skipped) and
# the offload benchmark with each run in its own process group (so each run's peak host memory is its own).
#   bash gpu/offload.sh <call-name>          # on nvidia-h200-x2, writes under $OUT
set -u
call=${1:-call}
out=${OUT:-/tmp/out}
mkdir -p "$out"
. gpu/env.sh 0.19.8 || exit 1
python3 gpu/steady_state.py --device cuda --steps 0 --out /tmp/steady > "$out/steady-$call.log" 2>&1
cp /tmp/steady/steady_state.json "$out/steady_state-$call.json"
tail -12 "$out/steady-$call.log"
python3 bench/run.py --device cuda --isolate --warmup 3 --steps ${STEPS:-30} --timeout 300 --out "$out/$call.json" \
  --run gpt2:stock:none --run gpt2:z3guard:param \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer 2>&1 | tail -25
