#!/usr/bin/env bash
# Ran at e75fd6d (b27); be93db0's worker threads: the overlap it measures was removed after b29 (no gain); re-run it there.
# Issue 8, one device call on nvidia-h200-x2, after the host step moved behind the next forward
# (adapter/overlap.py): GPU bit-identity (52 steps, 5 skipped, reads right after `step`: GatheredParameters,
# an eval forward, a checkpoint), then offload_param + offload_optimizer in one process group:
# stock, z3guard, z3guard-nooverlap, stock, z3guard-nooverlap, z3guard (ABBA for the overlap, two pairs
# against stock), 12 warm-up + 20 timed steps each.
#   bash gpu/overlap.sh <call-name>        (BITS=0: without the bit-identity runs)
. gpu/call.sh "$@"
[ "${BITS:-1}" = 0 ] || bit_identity
python3 bench/run.py --device cuda --warmup ${WARMUP:-12} --steps ${STEPS:-20} --timeout 480 --out "$out/$call.json" \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer --run gpt2:z3guard-nooverlap:param+optimizer \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard-nooverlap:param+optimizer --run gpt2:z3guard:param+optimizer \
  2>&1 | tail -14
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], "host step", r.get("host_step"), "phases", {k: round(1e3 * v) for k, v in r["phase_median_s"].items()})
PY
