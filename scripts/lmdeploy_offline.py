"""LMDeploy 0.18's PyTorch engine on the prompts of `lmd-bench offline`: the anchor the
turbo issue's offline targets compare with, run in the same device call as lmd.

    python3 scripts/lmdeploy_offline.py MODEL_DIR [--batches 1,64,512] [--input-len 512]
        [--output-len 256]

`lmdeploy.pipeline(MODEL_DIR, backend_config=PytorchEngineConfig(max_batch_size=the
largest batch))`, its other settings default. Each batch's prompts are the same random
token ids lmd's bench uses (`lmd.bench.offline.random_prompts`), given to LMDeploy as ids
(its AsyncEngine takes `input_ids` in place of messages); greedy, ignore_eos. Time: all
requests submitted at once until the last finishes, prefill included, after a warm-up
at the batch's size (other prompts, 2 tokens), as lmd's script. One JSON line per
batch. Needs LMDeploy on PYTHONPATH (../shared/scripts/lmdeploy-anchor.sh).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

from lmd.bench.offline import random_prompts


def generate(pipe: Any, prompts: list[list[int]], output_len: int) -> int:
    """Run every prompt at once; the output tokens made."""
    config = GenerationConfig(max_new_tokens=output_len, ignore_eos=True, do_sample=False)
    requests = (
        {"session_id": pipe.session_mgr.get(), "messages": None, "input_ids": ids,
         "gen_config": config, "stream_response": False}
        for ids in prompts
    )  # fmt: skip
    made = 0
    for outputs in pipe._infer(requests, multiplex=False):  # ids, not text
        last = None
        for out in outputs:
            last = out
        if last is None or last.finish_reason == "error":
            raise RuntimeError(f"LMDeploy failed a request: {last}")
        made += last.generate_token_len
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", type=Path)
    parser.add_argument("--batches", default="1,64,512")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, required=True, help="the model's vocab_size")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    pipe = pipeline(
        str(args.model), backend_config=PytorchEngineConfig(max_batch_size=max(batches))
    )
    generate(pipe, random_prompts(1, args.input_len, args.vocab, 1), 4)  # warm-up
    for batch in batches:
        # The warm-up of scripts/families_bench.py: this batch's shapes, other prompts.
        generate(pipe, random_prompts(batch, args.input_len, args.vocab, 3), 2)
        prompts = random_prompts(batch, args.input_len, args.vocab, 0)
        start = time.perf_counter()
        made = generate(pipe, prompts, args.output_len)
        seconds = time.perf_counter() - start
        if made != batch * args.output_len:
            raise RuntimeError(f"LMDeploy made {made} tokens, not {batch * args.output_len}")
        rate = round(made / seconds, 1)
        row = {"model": args.model.name, "engine": "lmdeploy-0.18-pytorch", "batch": batch,
               "seconds": round(seconds, 3), "output_tokens_per_s": rate}  # fmt: skip
        print(json.dumps(row), flush=True)
    pipe.close()


if __name__ == "__main__":
    main()
