"""A request's `bad_words` (vLLM's: text the output must never complete) as token ids.

A word is banned both as written and with a leading space, as vLLM does: "foo" at the start
of the text and " foo" after a word tokenize differently, and the model may emit either.
The engine bans each sequence's last token where the output so far ends with the rest
(engine/penalties.py).
"""

from __future__ import annotations

from collections.abc import Callable


def bad_word_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each word's token ids, as written and after a space, without repeats."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(encode(text))
            if ids:
                out[ids] = None
    return [list(ids) for ids in out]
