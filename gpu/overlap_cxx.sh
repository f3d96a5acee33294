#!/usr/bin/env bash
# Ran at 3acab99 (b29): the overlap it measures was removed after b29 (no gain); re-run it there.
# Issue 8, one device call on nvidia-h200-x2, after the overlap's worker runs each range in C++ without
# the GIL (nogil.fused_range): offload_param + offload_optimizer in one process group, stock, z3guard,
# z3guard-nooverlap, z3guard-nooverlap, z3guard (8 warm-up + 12 timed steps); then GPU bit-identity of
# the both-offloads pair (52 steps, 5 skipped, reads right after `step`).
#   bash gpu/overlap_cxx.sh <call-name>
. gpu/call.sh "$@"
python3 bench/run.py --device cuda --warmup ${WARMUP:-8} --steps ${STEPS:-12} --timeout 300 --out "$out/$call.json" \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer --run gpt2:z3guard-nooverlap:param+optimizer \
  --run gpt2:z3guard-nooverlap:param+optimizer --run gpt2:z3guard:param+optimizer 2>&1 | tail -12
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], r.get("host_step"), {k: round(1e3 * v) for k, v in r["phase_median_s"].items()})
PY
bit_identity "" --only param+optimizer
