"""Prompts in LMDeploy's shapes -> token ids, through the model's tokenizer and chat template.

A prompt is a string, a chat (a list of OpenAI messages) or token ids (a list of ints); a
call takes one prompt or a list of them. As in LMDeploy's pipeline, a string is one user
turn through the chat template (`do_preprocess=False`: the text as it is, tokenized as the
daemon's /v1/completions does); a chat is rendered as the daemon's /v1/chat/completions
renders it; token ids go to the engine unchanged. A model directory without a tokenizer
(a random-weight test model) takes token ids only, and its outputs carry no text.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tokenizers.decoders import ByteLevel

from lmd.engine.sequence import are_ints, first_outside
from lmd.tokenizer.text.chat_template import (
    ChatMessage,
    ChatTemplate,
    HfChatTemplate,
    LmdeployChatTemplate,
    parse_messages,
)
from lmd.tokenizer.text.detokenizer import (
    NUM_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    CachedDecoder,
    Detokenizer,
)
from lmd.tokenizer.text.stream import TextStream

Prompt = str | list[dict[str, Any]] | list[int]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True, slots=True)
class Tokenized:
    """One prompt as the engine gets it."""

    token_ids: list[int]
    chat: bool  # rendered through the chat template (its stop words apply)


def as_list(prompts: object) -> tuple[list[Prompt], bool]:
    """(the prompts as a list, whether a single prompt was given) or ValueError."""
    if _is_prompt(prompts):
        return [prompts], True  # type: ignore[list-item]  # _is_prompt checked the shape
    if isinstance(prompts, list | tuple) and prompts:
        for i, prompt in enumerate(prompts):
            if not _is_prompt(prompt):
                raise ValueError(
                    f"prompts[{i}] must be a string, a list of chat messages (dicts) or a "
                    f"list of token ids, got {_describe(prompt)}"
                )
        return list(prompts), False
    raise ValueError(
        "prompts must be a string, a chat (list of message dicts), token ids (list of "
        f"ints), or a non-empty list of those; got {_describe(prompts)}"
    )


def _is_prompt(value: object) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(m, Mapping) for m in value):
        return True
    return are_ints(value)


def _describe(value: object) -> str:
    if isinstance(value, list | tuple) and not value:
        return f"an empty {type(value).__name__}"
    return type(value).__name__


@dataclass(frozen=True, slots=True)
class WholeText:
    """The text of a request's whole output at once, as feeding its ids one by one to a
    Detokenizer gives it. Its contract says what that is: decode(context + ids) minus
    decode(context), the context being the prompt's last tokens: decodes in Rust instead
    of Python per token (`whole_texts` does those of several requests in one batch).
    Where the prompt ends inside a character the Detokenizer starts without context, and
    the text is decode(ids) (one more decode); where that is not known to be its text, or
    the context's text is not a prefix of the whole, the Detokenizer itself.
    byte_level: the decoder is ByteLevel alone (GPT-2, Llama 3, Qwen, SmolLM), which
    decodes the bytes of all the tokens joined, so decode(ids) is the Detokenizer's text
    even where bytes are invalid (U+FFFD)."""

    decoder: CachedDecoder
    prompt_ids: list[int]
    skip_special: bool
    byte_level: bool = False

    def __call__(self, token_ids: list[int]) -> str:
        return whole_texts([(self, token_ids)])[0]

    def finish(self, head: str, whole: str, token_ids: list[int], alone: str | None) -> str:
        """The text from decode(context), decode(context + token_ids) and, where the
        context ends inside a character, decode(token_ids) (`alone`)."""
        if head.endswith(REPLACEMENT_CHAR):
            # Without U+FFFD, decode(ids) is the Detokenizer's text by its contract; with
            # one, a ByteFallback decoder's differs. The Detokenizer in Python costs up to
            # ~15 us a token on random ids (the test models' output).
            if alone is not None and (self.byte_level or REPLACEMENT_CHAR not in alone):
                return alone
        elif whole.startswith(head):
            return whole[len(head) :]
        detok = Detokenizer(
            self.decoder, skip_special_tokens=self.skip_special, prompt_ids=self.prompt_ids
        )
        return detok.feed(token_ids) + detok.finish()


def whole_texts(jobs: SequenceOf[tuple[WholeText, list[int]]]) -> list[str]:
    """The whole texts of several finished requests: their decodes as one batch per
    decoder and skip_special_tokens (the tokenizer spreads a batch over the cores; a call's
    requests often end in the same step, after the engine's last)."""
    texts = [""] * len(jobs)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (text, _) in enumerate(jobs):
        groups.setdefault((id(text.decoder), text.skip_special), []).append(i)
    for (_, skip), members in groups.items():
        decoder = jobs[members[0]][0].decoder
        batch: list[list[int]] = []
        for i in members:
            text, ids = jobs[i]
            context = text.prompt_ids[-NUM_CONTEXT_TOKENS:]
            batch += [context, context + ids]
        decoded = decoder.decode_batch(batch, skip_special_tokens=skip)
        heads, wholes = decoded[::2], decoded[1::2]
        # decode(ids) where the context ends inside a character (WholeText.finish)
        alone: list[str | None] = [None] * len(members)
        split = [k for k, head in enumerate(heads) if head.endswith(REPLACEMENT_CHAR)]
        if split:
            ids_alone = [jobs[members[k]][1] for k in split]
            for k, text_alone in zip(
                split, decoder.decode_batch(ids_alone, skip_special_tokens=skip), strict=True
            ):
                alone[k] = text_alone
        for k, i in enumerate(members):
            text, ids = jobs[i]
            texts[i] = text.finish(heads[k], wholes[k], ids, alone[k])
    return texts


class Prompter:
    """The model's tokenizer and chat template, or neither (token ids only)."""

    def __init__(
        self,
        model_dir: Path,
        chat_template: LmdeployChatTemplate | None = None,
        vocab_size: int = 0,
    ) -> None:
        # The model's (set once it is loaded): a token id past it has no embedding.
        self.vocab_size = vocab_size
        self.tokenizer: Any = None
        self.decoder: CachedDecoder | None = None
        self.byte_level = False  # the decoder is ByteLevel alone (WholeText)
        self.template: ChatTemplate | None = chat_template
        if any((model_dir / name).exists() for name in TOKENIZER_FILES):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            # decode without clean-up; a token's own text is looked up, not decoded again
            self.decoder = CachedDecoder(self.tokenizer.backend_tokenizer)
            # ByteLevel alone: a Sequence around it is another class
            self.byte_level = isinstance(self.tokenizer.backend_tokenizer.decoder, ByteLevel)
            if self.template is None and self.tokenizer.chat_template:
                self.template = HfChatTemplate(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Rendered chat text -> ids (the template wrote its special tokens itself)."""
        return list(self._need_tokenizer("text")(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        """Ids -> text, special tokens kept (a chat session's history)."""
        if self.decoder is None:
            raise ValueError("this model has no tokenizer")
        return self.decoder.decode(token_ids, skip_special_tokens=False)

    def tokenize(self, prompt: Prompt, *, do_preprocess: bool = True) -> Tokenized:
        """One prompt's ids; ValueError says what is wrong with it."""
        if isinstance(prompt, str):
            if do_preprocess and self.template is not None:
                return Tokenized(self.encode(self.template.render_prompt(prompt)), chat=True)
            ids = self._need_tokenizer("a string prompt")(prompt, add_special_tokens=True)
            return Tokenized(self._checked(list(ids["input_ids"])), chat=False)
        if all(isinstance(m, Mapping) for m in prompt):
            chat = parse_messages(cast(list[dict[str, Any]], prompt))
            return Tokenized(self.encode(self.render(chat)), chat=True)
        ids = cast(list[int], prompt)  # ints (_is_prompt); int subclasses made plain
        plain = set(map(type, ids)) == {int}
        return Tokenized(self._checked(list(ids) if plain else list(map(int, ids))), chat=False)

    def render(self, messages: SequenceOf[ChatMessage]) -> str:
        return self.need_template().render(messages)

    def need_template(self) -> ChatTemplate:
        if self.template is None:
            raise ValueError(
                "this model has no chat template: pass chat_template_config=ChatTemplateConfig"
                "(...) to pipeline(), or give the prompt as a string with do_preprocess=False"
            )
        return self.template

    def text(
        self,
        tokenized: Tokenized,
        stop_words: SequenceOf[str],
        *,
        skip_special: bool,
        incremental: bool,
    ) -> TextStream | WholeText | None:
        """How a request's output becomes text: token by token (a TextStream: the
        tokenizer process's detokenizer and stop strings), or, when nothing needs the text
        before the end (no stream, no stop string), all at once when it ends (WholeText:
        the same text, several times less work per token). None: no tokenizer."""
        stops = list(stop_words)
        if tokenized.chat and self.template is not None:
            stops += [s for s in self.template.stop_words if s not in stops]
        if self.decoder is None:
            if stop_words:
                raise ValueError("stop_words need a tokenizer, and this model has none")
            return None
        if not incremental and not stops:
            return WholeText(self.decoder, tokenized.token_ids, skip_special, self.byte_level)
        return TextStream(
            self.decoder,
            prompt_ids=tokenized.token_ids,
            stops=stops,
            skip_special_tokens=skip_special,
        )

    def _checked(self, ids: list[int]) -> list[int]:
        bad = first_outside(ids, self.vocab_size)
        if bad is not None:
            raise ValueError(
                f"token id {bad} is outside this model's vocabulary (0-{self.vocab_size - 1})"
            )
        return ids

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"this model has no tokenizer, so {what} cannot be used: give token ids"
            )
        return self.tokenizer
