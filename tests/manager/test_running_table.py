"""`NativeRunningRequests` through its binding: what the scheduler's hot path gets back,
and bad input refused with a `ValueError` naming the request, the table left as it was.
(The table's rules against vLLM's own managers: `test_quiet_steps.py`.)"""

from __future__ import annotations

import pytest

from hybrid_alloc._native import NativeRunningRequests

# Full attention (16-token blocks, its room kept in pool 0) and a Mamba-like state (one
# block of 4096 tokens, skipping all but the last processed token).
RULES = [(16, 0, None, 0), (4096, 0, 1, None)]


def table(room: int = 32) -> NativeRunningRequests:
    return NativeRunningRequests(RULES, True, room, label="test coordinator")


def step(t: NativeRunningRequests, rid: str, computed: int, new: int = 1) -> object:
    # (computed, new, lookahead, in flight, prompt, num_tokens, max_model_len)
    return t.decode_step(rid, computed, new, 0, 0, 10, computed + 1, 1000)


def test_decode_steps_answer_quiet_grow_or_vllm() -> None:
    t = table()
    assert step(t, "a", 40) is None, "a request the table does not hold: vLLM's rules"
    t.sync("a", [3, 1], False, 41)
    assert "a" in t and t.num_requests == 1
    assert step(t, "a", 40) == ()  # 41 slots in 3 blocks of 16
    assert step(t, "a", 48) == (1, 0)  # 49 slots: a 4th attention block, no state block
    assert step(t, "a", 48, new=40) == (3, 0)
    # A pending prefix hit: vLLM's rules.
    t.sync("a", [3, 1], True, 41)
    assert step(t, "a", 40) is None
    t.forget("a")
    t.forget("a")  # vLLM frees requests it never allocated for: ignored
    assert "a" not in t and t.num_requests == 0


def test_the_room_is_counted_per_request() -> None:
    t = table(room=32)
    t.sync("a", [3, 1], False, 40)  # ceil(72 / 16) = 5 pages: lacks 2
    t.sync("b", [1, 1], False, 10)  # ceil(42 / 16) = 3: lacks 2
    assert t.room_asks("") == [(0, 4)]
    assert t.room_asks("a") == [(0, 2)]
    assert step(t, "a", 40) == ()  # quiet at length 41: ceil(73 / 16) = 5, still 2
    assert t.room_asks("") == [(0, 4)]
    t.sync("b", [None, None], False, 10)  # not running any more (refused): forgotten
    assert t.room_asks("") == [(0, 2)]


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.sync("a", [3], False, 10),
        lambda t: t.sync("a", [3, 1, 1], False, 10),
        lambda t: t.sync("a", [-1, 1], False, 10),
        lambda t: t.sync("a", [3, 1], False, -5),
        lambda t: t.note_removed("a", -1, [3, 1]),
        lambda t: t.note_removed("a", 5, [3]),
        lambda t: t.decode_step("a", -1, 1, 0, 0, 10, 41, 1000),
        lambda t: t.decode_step("a", 40, 1, 0, 0, 10, 41, -1),
        lambda t: t.quiet_step("a", -1, 0, 0),
    ],
    ids=[
        "too-few-groups",
        "too-many-groups",
        "negative-blocks",
        "negative-length",
        "negative-processed",
        "removed-groups",
        "negative-computed",
        "negative-max-len",
        "negative-slots",
    ],
)
def test_bad_input_is_refused_naming_the_request(call: object) -> None:
    t = table()
    t.sync("a", [3, 1], False, 41)
    before = (t.num_requests, t.room_asks(""), step(t, "a", 48))
    with pytest.raises(ValueError, match=r"test coordinator: request a"):
        call(t)  # type: ignore[operator]
    assert (t.num_requests, t.room_asks(""), step(t, "a", 48)) == before


def test_huge_counts_saturate() -> None:
    """Counts past 64 bits are as good as infinite (no OverflowError): slots past every
    block are never quiet."""
    t = table()
    t.sync("a", [3, 1], False, 41)
    assert t.quiet_step("a", 2**70, 0, 0) is False
    assert t.quiet_step("a", 40, 2**70, 0) is False  # the state's window moved


def test_rules_are_checked() -> None:
    with pytest.raises(ValueError, match="block size 0"):
        NativeRunningRequests([(0, 0, None, None)], True, 0)
    with pytest.raises(ValueError, match="rules"):
        NativeRunningRequests([(16, 0)], True, 0)  # type: ignore[list-item]
