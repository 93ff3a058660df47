from __future__ import annotations

from lmd.tokenizer.text.in_order import InOrder


def test_in_order_passes_straight_through() -> None:
    order: InOrder[str] = InOrder()
    assert [order.arrive(i, f"t{i}") for i in range(3)] == [["t0"], ["t1"], ["t2"]]
    assert order.num_released == 3 and order.num_waiting == 0


def test_decode_tokens_before_prefill_first_token_wait_for_it() -> None:
    order: InOrder[str] = InOrder()
    assert order.arrive(1, "t1") == []
    assert order.arrive(2, "t2") == []
    assert order.num_waiting == 2
    assert order.arrive(0, "t0") == ["t0", "t1", "t2"]
    assert order.arrive(3, "t3") == ["t3"]
    assert order.num_waiting == 0


def test_a_position_that_went_out_is_a_duplicate() -> None:
    order: InOrder[str] = InOrder()
    order.arrive(0, "t0")
    assert order.arrive(0, "again") is None
    assert order.num_released == 1


def test_take_is_the_in_order_case_only() -> None:
    order: InOrder[str] = InOrder()
    assert order.take(0) and order.num_released == 1
    assert not order.take(2)  # a gap: it must wait
    assert order.arrive(2, "t2") == []
    assert not order.take(1)  # something waits: arrive() releases it with t1
    assert order.arrive(1, "t1") == ["t1", "t2"]
    assert order.take(3)
