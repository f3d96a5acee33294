#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after b30 (gpu/gradoffload.sh) left partition_grads'
# change inside the drift between runs: (1) fast_grad_offload on and off on alternate steps of one
# engine (`bench/profile_step.py --timers-only --alternate`), two engines, 12 warm-up + 40 timed steps
# each (20 on, 20 off); (2) the harness, offload_param + offload_optimizer in one process group:
# stock, z3guard, z3guard, stock (10 warm-up + 15 timed steps each).
#   bash gpu/gradoffload_ab.sh <call-name>
. gpu/call.sh "$@"
timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/profile_step.py \
  --offload param+optimizer --device cuda --timers-only --alternate --warmup 12 --steps 40 --variants z3guard \
  --variants z3guard --out "$out/alternate-$call.json" > "$out/alternate-$call.log" 2>&1
grep -v "^\s*$" "$out/alternate-$call.log" | grep -v Warning | tail -21
python3 bench/run.py --device cuda --warmup ${WARMUP:-10} --steps ${STEPS:-15} --timeout 300 --out "$out/$call.json" \
  --run gpt2:stock:param+optimizer --run gpt2:z3guard:param+optimizer --run gpt2:z3guard:param+optimizer \
  --run gpt2:stock:param+optimizer 2>&1 | tail -8
python3 - "$out/$call.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["variant"], round(1e3 * r["median_step_s"], 1), {k: round(1e3 * v) for k, v in r["phase_median_s"].items()})
PY
