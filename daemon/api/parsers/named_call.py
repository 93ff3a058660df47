"""tool_choice naming a function: the reply is that function's arguments, nothing else.

Under constrained decoding the engine lets the model write only the arguments' JSON
object, so the whole reply (whitespace around it aside) is one call's `arguments`. The
call's first stream entry goes out with the reply's first character.
"""

from __future__ import annotations

from lmd.api.parsers.tool_calls import ToolsDelta, call_id


class NamedCallStream:
    """One reply read as the arguments of a call to `name`."""

    __slots__ = ("_pending", "name", "num_calls")

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0
        self._pending = ""  # trailing whitespace: more arguments, or the end

    def feed(self, text: str) -> ToolsDelta:
        buf, self._pending = self._pending + text, ""
        if self.num_calls == 0:
            buf = buf.lstrip()
        kept = buf.rstrip()
        self._pending = buf[len(kept) :]
        if not kept:
            return ToolsDelta()
        function = {"arguments": kept}
        if self.num_calls == 0:
            self.num_calls = 1
            entry = {"index": 0, "id": call_id(), "type": "function"}
            return ToolsDelta("", [{**entry, "function": {"name": self.name, **function}}])
        return ToolsDelta("", [{"index": 0, "function": function}])

    def finish(self) -> ToolsDelta:
        self._pending = ""
        return ToolsDelta()
