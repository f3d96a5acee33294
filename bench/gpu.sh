#!/usr/bin/env bash
# The GPU tables of docs/benchmarks.md and the GPU checks of docs/gpu-validation.md, on one machine with
# NVIDIA GPUs. Run from the repository root:
#
#   bash bench/gpu.sh                                  # DeepSpeed 0.19.8: install, tables, validation
#   DEEPSPEED=0.14.4 bash bench/gpu.sh                 # another version: install and validation only
#   WHEELS=/path/to/wheels bash bench/gpu.sh           # no package index: install from a folder of wheels
#
# 1. install: a virtual environment $OUT/venv-$DEEPSPEED that also sees the system's packages (so a torch
#    already installed is used), with torch, deepspeed==$DEEPSPEED and this project (`pip install .`),
#    from the package index or, with WHEELS set, only from that folder. DeepSpeed builds its CPU Adam op
#    on first use, as it always does (a C++ compiler is needed).
# 2. tables: bench/run.py with the arguments of each published table (records $OUT/<table>.json, plot
#    $OUT/benchmarks.png), the step's parts (bench/profile_step.py) and the host pass (bench/host_pass.py).
# 3. validate: the report's crash (`z3guard repro --device cuda`: stock crashes, z3guard completes
#    bit-identically), a natural fp16 overflow, DeepSpeed's own launcher, verify-resume; with 2 or more
#    GPUs also the save/load contract and the fast paths' bit-identity (bench/steady_state.py, 2 ranks).
# Each command's output goes to $OUT/<name>.log and its verdict to $OUT/summary.txt; the exit status is
# non-zero if any command failed.
#
# Variables:
#   NPROC      ranks, one GPU each (default 2, as in the published tables)
#   DEEPSPEED  the DeepSpeed version to install (default 0.19.8, the one the speed paths are written for)
#   WHEELS     a folder of wheels (torch, deepspeed, their dependencies, setuptools); unset: the package index
#   OUT        where the environment, records and logs go (default ./gpu-out)
#   PARTS      what to run (default "install tables validate"; "install validate" for other versions)
#   TORCH      the torch requirement (default "torch"; the published records used torch 2.11.0+cu130)
set -uo pipefail
NPROC=${NPROC:-2}
DEEPSPEED=${DEEPSPEED:-0.19.8}
mkdir -p "${OUT:-gpu-out}" && OUT=$(cd "${OUT:-gpu-out}" && pwd)
[ "$DEEPSPEED" = 0.19.8 ] && PARTS=${PARTS:-install tables validate} || PARTS=${PARTS:-install validate}
VENV=$OUT/venv-$DEEPSPEED
# The published runs had NVLink multicast off (NCCL NVLS, PyTorch symmetric memory, NVSHMEM); so does this.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=$OUT/torch-extensions-$DEEPSPEED PATH=$VENV/bin:$PATH

gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge "$NPROC" ] || { echo "NPROC=$NPROC but only $gpus GPUs" >&2; exit 1; }
has() { [[ " $PARTS " == *" $1 "* ]]; }
step() {  # step NAME COMMAND...: the output to $OUT/NAME.log, its last lines on screen, the verdict to summary.txt
  local name=$1 r; shift
  echo "== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then r=ok; else r="FAILED (exit $?)"; fi
  tail -n "${TAIL:-3}" "$OUT/$name.log"
  echo "$name: $r" | tee -a "$OUT/summary.txt"
}

if has install; then
  python3 -m venv --system-site-packages "$VENV" || exit 1
  pip=(python -m pip install -q); [ -n "${WHEELS:-}" ] && pip+=(--no-index --find-links "$WHEELS")
  pins=(); case $DEEPSPEED in 0.9.*) pins=("pydantic<2" "numpy<2") ;; esac  # 0.9 needs pydantic 1 and numpy 1
  "${pip[@]}" "${TORCH:-torch}" "setuptools>=77" wheel "${pins[@]}" &&
    DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation "deepspeed==$DEEPSPEED" "${pins[@]}" &&
    "${pip[@]}" --no-build-isolation . transformers psutil matplotlib "${pins[@]}" || exit 1
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)'
  lscpu | grep -E "^(Model name|CPU\(s\)|NUMA node\(s\))"; } > "$OUT/machine.txt"

bench() { step "$1" python bench/run.py --device cuda --nproc "$NPROC" --out "$OUT/$1.json" "${@:2}"; }
runs() { for r in "$@"; do printf -- "--run %s " "$r"; done; }
PO=param+optimizer
TORCHRUN=(python -m torch.distributed.run --standalone --nproc_per_node "$NPROC")

