# Sourced by the GPU scripts (gpu-check.sh, gpu-turbo.sh) on the device machine: install
# the carried wheels (.whl, from `../shared/scripts/device-wheels.sh setproctitle
# fastapi-offline gguf accelerate`, and for the tests pytest pluggy iniconfig pytest-timeout
# pytest-asyncio prometheus-client packaging jsonschema referencing jsonschema-specifications
# rpds-py attrs xgrammar apache-tvm-ffi; a run stops at once if one lmdd needs is
# missing), point PYTHONPATH at the import packages (daemon/ is lmd, clients/ is
# lmd_client), create $out and record the machine in $out/env.txt. Expects to run from
# the repository root.
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkgs && ln -sfn "$PWD/daemon" /tmp/pkgs/lmd && ln -sfn "$PWD/clients" /tmp/pkgs/lmd_client
export PYTHONPATH=/tmp/pkgs:/tmp/site:$PWD
# What lmdd imports that the machine's image lacks: missing, a daemon would never come up
# and a serving script would wait out its timeout.
missing=$(python3 -c '
import importlib.util as u
print(" ".join(m for m in ("zmq", "orjson", "fastapi", "fastapi_offline", "uvicorn", "setproctitle") if not u.find_spec(m)))')
if [[ -n $missing ]]; then
  echo "gpu-env.sh: not installed here: $missing (carry .whl with them: device-wheels.sh)" >&2
  exit 1
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  python3 -c 'import triton; print("triton", triton.__version__)' 2>/dev/null
} 2>&1 | tee "$out/env.txt"

# serve_runs PORT LABEL DIR [FLAGS...]: lmd-bench serve against 127.0.0.1:PORT at each of
# $RUNS ("C:N[:P] ...": concurrency, requests, client processes; default P: $CLIENTS, else
# 1, at most C), streaming /v1/completions, 512 in / 256 out, ignore_eos, 4 warm-up requests; the
# summaries on stdout, each run's JSON and stderr in DIR. FLAGS go to lmd-bench serve.
serve_runs() {
  local port=$1 label=$2 dir=$3 run c n procs
  shift 3
  for run in ${RUNS:-64:256 256:1024}; do
    IFS=: read -r c n procs <<<"$run"
    procs=${procs:-${CLIENTS:-1}}
    ((procs > c)) && procs=$c  # a process drives at least one stream
    python3 -m lmd.bench serve --url "http://127.0.0.1:$port" --endpoint /v1/completions \
      --num-prompts "$n" --concurrency "$c" --input-len 512 --output-len 256 --ignore-eos \
      --warmup 4 --label "$label-c$c" --no-progress --timeout 600 --out "$dir/serve-c$c.json" \
      --client-processes "$procs" "$@" 2>"$dir/serve-c$c.err"
  done
}
