#!/usr/bin/env bash
# One call on a GPU machine (the device tool) for the turbo backend: install the carried
# wheels, run its tests (CPU-side ones compiled on the GPU too), time decode steps
# (CUDA graph and eager) and the offline engine. Results land in $OUT (or ./gpu-out).
# Needs .whl carried (see scripts/gpu-check.sh).
#   scripts/gpu-turbo.sh [tests|smol|full|steps]
#     tests: tests only; smol (default): + SmolLM2-shape timings; full: + Llama-3-8B shape;
#     steps: tests + CUDA-graph decode steps of both shapes at batch 1, 4, 64 only
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-smol}
source scripts/gpu-env.sh
timeout 300 python3 -m pytest -q -ra -p no:cacheprovider --timeout 240 \
  tests/gpu/test_turbo_kernels_gpu.py tests/gpu/test_turbo_backend_gpu.py \
  tests/unit/test_turbo_kernels.py tests/unit/test_turbo_model.py -s \
  2>&1 | tee "$out/turbo-tests.txt" | grep -v "^Writing\|^Loading" | tail -25
[[ "$mode" == "tests" ]] && exit 0
# lmd-bench imports lmd._native (the migration benchmark).
python3 setup.py -q build_ext --inplace 2>&1 | tail -3

# Random-weight models of the benchmark shapes (docs/benchmarks.md), bf16.
python3 scripts/random_models.py smollm2-shape $([[ $mode == full || $mode == steps ]] && echo llama3-8b-shape)

# Decode step: one token for B sequences of 512 tokens of context, through
# TurboBackend.forward (host copies + graph replay + logits copy), median of 50.
cat > /tmp/turbo_timing.py <<'PY'
import math, os, statistics, sys, time
from pathlib import Path
import torch
from lmd.engine.backend import ForwardBatch
from lmd.engine.turbo.backend import TurboBackend
model_dir, batches = Path(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")]
kinds = (True,) if sys.argv[3:] == ["graph"] else (True, False)
block, context = 64, 512
for graphs in kinds:
    backend = TurboBackend(model_dir, torch.device("cuda"), torch.bfloat16, cuda_graphs=graphs)
    if os.environ.get("TURBO_SKINNY") == "0":  # A/B: cuBLAS for every projection
        backend.model.skinny = False
    per_seq = math.ceil((context + 1) / block)
    shape = backend.kv_cache_shape(max(batches) * per_seq, block)
    kv = torch.randn(shape, device="cuda").to(torch.bfloat16)
    if graphs:
        t0 = time.perf_counter()
        backend.capture_graphs(kv, max_batch_size=max(batches))
        print(f"{model_dir.name}: {len(backend.graphs.graphs)} graphs captured in "
              f"{time.perf_counter() - t0:.1f} s")
    for b in batches:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        batch = ForwardBatch.pack([[7]] * b, [context] * b, tables, block)
        times = []
        for _ in range(60):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            backend.forward(batch, kv)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step = statistics.median(times[10:]) * 1e3
        replay = ""
        if graphs and backend.graphs is not None:
            g = backend.graphs.graphs[min(s for s in backend.graphs.graphs if s >= b)]
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            replay = f", replay alone {start.elapsed_time(end) / 50:.3f} ms"
        kind = "graph" if graphs else "eager"
        print(f"{model_dir.name} batch {b} context {context} {kind}: step {step:.3f} ms{replay}")
    if not graphs:  # where an eager step's GPU time goes
        from torch.profiler import ProfilerActivity, profile
        batch = ForwardBatch.pack([[7]] * batches[0], [context] * batches[0],
                                  [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batches[0])], block)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                backend.forward(batch, kv)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    del backend, kv
    torch.cuda.empty_cache()
PY
# Prefill: the attention kernel alone at the Llama-3-8B shape (16 prompts of 512 tokens,
# one layer) for a few tilings, and where one 8,192-token prefill chunk's time goes.
cat > /tmp/turbo_prefill.py <<'PY'
import sys
from pathlib import Path
import torch, triton
from lmd.engine.backend import ForwardBatch
from lmd.engine.turbo import kernels
from lmd.engine.turbo.backend import TurboBackend
seqs, n, heads, kv_heads, d, block = 16, 512, 32, 8, 128, 64
q = torch.randn(seqs * n, heads, d, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(seqs * n // block, 1, 2, block, kv_heads, d, device="cuda", dtype=torch.bfloat16)
tables = torch.arange(seqs * n // block, device="cuda", dtype=torch.int32).view(seqs, -1)
cu = torch.arange(0, seqs * n + 1, n, device="cuda", dtype=torch.int32)
lens = torch.full((seqs,), n, device="cuda", dtype=torch.int32)
flops = 4 * seqs * heads * d * n * (n + 1) / 2  # QK^T and PV over the causal half
for tiles in (None, (64, 64, 4), (128, 64, 8), (128, 32, 8), (64, 32, 4), (128, 128, 8)):
    try:
        run = lambda: kernels.prefill_attention(q, kv, layer=0, block_tables=tables, cu_seqlens=cu,
                                                context_lens=lens, max_seq_len=n, scale=d**-0.5, tiles=tiles)
        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
        print(f"prefill attention 16x512, 32/8 heads x 128, tiles {tiles or 'default'}: "
              f"{ms * 1e3:.0f} us, {flops / ms / 1e9:.0f} TFLOP/s")
    except Exception as exc:  # a tiling that does not compile is a result too
        print(f"prefill attention tiles {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
backend = TurboBackend(Path(sys.argv[1]), torch.device("cuda"), torch.bfloat16, cuda_graphs=False)
pool = torch.randn(backend.kv_cache_shape(seqs * n // block, block), device="cuda").to(torch.bfloat16)
prompts = torch.randint(16, 1000, (seqs, n)).tolist()
batch = ForwardBatch.pack(prompts, [0] * seqs, tables.cpu().tolist(), block)
backend.forward(batch, pool)
torch.cuda.synchronize()
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    backend.forward(batch, pool)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=50))
PY
timing() {
  timeout "$1" python3 /tmp/turbo_timing.py "$2" "$3" "${4:-both}" 2>&1 | grep -v "^Loading\|^Writing" \
    | tee -a "$out/decode-steps.txt"
}
if [[ "$mode" == "steps" ]]; then  # skinny GEMMs on, off, on again: an A/B on one host
  for skinny in 1 0 1; do
    echo "TURBO_SKINNY=$skinny" | tee -a "$out/decode-steps.txt"
    TURBO_SKINNY=$skinny timing 150 /tmp/smollm2-shape 1,4 graph
    TURBO_SKINNY=$skinny timing 200 /tmp/llama3-8b-shape 1,4,64 graph
  done
  exit 0
fi
timing 150 /tmp/smollm2-shape 1,64,256 "$([[ $mode == full ]] && echo graph)"

bench() {
  timeout 200 python3 -m lmd.bench offline --device cuda --backend turbo --input-len 512 \
    --output-len 256 --json "$@" 2>>"$out/bench-stderr.txt" | tail -1 | tee -a "$out/offline.jsonl"
}
for batch in 1 64 512; do bench --model /tmp/smollm2-shape --batch "$batch"; done
if [[ "$mode" == "full" ]]; then
  timing 200 /tmp/llama3-8b-shape 1,64 graph
  timeout 150 python3 /tmp/turbo_prefill.py /tmp/llama3-8b-shape 2>&1 | grep -v "^Loading" \
    | tee -a "$out/prefill.txt"
  for batch in 64 512; do bench --model /tmp/llama3-8b-shape --batch "$batch"; done
fi
tail -3 "$out/bench-stderr.txt"
