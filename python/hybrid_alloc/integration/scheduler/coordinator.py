"""KV-cache coordinators whose managers each draw from their own pool.

vLLM 0.32's coordinator builds one pool and hands it to every single-type manager. The
classes here let vLLM build its coordinator as usual, then give each manager the pool of
its group from a :class:`~hybrid_alloc.integration.scheduler.pool_set.PoolSet`
(before any block is handed out), and put the `PoolSet` where vLLM keeps "the" pool
(``coordinator.block_pool``, which `KVCacheManager` and the scheduler use).

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
builds a per-group coordinator only for a :class:`PerGroupKVCacheConfig`; vLLM's layout
with prefix caching gets vLLM's hybrid coordinator with the running requests' table
(:class:`SharedPoolHybridKVCacheCoordinator`: quiet decode steps, `quiet_step`), anything
else vLLM's coordinator unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core import kv_cache_manager as _kv_cache_manager
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
)
from vllm.v1.core.kv_cache_coordinator import (
    get_kv_cache_coordinator as _stock_get_kv_cache_coordinator,
)
from vllm.v1.core.single_type_kv_cache_manager import (
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.request import RequestStatus

from hybrid_alloc._native import (
    STEP_CACHE_BLOCKS,
    STEP_REMOVE_SKIPPED,
    NativeBlockPool,
    NativeRunningRequests,
    block_ids,
)
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from hybrid_alloc.integration.scheduler.pool_set import PoolSet
from hybrid_alloc.integration.scheduler.quiet_step import (
    block_tables,
    blocks_held,
    cache_facts,
    has_partial_hit,
    partial_hit_maps,
    quiet_step_blocks,
    running_requests_table,
)

logger = logging.getLogger("hybrid_alloc")

# Whether coordinators built from now on answer quiet decode steps without vLLM's walk
# (`quiet_step`); off only to compare the two paths.
QUIET_STEPS = True

# How a manager takes a step's new blocks: (manager, request ID, token slots, the main
# model's tokens) -> the new blocks; a manager's ``allocate_new_blocks`` signature.
NewBlocksTaker = Callable[[Any, str, int, int], list[Any]]


def uncounted_loaded_blocks(
    manager: Any,
    request_id: str,
    hits: Sequence[Any],
    total_computed_tokens: int,
    num_local_computed_tokens: int,
) -> int:
    """Blocks a step takes that the manager's ``get_num_blocks_to_allocate`` leaves out.

    vLLM's Mamba manager in 'align' mode caps its count at the blocks its
    ``allocate_new_blocks`` takes (one state block, the speculative ones, a checkpoint),
    but before that the coordinator's ``allocate_new_computed_blocks`` has the same
    manager allocate blocks for the externally loaded tokens (the base class's
    ``allocate_external_computed_blocks``), which the count does not include: with a KV
    load, the step pops more state blocks than it was admitted for. This is that
    phase's count, as the base class computes it after ``add_local_computed_blocks``
    (nulls for skipped blocks, then the hits past them)."""
    if not isinstance(manager, MambaManager) or manager.mamba_cache_mode != "align":
        return 0
    num_external = total_computed_tokens - num_local_computed_tokens
    if num_external <= 0 or request_id in manager.num_cached_block:
        # No load, or a running request (the coordinator's phase is a no-op for it).
        return 0
    skipped = manager.get_num_skipped_tokens(total_computed_tokens)
    if skipped > 0:
        num_external = min(total_computed_tokens - skipped, num_external)
    if num_external <= 0:
        return 0
    held = max(skipped // manager.block_size, len(hits))
    return max(0, -(-total_computed_tokens // manager.block_size) - held)


def _grows_as_vllm_base(manager: Any) -> bool:
    """Whether ``manager`` allocates new blocks with vLLM's base
    ``SingleTypeKVCacheManager.allocate_new_blocks`` (full attention on vLLM 0.32 and
    0.33), keeping the state that method reads and extends."""
    base = SingleTypeKVCacheManager.allocate_new_blocks
    state = ("req_to_blocks", "_partial_hit_reqs", "_record_new_block_ids", "new_block_ids")
    return type(manager).allocate_new_blocks is base and all(hasattr(manager, n) for n in state)


def _hands_out_ids(pool: Any) -> bool:
    """Whether ``pool`` is this package's pool with its own ``get_new_blocks``, so that
    ``get_new_blocks_with_ids`` takes the same blocks (a subclass that overrides the
    former, as tests' recording pools do, is left to it)."""
    return (
        isinstance(pool, NativeBlockPool)
        and type(pool).get_new_blocks is NativeBlockPool.get_new_blocks
    )


class RunningTableMixin:
    """The running requests' table in Rust (`quiet_step`) on a coordinator: quiet decode
    steps (`_quiet_check`, None where no step can be quiet) and the decode room. Told
    after every call that changes a request's blocks (`_sync_running` after vLLM's
    ``allocate_slots``, `remove_skipped_blocks`, `free`) and after evictions from the
    prefix cache (`_cache_evicted`); kept only where one of the two is used. Mixed in
    before vLLM's class."""

    single_type_managers: tuple[Any, ...]
    _decode_room_tokens = 0
    """Each running request's decode room (elastic pools set it; 0: none kept)."""
    _per_group_pools = False
    """Whether this is a per-group coordinator (`PerGroupPoolsMixin`): read on the hot
    path instead of an isinstance test; only these take a decode step's full-attention
    blocks themselves (`PerGroupPoolsMixin._grow_decode_step`)."""

    def _init_running_table(self, room_pools: dict[int, int], room_tokens: int) -> None:
        running = running_requests_table(self, room_pools, room_tokens, QUIET_STEPS)
        self._running: NativeRunningRequests | None = (
            running if running.quiet_steps or room_tokens else None
        )
        self._quiet_check: NativeRunningRequests | None = running if running.quiet_steps else None
        managers = self.single_type_managers
        self.quiet_step_blocks = quiet_step_blocks(len(managers))
        self._block_tables = block_tables(managers)
        self._partial_hit_maps = partial_hit_maps(managers)
        self._windowed = self._quiet_check is not None and any(
            not isinstance(m, FullAttentionManager) for m in managers
        )
        # Whether the table learns what caching managers hold of a request at each sync.
        self._caching_table = self._quiet_check is not None and any(
            getattr(m, "enable_caching", False) for m in managers
        )

    def _sync_running(self, request: Any, length: int, cached_tokens: int = 0) -> None:
        """Tell the running-requests table the blocks ``request`` holds now, after
        vLLM's ``allocate_slots`` for it, and recount its room at ``length`` tokens
        (caching managers: what they hold of it, the call having cached at least
        ``cached_tokens`` tokens, read once the prompt is computed). A request's blocks
        change only in its own ``allocate_slots`` (where this runs), in
        `remove_skipped_blocks` and when it is freed (`free`), so the table answers as
        walking the managers would, at one request's cost."""
        running = self._running
        if running is not None:
            managers = self.single_type_managers
            request_id = request.request_id
            facts = None
            # Mid-prompt (or refused, or caching delayed) the request's next step is not
            # a decode step: without facts the table leaves it to vLLM's path.
            if self._caching_table and cached_tokens >= request.num_prompt_tokens:
                facts = cache_facts(managers, request_id, cached_tokens, request.num_prompt_tokens)
            running.sync(
                request_id,
                blocks_held(self._block_tables, request_id),
                self._quiet_check is not None
                and has_partial_hit(self._partial_hit_maps, request_id),
                length,
                facts,
            )

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, *args: Any, **kwargs: Any
    ) -> None:
        """vLLM's; the table learns which window blocks are freed (quiet steps)."""
        super().remove_skipped_blocks(  # type: ignore[misc]
            request_id, processed_computed_tokens, *args, **kwargs
        )
        running = self._running
        # The table learns nothing of a request it does not hold yet (a prompt's first
        # allocation): its first sync reads its blocks.
        if self._windowed and running is not None and request_id in running:
            running.note_removed(
                request_id,
                max(0, processed_computed_tokens),
                blocks_held(self._block_tables, request_id),
            )

    def _phases_step(self, kv_manager: Any, request: Any, num_new: int, phases: int) -> Any:
        """vLLM's ``allocate_slots`` for a running request's decode step that, by the
        running-requests table, takes no block and opens no checkpoint, so that its
        ``get_num_blocks_to_allocate`` and ``allocate_new_blocks`` find nothing to do
        (and its admission check passes): only the phases named in ``phases`` run, in
        vLLM's order and with vLLM's arguments: ``remove_skipped_blocks`` (a window's
        blocks, or Mamba 'align' states the running state has passed, are freed), then
        ``cache_blocks`` (a block the step fills is cached). The table is then told as
        after vLLM's whole path (the same room length and cached tokens). The answer is
        vLLM's for a step that allocates nothing, the empty blocks."""
        max_len = kv_manager.max_model_len
        computed = min(request.num_computed_tokens, max_len)
        if phases & STEP_REMOVE_SKIPPED:
            self.remove_skipped_blocks(
                request.request_id,
                max(0, computed - request.num_in_flight_tokens),
                num_prompt_tokens=request.num_prompt_tokens,
            )
        caches = _tokens_cached(request, num_new, max_len) if self._caching_table else 0
        if phases & STEP_CACHE_BLOCKS:
            self.cache_blocks(request, caches)  # type: ignore[attr-defined]
        length = _room_length(request, num_new) if self._decode_room_tokens else 0
        self._sync_running(request, length, caches)
        return self.quiet_step_blocks

    def _cache_evicted(self) -> None:
        """Cached blocks were evicted (vLLM's ``evict_blocks``): the table's caching
        facts may be stale (a running request's partial entry, which vLLM's
        ``cache_blocks`` registers again at its next step), so every running request's
        next step takes vLLM's path."""
        if self._caching_table and self._running is not None:
            self._running.cache_evicted()

    def _forget_running(self, request_id: str) -> None:
        if self._running is not None:
            self._running.forget(request_id)

    def free(self, request_id: str) -> None:
        """vLLM's; the request leaves the running-requests table with its blocks."""
        self._forget_running(request_id)
        super().free(request_id)  # type: ignore[misc]

    def pop_blocks_for_free(self, request_id: str) -> Any:
        """vLLM's (a free the scheduler defers while a step may still write the blocks);
        the request leaves the running-requests table with its blocks."""
        self._forget_running(request_id)
        return super().pop_blocks_for_free(request_id)  # type: ignore[misc]


