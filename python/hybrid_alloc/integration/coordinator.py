"""KV-cache coordinators whose managers each draw from their own pool.

vLLM 0.32's coordinator builds one pool and hands it to every single-type manager. The
classes here let vLLM build its coordinator as usual, then give each manager the pool of
its group from a :class:`~hybrid_alloc.integration.pool_set.PoolSet` (before any block is handed
out), and put the `PoolSet` where vLLM keeps "the" pool (``coordinator.block_pool``,
which `KVCacheManager` and the scheduler use).

Admission. `KVCacheManager.allocate_slots` asks the coordinator for one number of blocks
and compares it with one free count, ``block_pool.get_num_free_blocks()`` (minus the
watermark and reserved blocks). Here that free count is the primary pool's (the first
pool that grows with the sequence), and `get_num_blocks_to_allocate` checks every other
pool against its own free count first: if any cannot hold its groups' share it returns
more blocks than the primary pool has, so vLLM's comparison refuses the request; else it
returns the primary pool's share, so vLLM's comparison (watermark and reservation
included) decides on the pool that grows. No vLLM code changes: the one number keeps its
meaning for the pool that matters to the watermark, and the others are exact checks.

Install with :func:`install` (idempotent): vLLM's `KVCacheManager` looks up
``get_kv_cache_coordinator`` in its module when it builds its coordinator; the wrapper
builds a per-group coordinator only for a :class:`PerGroupKVCacheConfig`, anything else
gets vLLM's coordinator unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from vllm.v1.core import kv_cache_manager as _kv_cache_manager
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
)
from vllm.v1.core.kv_cache_coordinator import (
    get_kv_cache_coordinator as _stock_get_kv_cache_coordinator,
)
from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager

from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from hybrid_alloc.integration.pool_set import PoolSet


class PerGroupPoolsMixin:
    """What the per-group coordinators add to vLLM's; mixed in before vLLM's class."""

    pool_set: PoolSet
    single_type_managers: tuple[Any, ...]
    retention_interval: int | None

    def _adopt_pool_set(self, pool_set: PoolSet, max_model_len: int) -> None:
        """Give every manager its group's pool. Runs right after vLLM's ``__init__``,
        before any block is allocated, so the pool vLLM built is never used."""
        if pool_set.num_groups != len(self.single_type_managers):
            raise ValueError(
                f"per-group pools: {pool_set.num_groups} groups in the pools, "
                f"{len(self.single_type_managers)} managers"
            )
        for gid, manager in enumerate(self.single_type_managers):
            pool = pool_set.pool_for_group(gid)
            manager.block_pool = pool
            # The managers keep the null block they pad block tables with.
            manager._null_block = pool.null_block
        self.pool_set = pool_set
        # Where vLLM keeps its one pool; KVCacheManager reads it after we return.
        self.block_pool = pool_set
        # Elastic pools: requests whose KV a connector loads asynchronously (admitted and
        # holding pages, not running yet), and the one being admitted right now (see
        # `allocate_slots_honouring_loads`); their sequences count up to max_model_len.
        self._async_loads: dict[str, Any] = {}
        self._load_admission: Any = None
        self._max_model_len = max_model_len

    def free(self, request_id: str) -> None:
        self._async_loads.pop(request_id, None)
        super().free(request_id)  # type: ignore[misc]

    def _no_hits(self) -> tuple[Sequence[Any], ...]:
        return tuple(() for _ in self.single_type_managers)

    def _load_reservations(
        self,
        request_id: str,
        own_news: list[tuple[int, int]],
        own_full: list[tuple[int, int]],
    ) -> list[tuple[int, int]]:
        """Pages an async load must leave room for, beyond its own load: the rest of its
        own sequence (``own_full`` minus ``own_news``, per manager) and what every other
        loading request still needs for its whole sequence."""
        extra = [
            (idx, max(0, full - now))
            for (idx, now), (_, full) in zip(own_news, own_full, strict=True)
        ]
        for rid, req in self._async_loads.items():
            if rid == request_id:
                continue
            full_tokens = min(req.num_tokens, self._max_model_len)
            for gid, _, _, n in self._manager_needs(
                rid,
                full_tokens,
                self._no_hits(),
                0,
                req.num_computed_tokens,
                req.num_computed_tokens,
                full_tokens,
                True,
                max(req.num_prompt_tokens, req.num_tokens - 1),
            ):
                extra.append((self.pool_set.pool_index_of_group(gid), n))
        return extra

    def _manager_needs(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool,
        prefill_end: int,
    ) -> Iterator[tuple[int, Any, Sequence[Any], int]]:
        """(group, manager, its prefix-hit blocks, blocks it needs) per manager, in order:
        the per-manager counts vLLM's coordinator sums."""
        if self.retention_interval != 0:
            prefill_end = 0
        for gid, manager in enumerate(self.single_type_managers):
            if isinstance(manager, CrossAttentionManager):
                n = manager.get_num_blocks_to_allocate(
                    request_id,
                    num_encoder_tokens,
                    [],
                    0,
                    0,
                    num_encoder_tokens,
                    apply_admission_cap=apply_admission_cap,
                )
                yield gid, manager, (), n
            else:
                hits = new_computed_blocks[gid]
                n = manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    hits,
                    total_computed_tokens,
                    num_local_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap=apply_admission_cap,
                    prefill_end=prefill_end,
                )
                yield gid, manager, hits, n

    def get_num_blocks_to_allocate_per_pool(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> list[int]:
        """Blocks the request needs from each pool (the same per-manager counts vLLM's
        coordinator sums in ``KVCacheCoordinator.get_num_blocks_to_allocate``, summed
        per pool instead)."""
        need = [0] * len(self.pool_set)
        for gid, _, _, n in self._manager_needs(
            request_id,
            num_tokens,
            new_computed_blocks,
            num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        ):
            need[self.pool_set.pool_index_of_group(gid)] += n
        return need

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """The primary pool's share if every other pool can hold its own share now;
        otherwise a count the primary pool can never have free (see the module doc)."""
        if self.pool_set.elastic is not None:
            return self._elastic_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                num_encoder_tokens,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
                prefill_end,
            )
        need = self.get_num_blocks_to_allocate_per_pool(
            request_id,
            num_tokens,
            new_computed_blocks,
            num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )
        primary = self.pool_set.primary_index
        for idx, free in enumerate(self.pool_set.free_counts()):
            if idx != primary and need[idx] > free:
                return self.pool_set.primary.num_gpu_blocks + 1
        return need[primary]

    def _elastic_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool,
        prefill_end: int,
    ) -> int:
        """Elastic pools: run the allocation policy for this request's step (its hits in
        every group, then each group's new blocks in the managers' order) on the shared
        budget. Fits: the primary pool's share, which vLLM compares with the primary's
        obtainable count (watermark and reservations included); else a count it cannot
        have."""
        pool_set = self.pool_set
        hits: list[list[Any]] = [[] for _ in range(len(pool_set))]
        news: list[tuple[int, int]] = []
        needs_raw: list[tuple[int, int]] = []
        primary_need = 0
        for gid, manager, group_hits, n in self._manager_needs(
            request_id,
            num_tokens,
            new_computed_blocks,
            num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        ):
            idx = pool_set.pool_index_of_group(gid)
            # vLLM counts free hit blocks among the blocks to allocate; the plan takes the
            # hits themselves, so only the rest are new (all of it where the manager may
            # skip some hits, which over-counts and never under-counts).
            skipped = manager.get_num_skipped_tokens(total_computed_tokens) if group_hits else 0
            evictable = pool_set.pools[idx].count_evictable(group_hits) if not skipped else 0
            hits[idx].extend(group_hits)
            news.append((idx, max(0, n - evictable)))
            needs_raw.append((idx, n))
            if idx == pool_set.primary_index:
                primary_need += n
        loading = self._load_admission
        if loading is not None and loading.request_id == request_id:
            # An async load holds its pages while nothing runs it, and a waiting request
            # is never preempted: admit it only if its whole sequence and every other
            # loading request's still fit the budget, or loads that each hold part of the
            # budget can wait on one another for ever. vLLM reserves the same with one
            # block count (`reserved_blocks`), which cannot see which pool's pages, nor
            # slab edges, under elastic pools.
            full_tokens = max(num_tokens, min(loading.num_tokens, self._max_model_len))
            own_full = [
                (pool_set.pool_index_of_group(gid), n)
                for gid, _, _, n in self._manager_needs(
                    request_id,
                    full_tokens,
                    new_computed_blocks,
                    num_encoder_tokens,
                    total_computed_tokens,
                    num_local_computed_tokens,
                    full_tokens,
                    True,
                    prefill_end,
                )
            ]
            news = news + self._load_reservations(request_id, needs_raw, own_full)
        if not pool_set.plan(hits, news):
            return pool_set.get_num_free_blocks() + 1
        return primary_need

    def reset_prefix_cache(self) -> bool:
        """All pools or none (vLLM resets pool by pool and may leave them disagreeing)."""
        return self.pool_set.reset_prefix_cache()


