#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after the overflow check moved to stage 3's gradient
# norms: the host's CPU and NUMA layout, bit-identity on 2 GPUs (52 steps, 5 skipped), and two
# side-by-side pairs of offload_param + offload_optimizer, stock then z3guard.
#   bash gpu/norms.sh <call-name>
. gpu/call.sh "$@"
{ lscpu; nvidia-smi topo -m; cat /sys/devices/system/node/node*/cpulist; } > "$out/topology-$call.txt" 2>&1
grep -E "^(Model name|Socket|NUMA|Core|Thread)" "$out/topology-$call.txt"; nvidia-smi topo -m 2>&1 | head -5
bit_identity
python3 -c "import json; [print(r['run'], r.get('overflow_reads')) for r in json.load(open('$out/steady_state-$call.json'))['bit_identity']]" 2>&1 | tail -3
python3 bench/run.py --device cuda --warmup 3 --steps ${STEPS:-20} --timeout 400 --out "$out/$call.json" \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer 2>&1 | tail -10
