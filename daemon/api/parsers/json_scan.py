"""An incremental JSON validator for one value, fed one character at a time (or, inside
a string, a run of characters that cannot end it at once: `plain_run`).

The tool-call parsers read a call's JSON as the model writes it. Whether a character
keeps the text a JSON value in progress is known when that character arrives, whatever
the stream's split, so a streamed reply and the same reply parsed whole decide alike.
Only a number's end is seen late: on the character after it, which it does not consume.
"""

from __future__ import annotations

import enum
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_WHITESPACE = frozenset(" \t\n\r")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # characters that only continue a string


class Step(enum.IntEnum):
    """What a character did to the value."""

    MORE = 0  # consumed; the value goes on
    DONE = 1  # consumed; it completed the value
    BEFORE = 2  # not consumed: the value (a number) had ended just before it
    ERROR = 3  # not consumed: no JSON value goes on like this


class _Mode(enum.IntEnum):
    VALUE = 0  # a value comes next
    FIRST_ITEM = 1  # after `[`: a value or `]`
    FIRST_KEY = 2  # after `{`: a key or `}`
    KEY = 3  # after `,` in an object: a key
    COLON = 4
    STRING = 5
    ESCAPE = 6
    HEX = 7
    NUMBER = 8
    LITERAL = 9
    AFTER = 10  # after a value inside a container: `,` or its closing bracket
    END = 11  # the value is complete


def is_whitespace(ch: str) -> bool:
    return ch in _WHITESPACE


class ValueScanner:
    """Validates one JSON value (RFC 8259) as it arrives; `feed` takes one character."""

    __slots__ = ("_hex_left", "_in_key", "_literal", "_mode", "_number", "_stack")

    def __init__(self) -> None:
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._mode = _Mode.VALUE
        self._in_key = False  # the string being read is an object's key
        self._hex_left = 0  # hex digits still due in a \\u escape
        self._literal = ""  # letters still due in true, false or null
        self._number: list[str] = []

    @property
    def done(self) -> bool:
        return self._mode is _Mode.END

    def feed(self, ch: str) -> Step:
        mode = self._mode
        if mode is _Mode.STRING:
            if ch == '"':
                if self._in_key:
                    self._mode = _Mode.COLON
                    return Step.MORE
                return self._end_value()
            if ch == "\\":
                self._mode = _Mode.ESCAPE
            elif ord(ch) < 0x20:
                return Step.ERROR
            return Step.MORE
        if mode is _Mode.ESCAPE:
            if ch not in _ESCAPES:
                return Step.ERROR
            if ch == "u":
                self._mode, self._hex_left = _Mode.HEX, 4
            else:
                self._mode = _Mode.STRING
            return Step.MORE
        if mode is _Mode.HEX:
            if ch not in _HEX:
                return Step.ERROR
            self._hex_left -= 1
            if self._hex_left == 0:
                self._mode = _Mode.STRING
            return Step.MORE
        if mode is _Mode.NUMBER:
            if ch in _NUMBER_CHARS:
                self._number.append(ch)
                return Step.MORE
            if _NUMBER.fullmatch("".join(self._number)) is None:
                return Step.ERROR
            self._number.clear()
            if self._end_value() is Step.DONE:
                return Step.BEFORE
            return self.feed(ch)  # the character after the number, in its container
        if mode is _Mode.LITERAL:
            if ch != self._literal[0]:
                return Step.ERROR
            self._literal = self._literal[1:]
            return Step.MORE if self._literal else self._end_value()
        if ch in _WHITESPACE:
            return Step.ERROR if mode is _Mode.END else Step.MORE
        if mode is _Mode.VALUE or mode is _Mode.FIRST_ITEM:
            if mode is _Mode.FIRST_ITEM and ch == "]":
                self._stack.pop()
                return self._end_value()
            return self._start_value(ch)
        if mode is _Mode.FIRST_KEY or mode is _Mode.KEY:
            if ch == '"':
                self._mode, self._in_key = _Mode.STRING, True
                return Step.MORE
            if mode is _Mode.FIRST_KEY and ch == "}":
                self._stack.pop()
                return self._end_value()
            return Step.ERROR
        if mode is _Mode.COLON:
            if ch != ":":
                return Step.ERROR
            self._mode = _Mode.VALUE
            return Step.MORE
        if mode is _Mode.AFTER:
            top = self._stack[-1]
            if ch == ",":
                self._mode = _Mode.KEY if top == "{" else _Mode.VALUE
                return Step.MORE
            if ch == ("}" if top == "{" else "]"):
                self._stack.pop()
                return self._end_value()
        return Step.ERROR

    def plain_run(self, text: str, at: int) -> int:
        """Where the run of `text` from `at` that only continues a string ends (`at`:
        none, or not in a string). Feeding it would change nothing, so it is skipped."""
        if self._mode is not _Mode.STRING:
            return at
        found = _PLAIN.match(text, at)
        return at if found is None else found.end()

    def _start_value(self, ch: str) -> Step:
        if ch == "{":
            self._stack.append("{")
            self._mode = _Mode.FIRST_KEY
        elif ch == "[":
            self._stack.append("[")
            self._mode = _Mode.FIRST_ITEM
        elif ch == '"':
            self._mode, self._in_key = _Mode.STRING, False
        elif ch == "-" or "0" <= ch <= "9":
            self._mode = _Mode.NUMBER
            self._number.append(ch)
        elif ch in _LITERALS:
            self._mode, self._literal = _Mode.LITERAL, _LITERALS[ch]
        else:
            return Step.ERROR
        return Step.MORE

    def _end_value(self) -> Step:
        if self._stack:
            self._mode = _Mode.AFTER
            return Step.MORE
        self._mode = _Mode.END
        return Step.DONE

    def finish(self) -> bool:
        """At the end of the text: is the value complete (a trailing number counts)?"""
        if self._mode is _Mode.NUMBER and not self._stack:
            return _NUMBER.fullmatch("".join(self._number)) is not None
        return self._mode is _Mode.END
