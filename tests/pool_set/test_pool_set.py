"""`PoolSet`: one pool per KV-cache group, pool-scoped block IDs.

Unit tests for each operation, then a hypothesis-driven sequence of operations checked
against a model: every block lives in exactly one pool, IDs are never applied across
pools, and eviction (or anything else) in one pool never changes another pool.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from hybrid_alloc.integration.kv_cache_config import PoolLayout
from hybrid_alloc.integration.scheduler.block_pool import BlockPool
from hybrid_alloc.integration.scheduler.pool_set import PoolSet
from tests.helpers import make_request

BS = 4  # block size = hash block size in these tests


def make_set(sizes: tuple[int, ...] = (16, 6, 9), events: bool = False) -> PoolSet:
    """Pool i serves group i; pool 0 grows, the others hold fixed state."""
    layouts = [
        PoolLayout(group_ids=(i,), num_blocks=n, grows=(i == 0), label=f"g{i}")
        for i, n in enumerate(sizes)
    ]
    return PoolSet(layouts, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=events)


def snapshot(pool: BlockPool) -> Any:
    return pool.free_block_ids(), pool.ref_counts(), sorted(pool.cache_entries())


# ------------------------------------------------------------------ structure
def test_layout_validation() -> None:
    with pytest.raises(ValueError, match="exactly one pool"):
        PoolSet(
            [PoolLayout((0, 1), 4, True), PoolLayout((1,), 4, False)],
            enable_caching=True,
            hash_block_size=BS,
        )
    with pytest.raises(ValueError, match=r"0\.\.n-1"):
        PoolSet([PoolLayout((1,), 4, True)], enable_caching=True, hash_block_size=BS)
    with pytest.raises(ValueError, match="serves no group"):
        PoolSet([PoolLayout((), 4, True)], enable_caching=True, hash_block_size=BS)
    with pytest.raises(ValueError, match="at least one"):
        PoolSet([], enable_caching=True, hash_block_size=BS)


def test_groups_share_a_pool_and_primary_is_first_growing() -> None:
    ps = PoolSet(
        [PoolLayout((1,), 5, False), PoolLayout((0, 2), 11, True)],
        enable_caching=True,
        hash_block_size=BS,
    )
    assert ps.pool_for_group(0) is ps.pool_for_group(2) is ps.pools[1]
    assert ps.pool_for_group(1) is ps.pools[0]
    assert ps.primary is ps.pools[1] and ps.num_gpu_blocks == 11
    assert ps.get_num_free_blocks() == 10 and ps.free_counts() == (4, 10)
    assert ps.index_of(ps.pools[0]) == 0
    with pytest.raises(ValueError):
        ps.index_of(BlockPool(4, True, BS))


def test_ids_are_pool_scoped() -> None:
    ps = make_set()
    a = ps.pool_for_group(0).get_new_blocks(3)
    b = ps.pool_for_group(1).get_new_blocks(3)
    # Same IDs in both pools, different blocks.
    assert [x.block_id for x in a] == [x.block_id for x in b]
    assert all(x.pool is ps.pools[0] for x in a) and all(x.pool is ps.pools[1] for x in b)
    assert ps.free_counts() == (12, 2, 8)


def test_free_blocks_routes_each_block_to_its_pool() -> None:
    ps = make_set()
    a = ps.pool_for_group(0).get_new_blocks(2)
    b = ps.pool_for_group(2).get_new_blocks(2)
    ps.free_blocks(reversed([a[0], b[0], a[1], b[1]]))
    assert ps.free_counts() == (15, 5, 8)
    ps.check_invariants()


def test_usage_is_the_fullest_pool() -> None:
    ps = make_set((11, 3, 5))
    ps.pool_for_group(1).get_new_blocks(2)  # pool 1 full
    assert ps.usages()[1] == 1.0 and ps.get_usage() == 1.0
    assert ps.usages()[0] == 0.0


# -------------------------------------------------------------------- eviction
def _cache(ps: PoolSet, gid: int, seed: int, n: int) -> list[Any]:
    pool = ps.pool_for_group(gid)
    req = make_request(seed, n, BS)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, blocks, 0, n, BS, gid)
    return blocks


def test_evict_needs_a_group_and_stays_in_its_pool() -> None:
    ps = make_set()
    a = _cache(ps, 0, seed=1, n=3)
    b = _cache(ps, 1, seed=1, n=3)  # same hashes, same IDs, other group and pool
    ps.free_blocks(a + b)
    before = snapshot(ps.pools[1])
    with pytest.raises(TypeError, match="scoped"):
        ps.evict_blocks({a[0].block_id})  # type: ignore[arg-type]
    ps.evict_blocks({0: [a[0].block_id, a[2].block_id]})
    assert snapshot(ps.pools[1]) == before
    assert a[0].block_hash is None and a[1].block_hash is not None
    assert all(x.block_hash is not None for x in b)
    ps.evict_group_blocks(1, [b[1].block_id])
    assert b[1].block_hash is None and b[0].block_hash is not None


def test_evict_checks_every_id_first() -> None:
    ps = make_set((16, 6, 9))
    a = _cache(ps, 0, seed=2, n=2)
    ps.free_blocks(a)
    before = [snapshot(p) for p in ps.pools]
    # ID 10 exists in pool 0 but not in group 1's pool (6 blocks): nothing is evicted.
    with pytest.raises(ValueError, match="not a block of group 1"):
        ps.evict_blocks({0: [a[0].block_id], 1: [10]})
    with pytest.raises(ValueError, match="no group"):
        ps.evict_blocks({7: [1]})
    assert [snapshot(p) for p in ps.pools] == before


def test_prefix_lookup_is_per_pool() -> None:
    ps = make_set()
    req = make_request(5, 2, BS)
    _cache(ps, 0, seed=5, n=2)
    # Group 1's pool has nothing cached under these hashes.
    assert ps.pool_for_group(1).get_cached_prefix(req.block_hashes, [1], 2) == ([],)
    hit = ps.pool_for_group(0).get_cached_prefix(req.block_hashes, [0], 2)
    assert [b.pool for b in hit[0]] == [ps.pools[0]] * 2


# ---------------------------------------------------------------------- events
def test_events_keep_order_and_group() -> None:
    ps = make_set(events=True)
    a = _cache(ps, 0, seed=1, n=2)
    b = _cache(ps, 2, seed=1, n=1)
    c = _cache(ps, 0, seed=3, n=1)
    events = ps.take_events()
    assert [type(e) for e in events] == [BlockStored] * 3
    assert [e.group_idx for e in events] == [0, 2, 0]
    assert ps.take_events() == []
    ps.free_blocks(a + b + c)
    ps.evict_blocks({2: [b[0].block_id]})
    ps.evict_blocks({0: [a[1].block_id]})
    removed = ps.take_events()
    assert [(type(e), e.group_idx) for e in removed] == [(BlockRemoved, 2), (BlockRemoved, 0)]


def test_reset_is_all_or_nothing() -> None:
    ps = make_set(events=True)
    a = _cache(ps, 0, seed=1, n=2)
    held = _cache(ps, 1, seed=2, n=1)  # still in use
    ps.free_blocks(a)
    ps.take_events()
    before = [snapshot(p) for p in ps.pools]
    assert not ps.reset_prefix_cache()
    assert [snapshot(p) for p in ps.pools] == before
    ps.free_blocks(held)
    assert ps.reset_prefix_cache()
    assert all(p.cache_entries() == [] for p in ps.pools)
    assert [type(e) for e in ps.take_events()] == [AllBlocksCleared]


def test_events_off_returns_nothing() -> None:
    ps = make_set(events=False)
    _cache(ps, 0, seed=1, n=2)
    assert ps.take_events() == []


# ------------------------------------------------------- random operation traces
OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "cache", "free", "evict", "touch"]),
        st.integers(0, 2),  # group
        st.integers(0, 10_000),  # parameter
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60)
@given(ops=OPS, sizes=st.tuples(st.integers(2, 12), st.integers(2, 6), st.integers(2, 8)))
def test_random_traces_keep_pools_apart(ops: list[tuple[str, int, int]], sizes: Any) -> None:
    ps = make_set(sizes, events=True)
    held: list[list[Any]] = [[] for _ in ps.pools]  # blocks each group holds a ref on
    seeds = iter(range(1, 10_000))
    for op, gid, param in ops:
        pool = ps.pool_for_group(gid)
        others = [snapshot(p) for p in ps.pools if p is not pool]
        if op == "alloc":
            n = min(1 + param % 3, pool.get_num_free_blocks())
            blocks = pool.get_new_blocks(n)
            held[gid].extend(blocks)
        elif op == "cache":
            n = 1 + param % 2
            if pool.get_num_free_blocks() < n:
                continue
            held[gid].extend(_cache(ps, gid, next(seeds), n))
        elif op == "free":
            # Free a mix of this group's and another group's blocks in one call.
            take = [held[gid].pop()] if held[gid] else []
            other = (gid + 1) % 3
            if held[other]:
                take.append(held[other].pop())
            ps.free_blocks(take)
            others = None  # this op may legitimately change two pools
        elif op == "evict":
            n = pool.num_gpu_blocks
            ps.evict_blocks({gid: [1 + param % (n - 1)]})
        elif op == "touch":
            hit = [b for b in pool.blocks[1:] if b.block_hash is not None][:1]
            pool.touch(hit)
            held[gid].extend(hit)
        if others is not None:
            assert [snapshot(p) for p in ps.pools if p is not pool] == others, op
        # Every held block belongs to its group's pool, and counts add up per pool.
        for g in range(3):
            p = ps.pool_for_group(g)
            assert all(b.pool is p and 0 < b.block_id < p.num_gpu_blocks for b in held[g])
            in_use = sum(1 for c in p.ref_counts()[1:] if c > 0)
            assert p.get_num_free_blocks() + in_use == p.num_gpu_blocks - 1
        for event in ps.take_events():
            if isinstance(event, (BlockStored, BlockRemoved)):
                assert event.group_idx in (0, 1, 2)
        ps.check_invariants()
    # Everything back: each pool is whole again.
    ps.free_blocks([b for blocks in held for b in blocks])
    assert ps.free_counts() == tuple(n - 1 for n in sizes)
