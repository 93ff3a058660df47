"""`lmd-bench offline`: the engine in-process on a fixed workload.

    lmd-bench offline [--model M] [--batch 8] [--input-len 128] [--output-len 64]
                      [--device cpu] [--dtype auto] [--compare-hf] [--json]
                      [--guided-json SCHEMA.json]

Random-token prompts of exactly --input-len tokens, --output-len tokens each with
ignore_eos, greedy; all --batch requests are added at once and the engine steps until
they finish. Output tokens per second = batch * output_len / wall time. With
--compare-hf, transformers' `generate` runs the same prompts as one batch in the same
run (EOS neither stops nor is masked, as with ignore_eos) and the ratio is printed.
Each side runs a short warm-up first. With --guided-json every request follows that JSON
schema (structured output, engine/grammar.py; compiled before the clock starts), so the
figure against a plain run is the grammar's cost per step; a request then ends where the
grammar does (or at --output-len), and tokens per second count the tokens made. Both
sides share the process: transformers runs with the
torch thread count the process started with (the CPU engine lowers its own while other
processes keep cores busy, engine/torch_backend/cpu_threads.py) and with the engine's
allocator setting (engine/torch_backend/host_memory.py), which speeds up its prefill too.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.grammar import Grammars
from lmd.engine.model_source import resolve_model
from lmd.engine.sequence import SamplingParams, Sequence


def add_parser(sub: Any) -> None:
    p = sub.add_parser("offline", help="the engine in-process on a fixed workload")
    p.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    p.add_argument("--backend", default="auto")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-prefill-token-num", type=int, default=8192)
    p.add_argument(
        "--cache-max-entry-count",
        type=float,
        default=0.8,
        help="KV pool: fraction of free memory (lower it to leave room for --compare-hf)",
    )
    p.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="decode steps launched before the last one is read back (auto: on CUDA)",
    )
    p.add_argument(
        "--mixed-prefill-tokens",
        type=int,
        default=None,
        help="prompt tokens a decode step carries while prompts wait (0: prefill steps; "
        "default: 256 on CPU, 0 on CUDA)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-hf", action="store_true", help="also time transformers generate")
    p.add_argument(
        "--guided-json", metavar="SCHEMA", help="a JSON schema file every request follows"
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(run=run)


def random_prompts(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the lowest ids: special tokens (bos/eos/pad) live there in most vocabularies.
    return torch.randint(16, vocab, (batch, input_len), generator=g).tolist()


def time_engine(
    engine: Engine,
    prompts: list[list[int]],
    output_len: int,
    guided: tuple[str, str] | None = None,
    grammars: Grammars | None = None,
) -> tuple[float, int]:
    """Seconds to generate for every prompt at once, and the output tokens made."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, guided=guided)
    seqs = [Sequence(f"bench-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        if guided is not None and grammars is not None:
            seq.guide = grammars.guide(guided)
        engine.add(seq)
    _sync(engine.backend.device)
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    _sync(engine.backend.device)
    return time.perf_counter() - start, sum(s.num_output_tokens for s in seqs)


def time_hf(model: Any, prompts: list[list[int]], output_len: int) -> float:
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None  # as ignore_eos: never stop, never mask
    # GenerationConfig takes **kwargs, untyped in transformers.
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=output_len, do_sample=False, pad_token_id=0
    )
    ids = torch.tensor(prompts, device=model.device)
    _sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    _sync(model.device)
    elapsed = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + output_len:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens")
    return elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.batch, args.input_len, args.output_len) < 1:
        raise ValueError("--batch, --input-len and --output-len must be >= 1")
    model = resolve_model(args.model)
    threads = torch.get_num_threads()
    config = EngineConfig(
        block_size=args.block_size,
        max_batch_size=max(args.batch, 1),
        max_prefill_token_num=args.max_prefill_token_num,
        cache_max_entry_count=args.cache_max_entry_count,
        overlap_steps={"auto": None, "on": True, "off": False}[args.overlap],
        mixed_prefill_tokens=args.mixed_prefill_tokens,
    )
    engine = Engine.build(
        model.path, config, device=args.device, dtype=args.dtype, backend=args.backend
    )
    vocab = engine.backend.vocab_size
    prompts = random_prompts(args.batch, args.input_len, vocab, args.seed)
    guided, grammars = None, None
    if args.guided_json:
        guided = ("json", Path(args.guided_json).read_text())
        grammars = Grammars(model.path, vocab, engine.backend.eos_token_ids)
        asyncio.run(grammars.prepare(guided))
    time_engine(engine, prompts[:1], 4, guided, grammars)  # warm-up
    steps_before = engine.num_steps
    seconds, num_output = time_engine(engine, prompts, args.output_len, guided, grammars)
    steps = engine.num_steps - steps_before
    result: dict[str, Any] = {
        "benchmark": "offline",
        "model": model.name,
        "device": str(engine.backend.device),
        "dtype": str(engine.backend.dtype).removeprefix("torch."),
        "backend": engine.backend.name,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(num_output / seconds, 1),
        "guided_json": bool(guided),
        "output_tokens": num_output,
        "steps": steps,
        "ms_per_step": round(1000 * seconds / max(steps, 1), 3),
        "ahead_steps": engine.num_ahead_steps,
        "threads": threads,
        "engine_threads_at_end": torch.get_num_threads(),
    }
    if args.compare_hf:
        from transformers import AutoModelForCausalLM

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # transformers as it would run alone

        hf = AutoModelForCausalLM.from_pretrained(
            str(model.path), dtype=engine.backend.dtype, local_files_only=True
        )
        # PreTrainedModel.to is wrapped by a decorator whose typing mypy misreads.
        hf = hf.to(engine.backend.device).eval()  # type: ignore[arg-type]
        time_hf(hf, prompts[:1], 4)  # warm-up
        hf_seconds = time_hf(hf, prompts, args.output_len)
        num_output = args.batch * args.output_len
        result["hf_seconds"] = round(hf_seconds, 3)
        result["hf_output_tokens_per_s"] = round(num_output / hf_seconds, 1)
        result["speedup_vs_hf"] = round(hf_seconds / seconds, 2)
    return result


def summary(result: dict[str, Any]) -> str:
    line = (
        f"{result['model']} on {result['device']} ({result['dtype']}, {result['backend']}), "
        f"batch {result['batch']}, {result['input_len']} in / {result['output_len']} out: "
        f"{result['output_tokens_per_s']:,} output tok/s ({result['seconds']} s)"
    )
    if "hf_output_tokens_per_s" in result:
        line += (
            f"\ntransformers generate: {result['hf_output_tokens_per_s']:,} output tok/s "
            f"({result['hf_seconds']} s); lmd is {result['speedup_vs_hf']}x"
        )
    return line


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
