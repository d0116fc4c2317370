"""vLLM's own `KVCacheManager` over elastic per-group pools (one byte budget under an
attention pool and a Mamba 'align' state pool): the coordinator admits a request only if
the allocation policy, run on the whole step, finds every block, so ``allocate_slots``
either refuses (None) or gets every block, never raising mid-step; freed memory goes to
whichever pool needs it next, in both directions; the pools and the budget stay
consistent after every call.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc.integration.kv_cache_config import ElasticLayout, PerGroupKVCacheConfig
from hybrid_alloc.integration.scheduler.coordinator import (
    _manager_allocate_new_blocks,
    _take_new_blocks,
)
from hybrid_alloc.integration.scheduler.pool_set import PoolSet
from tests.helpers import (
    MAX_LEN,
    PER_GROUP_LAYOUTS,
    allocate_slots_installed,
    kept_per_live,
    new_request,
    per_group_config,
    per_group_manager,
)

LAYOUTS = ("full+mamba_align", "full+mamba_none", "full+swa+mamba_align")


def elastic_config(layout: str | list[Any], num_slabs: int) -> PerGroupKVCacheConfig:
    """The layout's per-group config (a name in ``PER_GROUP_LAYOUTS`` or the specs) with
    one byte budget of ``num_slabs`` slabs, each the least common multiple of the pools'
    page sizes."""
    specs = PER_GROUP_LAYOUTS[layout] if isinstance(layout, str) else layout
    config = per_group_config(specs, [2] * len(specs))
    pages = tuple(specs[layout_.group_ids[0]].page_size_bytes for layout_ in config.pool_layouts)
    slab = math.lcm(*pages)
    config.elastic = ElasticLayout(
        slab_bytes=slab,
        num_slabs=num_slabs,
        page_bytes=pages,
        kept_per_live=kept_per_live(specs, config, keep=False),
    )
    return config


class Driver:
    def __init__(self, layout: str, num_slabs: int) -> None:
        self.mgr = per_group_manager(elastic_config(layout, num_slabs))
        self.pools: PoolSet = self.mgr.coordinator.pool_set  # type: ignore[attr-defined]
        assert self.pools.elastic is not None
        self.running: dict[str, Request] = {}
        self.refused = 0

    def admit(self, rid: str, tokens: list[int], max_tokens: int) -> bool:
        req = new_request(rid, tokens, max_tokens)
        blocks, num_hit, _ = self.mgr.get_computed_blocks(req)
        new = self.mgr.allocate_slots(
            req,
            req.num_tokens - num_hit,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=blocks,
            full_sequence_must_fit=True,
        )
        if new is None:
            self.refused += 1
            return False
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(7)
        self.running[rid] = req
        return True

    def decode(self, rid: str, token: int) -> bool:
        req = self.running[rid]
        if self.mgr.allocate_slots(req, 1) is None:
            self.refused += 1
            return False
        req.num_computed_tokens += 1
        req.append_output_token_ids(token)
        return True

    def finish(self, rid: str) -> None:
        self.mgr.free(self.running.pop(rid))

    def check(self) -> None:
        self.pools.check_invariants()
        managers = self.mgr.coordinator.single_type_managers
        for idx, pool in enumerate(self.pools):
            groups = {g for g in range(len(managers)) if self.pools.pool_index_of_group(g) == idx}
            # Held pages count as held by nobody here: compare only the requests' blocks.
            holders = check_our_pool_counts(pool, [managers[g] for g in sorted(groups)])
            assert holders, "a pool's counts disagree with its managers"


def check_our_pool_counts(pool: Any, managers: list[Any]) -> bool:
    """Each block's count is the number of request block tables holding it (the pages the
    budget holds are outside every table and have exactly one reference)."""
    held: dict[int, int] = {}
    for manager in managers:
        for blocks in manager.req_to_blocks.values():
            for b in blocks:
                if not b.is_null:
                    held[b.block_id] = held.get(b.block_id, 0) + 1
    counts = pool.ref_counts()
    return all(counts[i] == n for i, n in held.items())


def run(d: Driver, seed: int, phases: list[tuple[int, int]]) -> None:
    """Phases of (prompt length, count) requests; decodes; preempt on a failed decode."""
    rng = random.Random(seed)
    token = 11
    for length, count in phases:
        pending = [
            (f"r{length}-{i}", [rng.randrange(5000) for _ in range(length)], rng.randrange(4, 24))
            for i in range(count)
        ]
        remaining = {rid: m for rid, _, m in pending}
        for _ in range(400):
            if not pending and not d.running:
                break
            d.mgr.new_step_starts()
            for _ in range(rng.randrange(1, 4)):
                if pending and d.admit(*pending[0]):
                    pending.pop(0)
            for rid in list(d.running):
                token = (token * 31 + 7) % 5000
                if not d.decode(rid, token):
                    req = d.running[rid]
                    d.finish(rid)
                    pending.append((rid, list(req.prompt_token_ids or []), remaining[rid]))
                    continue
                remaining[rid] -= 1
                if remaining[rid] <= 0:
                    d.finish(rid)
            d.check()
        assert not pending and not d.running, "a phase did not finish"


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10_000), num_slabs=st.integers(6, 8))
def test_admitted_steps_get_their_blocks(layout: str, seed: int, num_slabs: int) -> None:
    """Short requests, long ones, short again, through a budget that cannot hold them all
    at once: every admitted step gets its blocks (vLLM would raise otherwise), the budget
    agrees with the pools after every step, and every block comes back."""
    d = Driver(layout, num_slabs)
    run(d, seed, [(20, 30), (150, 8), (20, 30)])
    e = d.pools.elastic
    assert e is not None
    # The budget could not hold them all: steps were refused (and then served).
    assert d.refused > 0, "no step was refused: the budget never ran short"
    assert all(e.num_live_pages(i) == 0 for i in range(len(d.pools)))
    assert d.mgr.reset_prefix_cache()


def test_memory_changes_owner_both_ways() -> None:
    """Many short requests hold many state blocks at once; then long ones need attention
    blocks: slabs move from the state pool to the attention pool and, when short requests
    return, back."""
    d = Driver("full+mamba_none", 8)
    e = d.pools.elastic
    assert e is not None
    run(d, 1, [(8, 60)])
    assert [e.owner_changes(i)[1] for i in range(2)] == [0, 0], "unowned slabs first"
    run(d, 2, [(400, 4)])
    assert e.owner_changes(1)[1] > 0, "the state pool gave a slab to the attention pool"
    run(d, 3, [(8, 60)])
    assert e.owner_changes(0)[1] > 0, "the attention pool gave a slab back"


class Loads:
    """Async KV loads as vLLM's scheduler admits them (``delay_cache_blocks``): with
    ``reserve``, each load's ``reserved_blocks`` is what every load in flight still
    needs, asked of the coordinator through vLLM's own
    ``Scheduler._request_remaining_blocks``; through ``allocate_slots`` as installed
    (``honour``) or vLLM's own."""

    def __init__(self, num_slabs: int, honour: bool, reserve: bool = True) -> None:
        self.d = Driver("full+mamba_align", num_slabs)
        self.honour = honour
        self.reserve = reserve
        self.loading: list[Request] = []
        self.admitted = 0

    @contextmanager
    def _installed(self) -> Iterator[None]:
        if not self.honour:
            yield
            return
        with allocate_slots_installed():
            yield

    def _allocate(self, req: Request, *args: Any, **kwargs: Any) -> Any:
        with self._installed():
            return self.d.mgr.allocate_slots(req, *args, **kwargs)

    def reserved_blocks(self) -> int:
        """vLLM's ``_inflight_prefill_reserved_blocks`` over the loads in flight."""
        scheduler = SimpleNamespace(
            max_model_len=MAX_LEN,
            num_spec_tokens=0,
            num_lookahead_tokens=0,
            kv_cache_manager=self.d.mgr,
        )
        with self._installed():
            return sum(
                Scheduler._request_remaining_blocks(scheduler, req)  # type: ignore[arg-type]
                for req in self.loading
            )

    def load(self, rid: str, length: int, loaded: int) -> bool:
        req = new_request(rid, [hash((rid, i)) % 5000 for i in range(length)], 4)
        reserved = self.reserved_blocks() if self.reserve else 0
        blocks = self._allocate(
            req,
            0,
            num_external_computed_tokens=loaded,
            delay_cache_blocks=True,
            full_sequence_must_fit=True,
            reserved_blocks=reserved,
        )
        if blocks is None:
            return False
        self.admitted += 1
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = loaded
        self.loading.append(req)
        return True

    def finish_in_order(self) -> list[str]:
        """Each loaded request, oldest first, asks for the rest of its prompt (nothing
        else runs, as in a scheduler whose waiting head is a finished load) and then
        finishes; the IDs of those that could not get their slots."""
        stuck = []
        for req in self.loading:
            req.status = RequestStatus.WAITING
            rest = req.num_tokens - req.num_computed_tokens
            if self._allocate(req, rest) is None:
                stuck.append(req.request_id)
            self.d.mgr.free(req)
            self.d.check()
        return stuck


