"""A hypothesis state machine over the set of per-group pools.

Requests take blocks in every group (prefix hits first, each looked up in its own group's
pool), cache them, are freed through the set (each block routed to its own pool), and
blocks are evicted by (group, IDs). After every step: each pool's own invariants hold,
reference counts equal the holders the model tracks, every block handle belongs to the pool
of its group, no pool holds a key of another pool's group (nothing cached in one pool is
reachable through another), and an operation on one pool left every other pool unchanged.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, precondition, rule
from vllm.v1.core.kv_cache_utils import get_group_id

from hybrid_alloc.integration.kv_cache_config import PoolLayout
from hybrid_alloc.integration.scheduler.pool_set import PoolSet
from tests.helpers import CountingMachine, budget, make_request, stepping

BS = 4


def pool_state(pool: Any) -> Any:
    return pool.free_block_ids(), pool.ref_counts(), pool.cache_entries()


class PoolSetMachine(CountingMachine):
    MACHINE = "pool_set"

    def __init__(self) -> None:
        super().__init__()
        # request id -> {group: blocks}
        self.requests: dict[int, dict[int, list[Any]]] = {}
        self.reqs: dict[int, Any] = {}
        self.cached: dict[tuple[int, int], int] = {}  # (request, group) -> blocks cached
        self.next_id = 0

    @initialize(
        sizes=st.lists(st.integers(2, 14), min_size=2, max_size=4),
        shared=st.booleans(),
        first=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=3),
    )
    def build(self, sizes: list[int], shared: bool, first: list[tuple[int, int]]) -> None:
        """The pools, then a few requests admitted (every example starts with state)."""
        # Optionally two groups share the first pool (same page size, one pool).
        groups = list(range(len(sizes) + (1 if shared else 0)))
        layouts = []
        if shared:
            layouts.append(
                PoolLayout(group_ids=(0, 1), num_blocks=sizes[0], grows=True, label="p0")
            )
            rest = list(zip(groups[2:], sizes[1:], strict=True))
        else:
            layouts.append(PoolLayout(group_ids=(0,), num_blocks=sizes[0], grows=True, label="p0"))
            rest = list(zip(groups[1:], sizes[1:], strict=True))
        for g, n in rest:
            layouts.append(PoolLayout(group_ids=(g,), num_blocks=n, grows=False, label=f"p{g}"))
        self.groups = groups
        self.set = PoolSet(layouts, enable_caching=True, hash_block_size=BS)
        for seed, n in first:
            self.admit_request(seed, n)

    # ---------------------------------------------------------------- helpers
    def others_unchanged(self, touched: set[int]) -> Any:
        return {i: pool_state(p) for i, p in enumerate(self.set) if i not in touched}

    # ------------------------------------------------------------------ rules
    def admit_request(self, seed: int, num_blocks: int) -> None:
        req = make_request(seed, num_blocks, BS)
        taken: dict[int, list[Any]] = {}
        for g in self.groups:
            pool = self.set.pool_for_group(g)
            hits = []
            for h in req.block_hashes:
                got = pool.get_cached_block(h, [g])
                if got is None:
                    break
                assert got[0].pool is pool
                hits.append(got[0])
            pool.touch(hits)
            need = num_blocks - len(hits)
            if need > pool.get_num_free_blocks():
                # One pool is full: give back what every group took (admission refused).
                pool.free_blocks(reversed(hits))
                for blocks in taken.values():
                    self.set.free_blocks(reversed(blocks))
                return
            taken[g] = hits + pool.get_new_blocks(need)
            self.cached[(self.next_id, g)] = len(hits)
        self.requests[self.next_id] = taken
        self.reqs[self.next_id] = req
        self.next_id += 1

    @rule(seed=st.integers(0, 3), num_blocks=st.integers(1, 4))
    @stepping
    def admit(self, seed: int, num_blocks: int) -> None:
        self.admit_request(seed, num_blocks)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    @stepping
    def cache(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        g = data.draw(st.sampled_from(self.groups))
        blocks = self.requests[rid][g]
        done = self.cached[(rid, g)]
        upto = data.draw(st.integers(done, len(blocks)))
        pool = self.set.pool_for_group(g)
        before = self.others_unchanged({self.set.index_of(pool)})
        pool.cache_full_blocks(self.reqs[rid], blocks, done, upto, BS, g)
        self.cached[(rid, g)] = max(done, upto)
        assert self.others_unchanged({self.set.index_of(pool)}) == before

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    @stepping
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        held = self.requests.pop(rid)
        # Every group's blocks in one mixed list: the set routes each to its own pool.
        mixed = [b for g in self.groups for b in reversed(held[g])]
        self.set.free_blocks(mixed)

    @precondition(lambda self: any(p.cache_entries() for p in self.set))
    @rule(data=st.data())
    @stepping
    def evict(self, data: st.DataObject) -> None:
        """Evict by (group, IDs): at least one cached block of the group's pool, and any
        other IDs of that pool. A bare set of IDs names no pool: refused first, with
        nothing changed."""
        before = self.others_unchanged(set())
        bare = data.draw(st.sets(st.integers(0, 3), min_size=1, max_size=3))
        with pytest.raises(TypeError, match="scoped to a pool"):
            self.set.evict_blocks(bare)  # type: ignore[arg-type]
        assert self.others_unchanged(set()) == before
        cached_groups = [
            g
            for g in self.groups
            if any(get_group_id(key) == g for key, _ in self.set.pool_for_group(g).cache_entries())
        ]
        g = data.draw(st.sampled_from(cached_groups))
        pool = self.set.pool_for_group(g)
        cached = sorted(
            {i for key, ids in pool.cache_entries() if get_group_id(key) == g for i in ids}
        )
        ids = {data.draw(st.sampled_from(cached))}
        ids |= data.draw(st.sets(st.integers(0, pool.num_gpu_blocks - 1), max_size=2))
        before = self.others_unchanged({self.set.index_of(pool)})
        self.set.evict_blocks({g: ids})
        assert self.others_unchanged({self.set.index_of(pool)}) == before

    @precondition(lambda self: any(p.cache_entries() for p in self.set))
    @rule()
    @stepping
    def reset(self) -> None:
        """All pools or none: refused (nothing changes) while any pool has a block in use,
        else every pool's cache is empty afterwards."""
        before = self.others_unchanged(set())
        busy = any(p.get_num_free_blocks() != p.num_gpu_blocks - 1 for p in self.set)
        ok = self.set.reset_prefix_cache()
        assert ok == (not busy)
        if ok:
            assert all(p.cache_entries() == [] for p in self.set)
        else:
            assert self.others_unchanged(set()) == before

    # ------------------------------------------------------------- invariants
    @invariant()
    def pools_stay_apart(self) -> None:
        if not hasattr(self, "set"):
            return
        self.set.check_invariants()
        holders: list[Counter[int]] = [Counter() for _ in self.set]
        for held in self.requests.values():
            for g, blocks in held.items():
                pool = self.set.pool_for_group(g)
                i = self.set.index_of(pool)
                for b in blocks:
                    assert b.pool is pool, "a block is used through another pool"
                    holders[i][b.block_id] += 1
        for i, pool in enumerate(self.set):
            counts = {bid: c for bid, c in enumerate(pool.ref_counts()) if c}
            assert counts == dict(holders[i]), f"pool {i}: ref counts != holders"
            own_groups = {g for g in self.groups if self.set.pool_for_group(g) is pool}
            for key, _ids in pool.cache_entries():
                assert get_group_id(key) in own_groups, "a pool caches another pool's group"
        self.account(
            (
                tuple(pool_state(p) for p in self.set),
                sorted(
                    (rid, g, len(b)) for rid, held in self.requests.items() for g, b in held.items()
                ),
                sorted(self.cached.items()),
            )
        )


PoolSetMachine.TestCase.settings = settings(max_examples=budget(100), stateful_step_count=40)
test_pool_set_machine = PoolSetMachine.TestCase
