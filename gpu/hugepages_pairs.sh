#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after b52 (gpu/hugepages.sh): the both-offloads GPU
# bit-identity with huge_pages on (52 steps, 5 skipped), then the harness, both offloads, a process group
# per run: z3guard-4kpages, z3guard, stock, z3guard, z3guard-4kpages (8 warm-up + 12 timed steps).
#   bash gpu/hugepages_pairs.sh <call-name>      (at dd46cd7; the path was removed after b53)
. gpu/call.sh "$@"
bit_identity
ORDER="z3guard-4kpages z3guard stock z3guard z3guard-4kpages"
runs=()
for variant in $ORDER; do runs+=(--run "gpt2:$variant:param+optimizer"); done
python3 bench/run.py --device cuda --isolate --warmup 8 --steps 12 --timeout 150 --out "$out/$call.json" \
  "${runs[@]}" 2>&1 | tail -n 9
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], round(1e3 * r["median_step_s"], 1), {k: round(1e3 * v) for k, v in r["phase_median_s"].items()},
          "host peak GiB", round(r["host_peak_rss_bytes"] / 2**30, 2), "huge GiB",
          round((r.get("host_huge_bytes") or 0) / 2**30, 2))
PY