@settings(max_examples=40, deadline=None)
@given(
    num_slabs=st.integers(4, 12),
    loads=st.lists(st.tuples(st.integers(40, 300), st.floats(0.2, 0.95)), min_size=2, max_size=6),
)
def test_async_loads_never_wait_on_each_other(
    num_slabs: int, loads: list[tuple[int, float]]
) -> None:
    """Async KV loads hold their pages while no step runs them, and vLLM never preempts a
    waiting request: each load admitted must leave room for its own whole sequence and for
    every earlier load's, so the loaded requests can each run in turn. (The engine stalled
    with two half-loaded requests, each waiting for pages the other held.)"""
    s = Loads(num_slabs, honour=True)
    for i, (length, frac) in enumerate(loads):
        s.load(f"l{i}", length, max(1, int(length * frac)))
    assert s.admitted >= 1, "no load was admitted"
    assert s.finish_in_order() == []
    e = s.d.pools.elastic
    assert e is not None
    assert all(e.num_live_pages(i) == 0 for i in range(len(s.d.pools)))


def test_async_loads_without_the_reservation_can_wait_for_ever() -> None:
    """The case the reservation exists for: with no reservation two loads are admitted
    that cannot both finish; with vLLM's scheduler reservation, planned pool by pool by
    the installed ``allocate_slots``, the second waits until the first has run."""
    plain = Loads(4, honour=False, reserve=False)
    assert plain.load("a", 280, 70) and plain.load("b", 150, 37)
    assert plain.finish_in_order() == ["a"]
    honoured = Loads(4, honour=True)
    assert honoured.load("a", 280, 70)
    assert not honoured.load("b", 150, 37)
    assert honoured.finish_in_order() == []


