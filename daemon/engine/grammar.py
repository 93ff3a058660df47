"""Structured output: a request's grammar, compiled by xgrammar, masks its tokens.

A request asks for it with `SamplingParams.guided = (kind, spec)`:
  json      spec: a JSON schema (JSON text), or "" for any JSON object (json_object)
  regex     spec: a regular expression the whole output matches
  grammar   spec: an EBNF grammar in xgrammar's dialect (its `root` rule is the output)
JSON is written compact (`, ` and `: ` between items, no other whitespace), so a model
cannot spend its tokens on whitespace.

Life cycle in an engine worker:
  1. A message that brings a grammar (Generate; a decode worker's Reserve) waits, with
     any later message of its request, while `Grammars.prepare` compiles it in a thread
     (the step loop goes on); a spec seen before is in the cache (by kind and spec).
  2. Between steps, `Grammars.guide` gives the sequence its own `Guide` (an xgrammar
     matcher over the compiled grammar): a bad spec is the request's 400 then.
  3. Each step the sampler asks every guided row's Guide for the tokens allowed next
     (a bitmask, filled on the CPU and applied on the logits' device: GuideMasks) and
     the sequence hands each token it appends to its Guide. The mask depends on the
     token before (SamplingParams.needs_history): with overlapped steps, a step's
     forward runs ahead and its sampling waits for that token (engine.py).
  4. Once the grammar is complete only the model's end-of-sequence tokens are allowed;
     the sequence stops when its Guide has taken one (even with ignore_eos).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the api checks specs without either (SamplingParams imports this)
    import torch
    import xgrammar

log = logging.getLogger(__name__)

GUIDED_KINDS = ("json", "regex", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar; a bigger one is a 400
CACHE_ENTRIES = 256  # compiled grammars kept, by (kind, spec)
ANY_OBJECT = '{"type": "object"}'  # the schema of ("json", ""): OpenAI's json_object


class GrammarError(ValueError):
    """A spec xgrammar cannot compile; the message says why in one line."""


def check_guided(value: object) -> tuple[str, str] | None:
    """SamplingParams.guided as given over IPC: None, or (kind, spec)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"guided must be [kind, spec], got {value!r:.80}")
    kind, spec = value
    if kind not in GUIDED_KINDS or not isinstance(spec, str):
        raise ValueError(f"guided kind must be one of {', '.join(GUIDED_KINDS)} with a text spec")
    if kind != "json" and not spec:
        raise ValueError(f"a guided {kind} needs a non-empty spec")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"a guided {kind} spec takes at most {MAX_SPEC_CHARS} characters")
    return kind, spec


def one_line(exc: Exception) -> str:
    """xgrammar's error without its source location: `[time] file.cc:N: why` -> `why`."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


# xgrammar 0.2.8 writes a string with minLength or maxLength as characters other than
# `"`, `\\`, CR and LF, so control characters (a byte-level token such as 0x12) got
# through and the output was not JSON; JSON's own rule excludes U+0000 to U+001F.
_LOOSE_CHARACTER = r"[^\"\\\r\n]"
_JSON_CHARACTER = r"[^\"\\\0-\x1f]"


def check_spec(kind: str, spec: str) -> None:
    """GrammarError when `spec` does not parse (no tokenizer needed: the api's check)."""
    grammar_of(kind, spec)


def grammar_of(kind: str, spec: str) -> xgrammar.Grammar:
    """The spec as an xgrammar Grammar (not compiled for a vocabulary yet); GrammarError
    saying why when it does not parse."""
    import xgrammar as xgr

    try:
        if kind == "json":
            text = str(xgr.Grammar.from_json_schema(spec or ANY_OBJECT, any_whitespace=False))
            return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARACTER, _JSON_CHARACTER))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        return xgr.Grammar.from_ebnf(spec)
    except RuntimeError as exc:
        raise GrammarError(f"the {kind} is not valid: {one_line(exc)}") from None


