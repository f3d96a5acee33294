#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x2: why the fused host pass takes ~85 ms inside the step (b24)
# against ~32 ms alone (for half the partition, it turned out: b25): split into its parts inside the step,
# OpenMP threads x chunk size swept inside the step (each 5 steps, twice in turn), then outside the step on
# the same buffers (both ranks, rank 0 alone) and on unpinned copies (bench/host_pass.py).
#   bash gpu/hostpass.sh <call-name>
. gpu/call.sh "$@"
python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/host_pass.py --device cuda --warmup 15 \
  --sweep 16:1048576 --sweep 16:4194304 --sweep 12:1048576 --sweep 12:4194304 --sweep 8:4194304 \
  --sweep 16:262144 --sweep 16:16777216 --sweep 24:4194304 \
  --out "$out/host-pass-$call.json" > "$out/host-pass-$call.log" 2>&1
grep -v "^\s*$" "$out/host-pass-$call.log" | grep -v "Warning\|return func\|AttentionInterface" | tail -50
