"""Differential fuzzing: the same operation sequence on vLLM's stock BlockPool and ours must
give the same results after every step (block IDs, free order, ref counts, hashes, cache
contents, lookups, events, metrics-collector callbacks).

Our extras are checked against what vLLM computes with the stock pool's own methods:
``get_cached_prefix`` against vLLM's loop of ``get_cached_block`` calls (stopping at the
first miss), ``count_evictable`` against the count vLLM's managers take
(``ref_cnt == 0 and not is_null``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, precondition, rule
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
    resolve_block_hashes,
)

from hybrid_alloc.integration.scheduler.block_pool import BlockPool as RustPool
from tests.helpers import (
    CountingMachine,
    FakeRequest,
    RecordingCollector,
    budget,
    make_request,
    normalize_events,
    rust_snapshot,
    stepping,
    stock_snapshot,
)

HASH_BLOCK_SIZE = 4


@dataclass
class Held:
    """A request's blocks in both pools (same IDs), and how many are cached."""

    request: FakeRequest
    stock: list[Any]
    ours: list[Any]
    num_cached: int = 0


def replay(counts: Counter[tuple[Any, int]], events: list[Any]) -> None:
    """Apply KV-cache events to a multiset of (external hash, group): each stored hash adds
    a holder, each removed hash drops one."""
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            counts.clear()
            continue
        sign = 1 if isinstance(ev, BlockStored) else -1
        for h in ev.block_hashes:
            counts[(h, ev.group_idx)] += sign


def external_key(key: bytes) -> tuple[Any, int]:
    """A cache key as events name it (vLLM may shorten hashes to ints in events)."""
    return maybe_convert_block_hash(get_block_hash(key)), get_group_id(key)


def ids(blocks: Any) -> list[int] | None:
    return None if blocks is None else [b.block_id for b in blocks]


def stock_prefix(pool: Any, hashes: Any, groups: list[int], max_blocks: int) -> list[list[int]]:
    """vLLM's prefix lookup on the stock pool: one ``get_cached_block`` per block hash,
    stopping at the first miss; block IDs per group."""
    found: list[list[int]] = [[] for _ in groups]
    for h in list(hashes)[:max_blocks]:
        got = pool.get_cached_block(h, groups)
        if not got:
            break
        for out, block in zip(found, got, strict=True):
            out.append(block.block_id)
    return found


def stock_evictable(blocks: Any) -> int:
    """The count vLLM's managers take of prefix-hit blocks that leave the free queue."""
    return sum(b.ref_cnt == 0 and not b.is_null for b in blocks)