if has tables; then
  TAIL=16
  # Both offloads under torchrun's defaults (OMP_NUM_THREADS=1 per rank), a process group per run.
  bench both-offloads --isolate --warmup 8 --steps 12 $(runs gpt2:stock:$PO gpt2:z3guard:$PO \
    gpt2:z3guard-noblocks:$PO gpt2:stock:$PO gpt2:z3guard:$PO)
  # offload_param only and no offload, a process group per run (stock with offload_param added at the end).
  bench param-offload --isolate --warmup 8 --steps 15 $(runs gpt2:stock:none gpt2:z3guard:param \
    gpt2:z3guard-noblocks:param gpt2:z3guard:none gpt2:stock:none gpt2:stock:param)
  # The baselines: stock given the cores per rank, z3guard in fp16 and bf16, PyTorch FSDP2 (bf16; with offload
  # its CPUOffloadPolicy), no offload and both offloads, a process group per run.
  bench baselines --isolate --warmup 8 --steps 12 $(runs gpt2:stock:none gpt2:z3guard:none \
    gpt2:z3guard-bf16:none gpt2:fsdp2:none gpt2:stock:$PO gpt2:stock-tuned:$PO gpt2:z3guard:$PO \
    gpt2:fsdp2:$PO gpt2:fsdp2-tuned:$PO)
  # Blocks of 0.8B parameters: peak GPU memory against stock's.
  bench big-blocks --isolate --warmup 3 --steps 5 $(runs big:stock:param big:z3guard:param big:stock:$PO \
    big:z3guard:$PO)
  # Models whose module order changes, the workarounds and the trace guard alone, in one process group.
  bench order-changes --warmup 5 --steps 20 $(runs gpt2:stock:param gpt2:stock-persist0:param \
    gpt2:stock-noprefetch:param gpt2:z3guard-nofast:param gpt2:z3guard:param gpt2-skip:stock:param \
    gpt2-skip:z3guard-nofast:param gpt2-skip:z3guard:param gpt2-moe:stock:param gpt2-moe:z3guard-nofast:param \
    gpt2-moe:z3guard:param)
  # Where the step's time goes (device-synchronised timers), and the host optimizer pass (threads x chunk).
  step step-parts "${TORCHRUN[@]}" bench/profile_step.py --offload $PO --device cuda --timers-only \
    --warmup 12 --steps 20 --variants z3guard --variants stock --variants z3guard --out "$OUT/step-parts.json"
  step host-pass "${TORCHRUN[@]}" bench/host_pass.py --device cuda --warmup 15 --sweep 16:1048576 \
    --sweep 16:4194304 --sweep 12:1048576 --sweep 12:4194304 --sweep 8:4194304 --sweep 16:262144 \
    --sweep 16:16777216 --sweep 24:4194304 --out "$OUT/host-pass.json"
  TAIL=1 step plot python bench/plot.py "$OUT/benchmarks.png" "$OUT/both-offloads.json" "$OUT/param-offload.json"
  unset TAIL
fi

if has validate; then
  v=$DEEPSPEED
  step repro-$v z3guard repro --device cuda --nproc "$NPROC" --out "$OUT/runs/repro-$v" --json "$OUT/repro-$v.json"
  step repro-natural-$v z3guard repro --device cuda --nproc "$NPROC" --overflow natural \
    --out "$OUT/runs/repro-natural-$v" --json "$OUT/repro-natural-$v.json"
  step repro-deepspeed-launcher-$v z3guard repro --device cuda --nproc "$NPROC" --launcher deepspeed \
    --out "$OUT/runs/repro-launcher-$v" --json "$OUT/repro-deepspeed-launcher-$v.json"
  step verify-resume-$v z3guard verify-resume --device cuda --nproc "$NPROC" --out "$OUT/runs/verify-resume-$v"
  if [ "$gpus" -ge 2 ]; then
    step contract-$v python -m torch.distributed.run --standalone --nproc_per_node 2 \
      tests/scripts/engine_contract.py "$OUT/contract-$v"
    step bit-identity-$v python bench/steady_state.py --device cuda --out "$OUT/bit-identity-$v"
    step bit-identity-blocks-$v python bench/steady_state.py --device cuda --steps 0 --scenario tied \
      --out "$OUT/bit-identity-blocks-$v"
  fi
fi
! grep -q FAILED "$OUT/summary.txt" 2>/dev/null
