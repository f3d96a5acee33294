#!/usr/bin/env bash
# One device call on nvidia-h200-x2: `z3guard repro --launcher deepspeed` with CUDA_VISIBLE_DEVICES=1,0 set
# (DeepSpeed's runner drops the variable when given --num_gpus; z3guard names the visible GPUs instead).
#   bash gpu/launcher_visible.sh <call-name>
. gpu/call.sh "$@"
CUDA_VISIBLE_DEVICES=1,0 python3 -m z3guard.cli repro --device cuda --launcher deepspeed --out /tmp/repro-visible \
  --json "$out/repro-visible-$call.json" > "$out/repro-visible-$call.log" 2>&1
echo "repro exit $?"
grep -E "as expected|NOT as expected" "$out/repro-visible-$call.log"
grep -hE "cmd = |Setting CUDA_VISIBLE_DEVICES" /tmp/repro-visible/phase*/launch.log | cut -c1-220 | tee "$out/launch-visible-$call.txt"
