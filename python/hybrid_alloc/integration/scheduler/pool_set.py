"""`PoolSet`: one Rust `BlockPool` per KV-cache group (or per set of groups sharing one).

vLLM 0.32 gives every group of a hybrid model the same pool, so every page must have the
same size (Mamba pages are padded, attention blocks are inflated) and Mamba state, which
is fixed per request, competes with attention KV, which grows with the sequence. A
`PoolSet` gives each pool its own block IDs (0 is its null block), its own free queue and
its own prefix cache. Block IDs are scoped to their pool, so every operation that takes
bare IDs also names the group they belong to; no ID is ever applied to another pool.

The object also stands in for vLLM's single pool where `KVCacheManager` and the scheduler
hold one (``kv_cache_manager.block_pool``): the methods they call are here with a
per-pool meaning, documented on each.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, KVCacheEvent

from hybrid_alloc._native import NativeElasticPools
from hybrid_alloc.integration.kv_cache_config import ElasticLayout, PoolLayout, pool_of_each_group
from hybrid_alloc.integration.scheduler.block_pool import BlockPool

logger = logging.getLogger("hybrid_alloc")


class PoolSet:
    """The pools of one KV-cache coordinator, one per `PoolLayout`.

    Every group appears in exactly one layout. The *primary* pool is the first pool that
    grows with the sequence (the first pool if none grows): it is the pool whose free
    count stands for "the" free count where vLLM compares one number (see
    :meth:`get_num_free_blocks`).
    """

    def __init__(
        self,
        layouts: Sequence[PoolLayout],
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: Any = None,
        medium: str = MEDIUM_GPU,
        num_hash_lookahead_tokens: int = 0,
        elastic: ElasticLayout | None = None,
    ) -> None:
        owner = pool_of_each_group(layouts)
        # With an elastic layout each pool spans every page of one shared budget (its
        # layout's num_blocks is not used) and memory is lent to the pool that needs it.
        self.elastic: NativeElasticPools | None = None
        if elastic is not None:
            if len(elastic.page_bytes) != len(layouts):
                raise ValueError(
                    f"per-group pools: {len(elastic.page_bytes)} page sizes for "
                    f"{len(layouts)} pools"
                )
            self.elastic = NativeElasticPools(
                elastic.slab_bytes,
                elastic.num_slabs,
                list(elastic.page_bytes),
                label="elastic",
                kept_per_live=list(elastic.kept_per_live) or None,
            )
        num_groups = len(owner)
        self.layouts: tuple[PoolLayout, ...] = tuple(layouts)
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        # vLLM 0.33's pools take the lookahead; 0.32's never see a non-zero one.
        lookahead = (
            {"num_hash_lookahead_tokens": num_hash_lookahead_tokens}
            if num_hash_lookahead_tokens
            else {}
        )
        sizes = [
            layout.num_blocks if self.elastic is None else self.elastic.num_pages(idx)
            for idx, layout in enumerate(layouts)
        ]
        self.pools: tuple[BlockPool, ...] = tuple(
            BlockPool(
                sizes[idx],
                enable_caching,
                hash_block_size,
                enable_kv_cache_events,
                metrics_collector,
                medium=medium,
                **lookahead,
                label=layout.label or f"pool{idx}[groups {','.join(map(str, layout.group_ids))}]",
            )
            for idx, layout in enumerate(layouts)
        )
        # One event list shared by every pool: events keep their order across pools, as
        # they would in one pool (each pool appends to whatever list it holds).
        self._events: list[KVCacheEvent] = []
        for pool in self.pools:
            pool.kv_event_queue = self._events
        if self.elastic is not None:
            for idx, pool in enumerate(self.pools):
                self.elastic.attach(idx, pool)
        self._pool_of_group: tuple[int, ...] = tuple(owner[g] for g in range(num_groups))
        growing = [i for i, layout in enumerate(layouts) if layout.grows]
        self.primary_index: int = growing[0] if growing else 0

    # ---------------------------------------------------------------- structure
    def __len__(self) -> int:
        return len(self.pools)

    def __iter__(self) -> Iterator[BlockPool]:
        return iter(self.pools)

    @property
    def num_groups(self) -> int:
        return len(self._pool_of_group)

    @property
    def primary(self) -> BlockPool:
        return self.pools[self.primary_index]

    def pool_index_of_group(self, group_id: int) -> int:
        return self._pool_of_group[group_id]

    def pool_for_group(self, group_id: int) -> BlockPool:
        """The pool that group ``group_id`` allocates from."""
        return self.pools[self._pool_of_group[group_id]]

    def index_of(self, pool: object) -> int:
        """Index of ``pool`` (by identity); ValueError for a pool not in this set."""
        for idx, own in enumerate(self.pools):
            if own is pool:
                return idx
        raise ValueError(f"PoolSet: {pool!r} is not one of its pools")

    # --------------------------------------------------------------- accounting
    @property
    def num_gpu_blocks(self) -> int:
        """Blocks of the primary pool (vLLM's single ``num_gpu_blocks``)."""
        return self.primary.num_gpu_blocks

    def get_num_free_blocks(self, pool_index: int | None = None) -> int:
        """Free blocks of one pool; without an index, of the primary pool.

        vLLM's `KVCacheManager` compares one required count with this one number; the
        per-group coordinator makes its required count refer to the primary pool and
        refuses, before that comparison, any allocation another pool cannot hold.
        """
        idx = self.primary_index if pool_index is None else pool_index
        if self.elastic is not None:
            # What this pool could have now: its free blocks and the pages of any slab no
            # block pins that it does not own yet (shared by every pool: the
            # coordinator's plan decides, this bounds it), counted in one core call.
            return self.elastic.num_free_for(idx)
        return self.pools[idx].get_num_free_blocks()

    def free_counts(self) -> tuple[int, ...]:
        return tuple(pool.get_num_free_blocks() for pool in self.pools)

    def usages(self) -> tuple[float, ...]:
        return tuple(pool.get_usage() for pool in self.pools)

    def get_usage(self) -> float:
        """The fullest pool's usage: a full pool stops admission whichever pool it is.
        Elastic pools: the share of the budget's bytes in use."""
        if self.elastic is not None:
            # Every group's live bytes over the lendable ones (vLLM reads it every step).
            return self.elastic.usage
        return max(self.usages())

    def plan(self, hits: Sequence[Sequence[Any]], news: Sequence[tuple[int, int]]) -> bool:
        """Elastic pools: whether a step fits (``hits[i]``: pool i's prefix-hit blocks,
        taken first; ``news``: (pool index, new blocks) in allocation order)."""
        if self.elastic is None:
            raise RuntimeError("PoolSet.plan: the pools are not elastic")
        return self.elastic.plan(list(hits), list(news)) is None

    # ------------------------------------------------------------ block traffic
    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Return blocks of any pool (the scheduler's deferred frees mix groups): each
        block goes back to the pool it came from (``block.pool``), in the given order."""
        # The Rust pool routes blocks of other pools through `block.pool`, keeping the
        # order within each pool.
        self.primary.free_blocks(ordered_blocks)

    def evict_blocks(self, block_ids: Mapping[int, Iterable[int]]) -> None:
        """Evict cached blocks, given as ``{group_id: block IDs of that group's pool}``.

        A bare set of IDs (vLLM's `KVCacheManager.evict_blocks` signature) is refused:
        IDs are scoped to a pool, so without a group they name no block. All IDs are
        checked before any block is evicted.
        """
        if not isinstance(block_ids, Mapping):
            raise TypeError(
                "PoolSet.evict_blocks: block IDs are scoped to a pool; pass "
                "{group_id: ids}, not a bare collection of IDs"
            )
        per_pool: dict[int, list[int]] = {}
        for gid, ids in block_ids.items():
            if not 0 <= gid < self.num_groups:
                raise ValueError(f"PoolSet.evict_blocks: no group {gid}")
            idx = self._pool_of_group[gid]
            pool = self.pools[idx]
            checked = per_pool.setdefault(idx, [])
            for bid in ids:
                if not isinstance(bid, int) or not 0 <= bid < pool.num_gpu_blocks:
                    raise ValueError(
                        f"PoolSet.evict_blocks: {bid!r} is not a block of group {gid}'s "
                        f"pool ({pool.label}, {pool.num_gpu_blocks} blocks)"
                    )
                checked.append(bid)
        for idx, ids in per_pool.items():
            if ids:
                self.pools[idx].evict_blocks(ids)

    def evict_group_blocks(self, group_id: int, block_ids: Iterable[int]) -> None:
        """Evict blocks of one group's pool by ID."""
        self.evict_blocks({group_id: list(block_ids)})

    # ----------------------------------------------------------- prefix caching
    def reset_prefix_cache(self) -> bool:
        """Drop every pool's cached hashes, or none: refused (False) while any pool has a
        block in use, so the pools never disagree about what is cached."""
        in_use = [
            (pool.label, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks() - held)
            for pool in self.pools
            for held in [pool._held_by_budget()]
        ]
        busy = [(label, n) for label, n in in_use if n]
        if busy:
            logger.warning(
                "Failed to reset prefix cache because some blocks are not freed yet: %s",
                ", ".join(f"{label}: {n}" for label, n in busy),
            )
            return False
        mark = len(self._events)
        ok = all([pool.reset_prefix_cache() for pool in self.pools])
        if self.enable_kv_cache_events:
            # One reset of the whole cache: one AllBlocksCleared, not one per pool.
            tail = [ev for ev in self._events[mark:] if not isinstance(ev, AllBlocksCleared)]
            del self._events[mark:]
            self._events.extend(tail)
            self._events.append(AllBlocksCleared())
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        """Every pool's events since the last call, in the order they happened. Each
        event carries the group it was emitted for (``group_idx``)."""
        if not self.enable_kv_cache_events:
            return []
        events = self._events[:]
        # Clear in place: every pool holds this same list.
        self._events.clear()
        return events

    def check_invariants(self) -> None:
        for pool in self.pools:
            pool.check_invariants()
        if self.elastic is not None:
            self.elastic.check_invariants()

    def __repr__(self) -> str:
        body = ", ".join(
            f"{p.label}: {p.get_num_free_blocks()}/{p.num_gpu_blocks - 1} free" for p in self.pools
        )
        return f"hybrid_alloc.PoolSet({body})"
