#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after the fused host step: bit-identity on 2 GPUs
# (52 steps, 5 skipped), the host step in isolation (bench/fused_step.py, 16 threads, GPT-2 medium's
# partition per rank), and offload_param + offload_optimizer with and without it beside stock.
#   bash gpu/fused.sh <call-name>
set -u
call=${1:-call}
out=${OUT:-/tmp/out}
mkdir -p "$out"
. gpu/env.sh 0.19.8 || exit 1
python3 gpu/steady_state.py --device cuda --steps 0 --out /tmp/steady > "$out/steady-$call.log" 2>&1
cp /tmp/steady/steady_state.json "$out/steady_state-$call.json"
tail -8 "$out/steady-$call.log"
python3 bench/fused_step.py --numel 88700000 --threads 16 --repeats 7 --out "$out/fused-step-$call.json" 2>&1 | tail -10
python3 bench/run.py --device cuda --warmup 3 --steps ${STEPS:-15} --timeout 300 --out "$out/$call.json" \
  --run gpt2:z3guard:param+optimizer --run gpt2:z3guard-nofused:param+optimizer \
  --run gpt2:stock:param+optimizer 2>&1 | tail -10
