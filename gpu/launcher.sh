#!/usr/bin/env bash
# One device call on nvidia-h200-x2: the report's scenario on 2 GPUs with the ranks started by DeepSpeed's
# own launcher (`z3guard repro --launcher deepspeed`, i.e. `deepspeed --num_gpus 2`) on 0.19.8 and 0.14.4,
# and with torchrun on 0.19.8 beside it.
#   bash gpu/launcher.sh <call-name>
call=${1:-call}; out=${OUT:-/tmp/out}; mkdir -p "$out"
for run in "0.19.8 deepspeed" "0.14.4 deepspeed" "0.19.8 torchrun"; do
  set -- $run
  ( . gpu/env.sh "$1" || exit 1
    start=$(date +%s)
    python3 -m z3guard.cli repro --device cuda --launcher "$2" --out "/tmp/repro-$1-$2" \
      --json "$out/repro-$1-$2-$call.json" > "$out/repro-$1-$2-$call.log" 2>&1
    echo "repro DeepSpeed $1, $2: exit $? in $(( $(date +%s) - start )) s"
    grep -E "as expected|NOT as expected|ranks on" "$out/repro-$1-$2-$call.log" | head -3 )
done
