#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2 (at the commit named in docs/benchmarks.md): blocks fetched
# whole (fast_block_fetch). 1) GPU bit-identity, stock vs z3guard, on the tied LM of repeated blocks
# (gpu/steady_state.py --scenario tied: both pairs, 52 steps, 5 skipped); 2) offload_param +
# offload_optimizer, stock, z3guard, z3guard-noblocks, stock, z3guard, each in a process group of its own.
#   bash gpu/blocks.sh <call-name>
. gpu/call.sh "$@"
bit_identity tied --scenario tied
ORDER="${ORDER:-stock z3guard z3guard-noblocks stock z3guard}" STEPS=${STEPS:-12} WARMUP=${WARMUP:-8} \
  bash gpu/isolated.sh "$call"
