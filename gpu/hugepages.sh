#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: does the host step gain from 2 MiB pages under its state
# (z3guard's huge_pages, madvise(MADV_COLLAPSE))? The host's THP settings; the fused pass alone in two
# processes at once (as two ranks share the memory bus), 4 KiB against 2 MiB pages alternating in each;
# then the harness, both offloads, a process group per run: stock, z3guard, z3guard-4kpages, z3guard.
#   bash gpu/hugepages.sh <call-name>      (at 25001c1, where the path and `fused_step.py --huge` exist; removed after b53)
. gpu/call.sh "$@"
{ uname -r; grep . /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
  nproc; grep -E "MemTotal|MemFree|AnonHuge" /proc/meminfo; lscpu | grep -E "Model name|NUMA|Socket|Thread"; } \
  > "$out/sys-$call.txt" 2>&1
cat "$out/sys-$call.txt"
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" > /dev/null 2>&1
for r in 0 1; do
  python3 bench/fused_step.py --numel 177411584 --threads 16 --repeats 9 --chunks 1048576 --huge \
    --out "$out/fused-$call-$r.json" > "/tmp/fused-$r.log" 2>&1 &
done
wait
tail -n 7 /tmp/fused-0.log /tmp/fused-1.log
python3 bench/run.py --device cuda --isolate --warmup 8 --steps 12 --timeout 200 --out "$out/$call.json" \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer --run gpt2:z3guard-4kpages:param+optimizer \
  --run gpt2:z3guard:param+optimizer 2>&1 | tail -9
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], round(1e3 * r["median_step_s"], 1), {k: round(1e3 * v) for k, v in r["phase_median_s"].items()},
          "host peak GiB", round(r["host_peak_rss_bytes"] / 2**30, 2), "huge GiB",
          round((r.get("host_huge_bytes") or 0) / 2**30, 2), r["fast_paths"])
PY
