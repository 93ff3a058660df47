"""The interactive session table and how a turn's prompt and history are built."""

from __future__ import annotations

import pytest

from lmd.tokenizer.sessions import (
    SessionBusyError,
    SessionError,
    SessionTable,
    Turn,
    finish_turn,
    start_turn,
)
from lmd.tokenizer.text.chat_template import ChatMessage, LmdeployChatTemplate

TEMPLATE = LmdeployChatTemplate(
    model_name="t", user="<u>", eoh="</u>", assistant="<a>", eoa="</a>", separator="\n"
)


def encode(text: str) -> list[int]:
    """One token per character: token boundaries never hide a mismatch."""
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_open_creates_then_returns_the_same_session() -> None:
    table = SessionTable(60)
    first = table.open(1, fresh=False)
    table.commit(first, [ChatMessage("user", "hi")], "<u>hi</u>", [1, 2, 3])
    again = table.open(1, fresh=False)
    assert again is first and again.token_ids == [1, 2, 3]
    assert len(table) == 1 and 1 in table


def test_fresh_open_forgets_the_history() -> None:
    table = SessionTable(60)
    session = table.open(1, fresh=False)
    table.commit(session, [ChatMessage("user", "hi")], "<u>hi</u>", [1, 2, 3])
    session = table.open(1, fresh=True)
    assert (session.messages, session.text, session.token_ids) == ([], "", [])


def test_a_busy_session_refuses_a_second_turn() -> None:
    table = SessionTable(60)
    session = table.open(5, fresh=False)
    table.begin(session, "chat-1")
    assert session.is_busy and table.num_busy == 1
    with pytest.raises(SessionBusyError, match=r"session 5 is busy.*cancel"):
        table.open(5, fresh=False)
    with pytest.raises(SessionBusyError):
        table.open(5, fresh=True)  # interactive_mode false does not bypass it either
    table.release(session)
    assert table.open(5, fresh=False) is session and not session.is_busy


def test_idle_sessions_expire_busy_ones_never() -> None:
    clock = Clock()
    table = SessionTable(10, clock=clock)
    idle = table.open(1, fresh=False)
    busy = table.open(2, fresh=False)
    table.begin(busy, "chat-2")
    clock.now += 5
    assert table.expire() == []
    table.open(1, fresh=False)  # used again: its idle time starts over
    clock.now += 8
    assert table.expire() == [] and 1 in table
    clock.now += 3
    assert table.expire() == [1]
    assert table.get(1) is None and table.get(2) is busy
    clock.now += 100
    table.release(busy)  # finished long after it began: idle from now on
    assert table.expire() == []
    assert idle.session_id not in table


def test_full_table_evicts_the_least_recently_used_idle_session() -> None:
    table = SessionTable(60, max_sessions=3)
    for sid in (1, 2, 3):
        table.open(sid, fresh=False)
    table.open(1, fresh=False)  # 2 is now the least recently used
    table.open(4, fresh=False)
    assert 2 not in table and {1, 3, 4} == {s for s in (1, 2, 3, 4) if s in table}
    for sid in (1, 3, 4):
        table.begin(table.open(sid, fresh=False), f"chat-{sid}")
    with pytest.raises(SessionError, match="all 3 interactive sessions are busy"):
        table.open(5, fresh=False)


def test_end_forgets_a_session() -> None:
    table = SessionTable(60)
    session = table.open(3, fresh=False)
    assert table.end(3) is session and table.end(3) is None and len(table) == 0


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="idle_timeout_s"):
        SessionTable(0)


# Turns -----------------------------------------------------------------------------------


def test_first_turn_renders_the_prompt_alone() -> None:
    session = SessionTable(60).open(1, fresh=False)
    turn = start_turn(session, [ChatMessage("user", "hi")], TEMPLATE, encode, bare_prompt="hi")
    assert turn.text == "<u>hi</u><a>" and turn.token_ids == encode(turn.text)
    assert turn.num_history_tokens == 0


def test_next_turn_keeps_the_history_ids_and_tokenizes_only_the_new_text() -> None:
    table = SessionTable(60)
    session = table.open(1, fresh=False)
    turn = start_turn(session, [ChatMessage("user", "hi")], TEMPLATE, encode)
    sampled = encode("hello</a>")  # the answer and its end marker, as generated
    history = finish_turn(turn, "hello", sampled, template=TEMPLATE, encode=encode, decode=decode)
    messages, text, ids = history
    assert text == "<u>hi</u><a>hello</a>\n"
    assert ids == turn.token_ids + sampled + encode("\n")  # the separator after the marker
    table.commit(session, messages, text, ids)

    second = start_turn(session, [ChatMessage("user", "more")], TEMPLATE, encode)
    assert second.token_ids[: len(ids)] == ids  # the engine's prefix cache serves these
    assert second.num_history_tokens == len(ids)
    assert second.text == TEMPLATE.render([*messages, ChatMessage("user", "more")])
    assert second.token_ids == ids + encode("<u>more</u><a>")


def test_answer_cut_by_a_stop_string_is_tokenized_from_its_text() -> None:
    turn = Turn([ChatMessage("user", "hi")], "<u>hi</u><a>", encode("<u>hi</u><a>"), 0)
    sampled = encode("hello STOP and more")  # the text stopped at "STOP"
    _, text, ids = finish_turn(
        turn, "hello ", sampled, template=TEMPLATE, encode=encode, decode=decode
    )
    assert text == "<u>hi</u><a>hello </a>\n"
    assert ids == encode(text)


def test_history_the_template_does_not_extend_is_rendered_again() -> None:
    table = SessionTable(60)
    session = table.open(1, fresh=False)
    table.commit(session, [ChatMessage("user", "hi")], "something else", [9, 9, 9])
    turn = start_turn(session, [ChatMessage("user", "more")], TEMPLATE, encode)
    expected = TEMPLATE.render([ChatMessage("user", "hi"), ChatMessage("user", "more")])
    assert turn.text == expected and turn.token_ids == encode(expected)
    assert turn.num_history_tokens == 0
