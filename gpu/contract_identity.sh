#!/usr/bin/env bash
# One device call on nvidia-h200-x2: gpu/contract.sh's runs (the save/load contract with NCCL, verify-resume
# with the CUDA RNG stream), then the both-offloads GPU bit-identity, after `fastpaths.apply` began to undo
# itself on a failure and saves began to hold DeepSpeed's write errors until its collectives are done.
#   bash gpu/contract_identity.sh <call-name>
bash gpu/contract.sh "$@"
. gpu/call.sh "$@"
bit_identity "" --only param+optimizer
