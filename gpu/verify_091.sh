#!/usr/bin/env bash
# One device call on nvidia-h200-x2: `verify-resume --device cuda` on DeepSpeed 0.9.1 (the report's release),
# so that z3guard's guarded save (not only its load) runs there: phase 1 of `repro` saves with stock.
#   bash gpu/verify_091.sh <call-name>
call=${1:-call}; out=${OUT:-/tmp/out}; mkdir -p "$out"
. gpu/env.sh 0.9.1 || exit 1
python3 -m z3guard.cli verify-resume --device cuda --out /tmp/verify-091 > "$out/verify-resume-0.9.1-$call.log" 2>&1
echo "verify-resume 0.9.1 exit $?"
tail -18 "$out/verify-resume-0.9.1-$call.log"
