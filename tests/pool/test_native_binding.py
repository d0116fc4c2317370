"""The binding's own contract: blocks of other pools routed in one call (and refused as a
whole), the positions `_cache_full_blocks` reports for events, partial caching in one call,
the free-queue iterator."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from hybrid_alloc._native import FreeBlockIterator
from hybrid_alloc.integration.scheduler import block_pool
from hybrid_alloc.integration.scheduler.block_pool import BlockPool
from tests.helpers import FakeRequest, make_request, rust_snapshot

HBS = 4


class ForeignBlock:
    """A block of a pool that is not ours (only ``pool`` is read)."""

    def __init__(self, pool: Any, name: str) -> None:
        self.pool = pool
        self.name = name


class ForeignPool:
    def __init__(self) -> None:
        self.freed: list[list[str]] = []

    def free_blocks(self, blocks: list[ForeignBlock]) -> None:
        self.freed.append([b.name for b in blocks])


def test_free_blocks_routes_every_pool_in_one_call() -> None:
    a, b, c = (BlockPool(8, True, HBS, label=name) for name in "abc")
    ha, hb, hc = a.get_new_blocks(2), b.get_new_blocks(3), c.get_new_blocks(1)
    foreign = ForeignPool()
    mixed = [hb[2], ha[1], ForeignBlock(foreign, "x"), hc[0], hb[0], ha[0], a.null_block]
    mixed.append(ForeignBlock(foreign, "y"))
    a.free_blocks(iter(mixed))
    # Each pool freed its own blocks in list order (uncached: to the front, first first).
    assert a.free_block_ids()[:2] == [2, 1]
    assert b.free_block_ids()[:2] == [3, 1]
    assert b.ref_counts()[2] == 1
    assert c.get_num_free_blocks() == 7
    assert foreign.freed == [["x", "y"]]
    for pool in (a, b, c):
        pool.check_invariants()


def test_a_refused_mixed_free_changes_no_pool() -> None:
    a, b = BlockPool(8, True, HBS, label="pool-a"), BlockPool(8, True, HBS, label="pool-b")
    ha, hb = a.get_new_blocks(2), b.get_new_blocks(2)
    b.free_blocks([hb[1]])
    before = rust_snapshot(a), rust_snapshot(b)
    with pytest.raises(ValueError, match="pool-b: block 2 is freed more times"):
        a.free_blocks([ha[0], hb[0], hb[1]])
    with pytest.raises(ValueError, match="pool-a: block 1 is freed more times"):
        a.free_blocks([hb[0], ha[0], ha[0]])
    assert (rust_snapshot(a), rust_snapshot(b)) == before


def test_objects_claiming_a_pool_of_ours_are_refused() -> None:
    a, b = BlockPool(8, True, HBS, label="pool-a"), BlockPool(8, True, HBS, label="pool-b")
    ha = a.get_new_blocks(1)
    before = rust_snapshot(a)
    with pytest.raises(TypeError, match="pool-a: free_blocks: a ForeignBlock claims this pool"):
        a.free_blocks([ha[0], ForeignBlock(a, "x")])
    with pytest.raises(TypeError, match="pool-b: free_blocks: a ForeignBlock claims this pool"):
        a.free_blocks([ha[0], ForeignBlock(b, "x")])
    assert rust_snapshot(a) == before


def test_handles_live_outside_the_cyclic_gc_and_outlive_their_pool_safely() -> None:
    """Handles are made after the engine froze its heap; they hold their pool by address
    only, so the GC never walks them, and one held past its pool's end raises on every
    read of the pool instead of touching freed memory."""
    a, b = BlockPool(8, True, HBS, label="pool-a"), BlockPool(8, True, HBS, label="pool-b")
    held = a.get_new_blocks(3)
    assert not any(gc.is_tracked(h) for h in held)
    assert all(h.pool is a for h in held) and held[0].ref_cnt == 1
    assert [h.block_id for h in held] == [1, 2, 3] and a.null_block.is_null
    # Handles do not keep their pool alive: once its owner and its own views (a cycle)
    # are gone, the pool is freed and its handles let go of it.
    del a
    gc.collect()
    stale = held[1]
    for read in (
        lambda: stale.ref_cnt,
        lambda: stale.pool,
        lambda: stale.block_hash,
        lambda: stale.next_free_block,
        lambda: repr(stale),
    ):
        with pytest.raises(RuntimeError, match="block 2: its pool is gone"):
            read()
    assert stale.block_id == 2 and not stale.is_null  # the handle's own fields stay
    before = rust_snapshot(b)
    with pytest.raises(RuntimeError, match="block 2: its pool is gone"):
        b.free_blocks([stale])
    with pytest.raises(ValueError, match="pool-b: touch: block 2 belongs to another pool"):
        b.touch([stale])
    assert rust_snapshot(b) == before
    assert stale == held[1] and stale != b.get_new_blocks(1)[0]


def test_a_pool_makes_its_first_handles_as_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``EAGER_HANDLES`` blocks' handles are made with the pool (outside the
    scheduler's steps); the rest on first use, each still one object per block."""
    assert BlockPool(8, True, HBS).num_handles() == 8
    monkeypatch.setattr(block_pool, "EAGER_HANDLES", 5)
    pool = BlockPool(8, True, HBS)
    assert pool.num_handles() == 5
    first = pool.get_new_blocks(7)
    assert [b.block_id for b in first] == [1, 2, 3, 4, 5, 6, 7] and pool.num_handles() == 8
    pool.free_blocks(first)
    again = pool.get_new_blocks(7)
    assert all(any(a is b for b in first) for a in again)


