#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: why the fused host pass takes ~85 ms inside the step (b24)
# against ~32 ms alone: split into its parts inside the step, then outside it on the same buffers and on
# unpinned copies (bench/host_pass.py); then the step's parts again (bench/profile_step.py --timers-only).
#   bash gpu/hostpass.sh <call-name>
. gpu/call.sh "$@"
python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/host_pass.py --device cuda \
  --out "$out/host-pass-$call.json" > "$out/host-pass-$call.log" 2>&1
grep -v "^\s*$" "$out/host-pass-$call.log" | grep -v "Warning\|return func\|AttentionInterface" | tail -40
