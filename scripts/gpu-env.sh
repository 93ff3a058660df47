# Sourced by the GPU scripts (gpu-check.sh, gpu-turbo.sh) on the device machine: install
# the carried wheels (.whl, from ../shared/scripts/device-wheels.sh), point PYTHONPATH at
# the import packages (daemon/ is lmd, clients/ is lmd_client), create $out and record
# the machine in $out/env.txt. Expects to run from the repository root.
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkgs && ln -sfn "$PWD/daemon" /tmp/pkgs/lmd && ln -sfn "$PWD/clients" /tmp/pkgs/lmd_client
export PYTHONPATH=/tmp/pkgs:/tmp/site:$PWD
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  python3 -c 'import triton; print("triton", triton.__version__)' 2>/dev/null
} 2>&1 | tee "$out/env.txt"