class SharedPoolHybridKVCacheCoordinator(RunningTableMixin, HybridKVCacheCoordinator):
    """vLLM's own hybrid coordinator over vLLM's layout (one shared pool: the engine keeps
    it in 'align' mode where vLLM raises the block size), with the running requests'
    table: a decode step that changes nothing in any manager (no block taken, freed,
    cached or checkpointed; `quiet_step`) returns vLLM's empty answer without walking
    them. Everything else is vLLM's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_running_table({}, 0)


class PerGroupPoolsMixin(RunningTableMixin):
    """What the per-group coordinators add to vLLM's; mixed in before vLLM's class."""

    _per_group_pools = True

    pool_set: PoolSet
    single_type_managers: tuple[Any, ...]
    retention_interval: int | None
    block_pool: Any
    """Where vLLM keeps its coordinator's one pool: here the `PoolSet`, which answers
    the calls vLLM makes on "the" pool (typed as vLLM's ``BlockPool`` there)."""

    def _adopt_pool_set(
        self, pool_set: PoolSet, max_model_len: int, decode_room_tokens: int = 0
    ) -> None:
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
        # Per manager, fixed for the coordinator's life and read on every allocation:
        # whether it counts encoder tokens (cross-attention), and whether its count
        # leaves out loaded blocks (`uncounted_loaded_blocks`).
        self._cross_attention = [
            isinstance(m, CrossAttentionManager) for m in self.single_type_managers
        ]
        self._align_state = [
            isinstance(m, MambaManager) and m.mamba_cache_mode == "align"
            for m in self.single_type_managers
        ]
        # Where vLLM keeps its one pool; KVCacheManager reads it after we return.
        self.block_pool = pool_set
        self._group_pools = [pool_set.pool_index_of_group(g) for g in range(pool_set.num_groups)]
        self._primary_groups = [
            g for g, idx in enumerate(self._group_pools) if idx == pool_set.primary_index
        ]
        self._no_hits: tuple[tuple[()], ...] = tuple(() for _ in range(len(pool_set)))
        self._plain_growers = [_grows_as_vllm_base(m) for m in self.single_type_managers]
        # How each manager takes a step's new blocks: a plain grower whose pool hands out
        # the new blocks' IDs with them takes them that way (`_take_new_blocks`); a pool
        # class that overrides ``get_new_blocks`` keeps it, through the manager's method.
        self._growers: list[NewBlocksTaker] = [
            _take_new_blocks
            if plain and _hands_out_ids(m.block_pool)
            else _manager_allocate_new_blocks
            for plain, m in zip(self._plain_growers, self.single_type_managers, strict=True)
        ]
        self._max_model_len = max_model_len
        # Elastic pools (see `_elastic_blocks_to_allocate`). The request `allocate_slots`
        # is serving (set by `allocate_slots_honouring_loads`; None outside it), and the
        # vLLM `reserved_blocks` of an async load it is admitting.
        self._allocating: str | None = None
        self._load_reserved_blocks = 0
        # Decode room (`_decode_room_asks`): whether `allocate_slots` is admitting a
        # waiting or preempted request beside scheduled ones, the tokens of room each
        # running request keeps meanwhile, and the groups whose blocks grow with the
        # sequence (full attention: manager, block size, pool), whose pages it is kept in.
        self._admitting = False
        self._decode_room_tokens = decode_room_tokens if pool_set.elastic is not None else 0
        room_pools = {
            gid: pool_set.pool_index_of_group(gid)
            for gid, m in enumerate(self.single_type_managers)
            if isinstance(m, FullAttentionManager)
        }
        self._room_groups = [
            (self.single_type_managers[gid], self.single_type_managers[gid].block_size, pool)
            for gid, pool in room_pools.items()
        ]
        self._init_running_table(room_pools, self._decode_room_tokens)
        # Reservation queries since the last `allocate_slots`: vLLM's scheduler asks what
        # each in-flight prefill still needs just before it admits an async load; per
        # request, (pool, pages) in the managers' order and the count answered.
        self._reservation_queries: dict[str, tuple[list[tuple[int, int]], int]] = {}
        # The step `allocate_slots` admitted and has not allocated yet: (request, hit
        # blocks per pool, (pool, pages) per manager); reserved at the step's first
        # allocation (`_reserve_step`).
        self._admitted_step: tuple[str, Sequence[Sequence[Any]], list[tuple[int, int]]] | None = (
            None
        )
        # vLLM's `allocate_slots` asks for a waiting request's count twice, first for its
        # full sequence (the admission gate, cap on) and then for the step, and for a
        # prompt taken whole the two questions are the same. Where every manager answers
        # alike with the cap on or off and changes nothing as it answers
        # (`_counts_alike_with_cap`), the gate's plan is kept (`_gate_answer`: the call's
        # arguments, the pools' state, its hits, pages and answer) and the step reuses it
        # if nothing differs: the plan and the managers' counts run once.
        self._gate_reusable = all(map(_counts_alike_with_cap, self.single_type_managers))
        self._gate_answer: tuple[Any, ...] | None = None

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
            if self._cross_attention[gid]:
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
        obtainable count (watermark included); else a count it cannot have.

        Three callers, told apart by where they come from:

        - ``allocate_slots``' own check before it allocates (``apply_admission_cap``
          off): an admitted step is remembered and reserved when it first allocates
          (`_reserve_step`), so it gets its pages whatever order vLLM allocates the
          groups in (`versions.VllmRelease.step_phases`);
        - ``allocate_slots``' full-sequence gate (cap on, inside ``allocate_slots``): the
          plan only;
        - vLLM's scheduler asking what an in-flight prefill still needs, to reserve it
          for async loads (cap on, outside ``allocate_slots``): answered in vLLM's units,
          primary-pool pages of the same bytes (`_reservation_query`).
        """
        pool_set = self.pool_set
        question = (
            request_id,
            num_tokens,
            num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            prefill_end,
        )
        gate = self._gate_answer
        if gate is not None:
            self._gate_answer = None
            if (
                not apply_admission_cap
                and gate[0] == question
                and gate[1] is new_computed_blocks
                and gate[2] == self._pools_state()
            ):
                # The step asks what the admission gate just asked, and nothing was freed
                # or taken since (vLLM's `remove_skipped_blocks` runs in between): the
                # gate's plan fitted, and it is the step's.
                self._admitted_step = (request_id, gate[3], gate[4])
                return gate[5]  # type: ignore[no-any-return]
        # Per pool, the hits the plan takes: lists only once a group has hits (a fresh
        # prompt has none).
        hit_lists: list[list[Any]] | None = None
        news: list[tuple[int, int]] = []
        primary_need = 0
        takes = False  # whether any group takes a hit or a new block
        group_pools = self._group_pools
        primary = pool_set.primary_index
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
            idx = group_pools[gid]
            evictable = 0
            if group_hits:
                takes = True
                # vLLM counts free hit blocks among the blocks to allocate; the plan takes
                # the hits themselves, so only the rest are new (all of it where the
                # manager may skip some hits, which over-counts and never under-counts).
                if not manager.get_num_skipped_tokens(total_computed_tokens):
                    evictable = pool_set.pools[idx].count_evictable(group_hits)
                if hit_lists is None:
                    hit_lists = [[] for _ in self._no_hits]
                hit_lists[idx].extend(group_hits)
            if self._align_state[gid]:
                n += uncounted_loaded_blocks(
                    manager,
                    request_id,
                    group_hits,
                    total_computed_tokens,
                    num_local_computed_tokens,
                )
            new = max(0, n - evictable)
            news.append((idx, new))
            takes = takes or new > 0
            if idx == primary:
                primary_need += n
        hits = self._no_hits if hit_lists is None else hit_lists
        if apply_admission_cap and self._allocating is None and _allocate_slots_is_ours():
            return self._reservation_query(request_id, news)
        loads_reserved = self._allocating == request_id and self._load_reserved_blocks
        if not loads_reserved and not takes:
            # A step that takes no page (most decode steps): it fits whatever the budget
            # holds, and there is nothing to reserve; the plan would answer the same.
            return primary_need
        extra = self._load_reservation_asks() if loads_reserved else []
        if self._admitting:
            extra += self._decode_room_asks(request_id)
        if not pool_set.plan(hits, news + extra):
            return pool_set.get_num_free_blocks() + 1
        if not apply_admission_cap:
            self._admitted_step = (request_id, hits, news)
        elif self._gate_reusable and self._allocating == request_id:
            self._gate_answer = (
                question,
                new_computed_blocks,
                self._pools_state(),
                hits,
                news,
                primary_need,
            )
        return primary_need

    def _pools_state(self) -> tuple[list[int], int, int]:
        """Elastic pools: each pool's free pages, the budget's unowned slabs and its
        reserved steps. A block freed or taken changes one of the first two (a free adds
        a page to its pool's queue unless its slab goes back to the budget, which adds an
        unowned slab), and a plan counts the reservations too."""
        e: Any = self.pool_set.elastic
        return e.state()  # type: ignore[no-any-return]

    def _decode_room_asks(self, request_id: str) -> list[tuple[int, int]]:
        """(pool, pages) the running requests lack for ``decode_room_tokens`` more tokens
        each, past their length. An admission plans them too (they are not reserved), so
        a request is admitted beside running ones only if each of them keeps the room
        that vLLM's shared pool, whose attention blocks are twice that long, leaves in a
        request's last block on average. Without it 16-token pages admit into the last
        free pages, and the running requests' next decode steps preempt one, which then
        recomputes its whole prompt. The admitted request's own room is not counted."""
        if not self._decode_room_tokens or self._running is None:
            return []
        return self._running.room_asks(request_id)

    def _grow_decode_step(
        self, kv_manager: Any, request: Any, num_new: int, lookahead: int, needs: Sequence[int]
    ) -> Any:
        """vLLM's ``allocate_slots`` for a running request's decode step that, by the
        running-requests table, only takes ``needs[g]`` blocks in groups without a window
        (full attention; with prefix caching also Mamba 'align', whose running state
        moves into one new block): the same admission (each pool's need against its free
        blocks; elastic pools: the plan and the primary pool's count, as vLLM compares
        it), the same managers' ``allocate_new_blocks``, the same result, and the same
        reservation of an elastic step. What vLLM's call would also walk finds nothing
        to do here: no block leaves a window (``remove_skipped_blocks``), no block fills
        (``cache_blocks``), no checkpoint opens, and the other groups take no block.
        Refused: None, nothing changed (vLLM's answer; the scheduler preempts)."""
        request_id = request.request_id
        max_len = kv_manager.max_model_len
        main = min(request.num_computed_tokens, max_len) + num_new
        slots = min(main + lookahead, max_len)
        pool_set = self.pool_set
        e = pool_set.elastic
        if e is not None and self._grows_in_place(request_id, slots, needs):
            return self._grow_in_place(kv_manager, request, num_new, needs, e)
        blocks: tuple[list[Any], ...] | None = None
        try:
            if e is not None:
                # The same two refusals as `_grow_in_place`, then vLLM's managers take the
                # pages.
                news = list(zip(self._group_pools, needs, strict=True))
                if (
                    sum(needs[g] for g in self._primary_groups) > pool_set.get_num_free_blocks()
                    or e.reserve(self._no_hits, news) is not None
                ):
                    return None
            else:
                need = [0] * len(pool_set)
                for idx, n in zip(self._group_pools, needs, strict=True):
                    need[idx] += n
                if any(n > free for n, free in zip(need, pool_set.free_counts(), strict=True)):
                    return None
            managers = self.single_type_managers
            growers = self._growers
            blocks = tuple(
                growers[g](managers[g], request_id, slots, main) if n else []
                for g, n in enumerate(needs)
            )
        finally:
            self._reservation_queries.clear()
            self._end_step()
            if blocks is not None:
                room = _room_length(request, num_new) if self._decode_room_tokens else 0
                table = self._running
                if self._caching_table:
                    # What caching managers keep of the request changed (Mamba 'align':
                    # the state of two steps ago): the table reads it back, as after
                    # vLLM's call.
                    self._sync_running(request, room, _tokens_cached(request, num_new, max_len))
                elif table is not None and tuple(map(len, blocks)) == tuple(needs):
                    # The managers took what the table planned: it adds them itself.
                    table.grown(request_id, needs, room)
                else:
                    self._sync_running(request, room)
        return kv_manager.create_kv_cache_blocks(blocks)

    def _grow_in_place(
        self, kv_manager: Any, request: Any, num_new: int, needs: Sequence[int], e: Any
    ) -> Any:
        """`_grow_decode_step` on elastic pools where `_grows_in_place` holds: vLLM's two
        refusals (the primary pool's count as vLLM compares it, then the plan, which
        reserves the step before it lends anything) and each group's pages, in one call
        to the pools (`NativeElasticPools.grow`, which sums the primary pool's need
        itself); the managers' tables are extended as their ``allocate_new_blocks`` would,
        and the running-requests table adds exactly ``needs`` (what the pools took)."""
        request_id = request.request_id
        news = list(zip(self._group_pools, needs, strict=True))
        try:
            grown = e.grow(news, self.pool_set.primary_index)
        finally:
            self._reservation_queries.clear()
            e.end_step()
            self._admitted_step = None
        if grown is None:
            return None
        managers = self.single_type_managers
        for g, new in enumerate(grown):
            if new:
                manager = managers[g]
                _append_new_blocks(manager, manager.req_to_blocks[request_id], new, None)
        table = self._running
        if table is not None:
            room = _room_length(request, num_new) if self._decode_room_tokens else 0
            table.grown(request_id, needs, room)
        return kv_manager.create_kv_cache_blocks(tuple(grown))

    def _grows_in_place(self, request_id: str, slots: int, needs: Sequence[int]) -> bool:
        """Whether every manager that takes blocks in this decode step is one whose
        ``allocate_new_blocks`` is vLLM's base method (`_plain_growers`), with no partial
        hit to copy for the request, and would take exactly ``needs[g]`` blocks for
        ``slots`` token slots: then the step's pages can be taken in one call to the
        pools and appended where that method appends them."""
        plain = self._plain_growers
        managers = self.single_type_managers
        for g, n in enumerate(needs):
            if not n:
                continue
            if not plain[g]:
                return False
            manager = managers[g]
            if request_id in manager._partial_hit_reqs:
                return False
            held = len(manager.req_to_blocks[request_id])
            if -(-slots // manager.block_size) - held != n:
                return False
        return True

    def _reservation_query(self, request_id: str, news: list[tuple[int, int]]) -> int:
        """What an in-flight prefill still needs, in vLLM's units: primary-pool pages of
        the same bytes (rounded up). vLLM sums these into one ``reserved_blocks`` for an
        async load; the pages per pool are kept for that load's plan."""
        pool_set = self.pool_set
        e = pool_set.elastic
        assert e is not None
        need_bytes = sum(n * e.page_bytes(idx) for idx, n in news)
        answer = -(-need_bytes // e.page_bytes(pool_set.primary_index))
        self._reservation_queries[request_id] = (news, answer)
        return answer

    def _load_reservation_asks(self) -> list[tuple[int, int]]:
        """The pages vLLM's ``reserved_blocks`` stands for, per pool: what each in-flight
        prefill still needs (the queries it was summed from), then the rest of it (the
        spec-decode step's blocks of the attention groups) on the primary pool."""
        asks: list[tuple[int, int]] = []
        answered = 0
        for news, answer in self._reservation_queries.values():
            asks.extend(news)
            answered += answer
        rest = self._load_reserved_blocks - answered
        if rest > 0:
            asks.append((self.pool_set.primary_index, rest))
        return asks

    def _reserve_step(self, request_id: str) -> None:
        """At the step's first allocation: lend every pool the memory the admitted step
        needs, all at once (`NativeElasticPools.reserve`), so that no group's allocation
        can take what another group of the step was counted on."""
        step, self._admitted_step = self._admitted_step, None
        e = self.pool_set.elastic
        if e is None or step is None or step[0] != request_id:
            return
        _, hits, news = step
        # The plan that admitted the step ran on this same state a moment ago, so the
        # reservation fits; if it did not, the step's pops would still try the policy.
        short = e.reserve(hits, news)
        if short is not None:
            logger.warning(
                "hybrid_alloc: request %s: the admitted step's reservation fell short "
                "(pool %d, %d blocks); allocating without it",
                request_id,
                *short,
            )

    def _end_step(self) -> None:
        e = self.pool_set.elastic
        if e is not None:
            e.end_step()
        self._admitted_step = None
        self._gate_answer = None

    def allocate_new_computed_blocks(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        """vLLM's (first phase of a step's allocation); reserves the admitted step first."""
        self._reserve_step(request_id)
        super().allocate_new_computed_blocks(request_id, *args, **kwargs)  # type: ignore[misc]

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[Any], ...]:
        """vLLM's (last phase of a step's allocation: each manager in order, encoder tokens
        for cross-attention); the step's reservation ends with it. A manager that grows
        with vLLM's base method takes its blocks through `_take_new_blocks`."""
        self._reserve_step(request_id)
        try:
            blocks: list[list[Any]] = []
            for manager, grow, cross in zip(
                self.single_type_managers, self._growers, self._cross_attention, strict=True
            ):
                tokens = num_encoder_tokens if cross else num_tokens
                blocks.append(grow(manager, request_id, tokens, num_tokens_main_model))
            return tuple(blocks)
        finally:
            self._end_step()

    def reset_prefix_cache(self) -> bool:
        """All pools or none (vLLM resets pool by pool and may leave them disagreeing)."""
        return self.pool_set.reset_prefix_cache()


def _manager_allocate_new_blocks(
    manager: Any, request_id: str, num_tokens: int, num_tokens_main_model: int
) -> list[Any]:
    """The manager's own ``allocate_new_blocks`` (`_take_new_blocks`'s signature)."""
    return manager.allocate_new_blocks(  # type: ignore[no-any-return]
        request_id, num_tokens, num_tokens_main_model
    )


def _take_new_blocks(
    manager: Any, request_id: str, num_tokens: int, num_tokens_main_model: int
) -> list[Any]:
    """vLLM's base ``allocate_new_blocks`` for ``manager`` (`_grows_as_vllm_base`;
    a pending partial hit goes to it), with the IDs it records for zeroing handed
    out by the pool with the blocks (`get_new_blocks_with_ids`, the ints the handles
    hold). vLLM's generator over the new handles costs about 28 ns a block; a
    prompt's pages on elastic pools made it a sixth of ``allocate_slots``
    (Falcon-H1-7B 40 GiB, a 9,000-token prompt, 564 pages: 80 -> 68 us)."""
    if request_id in manager._partial_hit_reqs:
        return manager.allocate_new_blocks(  # type: ignore[no-any-return]
            request_id, num_tokens, num_tokens_main_model
        )
    req_blocks = manager.req_to_blocks[request_id]
    num_new = -(-num_tokens // manager.block_size) - len(req_blocks)
    if num_new <= 0:
        return []
    new, ids = manager.block_pool.get_new_blocks_with_ids(num_new)
    _append_new_blocks(manager, req_blocks, new, ids)
    return new  # type: ignore[no-any-return]


def _append_new_blocks(
    manager: Any, req_blocks: list[Any], new: list[Any], ids: list[int] | None
) -> None:
    """What vLLM's base ``allocate_new_blocks`` does with the blocks it took: extend the
    request's table (``req_blocks``, the manager's ``req_to_blocks`` entry), and record
    their IDs for zeroing where the manager records them (``ids``, or read from the
    handles when the pool did not hand them out)."""
    req_blocks.extend(new)
    if manager._record_new_block_ids:
        manager.new_block_ids.extend(block_ids(new) if ids is None else ids)


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
        self._adopt_pool_set(pool_set, max_model_len, kv_cache_config.decode_room_tokens)
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
        self._adopt_pool_set(pool_set, max_model_len, kv_cache_config.decode_room_tokens)


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
    # What every coordinator class takes by keyword, vLLM's and ours alike.
    common: dict[str, Any] = dict(
        dcp_world_size=dcp_world_size,
        pcp_world_size=pcp_world_size,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        metrics_collector=metrics_collector,
        num_prefill_lookahead=num_prefill_lookahead,
        **extra,
    )
    head = (kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle)
    several_groups = len(kv_cache_config.kv_cache_groups) > 1
    if not isinstance(kv_cache_config, PerGroupKVCacheConfig) or not several_groups:
        if enable_caching and several_groups:
            # vLLM's layout, where vLLM's factory builds its hybrid coordinator: the
            # same class with the running requests' table, built with the same arguments.
            return SharedPoolHybridKVCacheCoordinator(
                *head,
                enable_caching,
                enable_kv_cache_events,
                allow_partial_hash_hits=allow_partial_hash_hits,
                **common,
            )
        return _stock_get_kv_cache_coordinator(
            *head,
            enable_caching,
            enable_kv_cache_events,
            allow_partial_hash_hits=allow_partial_hash_hits,
            **common,
        )
    if not enable_caching:
        return PerGroupNoPrefixCacheCoordinator(*head, enable_kv_cache_events, **common)
    return PerGroupHybridCoordinator(*head, enable_caching, enable_kv_cache_events, **common)


_stock_allocate_slots = _kv_cache_manager.KVCacheManager.allocate_slots
# Positions of ``delay_cache_blocks`` and ``reserved_blocks`` among `allocate_slots`'
# arguments after the request.
_DELAY_CACHE_BLOCKS_ARG = 5
_RESERVED_BLOCKS_ARG = 8
_RUNNING = RequestStatus.RUNNING


def _allocate_slots_is_ours() -> bool:
    return _kv_cache_manager.KVCacheManager.allocate_slots is allocate_slots_honouring_loads


def allocate_slots_honouring_loads(
    self: Any,
    request: Any,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Any = None,
    num_lookahead_tokens: int = 0,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """vLLM's `KVCacheManager.allocate_slots`. Where the coordinator keeps the running
    requests' table (per-group pools; vLLM's layout with prefix caching) a running
    request's step that changes nothing (`quiet_step`) returns vLLM's answer for it at
    once, and the table is told after vLLM's path; under
    elastic pools it tells the coordinator which request it serves, and an async KV load's
    ``reserved_blocks`` (what in-flight prefills still need, one count) becomes the
    coordinator's plan of those same needs pool by pool: the load is admitted exactly when
    the budget holds the load and every reservation, and vLLM's one-count comparison then
    sees no reservation (it would compare pages of several pools, and slabs, as one
    number).

    The first five parameters are vLLM's own (the same in 0.32 and 0.33), named so that
    the scheduler's call for a running request, made at every step for every running
    request, binds without packing its arguments (measured: 120 of ~400 ns a call)."""
    coordinator = self.coordinator
    if not isinstance(coordinator, RunningTableMixin):
        return _stock_allocate_slots(
            self,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            *args,
            **kwargs,
        )
    quiet = coordinator._quiet_check
    if (
        quiet is not None
        and not args
        and not kwargs
        and not num_new_computed_tokens
        and new_computed_blocks is None
        and num_new_tokens > 0
        and request.status is _RUNNING
    ):
        # The scheduler's call for a running request (no hits, loads or encoder tokens);
        # the table computes vLLM's `num_tokens_need_slot` and the processed prefix
        # `remove_skipped_blocks` is given from the request's counts, as
        # `allocate_slots` does, and the length its room is counted from.
        plan = quiet.decode_step(
            request.request_id,
            request.num_computed_tokens,
            num_new_tokens,
            num_lookahead_tokens,
            request.num_in_flight_tokens,
            request.num_prompt_tokens,
            request.num_tokens,
            self.max_model_len,
        )
        if plan is not None:
            # `()`: quiet; an int: the phases of vLLM's call that have work in a step that
            # takes no block; else the blocks each group takes.
            if not plan or isinstance(plan, int):
                if coordinator._per_group_pools:
                    if TYPE_CHECKING:  # the flag is the test, at no isinstance cost
                        assert isinstance(coordinator, PerGroupPoolsMixin)
                    if coordinator._reservation_queries:
                        # As after any `allocate_slots` (below): the queries were for
                        # this step.
                        coordinator._reservation_queries.clear()
                if plan:
                    return coordinator._phases_step(self, request, num_new_tokens, plan)
                return coordinator.quiet_step_blocks
            if coordinator._per_group_pools:
                if TYPE_CHECKING:
                    assert isinstance(coordinator, PerGroupPoolsMixin)
                return coordinator._grow_decode_step(
                    self, request, num_new_tokens, num_lookahead_tokens, plan
                )
    # vLLM's arguments after the request, by position.
    positional = (
        num_new_tokens,
        num_new_computed_tokens,
        new_computed_blocks,
        num_lookahead_tokens,
        *args,
    )
    per_group = coordinator._per_group_pools
    num_new = int(num_new_tokens)
    # The tokens this call caches at least, if it succeeds (caching tables learn from
    # it whether the prompt's partial entry is registered): `allocate_slots` caches
    # `min(computed + hits + new, num_tokens)`, none if its caching is delayed.
    delayed = bool(
        kwargs.get(
            "delay_cache_blocks",
            positional[_DELAY_CACHE_BLOCKS_ARG]
            if len(positional) > _DELAY_CACHE_BLOCKS_ARG
            else False,
        )
    )
    caches = 0
    if coordinator._caching_table and not delayed:
        caches = _tokens_cached(request, num_new, self.max_model_len)
    if not per_group:
        result = None
        try:
            result = _stock_allocate_slots(self, request, *positional, **kwargs)
            return result
        finally:
            coordinator._sync_running(request, 0, caches if result is not None else 0)
    if TYPE_CHECKING:
        assert isinstance(coordinator, PerGroupPoolsMixin)
    if coordinator.pool_set.elastic is None:
        if coordinator._running is None:
            return _stock_allocate_slots(self, request, *positional, **kwargs)
        result = None
        try:
            result = _stock_allocate_slots(self, request, *positional, **kwargs)
            return result
        finally:
            coordinator._sync_running(request, 0, caches if result is not None else 0)
    args_list = list(positional)
    loading = delayed
    reserved = 0
    if "reserved_blocks" in kwargs:
        reserved = int(kwargs["reserved_blocks"])
        kwargs["reserved_blocks"] = 0
    elif len(args_list) > _RESERVED_BLOCKS_ARG:
        reserved = int(args_list[_RESERVED_BLOCKS_ARG])
        args_list[_RESERVED_BLOCKS_ARG] = 0
    coordinator._allocating = request.request_id
    coordinator._load_reserved_blocks = reserved if loading else 0
    length = 0
    if coordinator._decode_room_tokens:
        length = _room_length(request, num_new)
        # Like vLLM's watermark: only for a waiting or preempted request, and only beside
        # requests already scheduled this step.
        coordinator._admitting = bool(
            kwargs.get("has_scheduled_reqs", True)
        ) and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    result = None
    try:
        result = _stock_allocate_slots(self, request, *args_list, **kwargs)
        return result
    finally:
        coordinator._sync_running(request, length, caches if result is not None else 0)
        coordinator._allocating = None
        coordinator._admitting = False
        coordinator._load_reserved_blocks = 0
        coordinator._reservation_queries.clear()
        coordinator._end_step()


def _counts_alike_with_cap(manager: Any) -> bool:
    """Whether ``manager``'s ``get_num_blocks_to_allocate`` gives the same count with
    vLLM's ``apply_admission_cap`` on or off, from the same arguments and state, and
    changes nothing as it counts: vLLM's base rule (full and cross-attention) or Mamba
    outside 'align' mode (its speculative blocks added, then the base rule), where the
    manager has no admission cap (sliding windows and chunked local attention have one,
    and 'align' Mamba records the step's checkpoint only with the cap off)."""
    if getattr(manager, "max_admission_blocks_per_request", None) is not None:
        return False
    method = type(manager).get_num_blocks_to_allocate
    if method is SingleTypeKVCacheManager.get_num_blocks_to_allocate:
        return True
    return method is MambaManager.get_num_blocks_to_allocate and manager.mamba_cache_mode != "align"


def _tokens_cached(request: Any, num_new: int, max_len: int) -> int:
    """The tokens vLLM's ``allocate_slots`` caches for a request whose step adds
    ``num_new`` tokens and no prefix hits: its computed tokens (at most ``max_len``) plus
    the new ones, at most its length. A running request's decode step (the table's
    growth and phase steps) caches exactly this; at admission, hits add to it, so it is
    what the call caches at least."""
    return min(min(request.num_computed_tokens, max_len) + num_new, request.num_tokens)


def _room_length(request: Any, num_new: int) -> int:
    """The request's length after this step, or its prompt's if longer (a prefill in
    chunks needs all of it; a resumed request replays its output as prompt): what its
    decode room is counted from (`PerGroupPoolsMixin._decode_room_asks`). The quiet path
    counts the same in the running-requests table (`DecodeStep::room_length` in
    rust/src/running.rs); `test_quiet_steps` holds the two to the same totals."""
    return max(
        request.num_prompt_tokens,
        request.num_tokens - 1,
        request.num_computed_tokens + num_new,
    )


_stock_evict_blocks = _kv_cache_manager.KVCacheManager.evict_blocks


def evict_blocks_telling_the_table(self: Any, block_ids: Any) -> None:
    """vLLM's `KVCacheManager.evict_blocks`; then, where the coordinator keeps the
    running requests' table, that table hears of it (`RunningTableMixin._cache_evicted`),
    also when the pool refused part of the call."""
    try:
        _stock_evict_blocks(self, block_ids)
    finally:
        coordinator = self.coordinator
        if isinstance(coordinator, RunningTableMixin):
            coordinator._cache_evicted()


def install() -> None:
    """Make vLLM's `KVCacheManager` build its coordinator through
    :func:`get_kv_cache_coordinator`, allocate through
    :func:`allocate_slots_honouring_loads` and evict through
    :func:`evict_blocks_telling_the_table` (idempotent)."""
    _kv_cache_manager.get_kv_cache_coordinator = get_kv_cache_coordinator  # type: ignore[assignment]
    _kv_cache_manager.KVCacheManager.allocate_slots = allocate_slots_honouring_loads  # type: ignore[method-assign]
    _kv_cache_manager.KVCacheManager.evict_blocks = evict_blocks_telling_the_table  # type: ignore[method-assign]


def uninstall() -> None:
    _kv_cache_manager.get_kv_cache_coordinator = _stock_get_kv_cache_coordinator  # type: ignore[assignment]
    _kv_cache_manager.KVCacheManager.allocate_slots = _stock_allocate_slots  # type: ignore[method-assign]
    _kv_cache_manager.KVCacheManager.evict_blocks = _stock_evict_blocks  # type: ignore[method-assign]


def is_installed() -> bool:
    return _kv_cache_manager.get_kv_cache_coordinator is get_kv_cache_coordinator
