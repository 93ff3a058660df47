"""`pipeline()`: LMDeploy's offline inference API over lmd's engine, in-process.

The same Engine and backends as the daemon's hybrid worker, on CPU or GPU, with no
sockets: the engine steps in a thread of its own (engine_thread.py) with continuous
batching across every call in flight, from any thread or event loop; each call's
tokens are detokenized in the caller's thread (the tokenizer process's TextStream), so
text, counts and finish reasons are what the daemon would answer.

    with pipeline() as pipe:                          # the embedded SmolLM2 on CPU
        print(pipe(["Hi!", "Name a prime."], gen_config=GenerationConfig(max_new_tokens=16)))

Life cycle: pipeline(...) loads the model and sizes the KV pool -> calls (`pipe(...)`,
`infer`, `stream_infer`, `chat`, `get_ppl` and the async forms) -> `close()` (or the end
of a `with` block) ends the engine thread, cutting off what still runs, and frees the
model and the pool (GPU memory included).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import queue
import weakref
from collections.abc import AsyncIterator, Iterator
from functools import partial
from os import PathLike
from typing import Any

import torch

from lmd.engine.backend import Backend
from lmd.engine.engine import Engine
from lmd.engine.model_source import resolve_model
from lmd.pipeline import scoring
from lmd.pipeline.calls import Call, build_request, output_tensors, perplexity_inputs
from lmd.pipeline.config import (
    ChatTemplateConfig,
    EngineSettings,
    GenerationConfig,
    PytorchEngineConfig,
    TurbomindEngineConfig,
)
from lmd.pipeline.engine_thread import EngineThread, Item
from lmd.pipeline.group import PipelineGroup
from lmd.pipeline.outputs import RequestOutput, Response
from lmd.pipeline.prompts import Prompter, Tokenized, as_list
from lmd.pipeline.session import Session

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
GenConfigs = GenerationConfig | list[GenerationConfig] | None


def pipeline(
    model_path: str | PathLike[str] | None = None,
    backend_config: EngineSettings | None = None,
    chat_template_config: ChatTemplateConfig | None = None,
    log_level: str = "WARNING",
) -> Pipeline:
    """A Pipeline on `model_path`: a local Hugging Face directory, a .gguf file, or None
    for the embedded SmolLM2-135M-Instruct. backend_config: PytorchEngineConfig (the
    torch backend), TurbomindEngineConfig (turbo where it runs, else torch), or None (as
    TurbomindEngineConfig()); its device_type None is CUDA where available, else CPU."""
    return Pipeline(model_path, backend_config, chat_template_config, log_level)


class Pipeline:
    def __init__(
        self,
        model_path: str | PathLike[str] | None = None,
        backend_config: EngineSettings | None = None,
        chat_template_config: ChatTemplateConfig | None = None,
        log_level: str = "WARNING",
    ) -> None:
        if log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
        logging.getLogger("lmd").setLevel(log_level)
        settings = TurbomindEngineConfig() if backend_config is None else backend_config
        if not isinstance(settings, PytorchEngineConfig | TurbomindEngineConfig):
            raise ValueError(
                "backend_config must be a PytorchEngineConfig, a TurbomindEngineConfig or "
                f"None, got {type(backend_config).__name__}"
            )
        if chat_template_config is not None and not isinstance(
            chat_template_config, ChatTemplateConfig
        ):
            raise ValueError(
                "chat_template_config must be a ChatTemplateConfig or None, got "
                f"{type(chat_template_config).__name__}"
            )
        device = _device(settings.device_type)
        backend = settings.backend
        if backend_config is None and device == "cpu":
            backend = "torch"  # what auto picks on a CPU, without its warning
        model = resolve_model(model_path)
        self.prompter = Prompter(model.path, chat_template_config)
        self._group: PipelineGroup | None = None
        if settings.tp > 1:  # ranks 1..N-1 in processes of their own (group.py)
            self._group = PipelineGroup(model.path, settings, device, backend)
            group = self._group
            self._engine = EngineThread(lambda: group.engine)
        else:  # built in the thread that will step it (engine_thread.py)
            self._engine = EngineThread(
                functools.partial(
                    Engine.build,
                    model.path,
                    settings.engine_config(),
                    device=device,
                    dtype=settings.dtype,
                    backend=backend,
                )
            )
        engine = self._engine.engine
        assert engine is not None
        self.prompter.vocab_size = engine.backend.vocab_size
        self.model_name = model.name
        self.session_len = int(engine.config.session_len or 0)  # resolved by the engine
        # An unclosed pipeline is closed when it is collected (or at exit).
        self._finalizer = weakref.finalize(self, _close, self._engine, self._group)

    # Life cycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Cut off what still runs, end the engine thread, free the model and KV pool."""
        self._finalizer()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """The engine's KV blocks (total, free), running and waiting requests; with tp >
        1, `ranks`: the other ranks' processes (rank, pid, device)."""
        stats: dict[str, Any] = self._engine.call(lambda engine: engine.stats()).result()
        if self._group is not None:
            stats["ranks"] = self._group.ranks()
        return stats

    @property
    def backend(self) -> Backend:
        """The engine's backend (its `name`, `device`, `dtype`, `vocab_size`...)."""
        engine = self._engine.engine
        if engine is None:
            raise RuntimeError("the pipeline is closed; create a new one")
        return engine.backend

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (None for a model without one)."""
        return self.prompter.tokenizer

    # Generation, blocking ------------------------------------------------------------------

    def __call__(
        self, prompts: Any, gen_config: GenConfigs = None, do_preprocess: bool = True
    ) -> Response | list[Response]:
        return self.infer(prompts, gen_config, do_preprocess)

    def infer(
        self, prompts: Any, gen_config: GenConfigs = None, do_preprocess: bool = True
    ) -> Response | list[Response]:
        """Generate for one prompt (a Response) or a list of them (a list, in order)."""
        call, single = self._call(prompts, gen_config, do_preprocess, streamed=False)
        for _ in self._stream(call):
            pass
        responses = [out.response() for out in call.outputs]
        return responses[0] if single else responses

    def stream_infer(
        self, prompts: Any, gen_config: GenConfigs = None, do_preprocess: bool = True
    ) -> Iterator[Response]:
        """Responses as tokens come: each holds a prompt's new text and token ids (its
        `index` says which prompt), the last one its finish_reason and tensors. Leaving
        the loop early cuts off what still runs."""
        call, _single = self._call(prompts, gen_config, do_preprocess, streamed=True)
        return (out.delta() for out in self._stream(call))

    def chat(
        self,
        prompt: str | list[dict[str, Any]],
        session: Session | None = None,
        gen_config: GenerationConfig | None = None,
        stream_response: bool = False,
    ) -> Session | Iterator[Response]:
        """One turn of a conversation: the session with the answer in its history and
        `session.response` (a new session when None); with stream_response, an iterator
        of Responses that updates the session when it ends."""
        session = Session() if session is None else session
        if not isinstance(session, Session):
            raise ValueError(f"session must be a Session or None, got {type(session).__name__}")
        if gen_config is not None and not isinstance(gen_config, GenerationConfig):
            raise ValueError(
                f"gen_config must be a GenerationConfig, got {type(gen_config).__name__}"
            )
        gen = gen_config or GenerationConfig()
        turn = session.start(prompt, self.prompter)
        tokenized = Tokenized(turn.token_ids, chat=True)
        out, seq = build_request(
            0, tokenized, gen, self.prompter, self.session_len, streamed=stream_response
        )
        call = Call([out], [seq], streamed=stream_response)

        def turn_stream() -> Iterator[Response]:
            for changed in self._stream(call):
                yield changed.delta()
            session.finish(prompt, turn, out.response(), self.prompter)

        stream = turn_stream()
        if stream_response:
            return stream
        for _ in stream:
            pass
        return session

    def get_ppl(self, input_ids: list[int] | list[list[int]]) -> list[float]:
        """Per sequence, the mean cross-entropy (nats, not exponentiated) of each token
        after the first given those before it, as LMDeploy's get_ppl and transformers'
        `model(ids, labels=ids).loss` compute it."""
        seqs = perplexity_inputs(input_ids, self.prompter.vocab_size, self.session_len)

        def score(engine: Engine) -> list[float]:
            rows = scoring.max_rows(engine.backend, engine.config.max_prefill_token_num)
            return scoring.cross_entropy(
                engine.backend, seqs, block_size=engine.pool.block_size, rows=rows
            )

        return self._engine.call(score).result()

    # Generation, asyncio -------------------------------------------------------------------

    async def async_infer(
        self, prompts: Any, gen_config: GenConfigs = None, do_preprocess: bool = True
    ) -> Response | list[Response]:
        """`infer` for an event loop: other tasks run while the engine computes."""
        call, single = self._call(prompts, gen_config, do_preprocess, streamed=False)
        async for _ in self._astream(call):
            pass
        responses = [out.response() for out in call.outputs]
        return responses[0] if single else responses

    def async_stream_infer(
        self, prompts: Any, gen_config: GenConfigs = None, do_preprocess: bool = True
    ) -> AsyncIterator[Response]:
        """`stream_infer` for `async for`; cancelling the task cuts off what still runs."""
        call, _single = self._call(prompts, gen_config, do_preprocess, streamed=True)
        return (out.delta() async for out in self._astream(call))

    # Inside ------------------------------------------------------------------------------

    def _call(
        self, prompts: Any, gen_config: GenConfigs, do_preprocess: bool, *, streamed: bool
    ) -> tuple[Call, bool]:
        """The call's requests, every argument checked (ValueError naming the prompt)."""
        items, single = as_list(prompts)
        gens = _gen_configs(gen_config, len(items))
        outputs, seqs = [], []
        for i, (prompt, gen) in enumerate(zip(items, gens, strict=True)):
            try:
                if gen.output_last_hidden_state and not _has_hidden(self.backend):
                    raise ValueError(
                        f"output_last_hidden_state needs the torch backend (PytorchEngineConfig); "
                        f"this pipeline runs {self.backend.name}"
                    )
                tokenized = self.prompter.tokenize(prompt, do_preprocess=do_preprocess)
                out, seq = build_request(
                    i, tokenized, gen, self.prompter, self.session_len, streamed=streamed
                )
            except ValueError as exc:
                raise ValueError(str(exc) if single else f"prompts[{i}]: {exc}") from None
            outputs.append(out)
            seqs.append(seq)
        return Call(outputs, seqs, streamed=streamed), single

    def _stream(self, call: Call) -> Iterator[RequestOutput]:
        """The call's outputs as they change, waiting in this thread."""
        items: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._engine.add(call.seqs, items.put, delivery=call.delivery)
        try:
            while not call.done:
                for out in call.take(items.get(), self._engine):
                    if out.finished and out.gen.wants_tensors:
                        job = partial(output_tensors, out)
                        out.logits, out.last_hidden_state = self._engine.call(job).result()
                    yield out
        finally:
            call.abort(self._engine)

    async def _astream(self, call: Call) -> AsyncIterator[RequestOutput]:
        """The call's outputs as they change, waiting in the running event loop."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Item] = asyncio.Queue()

        def sink(item: Item) -> None:  # in the engine thread
            loop.call_soon_threadsafe(items.put_nowait, item)

        self._engine.add(call.seqs, sink, delivery=call.delivery)
        try:
            while not call.done:
                for out in call.take(await items.get(), self._engine):
                    if out.finished and out.gen.wants_tensors:
                        job = self._engine.call(partial(output_tensors, out))
                        out.logits, out.last_hidden_state = await asyncio.wrap_future(job)
                    yield out
        finally:
            call.abort(self._engine)


def _gen_configs(gen_config: object, num_prompts: int) -> list[GenerationConfig]:
    if gen_config is None:
        return [GenerationConfig()] * num_prompts
    if isinstance(gen_config, GenerationConfig):
        return [gen_config] * num_prompts
    if isinstance(gen_config, list | tuple) and all(
        isinstance(g, GenerationConfig) for g in gen_config
    ):
        if len(gen_config) != num_prompts:
            raise ValueError(
                f"gen_config has {len(gen_config)} entries for {num_prompts} prompts: give "
                "one per prompt, or one GenerationConfig for all"
            )
        return list(gen_config)
    raise ValueError(
        "gen_config must be a GenerationConfig, a list of them (one per prompt) or None, "
        f"got {type(gen_config).__name__}"
    )


def _device(device_type: str | None) -> str:
    if device_type is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_type.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device_type {device_type!r}: no CUDA device here; use 'cpu'")
    return device_type


def _has_hidden(backend: Backend) -> bool:
    return type(backend).forward_hidden is not Backend.forward_hidden


def _close(engine: EngineThread, group: PipelineGroup | None) -> None:
    engine.close()
    if group is not None:
        group.close()
    gc.collect()  # the model and pool may sit in reference cycles (transformers modules)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
