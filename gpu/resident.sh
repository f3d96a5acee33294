#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after the norm-decided overflow check and persistent
# parameters kept gathered through the step: bit-identity on 2 GPUs (52 steps, 5 skipped), then
# offload_param + offload_optimizer stock vs z3guard, one pair per process group (each saved on its own).
#   bash gpu/resident.sh <call-name>
. gpu/call.sh "$@"
bit_identity
for i in $(seq ${PAIRS:-2}); do
  python3 bench/run.py --device cuda --warmup ${WARMUP:-10} --steps ${STEPS:-20} --timeout 300 --out "$out/$call-$i.json" \
    --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer 2>&1 | grep -E "stock|z3guard" | grep -v "^bench:"
done
