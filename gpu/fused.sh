#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after the fused host step: bit-identity on 2 GPUs
# (52 steps, 5 skipped), the host step in isolation (bench/fused_step.py, 16 threads, GPT-2 medium's
# partition per rank), and offload_param + offload_optimizer with and without it beside stock.
#   bash gpu/fused.sh <call-name>
. gpu/call.sh "$@"
bit_identity
python3 bench/fused_step.py --numel 88700000 --threads 16 --repeats 7 --out "$out/fused-step-$call.json" 2>&1 | tail -10
python3 bench/run.py --device cuda --warmup 3 --steps ${STEPS:-15} --timeout 300 --out "$out/$call.json" \
  --run gpt2:z3guard:param+optimizer --run gpt2:z3guard-nofused:param+optimizer \
  --run gpt2:stock:param+optimizer 2>&1 | tail -10
