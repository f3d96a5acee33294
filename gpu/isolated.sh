#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2 (at the commit named in docs/benchmarks.md): offload_param +
# offload_optimizer, stock, z3guard, z3guard, stock, each run in a process group of its own (`--isolate`,
# as a user's job runs one engine), 10 warm-up + 15 timed steps. In one process group (b31) the z3guard
# run right after a stock run took a 303 ms step phase, the profiled engines before it 106-140 ms.
#   bash gpu/isolated.sh <call-name>        (ORDER="z3guard stock ..." sets the runs and their order;
#                                            "gpt2-leaf:stock" names another bench model than gpt2)
. gpu/call.sh "$@"
runs=()
for run in ${ORDER:-stock z3guard z3guard stock}; do
  [[ $run == *:* ]] || run=gpt2:$run
  runs+=(--run "$run:param+optimizer")
done
python3 bench/run.py --device cuda --isolate --warmup ${WARMUP:-10} --steps ${STEPS:-15} --timeout 200 \
  --out "$out/$call.json" "${runs[@]}" 2>&1 | tail -9
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["model"], r["variant"], round(1e3 * r["median_step_s"], 1), {k: round(1e3 * v) for k, v in r["phase_median_s"].items()},
          "host peak GiB", round(r["host_peak_rss_bytes"] / 2**30, 2))
PY