class Guide:
    """One sequence's place in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Take the token the sequence appended; False when the grammar forbids it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_done(self) -> bool:
        """The grammar is complete and an end token was taken."""
        return bool(self.matcher.is_terminated())


class Grammars:
    """One engine's compiler and cache. The tokenizer's vocabulary is read on the first
    guided request (a few seconds for a 150k-token vocabulary), not at start."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: SequenceOf[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width, which the bitmask covers
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: asyncio.Future[xgrammar.GrammarCompiler] | None = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # grammar or error
        self._pending: dict[tuple[str, str], asyncio.Future[None]] = {}
        self.num_compiled = 0

    async def prepare(self, guided: tuple[str, str]) -> None:
        """Compile `guided` into the cache, in a thread; a failure is cached too."""
        if guided in self._compiled:
            self._compiled.move_to_end(guided)
            return
        pending = self._pending.get(guided)
        if pending is None:
            pending = self._pending[guided] = asyncio.ensure_future(self._compile(guided))
            pending.add_done_callback(lambda _: self._pending.pop(guided, None))
        await asyncio.shield(pending)

    async def _compile(self, guided: tuple[str, str]) -> None:
        if self._compiler is None:
            self._compiler = asyncio.ensure_future(asyncio.to_thread(self._load_compiler))
        result: Any
        try:
            compiler = await asyncio.shield(self._compiler)
        except Exception as exc:  # no tokenizer files beside the model, ...
            log.error("structured output is unavailable: %s", exc)
            result = GrammarError(f"structured output is unavailable on this model: {exc}")
        else:
            result = await asyncio.to_thread(_compile, compiler, *guided)
        self._remember(guided, result)

    def _remember(self, guided: tuple[str, str], result: Any) -> None:
        self._compiled[guided] = result
        self.num_compiled += 1
        while len(self._compiled) > CACHE_ENTRIES:
            self._compiled.popitem(last=False)

    def _load_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
        )
        log.info("structured output: vocabulary of %d tokens read", self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=2)

    def guide(self, guided: tuple[str, str]) -> Guide:
        """A new Guide for a prepared spec; GrammarError when the spec is bad."""
        import xgrammar as xgr

        result = self._compiled.get(guided)
        if result is None:  # evicted since it was prepared (a burst of new specs)
            compiler = self._compiler
            if compiler is None or not compiler.done() or compiler.exception() is not None:
                raise GrammarError("the grammar was not compiled; retry")
            result = _compile(compiler.result(), *guided)
            self._remember(guided, result)
        if isinstance(result, GrammarError):
            raise result
        return Guide(xgr.GrammarMatcher(result, override_stop_tokens=self.eos_token_ids))


def _compile(compiler: xgrammar.GrammarCompiler, kind: str, spec: str) -> Any:
    """The spec compiled for the vocabulary, or the GrammarError saying why not."""
    try:
        return compiler.compile_grammar(grammar_of(kind, spec))
    except GrammarError as exc:
        return exc


class GuideMasks:
    """Fills and applies the guided rows' bitmasks for one sampler: the matchers filled
    together on xgrammar's threads, into a pinned host buffer kept across steps, copied
    to the logits' device without a wait."""

    def __init__(self) -> None:
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._host: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32

    def apply(self, x: torch.Tensor, rows: list[int], guides: list[Guide]) -> None:
        """Mask the logits `x` ([B, V], in place) of `rows` to their guides' tokens."""
        import torch
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        width = xgr.get_bitmask_shape(1, x.shape[1])[1]
        host = self._host
        if host is None or host.shape[0] < x.shape[0] or host.shape[1] != width:
            pinned = x.device.type == "cuda"
            host = self._host = torch.empty(x.shape[0], width, dtype=torch.int32, pin_memory=pinned)
        bitmask = host[: x.shape[0]]
        matchers = [guide.matcher for guide in guides]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        device_mask = bitmask.to(x.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(x, device_mask, indices=rows)
