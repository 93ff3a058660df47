"""The tokenizer process: prompts in, token ids to an engine, text back to the api.

Life cycle of a request in the tokenizer:
  1. TextRequest from an api worker: render the chat template (messages) or take the
     prompt (text or token ids), tokenize, check the length against the session
     length, pick the engine workers (routing.Router: a hybrid engine, or a prefill and
     a decode worker, the least loaded that run), send Generate to the engine with this
     worker as reply_to. Anything wrong answers RequestError.
  2. Tokens from the engine: each token goes through the request's TextStream
     (incremental detokenizer + stop strings); the new text of every Tokens message
     handled in one turn of the event loop (one engine step, or several when the
     tokenizer is behind) goes back as one TextDelta per api worker (DeltaOutbox). A stop
     string finishes the request and aborts it in the engine.
  3. RequestError from the engine is passed to the api; Abort from the api is passed
     to the engine (and the decode worker). Either way, and on finish, the request's
     state is dropped. A worker serving a request that dies or restarts (ClusterState)
     fails the request at once: nothing waits for tokens that cannot come.
Interactive sessions (`TextRequest.session_id`, /v1/chat/interactive) live here, in a
SessionTable (sessions.py): a turn's prompt is the session's history ids + the new turn's
text tokenized; when the turn finishes its answer joins the history (not when aborted);
SessionControl cancels a session's running turn or ends the session. Tokenize and
Detokenize (/tokenize, /detokenize) are answered at once with Tokenized (prompts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from lmd import protocol
from lmd.engine.config import context_len, read_hf_config, resolve_session_len
from lmd.engine.model_source import ModelSourceError, resolve_model
from lmd.names import role_of
from lmd.protocol import Message, Role
from lmd.roles import worker_names
from lmd.tokenizer.bad_words import bad_word_ids
from lmd.tokenizer.prompts import Prompts
from lmd.tokenizer.request import DeltaOutbox, Entry, TokenizerRequest
from lmd.tokenizer.routing import NoEngine, Route, Router
from lmd.tokenizer.sessions import (
    Session,
    SessionError,
    SessionTable,
    Turn,
    finish_turn,
    start_turn,
)
from lmd.tokenizer.text.chat_template import (
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    HfChatTemplate,
    load_chat_template,
    parse_messages,
)
from lmd.tokenizer.text.detokenizer import CachedDecoder
from lmd.tokenizer.text.stream import StreamUpdate, TextStream
from lmd.tokenizer.text.token_bytes import TokenBytes
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
        self.vocab_size = len(self.tokenizer)
        self.prompts = Prompts(self.tokenizer, self.template, self.vocab_size, self.session_len)
        hybrid = self.config.mode == "hybrid"
        engine_role, decode_role = (Role.HYBRID, None) if hybrid else (Role.PREFILL, Role.DECODE)
        configured = worker_names(self.config, engine_role)
        if decode_role is not None:
            configured += worker_names(self.config, decode_role)
        self.router = Router(engine_role, decode_role, configured, self.config.block_size)
        self._requests: dict[str, TokenizerRequest] = {}
        self.outbox = DeltaOutbox(self.push)  # new text for the api workers
        self.sessions = SessionTable(self.config.session_idle_timeout)
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
        for request_id, request in list(self._requests.items()):
            if self._client_gone(request):
                self._drop(request_id)
                self._abort_engines(request, request_id)
                continue
            reason = self._broken(request.route)
            if reason is None:
                continue
            self._drop(request_id)
            self._abort_engines(request, request_id)  # free what a survivor holds
            error = protocol.RequestError(request_id, "service_unavailable", reason)
            self.outbox.send(request.reply_to, error)  # after the text before it

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

    def _abort_engines(self, request: TokenizerRequest, request_id: str) -> None:
        abort = protocol.Abort(request_id)
        self.push(request.route.engine, abort)
        if request.route.decode:
            self.push(request.route.decode, abort)

    async def handle(self, msg: Message) -> bool:
        if isinstance(msg, protocol.TextRequest):
            self._start_request(msg)
        elif isinstance(msg, protocol.Tokens):
            self._on_tokens(msg)
        elif isinstance(msg, protocol.RequestError):
            request = self._drop(msg.request_id)
            if request is not None:
                self.outbox.send(request.reply_to, msg)  # after the text before it
        elif isinstance(msg, protocol.Abort):
            request = self._drop(msg.request_id)
            if request is not None:
                self._abort_engines(request, msg.request_id)
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
            fail("overloaded", "the server is draining; retry later")
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
                turn = self._start_turn(session, msg)
                prompt_ids = turn.token_ids
        except (SessionError, ChatTemplateError, ValueError) as exc:
            fail("invalid_request_error", str(exc))
            return
        if len(prompt_ids) >= self.session_len:
            hint = ""
            if session is not None:
                hint = "; end the session or start it again with interactive_mode false"
            fail(
                "invalid_request_error",
                f"the prompt has {len(prompt_ids)} tokens; this "
                f"model's limit is {self.session_len - 1} prompt tokens (session_len "
                f"{self.session_len}, shared with the output){hint}",
            )
            return
        stops = list(msg.stop)
        if msg.messages is not None or session is not None:
            stops += [s for s in self.template.stop_words if s not in stops]
        stream = TextStream(
            self.decoder,
            prompt_ids=prompt_ids,
            stops=stops,
            skip_special_tokens=msg.skip_special_tokens,
            token_bytes=self.token_bytes if msg.sampling.get("logprobs") is not None else None,
        )
        try:
            route = self.router.pick(
                self.workers or None, self.draining_workers, self.load, len(prompt_ids)
            )
        except NoEngine as exc:
            fail("service_unavailable", f"{exc}; retry later")
            return
        request = TokenizerRequest(msg.reply_to, route, stream, session=session, turn=turn)
        request.reply_pid = self.workers.get(msg.reply_to) if self.workers else None
        request.keep_turn = msg.interactive_mode
        self._requests[msg.request_id] = request
        if session is not None:
            self.sessions.begin(session, msg.request_id)
        # No max_tokens: as much as the session length leaves (as LMDeploy and vLLM do).
        room = self.session_len - len(prompt_ids)
        sampling = {**msg.sampling, "max_tokens": min(msg.sampling.get("max_tokens") or room, room)}
        if words := sampling.get("bad_words"):
            sampling["bad_words"] = bad_word_ids(words, self._encode)
        generate = protocol.Generate(
            msg.request_id, self.spec.name, sampling, protocol.pack_ids(prompt_ids), route.decode
        )
        if not self.push(route.engine, generate):
            self._drop(msg.request_id)
            fail("service_unavailable", f"engine {route.engine} is not taking requests")

    def _encode(self, text: str) -> list[int]:
        return self.prompts.encode(text)

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

    def _start_turn(self, session: Session, msg: protocol.TextRequest) -> Turn:
        """An interactive turn's prompt: the session's history + the new messages."""
        if msg.messages is not None:
            new = parse_messages(msg.messages)
        else:
            new = [ChatMessage("user", msg.prompt or "")]
        turn = start_turn(session, new, self.template, self._encode, bare_prompt=msg.prompt)
        if not turn.token_ids:
            raise ValueError("the prompt is empty")
        return turn

    # Requests out ----------------------------------------------------------------------

    def _drop(self, request_id: str) -> TokenizerRequest | None:
        """Forget a request that did not finish; its session keeps its history."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.router.finished(request.route)
            if request.session is not None:
                self._close_turn(request, keep=False)
        return request

    def _close_turn(self, request: TokenizerRequest, *, keep: bool) -> None:
        """The turn is over: keep its answer in the session's history, or not."""
        session, turn = request.session, request.turn
        assert session is not None and turn is not None
        if not (keep and request.keep_turn):
            self.sessions.release(session)
            if not request.keep_turn:  # a one-off turn: LMDeploy ends its session
                self.sessions.end(session.session_id)
            return
        try:
            history = finish_turn(
                turn,
                "".join(request.answer),
                request.output_ids,
                template=self.template,
                encode=self._encode,
                decode=lambda ids: self.decoder.decode(ids, skip_special_tokens=False),
            )
        except ChatTemplateError as exc:
            log.warning("session %d starts afresh: %s", session.session_id, exc)
            session.reset()
            self.sessions.release(session)
            return
        self.sessions.commit(session, *history)

    def _session_control(self, msg: protocol.SessionControl) -> None:
        """Cancel a session's running turn (it ends with "abort"), or end the session."""
        session = self.sessions.get(msg.session_id)
        if session is None:
            return
        rid = session.request_id
        request = None if rid is None else self._drop(rid)
        if rid is not None and request is not None:
            self._abort_engines(request, rid)
            abort = request.delta_entry(rid, StreamUpdate("", "abort", False))
            self.outbox.add(request.reply_to, abort)
            self.outbox.flush()
        if msg.action == "end":
            self.sessions.end(msg.session_id)

    def _on_tokens(self, msg: protocol.Tokens) -> None:
        """Each token through its request's TextStream; the new text to the outbox."""
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
                self.outbox.add(request.reply_to, request.delta_entry(rid, update))
                continue
            for entry in ready:
                self._feed(rid, request, entry)

    def _feed(self, rid: str, request: TokenizerRequest, entry: Entry) -> None:
        token, reason, lp, cached = entry
        if rid not in self._requests:
            return  # ended by an earlier token of this batch (a stop string)
        if request.cached_tokens is None:
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
            self.outbox.add(request.reply_to, request.delta_entry(rid, update))

    def _finish(self, rid: str, request: TokenizerRequest, update: StreamUpdate) -> None:
        del self._requests[rid]
        self.router.finished(request.route)
        if request.session is not None:
            self._close_turn(request, keep=update.finish_reason != "abort")
