#!/usr/bin/env bash
# One device call on nvidia-h200-x2: gpu/validate.sh (repro on 0.19.8, 0.14.4 and 0.9.1, a natural overflow,
# verify-resume) after the checkpoint code changed (save phases agreed across ranks, DeepSpeed's write errors
# held until its collectives end, save/load bound to each release's own signature).
#   bash gpu/validate_again.sh <call-name>
out=${OUT:-/tmp/out}
bash gpu/validate.sh
cat "$out/summary.txt"
