#!/usr/bin/env bash
# One device call on nvidia-h200-x2: issue 7's GPU validation again at main's code (gpu/validate.sh: the
# report's crash and z3guard's fix on 0.19.8, 0.14.4 and 0.9.1, a natural overflow, verify-resume with
# offload), then the both-offloads GPU bit-identity (52 steps, 5 skipped), which now reads the final state
# one parameter per GatheredParameters (scenarios/job.py, since 13df781).
#   bash gpu/revalidate.sh <call-name>
bash gpu/validate.sh
. gpu/call.sh "$@"
bit_identity "" --only param+optimizer
