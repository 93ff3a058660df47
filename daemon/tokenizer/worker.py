"""The tokenizer process: prompts in, token ids to an engine, text back to the api.

Life cycle of a request in the tokenizer:
  1. TextRequest from an api worker: render the chat template (messages) or take the
     prompt (text or token ids), tokenize, check the length against the session
     length, pick the engine workers (routing.Router: a hybrid engine, or a prefill and
     a decode worker, the least loaded that run), send Generate to the engine with this
     worker as reply_to. Anything wrong answers RequestError. A request for n > 1
     choices is n engine requests on those workers, the later ones sent once choice 0's
     prompt is in the engine's prefix cache (choices.py).
  2. Tokens from the engine: each token goes through the request's TextStream
     (incremental detokenizer + stop strings); the new text of every Tokens message
     handled in one turn of the event loop (one engine step, or several when the
     tokenizer is behind) goes back as one TextDelta per api worker (DeltaOutbox). A stop
     string finishes the request and aborts it in the engine.
  3. RequestError from the engine is passed to the api; Abort from the api is passed
     to the engine (and the decode worker). Either way, and once its last choice
     finished, the request's state is dropped. A worker serving a request that dies or
     restarts (ClusterState) fails the request at once: nothing waits for tokens that
     cannot come.
Interactive sessions (`TextRequest.session_id`, /v1/chat/interactive) live here, in a
SessionTable (sessions.py): a turn's prompt is the session's history ids + the new turn's
text tokenized; when the turn finishes its answer joins the history (not when aborted);
SessionControl cancels a session's running turn or ends the session. Tokenize and
Detokenize (/tokenize, /detokenize) are answered at once with Tokenized (prompts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

from lmd import protocol
from lmd.engine.config import context_len, read_hf_config, resolve_session_len
from lmd.engine.model_source import ModelSourceError, resolve_model
from lmd.names import role_of
from lmd.protocol import Message, Role
from lmd.roles import worker_names
from lmd.tokenizer.bad_words import bad_word_ids
from lmd.tokenizer.choices import Requests, choice_ids, choice_seed, num_uncached
from lmd.tokenizer.prompts import Prompts
from lmd.tokenizer.request import DeltaOutbox, Entry, TokenizerRequest
from lmd.tokenizer.routing import NoEngine, Route, Router
from lmd.tokenizer.sessions import Session, SessionError, SessionTable, Turn
from lmd.tokenizer.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    HfChatTemplate,
    load_chat_template,
)
from lmd.tokenizer.text.detokenizer import CachedDecoder
from lmd.tokenizer.text.stream import StreamUpdate, TextStream
from lmd.tokenizer.text.token_bytes import TokenBytes
from lmd.tokenizer.turns import Turns
from lmd.worker import Worker, WorkerStartError

log = logging.getLogger(__name__)


class TokenizerWorker(Worker):
    role = Role.TOKENIZER

    async def start(self) -> None:
        from transformers import AutoTokenizer

        try:
            model = resolve_model(self.config.model)
            self.tokenizer = await asyncio.to_thread(
                AutoTokenizer.from_pretrained, str(model.path), local_files_only=True
            )
            self.template = self._load_template()
            hf_config = read_hf_config(model.path)
            self.session_len = resolve_session_len(self.config.session_len, context_len(hf_config))
        except (ModelSourceError, ChatTemplateError, OSError, ValueError) as exc:
            raise WorkerStartError(str(exc)) from None
        # decode without clean-up; a token's own text is looked up, not decoded again
        self.decoder = CachedDecoder(self.tokenizer.backend_tokenizer)
        self.token_bytes = TokenBytes(self.tokenizer.backend_tokenizer)
        self.prompts = Prompts(self.tokenizer, self.template, len(self.tokenizer), self.session_len)
        hybrid = self.config.mode == "hybrid"
        engine_role, decode_role = (Role.HYBRID, None) if hybrid else (Role.PREFILL, Role.DECODE)
        configured = worker_names(self.config, engine_role)
        if decode_role is not None:
            configured += worker_names(self.config, decode_role)
        self.router = Router(engine_role, decode_role, configured, self.config.block_size)
        self._requests = Requests()  # the choices in flight
        self.outbox = DeltaOutbox(self.push, self.stages)  # new text for the api workers
        self.sessions = SessionTable(self.config.session_idle_timeout)
        decode = functools.partial(self.decoder.decode, skip_special_tokens=False)
        self.turns = Turns(self.sessions, self.template, self.prompts.encode, decode)
        self._expiry = self.watch(self._expire_sessions(), "session expiry")

    async def stop(self) -> None:
        self.outbox.flush()
        self._expiry.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._expiry

    async def _expire_sessions(self) -> None:
        interval = min(self.config.session_idle_timeout / 2, 30.0)
        while True:
            await asyncio.sleep(interval)
            for session_id in self.sessions.expire():
                log.debug(
                    "session %d expired (idle for %.0f s)", session_id, self.sessions.idle_timeout_s
                )

    def _load_template(self) -> ChatTemplate:
        if self.config.chat_template:
            return load_chat_template(Path(self.config.chat_template), self.tokenizer)
        return HfChatTemplate(self.tokenizer)

    def info(self) -> dict[str, Any]:
        return {"session_len": self.session_len, "template": type(self.template).__name__}

    def stats(self) -> dict[str, Any]:
        return {"running": len(self._requests), "sessions": len(self.sessions)}

    def inflight(self) -> int:
        return len(self._requests)

    def on_cluster_state(self) -> None:
        """An engine that died took its requests with it: fail them now, never hang.
        An api worker that died took its clients: stop computing for them."""
        for engine_id, choice in self._requests.items():
            if self._requests.get(engine_id) is not choice:
                continue  # gone with a choice before it
            if self._client_gone(choice):
                self._abort(choice.request_id)
            elif (reason := self._broken(choice.route)) is not None:
                self._fail(choice.request_id, "service_unavailable", reason)

    def _client_gone(self, request: TokenizerRequest) -> bool:
        if not self.workers or request.reply_pid is None:
            return False  # not known when the request came
        return self.workers.get(request.reply_to) != request.reply_pid

    def _broken(self, route: Route) -> str | None:
        if self.workers:
            return self.router.broken(route, self.workers)
        # No worker list (an older supervisor or a test): go by the missing roles.
        for name in (route.engine, route.decode):
            if name and role_of(name) in self.missing_roles:
                return f"{name}, serving this request, restarted"
        return None

    def _abort_engines(self, request: TokenizerRequest, engine_id: str) -> None:
        abort = protocol.Abort(engine_id)
        self.push(request.route.engine, abort)
        if request.route.decode:
            self.push(request.route.decode, abort)

    def _abort(self, request_id: str, failed: str = "") -> list[TokenizerRequest]:
        """End every choice of the api's request: those sent are aborted in the engines
        (but `failed`, whose engine ended it), those held forgotten. Its choices."""
        dropped = self._drop(request_id)
        for engine_id, choice in dropped:
            if choice.held is None and engine_id != failed:
                self._abort_engines(choice, engine_id)
        return [choice for _, choice in dropped]

    def _fail(self, request_id: str, code: str, message: str, failed: str = "") -> None:
        """End the api's request with an error: all its choices (see _abort)."""
        choices = self._abort(request_id, failed)
        if choices:
            error = protocol.RequestError(request_id, code, message)
            self.outbox.send(choices[0].reply_to, error)  # after the text before it

    async def handle(self, msg: Message) -> bool:
        if isinstance(msg, protocol.TextRequest):
            self._start_request(msg)
        elif isinstance(msg, protocol.Tokens):
            self._on_tokens(msg)
        elif isinstance(msg, protocol.RequestError):  # from an engine, for one choice
            choice = self._requests.get(msg.request_id)
            if choice is not None:
                self._fail(choice.request_id, msg.code, msg.message, failed=msg.request_id)
        elif isinstance(msg, protocol.Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, protocol.SessionControl):
            self._session_control(msg)
        elif isinstance(msg, protocol.Tokenize | protocol.Detokenize):
            self._answer_tokenize(msg)
        else:
            return False
        return True

    # Requests in ----------------------------------------------------------------------

    def _start_request(self, msg: protocol.TextRequest) -> None:
        def fail(code: str, message: str) -> None:
            self.outbox.send(msg.reply_to, protocol.RequestError(msg.request_id, code, message))

        if self.draining:
            fail("service_unavailable", "the server is draining; retry later")
            return
        if msg.request_id in self._requests:
            fail("invalid_request_error", f"request id {msg.request_id} is already running")
            return
        session: Session | None = None
        turn: Turn | None = None
        try:
            if msg.session_id is None:
                prompt_ids = self.prompts.of_request(msg)
            else:
                session = self.sessions.open(msg.session_id, fresh=not msg.interactive_mode)
                turn = self.turns.start(session, msg)
                prompt_ids = turn.token_ids
            self.prompts.check_length(prompt_ids, in_session=session is not None)
        except (SessionError, ChatTemplateError, ValueError) as exc:
            fail("invalid_request_error", str(exc))
            return
        try:
            route = self.router.pick(
                self.workers or None, self.draining_workers, self.load, len(prompt_ids)
            )
        except NoEngine as exc:
            fail("service_unavailable", f"{exc}; retry later")
            return
        # No max_tokens: as much as the session length leaves (as LMDeploy and vLLM do).
        room = self.session_len - len(prompt_ids)
        sampling = {**msg.sampling, "max_tokens": min(msg.sampling.get("max_tokens") or room, room)}
        if words := sampling.get("bad_words"):
            sampling["bad_words"] = bad_word_ids(words, self.prompts.encode)
        choices = self._choices(msg, prompt_ids, route, sampling)
        self._requests.add(msg.request_id, [(g.request_id, c) for g, c in choices])
        if session is not None:  # a turn is one choice
            choices[0][1].session, choices[0][1].turn = session, turn
            self.sessions.begin(session, msg.request_id)
        for generate, choice in choices:
            if choice.held is None and not self.push(route.engine, generate):
                self._abort(msg.request_id)
                fail("service_unavailable", f"engine {route.engine} is not taking requests")
                return
        self.stages.since("tokenizer", msg.sent_at)

    def _choices(
        self,
        msg: protocol.TextRequest,
        prompt_ids: list[int],
        route: Route,
        sampling: dict[str, Any],
    ) -> list[tuple[protocol.Generate, TokenizerRequest]]:
        """The request's choices, each with its Generate, by index; with prefix caching,
        the later choices' Generates are held until choice 0's prompt is cached."""
        stops = list(msg.stop)
        if msg.messages is not None or msg.session_id is not None:
            stops += [s for s in self.template.stop_words if s not in stops]
        hold = msg.n > 1 and self.config.enable_prefix_caching
        packed = protocol.pack_ids(prompt_ids)
        reply_pid = self.workers.get(msg.reply_to) if self.workers else None
        out, now = [], time.time()
        for index, engine_id in enumerate(choice_ids(msg.request_id, msg.n)):
            stream = TextStream(
                self.decoder,
                prompt_ids=prompt_ids,
                stops=stops,
                skip_special_tokens=msg.skip_special_tokens,
                token_bytes=self.token_bytes if sampling.get("logprobs") is not None else None,
            )
            on = route
            if index > 0:
                left = num_uncached(len(prompt_ids), self.config.block_size) if hold else 0
                on = self.router.follow(route, left or len(prompt_ids))
            seed = choice_seed(sampling.get("seed"), index)
            generate = protocol.Generate(
                engine_id, self.spec.name, {**sampling, "seed": seed}, packed, route.decode, now
            )
            choice = TokenizerRequest(msg.request_id, msg.reply_to, on, stream, index)
            choice.reply_pid, choice.keep_turn = reply_pid, msg.interactive_mode
            if hold and index > 0:
                choice.held = generate
            out.append((generate, choice))
        return out

    def _answer_tokenize(self, msg: protocol.Tokenize | protocol.Detokenize) -> None:
        """/tokenize and /detokenize: answered at once, nothing kept."""
        try:
            if isinstance(msg, protocol.Tokenize):
                answer = self.prompts.tokenize(msg)
            else:
                answer = self.prompts.detokenize(msg)
        except (ChatTemplateError, ValueError) as exc:
            self.push(
                msg.reply_to,
                protocol.RequestError(msg.request_id, "invalid_request_error", str(exc)),
            )
            return
        if not self.push(msg.reply_to, answer):
            reason = "the tokenizer could not send the answer (over its size cap?)"
            self.push(msg.reply_to, protocol.RequestError(msg.request_id, "internal_error", reason))

    # Requests out ----------------------------------------------------------------------

    def _drop(self, request_id: str) -> list[tuple[str, TokenizerRequest]]:
        """Forget the choices of an api request that did not finish, as (engine id,
        choice); its session keeps its history."""
        dropped = self._requests.drop(request_id)
        for _, choice in dropped:
            self.router.finished(choice.route)
            if choice.session is not None:
                self.turns.close(choice, keep=False)
        return dropped

    def _send_held(self, request_id: str) -> None:
        """Choice 0's first token is back: its prompt's full blocks are in its engine's
        prefix cache, where the request's other choices go now (choices.py)."""
        for choice in self._requests.held(request_id):
            held, choice.held = choice.held, None
            if held is None:
                continue
            generate = dataclasses.replace(held, sent_at=time.time())
            if not self.push(choice.route.engine, generate):
                reason = f"engine {choice.route.engine} is not taking requests"
                self._fail(request_id, "service_unavailable", reason)
                return

    def _session_control(self, msg: protocol.SessionControl) -> None:
        """Cancel a session's running turn (it ends with "abort"), or end the session."""
        session = self.sessions.get(msg.session_id)
        if session is None:
            return
        rid = session.request_id
        for choice in [] if rid is None else self._abort(rid):  # one: a turn has n = 1
            self.outbox.add(choice.reply_to, choice.delta_entry(StreamUpdate("", "abort", False)))
            self.outbox.flush()
        if msg.action == "end":
            self.sessions.end(msg.session_id)

    def _on_tokens(self, msg: protocol.Tokens) -> None:
        """Each token through its request's TextStream; the new text to the outbox."""
        self.stages.since("to_tokenizer", msg.sent_at)
        self.outbox.arrived()
        ids = protocol.unpack_ids(msg.token_ids)
        positions = protocol.unpack_ids(msg.positions)
        for rid, token, position, reason, lp, cached in zip(
            msg.request_ids,
            ids,
            positions,
            msg.finish_reasons,
            msg.logprobs,
            msg.cached_tokens,
            strict=True,
        ):
            request = self._requests.get(rid)
            if request is None:
                continue  # finished by a stop string, or aborted
            entry = (token, reason, lp, cached)
            if request.order.take(position):  # the next one, as nearly always
                self._feed(rid, request, entry)
                continue
            ready = request.order.arrive(position, entry)
            if ready is None:  # a token that went out already
                if reason is None:
                    log.warning("%s: token %d came twice; dropped", rid, position)
                    continue
                # Decode ending the request on the token prefill sent: the finish alone.
                update = StreamUpdate("", reason, False)
                self._finish(rid, request, update)
                self.outbox.add(request.reply_to, request.delta_entry(update))
                continue
            for entry in ready:
                self._feed(rid, request, entry)

    def _feed(self, rid: str, request: TokenizerRequest, entry: Entry) -> None:
        token, reason, lp, cached = entry
        if self._requests.get(rid) is not request:
            return  # ended by an earlier token of this batch (a stop string, an error)
        first = request.cached_tokens is None
        if first:
            request.cached_tokens = cached
            self.router.prefilled(request.route)
        update = request.stream.feed(token, reason, lp)
        if request.session is not None:
            request.answer.append(update.text)
            request.output_ids.append(token)
        if update.stopped_by_string:
            self._abort_engines(request, rid)
        if update.finish_reason is not None:
            self._finish(rid, request, update)
        if update.text or update.finish_reason or update.logprobs:
            self.outbox.add(request.reply_to, request.delta_entry(update))
        if first and request.index == 0:
            self._send_held(request.request_id)

    def _finish(self, rid: str, request: TokenizerRequest, update: StreamUpdate) -> None:
        self._requests.finish(rid)
        self.router.finished(request.route)
        if request.session is not None:
            self.turns.close(request, keep=update.finish_reason != "abort")