def _build_pool_set(
    kv_cache_config: PerGroupKVCacheConfig,
    enable_caching: bool,
    hash_block_size: int,
    enable_kv_cache_events: bool,
    metrics_collector: Any,
    extra: dict[str, Any],
) -> PoolSet:
    return PoolSet(
        kv_cache_config.pool_layouts,
        elastic=kv_cache_config.elastic,
        enable_caching=enable_caching,
        hash_block_size=hash_block_size,
        enable_kv_cache_events=enable_kv_cache_events,
        metrics_collector=metrics_collector,
        num_hash_lookahead_tokens=extra.get("num_hash_lookahead_tokens", 0),
    )


class PerGroupHybridCoordinator(PerGroupPoolsMixin, HybridKVCacheCoordinator):
    """vLLM's hybrid coordinator (prefix caching on) with one pool per group."""

    def __init__(
        self,
        kv_cache_config: PerGroupKVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        num_prefill_lookahead: int = 0,
        allow_partial_hash_hits: bool = True,
        **extra: Any,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            metrics_collector=metrics_collector,
            num_prefill_lookahead=num_prefill_lookahead,
            # Sub-block hits copy a Mamba block (copy-on-write); the worker applies such
            # copies by bare block ID to every layer, which pool-scoped IDs do not allow.
            allow_partial_hash_hits=False,
            **extra,
        )
        pool_set = _build_pool_set(
            kv_cache_config,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            metrics_collector,
            extra,
        )
        self._adopt_pool_set(pool_set, max_model_len)
        # vLLM batched the lookup of groups with equal specs because they shared a pool;
        # with their own pools each is looked up in its own (the check at
        # ``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` compares the
        # managers' pools).
        self.verify_and_split_kv_cache_groups()


