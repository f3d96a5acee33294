#!/usr/bin/env bash
# Ran at 9f0a987 (b28): the overlap it measures was removed after b29 (no gain); re-run it there.
# Issue 8, one device call on nvidia-h200-x2, after the overlap's worker left cores to the forward (be93db0):
# offload_param + offload_optimizer in one process group, 10 warm-up + 15 timed steps each:
# stock, z3guard (worker 12 threads), z3guard-nooverlap, z3guard-threads8 (worker 6), then the same
# in reverse order. Bit-identity of the overlap was shown in b27 (the thread count does not change bits).
#   bash gpu/overlap_ab.sh <call-name>
. gpu/call.sh "$@"
python3 bench/run.py --device cuda --warmup ${WARMUP:-10} --steps ${STEPS:-15} --timeout 540 --out "$out/$call.json" \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer --run gpt2:z3guard-nooverlap:param+optimizer \
  --run gpt2:z3guard-threads8:param+optimizer --run gpt2:stock:param+optimizer \
  --run gpt2:z3guard-threads8:param+optimizer --run gpt2:z3guard-nooverlap:param+optimizer \
  --run gpt2:z3guard:param+optimizer 2>&1 | tail -16
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], r.get("host_step"), {k: round(1e3 * v) for k, v in r["phase_median_s"].items()})
PY
