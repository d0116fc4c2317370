"""Differential fuzzing: the same operation sequence on vLLM's stock BlockPool and ours must
give the same results after every step (block IDs, free order, ref counts, hashes, cache
contents, lookups, events)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

from hybrid_alloc.integration.block_pool import BlockPool as RustPool
from tests.helpers import (
    FakeRequest,
    budget,
    count_step,
    make_request,
    normalize_events,
    rust_snapshot,
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


class PoolDifferential(RuleBasedStateMachine):
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
    )
    def build(self, num_blocks: int, caching: bool, events: bool, block_size: int) -> None:
        self.block_size = block_size
        self.scale = block_size // HASH_BLOCK_SIZE
        self.caching = caching
        self.stock = StockPool(num_blocks, caching, HASH_BLOCK_SIZE, enable_kv_cache_events=events)
        self.ours = RustPool(num_blocks, caching, HASH_BLOCK_SIZE, enable_kv_cache_events=events)

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
    @rule(seed=st.integers(0, 4), num_blocks=st.integers(1, 8))
    def admit(self, seed: int, num_blocks: int) -> None:
        """Look up the longest cached prefix, touch it, allocate the rest."""
        req = make_request(seed, num_blocks * self.scale, HASH_BLOCK_SIZE)
        hashes = req.block_hashes
        if self.scale > 1:
            # Lookups are at block granularity: vLLM joins the hashes of a block's pieces.
            from vllm.v1.core.kv_cache_utils import resolve_block_hashes

            hashes = list(resolve_block_hashes(hashes, HASH_BLOCK_SIZE, self.block_size))
        hits_s: list[Any] = []
        hits_o: list[Any] = []
        if self.caching:
            for h in hashes[:num_blocks]:
                got_s = self.stock.get_cached_block(h, [0])
                got_o = self.ours.get_cached_block(h, [0])
                assert ids(got_s) == ids(got_o)
                if got_s is None:
                    break
                hits_s.append(got_s[0])
                hits_o.append(got_o[0])
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

    # vLLM's managers cache blocks only with prefix caching on.
    @precondition(lambda self: self.held and self.caching)
    @rule(data=st.data())
    def cache_full(self, data: st.DataObject) -> None:
        h = self.pick(data)
        upto = data.draw(st.integers(h.num_cached, len(h.stock)))
        mask = None
        if upto > h.num_cached and data.draw(st.booleans()):
            mask = data.draw(
                st.lists(st.booleans(), min_size=upto - h.num_cached, max_size=upto - h.num_cached)
            )
        args = (h.request, h.stock, h.num_cached, upto, self.block_size, 0, mask)
        self.stock.cache_full_blocks(*args)
        self.ours.cache_full_blocks(h.request, h.ours, h.num_cached, upto, self.block_size, 0, mask)
        h.num_cached = max(h.num_cached, upto)

    @precondition(lambda self: self.held and self.caching)
    @rule(data=st.data(), replace=st.booleans())
    def cache_partial(self, data: st.DataObject, replace: bool) -> None:
        if self.scale == 1:
            return
        h = self.pick(data)
        j = data.draw(st.integers(0, len(h.stock) - 1))
        pieces = data.draw(st.integers(1, self.scale - 1))
        num_tokens = j * self.block_size + pieces * HASH_BLOCK_SIZE
        if num_tokens // HASH_BLOCK_SIZE > len(h.request.block_hashes):
            return
        got_s = self.stock.cache_partial_block(
            h.request, h.stock[j], num_tokens, 0, self.block_size, replace
        )
        got_o = self.ours.cache_partial_block(
            h.request, h.ours[j], num_tokens, 0, self.block_size, replace
        )
        assert got_s == got_o

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        h = self.pick(data)
        self.held.remove(h)
        # Managers free in reverse so the tail of a block chain is evicted first; they
        # also pass the null block along, which must be a no-op.
        self.stock.free_blocks(reversed([*h.stock, self.stock.null_block]))
        self.ours.free_blocks(reversed([*h.ours, self.ours.null_block]))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unpin_request(self, data: st.DataObject) -> None:
        h = self.pick(data)
        self.held.remove(h)
        self.stock.unpin_blocks(h.stock, lambda b: self.reuse_log["stock"].append(b.block_id))
        self.ours.unpin_blocks(h.ours, lambda b: self.reuse_log["ours"].append(b.block_id))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share_block(self, data: st.DataObject) -> None:
        """A manager taking an extra reference with ``block.ref_cnt += 1`` (CoW source)."""
        h = self.pick(data)
        j = data.draw(st.integers(0, len(h.stock) - 1))
        h.stock[j].ref_cnt += 1
        h.ours[j].ref_cnt += 1
        self.held.append(Held(h.request, [h.stock[j]], [h.ours[j]], 1))

    @precondition(lambda self: self.held and self.caching)
    @rule(data=st.data())
    def move_hashes(self, data: st.DataObject) -> None:
        h = self.pick(data)
        j = data.draw(st.integers(0, len(h.stock) - 1))
        new_s, new_o, failed = self.both("get_new_blocks", 1)
        if failed:
            return
        self.stock.move_block_hashes(h.stock[j], new_s[0])
        self.ours.move_block_hashes(h.ours[j], new_o[0])
        self.held.append(Held(h.request, new_s, new_o, 1))

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        n = self.stock.num_gpu_blocks
        chosen = data.draw(st.sets(st.integers(0, n - 1), max_size=4))
        self.stock.evict_blocks(chosen)
        self.ours.evict_blocks(chosen)

    @rule()
    def reset(self) -> None:
        assert self.stock.reset_prefix_cache() == self.ours.reset_prefix_cache()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def writable(self, data: st.DataObject) -> None:
        h = self.pick(data)
        j = data.draw(st.integers(0, len(h.stock) - 1))
        assert self.stock.is_block_writable(h.stock[j]) == self.ours.is_block_writable(h.ours[j])

    @rule(data=st.data())
    def lookup_any(self, data: st.DataObject) -> None:
        seed = data.draw(st.integers(0, 4))
        i = data.draw(st.integers(0, 7))
        h = make_request(seed, i + 1, HASH_BLOCK_SIZE).block_hashes[i]
        groups = data.draw(st.sampled_from([[0], [0, 0], [1], [0, 1]]))
        assert ids(self.stock.get_cached_block(h, groups)) == ids(
            self.ours.get_cached_block(h, groups)
        )

    # ------------------------------------------------------------- invariants
    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "stock"):
            return
        count_step("pool")
        snapshot = rust_snapshot(self.ours)
        assert snapshot == stock_snapshot(self.stock)
        events = self.ours.take_events()
        assert normalize_events(events) == normalize_events(self.stock.take_events())
        if self.ours.enable_kv_cache_events:
            replay(self.replayed, events)
            holders = {external_key(key): len(ids) for key, ids in snapshot["cache"].items()}
            assert +self.replayed == Counter(holders), "events do not rebuild the cache"
        assert self.reuse_log["ours"] == self.reuse_log["stock"]
        self.ours.check_invariants()


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
