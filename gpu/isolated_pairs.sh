#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after b32 (gpu/isolated.sh): each run in a process group of
# its own (`--isolate`), 10 warm-up + 15 timed steps: offload_param + offload_optimizer as z3guard, stock,
# z3guard, stock, z3guard (the other order than b32's); then the offload_param target's pair: stock
# without offload, z3guard with offload_param.
#   bash gpu/isolated_pairs.sh <call-name>
. gpu/call.sh "$@"
python3 bench/run.py --device cuda --isolate --warmup ${WARMUP:-10} --steps ${STEPS:-15} --timeout 200 \
  --out "$out/$call.json" --run gpt2:z3guard:param+optimizer --run gpt2:stock:param+optimizer \
  --run gpt2:z3guard:param+optimizer --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer \
  --run gpt2:stock:none --run gpt2:z3guard:param 2>&1 | tail -11
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], r["offload"], round(1e3 * r["median_step_s"], 1),
          {k: round(1e3 * v) for k, v in r["phase_median_s"].items()}, "host peak GiB",
          round(r["host_peak_rss_bytes"] / 2**30, 2))
PY
