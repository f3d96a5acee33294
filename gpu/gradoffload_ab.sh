#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after fast_grad_offload (513f3b5): offload_param +
# offload_optimizer in one process group, ABBA: stock, z3guard, z3guard-nogradoffload,
# z3guard-nogradoffload, z3guard, stock (10 warm-up + 15 timed steps each).
#   bash gpu/gradoffload_ab.sh <call-name>
. gpu/call.sh "$@"
python3 bench/run.py --device cuda --warmup ${WARMUP:-10} --steps ${STEPS:-15} --timeout 540 --out "$out/$call.json" \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer \
  --run gpt2:z3guard-nogradoffload:param+optimizer --run gpt2:z3guard-nogradoffload:param+optimizer \
  --run gpt2:z3guard:param+optimizer --run gpt2:stock:param+optimizer 2>&1 | tail -12
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], round(1e3 * r["median_step_s"], 1), {k: round(1e3 * v) for k, v in r["phase_median_s"].items()})
PY
