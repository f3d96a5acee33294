#!/usr/bin/env bash
# One device call on nvidia-h200-x2: only the GPU bit-identity of the both-offloads pair (gpu/steady_state.py:
# 52 steps, 5 skipped, reads after `step`, gradients read and set through DeepSpeed's accessors), for a
# commit whose GPU-relevant change is small.
#   bash gpu/bit_identity.sh <call-name>
. gpu/call.sh "$@"
bit_identity "" --only param+optimizer