class RecordingDriver(Driver):
    """`Driver`, logging every call's block IDs per group, the IDs recorded for zeroing
    after it, and each request's whole block table."""

    def __init__(self, layout: str, num_slabs: int, ids_from_pool: bool) -> None:
        super().__init__(layout, num_slabs)
        coordinator: Any = self.mgr.coordinator
        for manager, plain in zip(
            coordinator.single_type_managers, coordinator._plain_growers, strict=True
        ):
            # As in an engine whose workers zero new attention blocks.
            manager._record_new_block_ids = plain
        if not ids_from_pool:
            # Every manager through its own ``allocate_new_blocks`` (vLLM's method).
            coordinator._growers = [_manager_allocate_new_blocks] * len(coordinator._growers)
        self.log: list[Any] = []

    def record(self, what: str, rid: str, new: Any) -> None:
        self.log.append(
            (
                what,
                rid,
                None if new is None else new.get_block_ids(),
                self.mgr.take_new_block_ids(),
                self.mgr.get_block_ids(rid) if rid in self.running else None,
            )
        )

    def admit(self, rid: str, tokens: list[int], max_tokens: int) -> bool:
        admitted = super().admit(rid, tokens, max_tokens)
        self.record("admit", rid, self.mgr.get_blocks(rid) if admitted else None)
        return admitted

    def decode(self, rid: str, token: int) -> bool:
        req = self.running[rid]
        new = self.mgr.allocate_slots(req, 1)
        self.record("decode", rid, new)
        if new is None:
            self.refused += 1
            return False
        req.num_computed_tokens += 1
        req.append_output_token_ids(token)
        return True


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_new_blocks_with_their_ids_as_vllms_managers_take_them(layout: str, seed: int) -> None:
    """The coordinator takes a plain-growing manager's new blocks with their IDs from the
    pool (`_take_new_blocks`): the same blocks, block tables, refusals and IDs recorded
    for zeroing, call by call, as each manager's own ``allocate_new_blocks``."""
    ours = RecordingDriver(layout, 7, ids_from_pool=True)
    vllms = RecordingDriver(layout, 7, ids_from_pool=False)
    growers = ours.mgr.coordinator._growers  # type: ignore[attr-defined]
    assert _take_new_blocks in growers
    phases = [(20, 20), (150, 6), (37, 20)]
    run(ours, seed, phases)
    run(vllms, seed, phases)
    assert ours.log == vllms.log
    assert ours.refused == vllms.refused > 0
    assert any(e[3] for e in ours.log), "no IDs were recorded for zeroing"