class PoolDifferential(CountingMachine):
    MACHINE = "pool"

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Held] = []
        self.reuse_log: dict[str, list[int]] = {"stock": [], "ours": []}
        # Our pool's cache contents rebuilt from its events alone: key -> holder count.
        self.replayed: Counter[tuple[Any, int]] = Counter()

    @initialize(
        num_blocks=st.integers(2, 24),
        caching=st.booleans(),
        events=st.booleans(),
        block_size=st.sampled_from([4, 8]),
        collect=st.booleans(),
        first=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 8)), min_size=1, max_size=3),
    )
    def build(
        self,
        num_blocks: int,
        caching: bool,
        events: bool,
        block_size: int,
        collect: bool,
        first: list[tuple[int, int]],
    ) -> None:
        """Both pools, then a few requests admitted (every example starts with state)."""
        self.block_size = block_size
        self.scale = block_size // HASH_BLOCK_SIZE
        self.caching = caching
        self.collectors = (RecordingCollector(), RecordingCollector()) if collect else None
        collector_s, collector_o = self.collectors or (None, None)
        self.stock = StockPool(
            num_blocks,
            caching,
            HASH_BLOCK_SIZE,
            enable_kv_cache_events=events,
            metrics_collector=collector_s,
        )
        self.ours = RustPool(
            num_blocks,
            caching,
            HASH_BLOCK_SIZE,
            enable_kv_cache_events=events,
            metrics_collector=collector_o,
        )
        for seed, n in first:
            self.admit_request(seed, n)

    # ---------------------------------------------------------------- helpers
    def both(self, op: str, *args_s: Any, args_o: tuple[Any, ...] | None = None) -> Any:
        """Call ``op`` on both pools; both must succeed with equal block IDs or both fail."""
        err_s = err_o = None
        res_s = res_o = None
        try:
            res_s = getattr(self.stock, op)(*args_s)
        except (ValueError, AssertionError) as e:
            err_s = e
        try:
            res_o = getattr(self.ours, op)(*(args_s if args_o is None else args_o))
        except ValueError as e:
            err_o = e
        assert (err_s is None) == (err_o is None), (op, err_s, err_o)
        return res_s, res_o, err_s is not None

    def pick(self, data: st.DataObject) -> Held:
        return self.held[data.draw(st.integers(0, len(self.held) - 1))]

    # ------------------------------------------------------------------ rules
    def admit_request(self, seed: int, num_blocks: int) -> None:
        """Look up the longest cached prefix, touch it, allocate the rest."""
        req = make_request(seed, num_blocks * self.scale, HASH_BLOCK_SIZE)
        hashes = req.block_hashes
        if self.scale > 1:
            # Lookups are at block granularity: vLLM joins the hashes of a block's pieces
            # (get_cached_prefix takes vLLM's lazy view as it is).
            hashes = resolve_block_hashes(hashes, HASH_BLOCK_SIZE, self.block_size)
        hits_s: list[Any] = []
        hits_o: list[Any] = []
        if self.caching:
            for h in list(hashes)[:num_blocks]:
                got_s = self.stock.get_cached_block(h, [0])
                got_o = self.ours.get_cached_block(h, [0])
                assert ids(got_s) == ids(got_o)
                if got_s is None:
                    break
                hits_s.append(got_s[0])
                hits_o.append(got_o[0])
            # The batched lookup and count vLLM's managers use on our pool.
            prefix = self.ours.get_cached_prefix(hashes, [0], num_blocks)
            assert [ids(found) for found in prefix] == [ids(hits_s)]
            assert prefix[0] == hits_o  # the very same handles
            assert self.ours.count_evictable(hits_o) == stock_evictable(hits_s)
            self.stock.touch(hits_s)
            self.ours.touch(hits_o)
        need = num_blocks - len(hits_s)
        new_s, new_o, failed = self.both("get_new_blocks", need)
        if failed:
            # Admission failed: release the prefix hits again.
            self.stock.free_blocks(reversed(hits_s))
            self.ours.free_blocks(reversed(hits_o))
            return
        assert ids(new_s) == ids(new_o)
        self.held.append(Held(req, hits_s + new_s, hits_o + new_o, len(hits_s)))

    @rule(seed=st.integers(0, 4), num_blocks=st.integers(1, 8))
    @stepping
    def admit(self, seed: int, num_blocks: int) -> None:
        self.admit_request(seed, num_blocks)

    # vLLM's managers cache blocks only with prefix caching on.
    @precondition(lambda self: self.caching and any(h.num_cached < len(h.stock) for h in self.held))
    @rule(data=st.data())
    @stepping
    def cache_full(self, data: st.DataObject) -> None:
        """Cache more of a request's blocks (a manager caches as blocks fill up)."""
        h = data.draw(st.sampled_from([h for h in self.held if h.num_cached < len(h.stock)]))
        upto = data.draw(st.integers(h.num_cached + 1, len(h.stock)))
        mask = None
        if upto > h.num_cached and data.draw(st.booleans()):
            mask = data.draw(
                st.lists(st.booleans(), min_size=upto - h.num_cached, max_size=upto - h.num_cached)
            )
        args = (h.request, h.stock, h.num_cached, upto, self.block_size, 0, mask)
        self.stock.cache_full_blocks(*args)
        self.ours.cache_full_blocks(h.request, h.ours, h.num_cached, upto, self.block_size, 0, mask)
        h.num_cached = max(h.num_cached, upto)

    # Partial entries exist where a block holds several hash blocks.
    @precondition(lambda self: self.held and self.caching and self.scale > 1)
    @rule(data=st.data(), replace=st.booleans())
    @stepping
    def cache_partial(self, data: st.DataObject, replace: bool) -> None:
        h = self.pick(data)
        # Every request has scale hashes per block: any block, any interior boundary.
        j = data.draw(st.integers(0, len(h.stock) - 1))
        pieces = data.draw(st.integers(1, self.scale - 1))
        num_tokens = j * self.block_size + pieces * HASH_BLOCK_SIZE
        assert num_tokens // HASH_BLOCK_SIZE <= len(h.request.block_hashes)
        got_s = self.stock.cache_partial_block(
            h.request, h.stock[j], num_tokens, 0, self.block_size, replace
        )
        got_o = self.ours.cache_partial_block(
            h.request, h.ours[j], num_tokens, 0, self.block_size, replace
        )
        assert got_s == got_o

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    @stepping
    def free_request(self, data: st.DataObject) -> None:
        # Blocks are in use: both pools refuse a prefix-cache reset (and change nothing).
        assert not self.stock.reset_prefix_cache()
        assert not self.ours.reset_prefix_cache()
        h = self.pick(data)
        self.held.remove(h)
        # Managers free in reverse so the tail of a block chain is evicted first; they
        # also pass the null block along, which must be a no-op.
        self.stock.free_blocks(reversed([*h.stock, self.stock.null_block]))
        self.ours.free_blocks(reversed([*h.ours, self.ours.null_block]))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    @stepping
    def unpin_request(self, data: st.DataObject) -> None:
        h = self.pick(data)
        self.held.remove(h)
        self.stock.unpin_blocks(h.stock, lambda b: self.reuse_log["stock"].append(b.block_id))
        self.ours.unpin_blocks(h.ours, lambda b: self.reuse_log["ours"].append(b.block_id))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    @stepping
    def share_block(self, data: st.DataObject) -> None:
        """A manager taking an extra reference with ``block.ref_cnt += 1`` (CoW source)."""
        h = self.pick(data)
        j = data.draw(st.integers(0, len(h.stock) - 1))
        h.stock[j].ref_cnt += 1
        h.ours[j].ref_cnt += 1
        self.held.append(Held(h.request, [h.stock[j]], [h.ours[j]], 1))

    @precondition(lambda self: self.held and self.caching and self.stock.get_num_free_blocks())
    @rule(data=st.data())
    @stepping
    def move_hashes(self, data: st.DataObject) -> None:
        h = self.pick(data)
        j = data.draw(st.integers(0, len(h.stock) - 1))
        new_s, new_o, failed = self.both("get_new_blocks", 1)
        assert not failed
        self.stock.move_block_hashes(h.stock[j], new_s[0])
        self.ours.move_block_hashes(h.ours[j], new_o[0])
        self.held.append(Held(h.request, new_s, new_o, 1))

    @precondition(lambda self: self.ours.cache_entries())
    @rule(data=st.data())
    @stepping
    def evict(self, data: st.DataObject) -> None:
        """Evict by ID: at least one cached block, and any other IDs (held, free, null)."""
        n = self.stock.num_gpu_blocks
        cached = sorted({i for _, ids in self.ours.cache_entries() for i in ids})
        chosen = {data.draw(st.sampled_from(cached))}
        chosen |= data.draw(st.sets(st.integers(0, n - 1), max_size=3))
        self.stock.evict_blocks(chosen)
        self.ours.evict_blocks(chosen)

    @precondition(lambda self: not self.held and self.ours.cache_entries())
    @rule()
    @stepping
    def reset(self) -> None:
        """Nothing is held: both reset (refusals are checked in ``free_request``)."""
        assert self.stock.reset_prefix_cache()
        assert self.ours.reset_prefix_cache()

    # ------------------------------------------------------------- invariants
    def same_answers(self) -> None:
        """Read-only answers, on every block and every request's hash chain: one-block
        lookups and whole-prefix lookups (``get_cached_prefix``) for any groups,
        ``count_evictable`` and ``is_block_writable`` (held, free, cached, null blocks)."""
        blocks_s, blocks_o = list(self.stock.blocks), list(self.ours.blocks)
        assert self.ours.count_evictable(blocks_o) == stock_evictable(blocks_s)
        assert self.ours.count_evictable(blocks_o[::-3]) == stock_evictable(blocks_s[::-3])
        writable = [self.stock.is_block_writable(b) for b in blocks_s]
        assert [self.ours.is_block_writable(b) for b in blocks_o] == writable
        if not self.caching:
            return
        for seed in range(5):
            hashes = make_request(seed, 8 * self.scale, HASH_BLOCK_SIZE).block_hashes
            if self.scale > 1:
                hashes = resolve_block_hashes(hashes, HASH_BLOCK_SIZE, self.block_size)
            for groups in ([0], [0, 0], [1], [0, 1]):
                assert ids(self.stock.get_cached_block(hashes[seed], groups)) == ids(
                    self.ours.get_cached_block(hashes[seed], groups)
                )
                max_blocks = 8 - seed
                prefix = self.ours.get_cached_prefix(hashes, groups, max_blocks)
                assert [ids(found) for found in prefix] == stock_prefix(
                    self.stock, hashes, groups, max_blocks
                )

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "stock"):
            return
        snapshot = rust_snapshot(self.ours)
        assert snapshot == stock_snapshot(self.stock)
        self.same_answers()
        events = self.ours.take_events()
        assert normalize_events(events) == normalize_events(self.stock.take_events())
        if self.ours.enable_kv_cache_events:
            replay(self.replayed, events)
            holders = {external_key(key): len(ids) for key, ids in snapshot["cache"].items()}
            assert +self.replayed == Counter(holders), "events do not rebuild the cache"
        assert self.reuse_log["ours"] == self.reuse_log["stock"]
        if self.collectors is not None:
            calls_s, calls_o = self.collectors[0].take(), self.collectors[1].take()
            assert calls_o == calls_s, (calls_s, calls_o)
        self.ours.check_invariants()
        self.account(
            (
                snapshot,
                [(ids(h.ours), h.num_cached) for h in self.held],
                len(self.reuse_log["ours"]),
            )
        )


