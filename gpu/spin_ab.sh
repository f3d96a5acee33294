#!/usr/bin/env bash
# Issue 8, one device call: the OpenMP workers ended after the step (hostthreads.worker_release) or
# left spinning, on alternate steps of one engine (bench/profile_step.py --alternate-release), both
# offloads, 10 warm-up + 40 timed steps; the forward after each is what the release is for.
#   bash gpu/spin_ab.sh <call-name>     (at 1b028f8; the release was removed after b55)
#   NPROC=1 VARIANT=z3guard-threads16 on one GPU, where torchrun leaves the thread count alone and
#   z3guard's automatic count with it
. gpu/call.sh "$@"
torchrun --nproc_per_node ${NPROC:-2} bench/profile_step.py --offload param+optimizer --device cuda --timers-only \
  --alternate-release --warmup 10 --steps 40 --variants ${VARIANT:-z3guard} --out "$out/$call.json" 2>&1 \
  | grep -v Warning | tail -n 22