class PerGroupNoPrefixCacheCoordinator(PerGroupPoolsMixin, KVCacheCoordinatorNoPrefixCache):
    """vLLM's coordinator without prefix caching, with one pool per group."""

    def __init__(
        self,
        kv_cache_config: PerGroupKVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        num_prefill_lookahead: int = 0,
        **extra: Any,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            metrics_collector=metrics_collector,
            num_prefill_lookahead=num_prefill_lookahead,
            **extra,
        )
        pool_set = _build_pool_set(
            kv_cache_config,
            False,
            hash_block_size,
            enable_kv_cache_events,
            metrics_collector,
            extra,
        )
        self._adopt_pool_set(pool_set, max_model_len)


def get_kv_cache_coordinator(
    kv_cache_config: Any,
    max_model_len: int,
    max_in_flight_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    scheduler_block_size: int,
    hash_block_size: int,
    metrics_collector: Any = None,
    num_prefill_lookahead: int = 0,
    allow_partial_hash_hits: bool = True,
    **extra: Any,
) -> KVCacheCoordinator:
    """vLLM's factory, except that a `PerGroupKVCacheConfig` with several groups gets a
    per-group coordinator. ``extra``: keyword arguments of the installed release that
    0.32 does not have (0.33: ``num_hash_lookahead_tokens``), passed on unchanged."""
    if (
        not isinstance(kv_cache_config, PerGroupKVCacheConfig)
        or len(kv_cache_config.kv_cache_groups) < 2
    ):
        return _stock_get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector=metrics_collector,
            num_prefill_lookahead=num_prefill_lookahead,
            allow_partial_hash_hits=allow_partial_hash_hits,
            **extra,
        )
    if not enable_caching:
        return PerGroupNoPrefixCacheCoordinator(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            metrics_collector=metrics_collector,
            num_prefill_lookahead=num_prefill_lookahead,
            **extra,
        )
    return PerGroupHybridCoordinator(
        kv_cache_config,
        max_model_len,
        max_in_flight_tokens,
        use_eagle,
        enable_caching,
        enable_kv_cache_events,
        dcp_world_size=dcp_world_size,
        pcp_world_size=pcp_world_size,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        metrics_collector=metrics_collector,
        num_prefill_lookahead=num_prefill_lookahead,
        **extra,
    )


_stock_allocate_slots = _kv_cache_manager.KVCacheManager.allocate_slots
# Position of ``delay_cache_blocks`` among `allocate_slots`' arguments after the request.
_DELAY_CACHE_BLOCKS_ARG = 5


def allocate_slots_honouring_loads(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's `KVCacheManager.allocate_slots`; under elastic pools it also tells the
    coordinator which request an async KV load admits (``delay_cache_blocks``) and keeps
    the coordinator's set of loading requests: added when a load is admitted, removed when
    the request gets slots to run or is freed."""
    coordinator = self.coordinator
    if not isinstance(coordinator, PerGroupPoolsMixin) or coordinator.pool_set.elastic is None:
        return _stock_allocate_slots(self, request, *args, **kwargs)
    loading = bool(
        kwargs.get(
            "delay_cache_blocks",
            args[_DELAY_CACHE_BLOCKS_ARG] if len(args) > _DELAY_CACHE_BLOCKS_ARG else False,
        )
    )
    if loading:
        coordinator._load_admission = request
    try:
        blocks = _stock_allocate_slots(self, request, *args, **kwargs)
    finally:
        coordinator._load_admission = None
    if blocks is not None:
        if loading:
            coordinator._async_loads[request.request_id] = request
        else:
            coordinator._async_loads.pop(request.request_id, None)
    return blocks


def install() -> None:
    """Make vLLM's `KVCacheManager` build its coordinator through
    :func:`get_kv_cache_coordinator`, and admit async KV loads through
    :func:`allocate_slots_honouring_loads` (idempotent)."""
    _kv_cache_manager.get_kv_cache_coordinator = get_kv_cache_coordinator  # type: ignore[assignment]
    _kv_cache_manager.KVCacheManager.allocate_slots = allocate_slots_honouring_loads  # type: ignore[method-assign]


def uninstall() -> None:
    _kv_cache_manager.get_kv_cache_coordinator = _stock_get_kv_cache_coordinator  # type: ignore[assignment]
    _kv_cache_manager.KVCacheManager.allocate_slots = _stock_allocate_slots  # type: ignore[method-assign]


def is_installed() -> bool:
    return _kv_cache_manager.get_kv_cache_coordinator is get_kv_cache_coordinator
