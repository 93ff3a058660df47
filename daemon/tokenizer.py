"""The tokenizer process: prompts in, token ids to an engine, text back to the api.

Life cycle of a request in the tokenizer:
  1. TextRequest from an api worker: render the chat template (messages) or take the
     prompt (text or token ids), tokenize, check the length against the session
     length, pick an engine (round robin over the engines of this daemon), send it
     Generate with this worker as reply_to. Anything wrong answers RequestError.
  2. Tokens from the engine: each token goes through the request's TextStream
     (incremental detokenizer + stop strings); the new text of every request of one
     engine step goes back as one TextDelta per api worker. A stop string finishes the
     request and aborts it in the engine.
  3. RequestError from the engine is passed to the api; Abort from the api is passed
     to the engine. Either way, and on finish, the request's state is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmd import protocol
from lmd.engine.model_source import ModelSourceError, resolve_model
from lmd.protocol import Message
from lmd.roles import plan_workers
from lmd.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    HfChatTemplate,
    LmdeployChatTemplate,
    parse_messages,
)
from lmd.text.stream import TextStream
from lmd.worker import Worker, WorkerStartError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    reply_to: str  # api worker
    engine: str
    stream: TextStream


class TokenizerWorker(Worker):
    role = "tokenizer"

    async def start(self) -> None:
        from transformers import AutoTokenizer

        try:
            model = resolve_model(self.config.model)
            self.tokenizer = await asyncio.to_thread(
                AutoTokenizer.from_pretrained, str(model.path), local_files_only=True
            )
            self.template = self._load_template()
            self.session_len = self.config.session_len or _max_positions(model.path)
        except (ModelSourceError, ChatTemplateError, OSError, ValueError) as exc:
            raise WorkerStartError(str(exc)) from None
        self.decoder = self.tokenizer.backend_tokenizer  # decode without clean-up
        self.vocab_size = len(self.tokenizer)
        engines = [s.name for s in plan_workers(self.config, "cpu", 0) if s.role == "hybrid"]
        self.engines = itertools.cycle(engines) if engines else None
        self._requests: dict[str, _Request] = {}

    def _load_template(self) -> ChatTemplate:
        if self.config.chat_template:
            return LmdeployChatTemplate.load(Path(self.config.chat_template))
        return HfChatTemplate(self.tokenizer)

    def info(self) -> dict[str, Any]:
        return {"session_len": self.session_len, "template": type(self.template).__name__}

    def stats(self) -> dict[str, Any]:
        return {"running": len(self._requests)}

    def inflight(self) -> int:
        return len(self._requests)

    def on_cluster_state(self) -> None:
        """An engine that died took its requests with it: fail them now, never hang."""
        if "hybrid" not in self.missing_roles:
            return
        for request_id, request in list(self._requests.items()):
            del self._requests[request_id]
            error = protocol.RequestError(
                request_id, "service_unavailable", "the engine serving this request restarted"
            )
            self.push(request.reply_to, error)

    async def handle(self, msg: Message) -> bool:
        if isinstance(msg, protocol.TextRequest):
            self._start_request(msg)
        elif isinstance(msg, protocol.Tokens):
            self._on_tokens(msg)
        elif isinstance(msg, protocol.RequestError):
            request = self._requests.pop(msg.request_id, None)
            if request is not None:
                self.push(request.reply_to, msg)
        elif isinstance(msg, protocol.Abort):
            request = self._requests.pop(msg.request_id, None)
            if request is not None:
                self.push(request.engine, msg)
        else:
            return False
        return True

    # Requests in ----------------------------------------------------------------------

    def _start_request(self, msg: protocol.TextRequest) -> None:
        def fail(code: str, message: str) -> None:
            self.push(msg.reply_to, protocol.RequestError(msg.request_id, code, message))

        if self.draining:
            fail("overloaded", "the server is draining; retry later")
            return
        if self.engines is None:
            fail(
                "service_unavailable",
                "no engine serves requests in disaggregated mode "
                "until KV migration lands; start lmdd with --mode hybrid",
            )
            return
        if msg.request_id in self._requests:
            fail("invalid_request_error", f"request id {msg.request_id} is already running")
            return
        try:
            prompt_ids, stops = self._tokenize(msg)
        except (ChatTemplateError, ValueError) as exc:
            fail("invalid_request_error", str(exc))
            return
        if len(prompt_ids) >= self.session_len:
            fail(
                "invalid_request_error",
                f"the prompt has {len(prompt_ids)} tokens; this "
                f"model's limit is {self.session_len - 1} prompt tokens (session_len "
                f"{self.session_len}, shared with the output)",
            )
            return
        stream = TextStream(
            self.decoder,
            prompt_ids=prompt_ids,
            stops=stops,
            skip_special_tokens=msg.skip_special_tokens,
            want_logprobs=msg.sampling.get("logprobs") is not None,
        )
        engine = next(self.engines)
        self._requests[msg.request_id] = _Request(msg.reply_to, engine, stream)
        # No max_tokens: as much as the session length leaves (as LMDeploy and vLLM do).
        room = self.session_len - len(prompt_ids)
        sampling = {**msg.sampling, "max_tokens": min(msg.sampling.get("max_tokens") or room, room)}
        generate = protocol.Generate(
            msg.request_id, self.spec.name, sampling, protocol.pack_ids(prompt_ids)
        )
        if not self.push(engine, generate):
            del self._requests[msg.request_id]
            fail("service_unavailable", f"engine {engine} is not taking requests")

    def _tokenize(self, msg: protocol.TextRequest) -> tuple[list[int], list[str]]:
        """Prompt token ids and stop strings of a request."""
        stops = list(msg.stop)
        if msg.messages is not None:
            text = self.template.render(parse_messages(msg.messages))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            stops += [s for s in self.template.stop_words if s not in stops]
        elif msg.prompt is not None:
            ids = self.tokenizer(msg.prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = protocol.unpack_ids(msg.prompt_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token id {bad[0]} is outside the vocabulary (0-{self.vocab_size - 1})"
                )
        if not ids:
            raise ValueError("the prompt is empty")
        return list(ids), stops

    # Tokens out ------------------------------------------------------------------------

    def _on_tokens(self, msg: protocol.Tokens) -> None:
        deltas: dict[str, list[tuple[str, _Request, Any]]] = defaultdict(list)
        ids = protocol.unpack_ids(msg.token_ids)
        for rid, token, reason, lp in zip(
            msg.request_ids, ids, msg.finish_reasons, msg.logprobs, strict=True
        ):
            request = self._requests.get(rid)
            if request is None:
                continue  # finished by a stop string, or aborted
            update = request.stream.feed(token, reason, lp)
            if update.stopped_by_string:
                self.push(request.engine, protocol.Abort(rid))
            if update.finish_reason is not None:
                del self._requests[rid]
            if update.text or update.finish_reason or update.logprobs:
                deltas[request.reply_to].append((rid, request, update))
        for reply_to, entries in deltas.items():
            self.push(
                reply_to,
                protocol.TextDelta(
                    [rid for rid, _, _ in entries],
                    [u.text for _, _, u in entries],
                    [u.finish_reason for _, _, u in entries],
                    [r.stream.num_prompt_tokens for _, r, _ in entries],
                    [r.stream.num_completion_tokens for _, r, _ in entries],
                    [u.logprobs for _, _, u in entries],
                ),
            )


def _max_positions(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings") or 4096)
