#!/usr/bin/env bash
# Ran at e8e726b and its parents (b19-b23); the staged fetch it measures was removed after b23 (no
# measurable gain), so the z3guard-nostaged variant no longer exists: check out that commit to re-run.
# Issue 8, one device call on nvidia-h200-x2: does the staged fetch pay? offload_param, z3guard with it
# and without it in ABBA ABBA order in one process group (b19-b22 gave -11 %, -7 %, +21 % from single pairs).
#   bash gpu/staged_ab.sh <call-name>
. gpu/call.sh "$@"
runs=""
for v in z3guard z3guard-nostaged z3guard-nostaged z3guard z3guard z3guard-nostaged z3guard-nostaged z3guard; do
  runs="$runs --run gpt2:$v:param"
done
python3 bench/run.py --device cuda --warmup ${WARMUP:-8} --steps ${STEPS:-15} --timeout 330 --out "$out/$call.json" \
  $runs 2>&1 | grep -E "z3guard" | grep -v "^bench:"