@pytest.mark.parametrize("events", [False, True])
def test_cache_full_blocks_reports_cached_positions_only_with_events(events: bool) -> None:
    pool = BlockPool(8, True, HBS, enable_kv_cache_events=events)
    blocks = [pool.null_block, *pool.get_new_blocks(3)]
    hashes = make_request(1, 4, HBS).block_hashes
    kept = pool._cache_full_blocks(blocks, hashes, 0, 4, HBS, 0, [True, True, False, True])
    assert kept == ([1, 3] if events else None)
    assert pool._cache_full_blocks(blocks, hashes, 4, 4, HBS, 0) is None
    assert [b.block_hash is not None for b in blocks] == [False, True, False, True]


@pytest.mark.parametrize("events", [False, True])
def test_cache_partial_block_promotes_and_reports_new_entries(events: bool) -> None:
    pool = BlockPool(4, True, HBS, enable_kv_cache_events=events)
    block = pool.get_new_blocks(1)[0]
    req = make_request(3, 4, HBS)
    first = pool._cache_partial_block(req.block_hashes, block, 4, 0, 4 * HBS)
    assert first is not None and first[1] is events
    assert pool._cache_partial_block(req.block_hashes, block, 4, 0, 4 * HBS) == (first[0], False)
    pool.take_events()
    key = pool.cache_partial_block(req, block, 8, 0, 4 * HBS)
    assert key == pool._cache_partial_block(req.block_hashes, block, 8, 0, 4 * HBS)[0]
    kinds = [type(e).__name__ for e in pool.take_events()]
    assert kinds == (["BlockRemoved", "BlockStored"] if events else [])
    assert block.block_hash == key and block.block_hash_num_tokens == 8
    assert pool.cache_partial_block(req, pool.null_block, 4, 0, 4 * HBS) is None
    with pytest.raises(ValueError, match="request has 4 block hashes, 5 needed"):
        pool.cache_partial_block(req, block, 20, 0, 8 * HBS)
    with pytest.raises(TypeError, match="block hashes as bytes, got str"):
        pool.cache_partial_block(FakeRequest(["ab"]), block, 4, 0, HBS)  # type: ignore[list-item]
    pool.check_invariants()


def test_free_queue_iterator_follows_the_queue() -> None:
    pool = BlockPool(6, True, HBS)
    it = pool.free_block_queue.iter_blocks_after(None)
    assert isinstance(it, FreeBlockIterator)
    first = next(it)
    assert first.block_id == 1
    pool.get_new_blocks(2)  # takes 1 and 2: the iterator's block left the queue
    assert list(it) == []
    assert [b.block_id for b in pool.free_block_queue.iter_blocks_after(pool.blocks[3])] == [4, 5]


def test_huge_requests_are_refused_before_anything_is_reserved() -> None:
    pool = BlockPool(8, True, HBS, label="pool-a")
    for n in (2**40, 2**62):
        with pytest.raises(ValueError, match="pool-a: Cannot get"):
            pool.get_new_blocks(n)
    with pytest.raises(ValueError, match="block_mask has 1 entries"):
        pool._cache_full_blocks([], [], 0, 2**62, HBS, 0, [True])
    with pytest.raises(IndexError):
        pool._cache_full_blocks([], [], 0, 2**62, HBS, 0)
    pool.check_invariants()


def test_new_blocks_come_with_the_ints_their_handles_hold() -> None:
    """``get_new_blocks_with_ids``: the blocks ``get_new_blocks`` would hand out (the same
    order, one reference each) and, as a second list, each handle's own ``block_id``."""
    ours, twin = BlockPool(16, True, HBS, label="ours"), BlockPool(16, True, HBS, label="twin")
    held = ours.get_new_blocks(3)
    twin.get_new_blocks(3)
    ours.free_blocks(held[1:2])
    twin.free_blocks([twin._block(2)])
    blocks, ids = ours.get_new_blocks_with_ids(5)
    expected = twin.get_new_blocks(5)
    assert [b.block_id for b in blocks] == [b.block_id for b in expected] == ids
    assert all(i is b.block_id for i, b in zip(ids, blocks, strict=True))
    assert ours.ref_counts() == twin.ref_counts()
    assert ours.get_new_blocks_with_ids(0) == ([], [])
    before = rust_snapshot(ours)
    with pytest.raises(ValueError, match="ours"):
        ours.get_new_blocks_with_ids(ours.get_num_free_blocks() + 1)
    assert rust_snapshot(ours) == before
    ours.check_invariants()
