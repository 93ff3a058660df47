"""The text half of the tokenizer process: pure functions of text and token ids.

`chat_messages` (OpenAI messages checked, tool calls kept), `chat_template` (messages and
tools -> prompt text: Jinja or LMDeploy templates),
`detokenizer` (token ids -> text deltas, per request) and `stop_strings` (stop strings
across delta boundaries, per request). No sockets, no processes, no model weights.
"""

from __future__ import annotations
