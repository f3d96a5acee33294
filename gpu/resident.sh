#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after the norm-decided overflow check and persistent
# parameters kept gathered through the step: bit-identity on 2 GPUs (52 steps, 5 skipped), then
# offload_param + offload_optimizer stock vs z3guard, one pair per process group (each saved on its own).
#   bash gpu/resident.sh <call-name>
set -u
call=${1:-call}
out=${OUT:-/tmp/out}
mkdir -p "$out"
. gpu/env.sh 0.19.8 || exit 1
python3 gpu/steady_state.py --device cuda --steps 0 --out /tmp/steady > "$out/steady-$call.log" 2>&1
cp /tmp/steady/steady_state.json "$out/steady_state-$call.json"
tail -7 "$out/steady-$call.log"
for i in $(seq ${PAIRS:-2}); do
  python3 bench/run.py --device cuda --warmup ${WARMUP:-10} --steps ${STEPS:-20} --timeout 300 --out "$out/$call-$i.json" \
    --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer 2>&1 | grep -E "stock|z3guard" | grep -v "^bench:"
done
