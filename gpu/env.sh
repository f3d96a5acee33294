# Source with a DeepSpeed release: `. gpu/env.sh 0.19.8`. Installs the carried wheels (.whl/, see
# docs/gpu-validation.md) into /tmp/site-<release> and points PYTHONPATH at them and at src/.
release=$1
site=/tmp/site-$release
if [ ! -d "$site" ]; then
  common=$(ls .whl/common/*.whl)
  case $release in 0.9.*) common=$(ls .whl/common/*.whl | grep -v pydantic) ;; esac  # 0.9 wants pydantic 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    $common .whl/ds$release/*.whl || return 1
fi
export PYTHONPATH=$site:$PWD/src DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=/tmp/torch-ext-$release
case $release in 0.9.*|0.14.*) export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 ;; esac
