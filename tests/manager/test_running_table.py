"""`NativeRunningRequests` through its binding: what the scheduler's hot path gets back,
and bad input refused with a `ValueError` naming the request, the table left as it was.
(The table's rules against vLLM's own managers: `test_quiet_steps.py`.)"""

from __future__ import annotations

import pytest

from hybrid_alloc._native import STEP_CACHE_BLOCKS, STEP_REMOVE_SKIPPED, NativeRunningRequests

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


# Prefix caching: caching full attention (64-token blocks, four 16-token hash blocks) and a
# Mamba 'align' state group; the coordinator's rule: hash blocks of 16, no rounding.
CACHING = [("full", 0, False), ("align", 0, False)]
CACHEABLE = (16, 1, 0)


def caching_table() -> NativeRunningRequests:
    rules = [(64, 0, None, None), (64, 0, 1, None)]
    return NativeRunningRequests(
        rules, True, 0, label="test coordinator", caching=CACHING, cacheable=CACHEABLE
    )


def facts(**changed: object) -> tuple[object, ...]:
    """(cached, retired, stale_state, state_boundary, settled, cached_tokens, prompt)
    for a request of a 100-token prompt holding 3 blocks per group, 2 of them full."""
    base: dict[str, object] = {
        "cached": [2, 2],
        "retired": [0, 2],
        "stale": [None, None],
        "boundary": [0, 96],
        "settled": True,
        "cached_tokens": 150,
        "prompt": 100,
    }
    base.update(changed)
    return tuple(base.values())


def caching_step(t: NativeRunningRequests, computed: int) -> object:
    return t.decode_step("a", computed, 1, 0, 0, 100, computed + 1, 4096)


def test_caching_steps_are_quiet_only_with_the_managers_facts() -> None:
    t = caching_table()
    assert [t.cacheable_tokens(g, 150) for g in (0, 1)] == [150, 150]
    t.sync("a", [3, 3], False, 0)
    assert caching_step(t, 150) is None, "no facts: vLLM's path"
    t.sync("a", [3, 3], False, 0, facts())
    assert caching_step(t, 150) == ()
    assert caching_step(t, 191) == STEP_CACHE_BLOCKS, "192 tokens fill block 2: only caching"
    t.sync("a", [3, 3], False, 0, facts(settled=False))
    assert caching_step(t, 150) is None, "a checkpoint pending: vLLM's path"
    t.sync("a", [3, 3], False, 0, facts(stale=[None, 1]))
    assert caching_step(t, 150) == STEP_REMOVE_SKIPPED, "only the stale state is freed there"
    assert caching_step(t, 191) == STEP_REMOVE_SKIPPED | STEP_CACHE_BLOCKS, "both, in one step"
    t.sync("a", [2, 3], False, 0, facts())
    assert caching_step(t, 150) == (1, 0), "block 2 taken: growth"


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.sync("a", [3, 3], False, 0, facts(cached=[-1, 2])),
        lambda t: t.sync("a", [3, 3], False, 0, facts(cached=[2])),
        lambda t: t.sync("a", [3, 3], False, 0, facts(retired=[0, 2, 2])),
        lambda t: t.sync("a", [3, 3], False, 0, facts(stale=[None, -2])),
        lambda t: t.sync("a", [3, 3], False, 0, facts(boundary=[0])),
        lambda t: t.sync("a", [3, 3], False, 0, facts(cached_tokens=-1)),
        lambda t: t.sync("a", [3, 3], False, 0, facts(prompt=-100)),
    ],
    ids=[
        "negative-cached",
        "cached-groups",
        "retired-groups",
        "negative-stale",
        "boundary-groups",
        "negative-cached-tokens",
        "negative-prompt",
    ],
)
def test_bad_facts_are_refused_naming_the_request(call: object) -> None:
    t = caching_table()
    t.sync("a", [3, 3], False, 0, facts())
    with pytest.raises(ValueError, match=r"test coordinator: request a"):
        call(t)  # type: ignore[operator]
    assert t.num_requests == 1 and caching_step(t, 150) == ()


def test_caching_rules_are_checked() -> None:
    rules = [(64, 0, None, None), (64, 0, 1, None)]
    with pytest.raises(ValueError, match="caching rule"):
        NativeRunningRequests(rules, True, 0, caching=CACHING)
    with pytest.raises(ValueError, match="unknown caching kind"):
        NativeRunningRequests(
            rules, True, 0, caching=[("sliding", 0, False)] * 2, cacheable=CACHEABLE
        )
    with pytest.raises(ValueError, match="2 groups"):
        NativeRunningRequests(rules, True, 0, caching=CACHING[:1], cacheable=CACHEABLE)
    with pytest.raises(ValueError, match="must be positive"):
        NativeRunningRequests(rules, True, 0, caching=CACHING, cacheable=(0, 1, 0))
    with pytest.raises(ValueError, match="group 5"):
        caching_table().cacheable_tokens(5, 100)
