"""Decode room on elastic pools: while ``allocate_slots`` admits a waiting or preempted
request beside scheduled ones, every running request keeps room to decode
``decode_room_tokens`` past its prompt (the room vLLM's shared pool leaves in a request's
last block on average), through vLLM's own `KVCacheManager` with the installed
``allocate_slots``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.request import Request, RequestStatus

from tests.helpers import (
    BLOCK,
    PER_GROUP_LAYOUTS,
    allocate_slots_installed,
    new_request,
    per_group_config,
    per_group_manager,
)
from tests.manager.test_elastic_manager import Driver, elastic_config, run

ROOM = 64
LAYOUT = "full+mamba_none"
SLABS = 6


def manager(room: int) -> Any:
    config = elastic_config(LAYOUT, SLABS)
    config.decode_room_tokens = room
    return per_group_manager(config)


def admit(mgr: Any, rid: str, length: int, scheduled: bool) -> Request | None:
    req = new_request(rid, [(7 * i + len(rid)) % 5000 for i in range(length)], 32)
    with allocate_slots_installed():
        new = mgr.allocate_slots(
            req, length, full_sequence_must_fit=True, has_scheduled_reqs=scheduled
        )
    if new is None:
        return None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = length
    return req


def state(mgr: Any) -> tuple[Any, ...]:
    pools = mgr.coordinator.pool_set
    e = pools.elastic
    return (
        pools.free_counts(),
        tuple(e.num_live_pages(i) for i in range(len(pools))),
        tuple(e.num_owned(i) for i in range(len(pools))),
        e.num_fully_free,
    )


def largest_admitted(room: int, first: int) -> int:
    """The longest second prompt admitted beside a running ``first``-token request."""
    best = 0
    for length in range(BLOCK, 1024, BLOCK):
        mgr = manager(room)
        assert admit(mgr, "a", first, scheduled=False) is not None
        if admit(mgr, "b", length, scheduled=True) is None:
            break
        best = length
    assert best > 0
    return best


def test_an_admission_leaves_running_requests_their_decode_room() -> None:
    first = 40
    longest = largest_admitted(0, first)
    # Request a holds ceil(40 / 16) = 3 pages; its room reaches ceil((40 + 64) / 16) = 7.
    pages_of_room = -(-(first + ROOM) // BLOCK) - -(-first // BLOCK)
    mgr = manager(ROOM)
    assert mgr.coordinator._decode_room_tokens == ROOM
    assert admit(mgr, "a", first, scheduled=False) is not None
    before = state(mgr)
    assert admit(mgr, "b", longest, scheduled=True) is None
    # A refused admission changes nothing.
    assert state(mgr) == before
    mgr.coordinator.pool_set.check_invariants()
    assert admit(mgr, "b", longest - pages_of_room * BLOCK, scheduled=True) is not None
    # With nothing else scheduled (vLLM's watermark rule) the room is not kept.
    alone = manager(ROOM)
    assert admit(alone, "a", first, scheduled=False) is not None
    assert admit(alone, "b", longest, scheduled=True) is None
    assert admit(alone, "b", longest, scheduled=False) is not None


def decode(mgr: Any, req: Request, steps: int) -> int:
    """Decode ``steps`` tokens of a running request; the steps it got."""
    with allocate_slots_installed():
        for token in range(steps):
            if mgr.allocate_slots(req, 1) is None:
                return token
            req.num_computed_tokens += 1
            req.append_output_token_ids(token)
    return steps


def test_running_requests_decode_into_their_room() -> None:
    """Admitted into the last pages without the room, the running request's decode is
    refused within its first 64 tokens (vLLM would preempt); with it, that decode runs."""
    first = 40
    longest = largest_admitted(0, first)
    tight = manager(0)
    a = admit(tight, "a", first, scheduled=False)
    assert a is not None and admit(tight, "b", longest, scheduled=True) is not None
    assert decode(tight, a, ROOM) < ROOM
    roomy = manager(ROOM)
    a = admit(roomy, "a", first, scheduled=False)
    assert a is not None
    assert admit(roomy, "b", longest, scheduled=True) is None
    pages_of_room = -(-(first + ROOM) // BLOCK) - -(-first // BLOCK)
    assert admit(roomy, "b", longest - pages_of_room * BLOCK, scheduled=True) is not None
    assert decode(roomy, a, ROOM) == ROOM


def test_the_room_follows_each_running_request() -> None:
    """The room is counted from each running request's length as it grows (as stock's
    last block leaves room at any length), and forgotten with the request."""
    mgr = manager(ROOM)
    a = admit(mgr, "a", 40, scheduled=False)
    assert a is not None
    for grown in (0, 9, 30):
        if grown:
            assert decode(mgr, a, grown - (a.num_tokens - 40)) > 0
        held = len(mgr.coordinator.single_type_managers[0].req_to_blocks["a"])
        length = a.num_computed_tokens
        want = -(-(length + ROOM) // BLOCK) - held
        assert mgr.coordinator._decode_room_asks("b") == [(0, want)]
        # A request's own admission does not count its own room.
        assert mgr.coordinator._decode_room_asks("a") == []
    mgr.free(a)
    assert mgr.coordinator._running.num_requests == 0
    assert mgr.coordinator._decode_room_asks("b") == []


def test_static_pools_keep_no_room() -> None:
    """The rule is elastic pools' (one budget); static pools never ask for it."""
    specs = PER_GROUP_LAYOUTS[LAYOUT]
    config = per_group_config(specs, [40, 4])
    config.decode_room_tokens = ROOM
    mgr = per_group_manager(config)
    assert mgr.coordinator._decode_room_tokens == 0


@pytest.mark.parametrize("layout", ("full+mamba_none", "full+mamba_align"))
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10_000), num_slabs=st.integers(6, 8))
def test_admitted_steps_get_their_blocks_with_the_room(
    layout: str, seed: int, num_slabs: int
) -> None:
    """The elastic manager's admission run with the room kept: every admitted step still
    gets its blocks, the budget agrees with the pools, and every block comes back."""
    d = Driver(layout, num_slabs)
    config = elastic_config(layout, num_slabs)
    config.decode_room_tokens = ROOM
    d.mgr = per_group_manager(config)
    d.pools = d.mgr.coordinator.pool_set
    with allocate_slots_installed():
        run(d, seed, [(20, 30), (150, 8), (20, 30)])
    e = d.pools.elastic
    assert e is not None
    assert d.refused > 0
    assert all(e.num_live_pages(i) == 0 for i in range(len(d.pools)))
