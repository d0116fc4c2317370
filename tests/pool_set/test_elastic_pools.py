"""Elastic per-group pools (``NativeElasticPools``: one byte budget under several groups'
``BlockPool``s), as a hypothesis state machine against a plain model of who holds what.

Requests take blocks in every group (prefix hits first, found through each group's own
pool, then new blocks), after ``plan`` said the step fits and ``reserve`` lent its memory:
an admitted step never runs short, whatever order its groups allocate in. Requests cache
their full blocks, finish (free), are preempted (freed without caching), lose a load
(their blocks evicted by ID, then freed), and the prefix cache is reset when nothing is
in use. Memory moves between groups whenever one needs it: unowned
slabs first, then the group's own least recently used cached block, then another group's
idle slab, taken back with its cached blocks evicted (``BlockRemoved`` events of the pool
they were in).

After every step: the budget and the pools agree (``check_invariants``: pages of slabs a
group does not own are held by the budget, live pages per slab match); every block's
reference count is the number of requests holding it; the budget's live pages are those
blocks; no block the budget holds can be freed, touched or re-counted (refused, nothing
changed).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import assume, settings
from hypothesis.stateful import initialize, invariant, precondition, rule

from hybrid_alloc._native import NativeElasticPools
from hybrid_alloc.integration.scheduler.block_pool import BlockPool
from tests.helpers import CountingMachine, RecordingCollector, budget, make_request, stepping

BS = 4


def _state(elastic: Any, pools: list[Any]) -> Any:
    return (
        [p.free_block_ids() for p in pools],
        [p.ref_counts() for p in pools],
        [p.cache_entries() for p in pools],
        [elastic.owner_changes(g) for g in range(len(pools))],
    )


class ElasticMachine(CountingMachine):
    MACHINE = "elastic"

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[int, list[list[Any]]] = {}  # id -> per group: blocks held
        self.reqs: dict[int, Any] = {}
        self.cached: dict[tuple[int, int], int] = {}  # (request, group) -> blocks cached
        self.next_id = 0
        self.removed_events = 0

    @initialize(
        slab=st.sampled_from([48, 64, 96]),
        num_slabs=st.integers(3, 7),
        pages=st.lists(st.sampled_from([8, 12, 16, 24, 48]), min_size=2, max_size=3),
    )
    def build(self, slab: int, num_slabs: int, pages: list[int]) -> None:
        pages = [min(p, slab) for p in pages]
        try:
            self.elastic = NativeElasticPools(slab, num_slabs, pages, label="elastic")
        except ValueError as e:
            assert "cannot always hold one page" in str(e), e
            assume(False)
        self.groups = list(range(len(pages)))
        self.pools = [
            BlockPool(
                self.elastic.num_pages(g), True, BS, enable_kv_cache_events=True, label=f"g{g}"
            )
            for g in self.groups
        ]
        for g, pool in enumerate(self.pools):
            self.elastic.attach(g, pool)
            assert pool.get_num_free_blocks() == 0, "every page starts held by the budget"

    # ---------------------------------------------------------------- helpers
    def hits(self, req: Any, g: int) -> list[Any]:
        pool = self.pools[g]
        found = []
        for h in req.block_hashes:
            got = pool.get_cached_block(h, [g])
            if got is None:
                break
            found.append(got[0])
        return found

    def release(self, rid: int) -> None:
        held = self.requests.pop(rid)
        for g, blocks in enumerate(held):
            self.pools[g].free_blocks(reversed(blocks))
        self.drain_events()

    def drain_events(self) -> None:
        for pool in self.pools:
            events = pool.take_events()
            self.removed_events += sum(1 for e in events if type(e).__name__ == "BlockRemoved")

    # ------------------------------------------------------------------ rules
    @rule(
        seed=st.integers(0, 3),
        sizes=st.lists(st.integers(0, 6), min_size=3, max_size=3),
        reverse=st.booleans(),
    )
    @stepping
    def admit(self, seed: int, sizes: list[int], reverse: bool) -> None:
        """A request, admitted as the coordinator admits a step: ``plan`` (nothing
        changes), then ``reserve`` (the plan's slabs lent at once), then prefix hits and
        new blocks in every group, the new blocks in group order or in reverse (vLLM's
        phases allocate in an order of their own): a reserved step never runs short."""
        req = make_request(seed, max(sizes), BS)
        hits = [self.hits(req, g)[: sizes[g]] for g in self.groups]
        new = [sizes[g] - len(hits[g]) for g in self.groups]
        news = [(g, new[g]) for g in self.groups]
        before = _state(self.elastic, self.pools)
        short = self.elastic.plan(hits, news)
        assert _state(self.elastic, self.pools) == before, "plan changed the pools"
        if short is not None:
            group, missing = short
            assert 0 < missing <= new[group]
            assert self.elastic.reserve(hits, news) == short
            assert _state(self.elastic, self.pools) == before, "a refused reserve changed"
            return
        assert self.elastic.reserve(hits, news) is None, "planned, then not reserved"
        taken: list[list[Any]] = [[] for _ in self.groups]
        for g in self.groups:
            self.pools[g].touch(hits[g])
        for g in reversed(self.groups) if reverse else self.groups:
            got = self.pools[g].get_new_blocks(new[g])
            assert len(got) == new[g]
            taken[g] = hits[g] + got
            self.cached[(self.next_id, g)] = len(hits[g])
        self.elastic.end_step()
        assert self.elastic.num_reserved == 0
        self.drain_events()
        self.requests[self.next_id] = taken
        self.reqs[self.next_id] = req
        self.next_id += 1

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), sizes=st.lists(st.integers(0, 4), min_size=3, max_size=3))
    @stepping
    def grow(self, data: st.DataObject, sizes: list[int]) -> None:
        """A running request's decode step that takes new pages only, in one call
        (`grow`): refused exactly when the primary group's count or the plan refuses it,
        then nothing changed; else reserved, each group's pages taken in order."""
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        primary = data.draw(st.sampled_from(self.groups))
        news = [(g, sizes[g]) for g in self.groups]
        before = _state(self.elastic, self.pools)
        counted = self.elastic.num_free_for(primary)
        pool, e = self.pools[primary], self.elastic
        others = e.num_fully_free - e.num_idle(primary)
        assert counted == pool.get_num_free_blocks() + others * e.pages_per_slab(primary)
        refused = sizes[primary] > counted or self.elastic.plan([[]] * len(self.groups), news)
        # The primary group's need as the coordinator passes it (None: the pages `news`
        # asks of group `primary`, summed by the pools), or given.
        given = data.draw(st.sampled_from([None, sizes[primary]]))
        got = self.elastic.grow(news, primary, given)
        if refused:
            assert got is None
            assert _state(self.elastic, self.pools) == before, "a refused grow changed"
            return
        assert got is not None, "planned and counted, then not grown"
        assert [len(blocks) for blocks in got] == [n for _, n in news]
        for g, blocks in enumerate(got):
            self.requests[rid][g].extend(blocks)
        self.elastic.end_step()
        assert self.elastic.num_reserved == 0
        self.drain_events()

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    @stepping
    def cache(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        g = data.draw(st.sampled_from(self.groups))
        blocks = self.requests[rid][g]
        done = self.cached[(rid, g)]
        # Blocks a decode step added (`grow`) past the prompt's hashes stay uncached.
        full = min(len(blocks), len(self.reqs[rid].block_hashes))
        upto = data.draw(st.integers(min(done, full), full))
        self.pools[g].cache_full_blocks(self.reqs[rid], blocks, done, upto, BS, g)
        self.cached[(rid, g)] = max(done, upto)
        self.drain_events()

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    @stepping
    def finish(self, data: st.DataObject) -> None:
        """Finished or preempted: every group's blocks go back (cached ones stay cached)."""
        self.release(data.draw(st.sampled_from(sorted(self.requests))))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    @stepping
    def load_fails(self, data: st.DataObject) -> None:
        """A failed load in one group: its blocks are evicted by ID, then the request's
        blocks in every group are freed (the recompute starts over)."""
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        g = data.draw(st.sampled_from(self.groups))
        ids = {b.block_id for b in self.requests[rid][g] if not b.is_null}
        self.pools[g].evict_blocks(ids)
        self.release(rid)

    @rule()
    @stepping
    def reset(self) -> None:
        """Refused while any block is in use; else every group's cache is empty."""
        busy = any(blocks for held in self.requests.values() for blocks in held)
        ok = all(pool.reset_prefix_cache() for pool in self.pools)
        self.drain_events()
        if busy:
            assert not ok
        else:
            assert ok and all(p.cache_entries() == [] for p in self.pools)

    @rule(
        g=st.integers(0, 2),
        block_id=st.integers(1, 60),
        op=st.sampled_from(["free", "touch", "unpin"]),
    )
    @stepping
    def held_block_refused(self, g: int, block_id: int, op: str) -> None:
        """A block the budget holds (its slab is not this group's) cannot be freed, touched,
        unpinned or re-counted."""
        g %= len(self.groups)
        pool = self.pools[g]
        assume(block_id < pool.num_gpu_blocks)
        block = pool.blocks[block_id]
        if (
            block.ref_cnt != 1
            or any(block in held[g] for held in self.requests.values())
            or block_id in pool.free_block_ids()
        ):
            return
        before = _state(self.elastic, self.pools)
        with pytest.raises(ValueError, match=f"block {block_id}"):
            if op == "free":
                pool.free_blocks([block])
            elif op == "touch":
                pool.touch([block])
            else:
                pool.unpin_blocks([block], lambda _: None)
        with pytest.raises(ValueError, match=f"block {block_id}"):
            block.ref_cnt = 2
        assert _state(self.elastic, self.pools) == before, "a refused call changed the pools"

    # ------------------------------------------------------------- invariants
    @invariant()
    def budget_and_pools_agree(self) -> None:
        """The budget's accounting, the pools' counts and the requests' holdings agree."""
        if not hasattr(self, "elastic"):
            return
        self.elastic.check_invariants()
        # The one-call state an admission compares is the pool-by-pool read.
        assert self.elastic.state() == (
            [pool.get_num_free_blocks() for pool in self.pools],
            self.elastic.num_unowned,
            self.elastic.num_reserved,
        )
        for g, pool in enumerate(self.pools):
            pool.check_invariants()
            holders: Counter[int] = Counter(
                b.block_id for held in self.requests.values() for b in held[g] if not b.is_null
            )
            counts = pool.ref_counts()
            live = 0
            for block_id, n in holders.items():
                assert counts[block_id] == n, f"group {g}: block {block_id}"
                live += 1
            assert self.elastic.num_live_pages(g) == live, f"group {g}: live pages"
        self.account(_state(self.elastic, self.pools))


ElasticMachine.TestCase.settings = settings(max_examples=budget(400), stateful_step_count=50)
test_elastic_machine = ElasticMachine.TestCase


def test_memory_changes_owner_both_ways() -> None:
    """Two groups take turns filling the budget: each takes the other's idle slabs back,
    evicting their cached blocks (as BlockRemoved events of their own pool)."""
    elastic = NativeElasticPools(64, 4, [16, 64])
    pools = [BlockPool(elastic.num_pages(g), True, BS, True, label=f"g{g}") for g in (0, 1)]
    for g, pool in enumerate(pools):
        elastic.attach(g, pool)
    a = pools[0].get_new_blocks(12)  # every slab
    assert elastic.plan([[], []], [(1, 1)]) == (1, 1)
    req = make_request(0, 12, BS)
    pools[0].cache_full_blocks(req, a, 0, 12, BS, 0)
    pools[0].free_blocks(a)
    pools[0].take_events()
    b = pools[1].get_new_blocks(3)
    removed = [e for e in pools[0].take_events() if type(e).__name__ == "BlockRemoved"]
    assert len(removed) == 12, "all three slabs' cached blocks evicted"
    assert elastic.owner_changes(0) == (3, 3) and elastic.owner_changes(1) == (3, 0)
    pools[1].free_blocks(b)
    assert len(pools[0].get_new_blocks(4)) == 4
    assert elastic.owner_changes(1) == (3, 1)
    elastic.check_invariants()


def test_attach_refuses_what_does_not_fit() -> None:
    elastic = NativeElasticPools(64, 4, [16, 64])
    with pytest.raises(ValueError, match="group 0: an elastic pool must be new with 16 blocks"):
        elastic.attach(0, BlockPool(10, True, BS))
    pool = BlockPool(16, True, BS)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="must be new"):
        elastic.attach(0, pool)
    with pytest.raises(ValueError, match="group 2 is not in this byte budget"):
        elastic.attach(2, BlockPool(4, True, BS))
    with pytest.raises(RuntimeError, match="group 0 has no pool attached"):
        elastic.plan([[], []], [(0, 1)])


def test_grow_refuses_bad_input_naming_the_group() -> None:
    elastic = NativeElasticPools(64, 4, [16, 64], label="budget-a")
    pools = [BlockPool(elastic.num_pages(g), True, BS, label=f"g{g}") for g in (0, 1)]
    for g, pool in enumerate(pools):
        elastic.attach(g, pool)
    before = _state(elastic, pools)
    with pytest.raises(ValueError, match="group 2 is not in this byte budget"):
        elastic.grow([(0, 1), (2, 1)], 0, 1)
    with pytest.raises(ValueError, match="budget-a: group -1 is not a group"):
        elastic.grow([(0, 1)], -1, 1)
    with pytest.raises(ValueError, match="group 5 is not in this byte budget"):
        elastic.num_free_for(5)
    assert elastic.grow([(0, 2**40)], 0, 0) is None, "more pages than the budget holds"
    # The primary need summed by the pools saturates rather than overflowing.
    assert elastic.grow([(0, 2**63), (0, 2**63)], 0) is None
    assert _state(elastic, pools) == before, "a refused call changed the pools"
    got = elastic.grow([(0, 3), (1, 1)], 0, 3)
    assert got is not None and [len(b) for b in got] == [3, 1]
    elastic.end_step()
    elastic.check_invariants()


def test_taking_a_slab_back_tells_reuse_watchers_and_observers() -> None:
    """A slab taken back is memory another group overwrites: the `unpin_blocks` watchers
    of its pages hear that their blocks are reused, and the metrics collector hears of
    each block whose cached keys were evicted (as when a block is handed out again)."""
    collector = RecordingCollector()
    elastic = NativeElasticPools(64, 2, [16, 64])
    pools = [
        BlockPool(elastic.num_pages(0), True, BS, True, collector, label="g0"),
        BlockPool(elastic.num_pages(1), True, BS, True, label="g1"),
    ]
    for g, pool in enumerate(pools):
        elastic.attach(g, pool)
    a = pools[0].get_new_blocks(4)  # the one lendable slab
    pools[0].cache_full_blocks(make_request(0, 3, BS), a, 0, 3, BS, 0)
    reused: list[int] = []
    pools[0].unpin_blocks(a, lambda block: reused.append(block.block_id))
    collector.take()
    assert len(pools[1].get_new_blocks(1)) == 1
    assert reused == [b.block_id for b in a], "watchers of a slab taken back not told"
    evicted = [c[1] for c in collector.take() if c[0] == "evicted"]
    assert evicted == [b.block_id for b in a[:3]]
    elastic.check_invariants()


def test_a_raising_watcher_of_a_slab_taken_back_leaves_the_pools_whole() -> None:
    """A reuse watcher that raises while its slab is taken back for another group's
    allocation: the allocation raises that error, and the pages it popped are claimed
    (held once, counted live in the budget), never left neither free nor held."""
    elastic = NativeElasticPools(64, 2, [16, 64])
    pools = [BlockPool(elastic.num_pages(g), True, BS, label=f"g{g}") for g in (0, 1)]
    for g, pool in enumerate(pools):
        elastic.attach(g, pool)
    a = pools[0].get_new_blocks(4)

    def raising(block: Any) -> None:
        raise RuntimeError(f"watcher of block {block.block_id}")

    pools[0].unpin_blocks(a, raising)
    free_before = pools[1].get_num_free_blocks()
    with pytest.raises(RuntimeError, match="watcher of block"):
        pools[1].get_new_blocks(1)
    elastic.check_invariants()
    for pool in pools:
        pool.check_invariants()
    assert elastic.num_owned(1) == 1 and elastic.num_live_pages(1) == 1
    assert pools[1].get_num_free_blocks() == free_before
    (claimed,) = [i for i, n in enumerate(pools[1].ref_counts()) if n == 1 and i > 0]
    pools[1].free_blocks([pools[1]._block(claimed)])
    elastic.check_invariants()
    assert elastic.num_live_pages(1) == 0


def test_caching_calls_refuse_blocks_the_budget_holds() -> None:
    """Giving a key to a block of a slab the group does not own would put a held block in
    the prefix cache: every caching call refuses it, naming the block, and changes
    nothing."""
    elastic = NativeElasticPools(64, 3, [16, 64])
    pools = [BlockPool(elastic.num_pages(g), True, BS, label=f"g{g}") for g in (0, 1)]
    for g, pool in enumerate(pools):
        elastic.attach(g, pool)
    mine = pools[0].get_new_blocks(1)[0]
    held = pools[0]._block(9)  # a page of the slab no group owns
    assert pools[0].ref_counts()[9] == 1
    req = make_request(0, 2, BS)
    before = (pools[0].cache_entries(), pools[0].ref_counts())
    with pytest.raises(ValueError, match="block 9"):
        pools[0].cache_full_blocks(req, [mine, held], 0, 2, BS, 0)
    with pytest.raises(ValueError, match="block 9"):
        pools[0]._insert_block_hash(b"k" * 32, held)
    with pytest.raises(ValueError, match="block 9"):
        pools[0].move_block_hashes(mine, held)
    assert (pools[0].cache_entries(), pools[0].ref_counts()) == before
