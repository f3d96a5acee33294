#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2, after b35 (gpu/hostgrads.sh) found the overflow check reading
# the fp16 buffer (40 ms) where the fp32 gradients are cast on the host (their norms were not noted; fixed):
# (1) GPU bit-identity of the both-offloads pair again (as in b35); (2) the harness, each run in a process
# group of its own: z3guard, stock, z3guard, stock, z3guard with both offloads (10 warm-up + 12 timed steps).
#   bash gpu/hostgrads_pairs.sh <call-name>
. gpu/call.sh "$@"
bit_identity "" --only param+optimizer
ORDER="${ORDER:-z3guard stock z3guard stock z3guard}" STEPS=${STEPS:-12} bash gpu/isolated.sh "$call" | tail -8
