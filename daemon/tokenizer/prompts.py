"""Prompt token ids from what a request gives (a chat, text, ids), and /tokenize and
/detokenize's answers: the tokenizer process's one way from text to ids and back.

A chat is rendered by the chat template (with the request's tools and template
variables) and tokenized without the tokenizer's special tokens (the template writes
them); a text prompt is tokenized with them (BOS), as vLLM and LMDeploy do. Given ids
are checked against the vocabulary. Errors are ChatTemplateError or ValueError, each a
400 saying what was wrong.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from lmd import protocol
from lmd.engine.sequence import first_outside
from lmd.tokenizer.text.chat_template import ChatTemplate, parse_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Prompts:
    """Text to prompt token ids and back, for one tokenizer and chat template."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: ChatTemplate,
        vocab_size: int,
        session_len: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.vocab_size = vocab_size
        self.session_len = session_len

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def of_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        text = self.template.render(
            parse_messages(messages),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        return self.encode(text, add_special_tokens=add_special_tokens)

    def checked(self, ids: list[int], what: str = "token id") -> list[int]:
        """`ids` if every one is in the vocabulary; else ValueError naming the first."""
        bad = first_outside(ids, self.vocab_size)
        if bad is not None:
            raise ValueError(f"{what} {bad} is outside the vocabulary (0-{self.vocab_size - 1})")
        return ids

    def of_request(self, msg: protocol.TextRequest) -> list[int]:
        """Prompt token ids of a request outside any session (never empty)."""
        if msg.messages is not None:
            ids = self.of_chat(msg.messages, msg.tools, msg.chat_template_kwargs)
        elif msg.prompt is not None:
            ids = self.encode(msg.prompt, add_special_tokens=True)
        else:
            ids = self.checked(protocol.unpack_ids(msg.prompt_ids), "prompt token id")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def check_length(self, ids: list[int], *, in_session: bool = False) -> None:
        """ValueError when a prompt leaves no room for output in the session length."""
        if len(ids) < self.session_len:
            return
        hint = "; end the session or start it again with interactive_mode false"
        raise ValueError(
            f"the prompt has {len(ids)} tokens; this model's limit is "
            f"{self.session_len - 1} prompt tokens (session_len {self.session_len}, shared "
            f"with the output){hint if in_session else ''}"
        )

    def tokenize(self, msg: protocol.Tokenize) -> protocol.Tokenized:
        if msg.messages is not None:
            ids = self.of_chat(
                msg.messages,
                msg.tools,
                msg.chat_template_kwargs,
                add_generation_prompt=msg.add_generation_prompt,
                add_special_tokens=msg.add_special_tokens,
            )
        else:
            ids = self.encode(msg.prompt or "", add_special_tokens=msg.add_special_tokens)
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if msg.return_token_strs else None
        return protocol.Tokenized(
            msg.request_id, protocol.pack_ids(ids), "", strs, self.session_len
        )

    def detokenize(self, msg: protocol.Detokenize) -> protocol.Tokenized:
        ids = self.checked(protocol.unpack_ids(msg.token_ids))
        text = cast(str, self.tokenizer.decode(ids))  # a flat list of ids: one text
        return protocol.Tokenized(msg.request_id, b"", text, None, self.session_len)
