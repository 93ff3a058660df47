"""What a generation request's answer is built with, by its body: the Format (response
bodies and stream chunks) and the Framing (a stream's bytes); a chat's Format with the
parsers its reply goes through (parsers/choice.py: tool calls, reasoning)."""

from __future__ import annotations

import time

from lmd.api.interactive import InteractiveFormat, InteractiveRequest, LineFraming
from lmd.api.openai_responses import ChatFormat, CompletionFormat, Framing, SseFraming
from lmd.api.openai_schema import ChatCompletionRequest, CompletionRequest
from lmd.api.parsers.choice import ReplyChoice

Format = ChatFormat | CompletionFormat | InteractiveFormat
Body = ChatCompletionRequest | CompletionRequest | InteractiveRequest


async def answer_format(
    body: Body, request_id: str, replies: ReplyChoice
) -> tuple[Format, Framing]:
    """The request's Format and Framing (a chat's parsers may read the model's chat
    template first, once: hence async)."""
    if isinstance(body, InteractiveRequest):
        interactive = InteractiveFormat()
        return interactive, LineFraming(interactive)
    head = (request_id, int(time.time()), body.model, body.include_usage, body.num_choices)
    if isinstance(body, ChatCompletionRequest):
        chat = ChatFormat(*head, reply=await replies.for_chat(body))
        return chat, SseFraming(chat)
    completion = CompletionFormat(*head)
    return completion, SseFraming(completion)
