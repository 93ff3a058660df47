"""What a chat reply's text holds besides its answer: tool calls and reasoning.

`registry` names the parsers (`--tool-call-parser`, `--reasoning-parser`) and picks the
tool-call format from the model's chat template; `choice` decides, per request, which
parsers read its reply (`reply.ReplyParser`); openai_responses.ChatFormat builds the
message and the stream deltas from what they read. The parsers: `tool_calls` (hermes,
llama3_json, mistral, and tool_choice "required"), `named_call` (a named tool_choice),
`reasoning` (`<think>`), over `call_reader` and `json_scan` (JSON read as it is written).
"""
