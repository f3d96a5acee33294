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
# b51 ran this second part as a separate command on the same machine: one rank on GPU 1 only.
CUDA_VISIBLE_DEVICES=1 python3 -m z3guard.cli repro --device cuda --nproc 1 --launcher deepspeed --out /tmp/repro-one \
  --json "$out/repro-one-$call.json" > "$out/repro-one-$call.log" 2>&1
echo "exit $?"; grep -E "as expected|NOT as expected" "$out/repro-one-$call.log"
grep -hE "Setting CUDA_VISIBLE_DEVICES|ignoring" /tmp/repro-one/phase*/launch.log | cut -c1-200 | tee "$out/launch-one-$call.txt"
