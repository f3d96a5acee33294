#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: offload_param + offload_optimizer, stock then z3guard,
# PAIRS times (default 2), after a longer warm-up (b15's host took ~15 steps to reach its steady host step), with every
# step's phases recorded.
#   bash gpu/warm.sh <call-name>
. gpu/call.sh "$@"
runs=""
for _ in $(seq ${PAIRS:-2}); do runs="$runs --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer"; done
python3 bench/run.py --device cuda --warmup ${WARMUP:-12} --steps ${STEPS:-20} --timeout 560 --out "$out/$call.json" \
  $runs 2>&1 | tail -12
python3 - "$out/$call.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d:
    print(r["variant"], "warm-up", [round(1e3 * x) for x in r.get("warmup_steps_s", [])])
    print(r["variant"], "host step", [round(1e3 * x) for x in r.get("phases_s", {}).get("step", [])])
PY
