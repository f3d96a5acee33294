#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after b53: does ending the OpenMP workers after the step
# (hostthreads.worker_release) speed up the next forward? The both-offloads GPU bit-identity (52 steps,
# 5 skipped), then the harness, both offloads, a process group per run: z3guard-spin (workers left
# spinning, as before), z3guard, stock, z3guard, z3guard-spin (8 warm-up + 12 timed steps).
#   bash gpu/spin.sh <call-name>     (at 1b028f8, where the release exists; removed after b55)
#   NPROC=1 on one GPU: one rank, no bit-identity run (which takes two)
. gpu/call.sh "$@"
[ "${NPROC:-2}" = 2 ] && bit_identity
ORDER="z3guard-spin z3guard stock z3guard z3guard-spin"
runs=()
for variant in $ORDER; do runs+=(--run "gpt2:$variant:param+optimizer"); done
python3 bench/run.py --device cuda --isolate --nproc ${NPROC:-2} --warmup 8 --steps 12 --timeout 150 --out "$out/$call.json" \
  "${runs[@]}" 2>&1 | tail -n 9
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], round(1e3 * r["median_step_s"], 1), {k: round(1e3 * v) for k, v in r["phase_median_s"].items()},
          "host peak GiB", round(r["host_peak_rss_bytes"] / 2**30, 2))
PY