PoolDifferential.TestCase.settings = settings(max_examples=budget(150), stateful_step_count=50)
test_pool_differential = PoolDifferential.TestCase


def test_free_order_after_long_cached_chain() -> None:
    """A freed cached chain goes to the back tail-first; uncached blocks go to the front."""
    stock = StockPool(10, True, HASH_BLOCK_SIZE)
    ours = RustPool(10, True, HASH_BLOCK_SIZE)
    req = make_request(1, 4, HASH_BLOCK_SIZE)
    for pool in (stock, ours):
        blocks = pool.get_new_blocks(6)
        pool.cache_full_blocks(req, blocks, 0, 4, HASH_BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
    assert ours.free_block_ids() == [
        b.block_id for b in stock.free_block_queue.get_all_free_blocks()
    ]


@pytest.mark.parametrize("events", [False, True])
def test_events_match_for_a_request_lifecycle(events: bool) -> None:
    stock = StockPool(8, True, HASH_BLOCK_SIZE, enable_kv_cache_events=events)
    ours = RustPool(8, True, HASH_BLOCK_SIZE, enable_kv_cache_events=events)
    req = make_request(2, 3, HASH_BLOCK_SIZE)
    for pool in (stock, ours):
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(req, blocks, 0, 2, HASH_BLOCK_SIZE, 0)
        pool.cache_full_blocks(req, blocks, 2, 3, HASH_BLOCK_SIZE, 0)
        pool.emit_cached_block_events(req, 2, HASH_BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
        pool.get_new_blocks(7)  # evicts all three cached blocks
    assert normalize_events(ours.take_events()) == normalize_events(stock.take_events())
    assert ours.take_events() == []
