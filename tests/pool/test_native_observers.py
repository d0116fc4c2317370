"""Callbacks a pool makes to its observers (vLLM's metrics collector and the reuse watchers
of ``unpin_blocks``) come in the same order, with the same blocks, on the stock pool and on
ours: the same random walk over every operation that calls back is run on both and the
call logs are compared after every step."""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool as StockPool

from hybrid_alloc.integration.scheduler.block_pool import BlockPool as RustPool
from tests.helpers import make_request, rust_snapshot, stock_snapshot

HASH_BLOCK_SIZE = 4


class Recorder:
    """A stand-in for vLLM's ``KVCacheMetricsCollector`` that logs every call."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def on_block_allocated(self, block: Any) -> None:
        self.log.append(("allocated", block.block_id))

    def on_block_accessed(self, block: Any) -> None:
        self.log.append(("accessed", block.block_id))

    def on_block_evicted(self, block: Any) -> None:
        self.log.append(("evicted", block.block_id))

    def reset(self) -> None:
        self.log.append(("reset", -1))


class Side:
    """One pool, the blocks its requests hold, and its call log."""

    def __init__(self, cls: type, num_blocks: int, caching: bool, collect: bool) -> None:
        self.log: list[tuple[str, int]] = []
        collector = Recorder(self.log) if collect else None
        self.pool = cls(num_blocks, caching, HASH_BLOCK_SIZE, metrics_collector=collector)
        self.held: list[list[Any]] = []

    def watcher(self, block: Any) -> None:
        self.log.append(("reused", block.block_id))


def walk(seed: int, caching: bool, collect: bool, steps: int = 300) -> None:
    rnd = random.Random(seed)
    num_blocks = rnd.randint(4, 16)
    stock = Side(StockPool, num_blocks, caching, collect)
    ours = Side(RustPool, num_blocks, caching, collect)
    for step in range(steps):
        op = rnd.randrange(7)
        if op == 0 or not stock.held:
            n = rnd.randint(0, 4)
            if n > stock.pool.get_num_free_blocks():
                continue
            for side in (stock, ours):
                side.held.append(side.pool.get_new_blocks(n))
        elif op == 1:
            i = rnd.randrange(len(stock.held))
            upto = rnd.randint(0, len(stock.held[i]))
            req = make_request(rnd.randrange(3), upto, HASH_BLOCK_SIZE)
            for side in (stock, ours):
                blocks = side.held[i]
                if caching and all(b.block_hash is None for b in blocks[:upto]):
                    side.pool.cache_full_blocks(req, blocks, 0, upto, HASH_BLOCK_SIZE, 0)
        elif op == 2:
            i = rnd.randrange(len(stock.held))
            for side in (stock, ours):
                side.pool.free_blocks(reversed(side.held.pop(i)))
        elif op == 3:
            i = rnd.randrange(len(stock.held))
            for side in (stock, ours):
                side.pool.unpin_blocks(side.held.pop(i), side.watcher)
        elif op == 4:
            seed_req = rnd.randrange(3)
            for side in (stock, ours):
                hits = []
                for h in make_request(seed_req, 4, HASH_BLOCK_SIZE).block_hashes:
                    got = side.pool.get_cached_block(h, [0])
                    if got is None:
                        break
                    hits.append(got[0])
                side.pool.touch(hits)
                side.held.append(hits)
        elif op == 5:
            chosen = rnd.sample(range(num_blocks), rnd.randint(0, 3))
            single = rnd.random() < 0.5
            for side in (stock, ours):
                if single and chosen:
                    side.pool._maybe_evict_cached_block(side.pool.blocks[chosen[0]])
                else:
                    side.pool.evict_blocks(list(chosen))
        else:
            assert stock.pool.reset_prefix_cache() == ours.pool.reset_prefix_cache()
        assert ours.log == stock.log, f"step {step}, op {op}"
        assert rust_snapshot(ours.pool) == stock_snapshot(stock.pool), f"step {step}"
        ours.pool.check_invariants()


@pytest.mark.parametrize("collect", [True, False])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_observer_calls_match_stock(seed: int, caching: bool, collect: bool) -> None:
    walk(seed, caching, collect)


def test_metrics_collector_can_be_replaced_and_removed() -> None:
    log: list[tuple[str, int]] = []
    pool = RustPool(8, True, HASH_BLOCK_SIZE)
    assert pool.metrics_collector is None
    pool.get_new_blocks(1)
    assert log == []
    collector = Recorder(log)
    pool.metrics_collector = collector
    assert pool.metrics_collector is collector
    pool.get_new_blocks(1)
    assert log == [("evicted", 2), ("allocated", 2)]
    pool.metrics_collector = None
    pool.get_new_blocks(1)
    assert log == [("evicted", 2), ("allocated", 2)]


def test_a_failing_watcher_leaves_the_pool_consistent() -> None:
    pool = RustPool(6, True, HASH_BLOCK_SIZE)
    blocks = pool.get_new_blocks(5)

    def boom(block: Any) -> None:
        raise RuntimeError(f"watcher of block {block.block_id}")

    pool.unpin_blocks(blocks[:1], boom)
    with pytest.raises(RuntimeError, match="watcher of block 1"):
        pool.get_new_blocks(1)
    pool.check_invariants()
