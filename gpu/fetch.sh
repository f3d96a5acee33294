#!/usr/bin/env bash
# Ran at e8e726b and its parents (b19-b23); the staged fetch it measures was removed after b23 (no
# measurable gain), so the z3guard-nostaged variant no longer exists: check out that commit to re-run.
# Issue 8, one device call on nvidia-h200-x2, after the staged fetch (adapter/stagedfetch.py): GPU
# bit-identity of every fast path (52 steps, 5 skipped; b19 without a host wait, b21 with one per bucket,
# both not identical: a lone parameter's device copy was freed under NCCL; b22 stages coalesced buckets
# only), then offload_param + offload_optimizer with the staged fetch on and off beside stock (z3guard
# runs both before and after stock), then offload_param against no-offload stock (the 1.15 x target).
#   bash gpu/fetch.sh <call-name>
. gpu/call.sh "$@"
bit_identity
python3 bench/run.py --device cuda --warmup ${WARMUP:-10} --steps ${STEPS:-15} --timeout 330 --out "$out/$call-po.json" \
  --run gpt2:z3guard:param+optimizer --run gpt2:z3guard-nostaged:param+optimizer --run gpt2:stock:param+optimizer \
  --run gpt2:z3guard-nostaged:param+optimizer --run gpt2:z3guard:param+optimizer 2>&1 | grep -E "stock|z3guard" | grep -v "^bench:"
python3 bench/run.py --device cuda --warmup ${WARMUP:-10} --steps ${STEPS:-15} --timeout 150 --out "$out/$call-p.json" \
  --run gpt2:stock:none --run gpt2:z3guard:param --run gpt2:z3guard-nostaged:param 2>&1 | grep -E "stock|z3guard" | grep -v "^bench:"
