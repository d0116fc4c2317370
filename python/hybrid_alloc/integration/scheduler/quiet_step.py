"""The coordinator's table of running requests, in Rust: decode steps and decode room.

vLLM's scheduler calls ``KVCacheManager.allocate_slots(request, n, num_lookahead_tokens=k)``
for every running request on every step. Most of those calls change nothing: no group
needs a page, no block leaves a window, nothing gets cached; with per-group pools' natural
pages most of the rest take one page in each full-attention group. vLLM still walks its
coordinator and every single-type manager to find that out (about 14 us a request on a
4-group model, 24 us with prefix caching, measured in ``benches/bench_manager.py``).

:func:`running_requests_table` builds the coordinator's
:class:`~hybrid_alloc._native.NativeRunningRequests`: per KV-cache group, the rules of
its manager, as vLLM's methods apply them; per request, the blocks each group holds and
how far its window's blocks are freed (told after every call that can change them). One
call per request and step (``decode_step``) answers what this ``allocate_slots`` would
do: nothing (quiet; the request's decode room is recounted in the same call), only take
blocks in full-attention groups, and with prefix caching in Mamba 'align' groups
(`PerGroupPoolsMixin._grow_decode_step` then allocates just those), take no block but
free some in ``remove_skipped_blocks`` (a window moves, or Mamba 'align' states the
running state has passed are freed) or cache one the step fills in ``cache_blocks``
(`RunningTableMixin._phases_step` then runs just those of vLLM's calls), or anything
else (vLLM's whole ``allocate_slots``). It also keeps the decode room's totals (elastic
pools, ``PerGroupPoolsMixin._decode_room_asks``). Rules modelled:

* full attention (``FullAttentionManager`` itself, not its subclasses): never frees
  while a request runs; needs a page when the slots outgrow its blocks;
* sliding window (``SlidingWindowManager``): also frees the blocks that leave the window
  (vLLM skips ``processed - (window - 1 + extra_retained_tokens)`` tokens);
* Mamba/GDN outside 'align' mode (one state block, plus the speculative ones): the same
  two rules, skipping ``processed - 1`` tokens;
* with prefix caching on, full attention that caches its blocks and Mamba in 'align'
  mode: after each of vLLM's calls the table reads what the managers keep of the request
  (:func:`cache_facts`), and a decode step is quiet only where no block fills (by the
  coordinator's ``get_num_cacheable_tokens``, checked against it at build time), no
  state block starts or is freed, no checkpoint opens and no partial entry is
  registered. A step that only frees blocks or caches a filled one runs those phases; one
  that only takes blocks (a full-attention block, an 'align' state moving into its next
  block) grows; one that does both, opens a checkpoint or registers a partial entry takes
  vLLM's path, and the table reads the managers back after every step but a quiet one.

Any other manager kind (a caching sliding window, chunked local, cross-attention, sinks,
...) makes every call take vLLM's path, and the table keeps only the room. A quiet call
returns what vLLM returns for it, an empty ``KVCacheBlocks`` (`QuietStepBlocks`, whose
``get_block_ids`` answers without walking the groups), and nothing else happens in vLLM
either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from hybrid_alloc._native import NativeRunningRequests

GroupRule = tuple[int, int, int | None, int | None]
"""(block size, extra slots, skip offset or None, room pool or None) per group."""

CachingRule = tuple[str, int, bool]
"""Per group: ("" caches nothing, "full" full attention, "align" Mamba 'align' mode),
speculative blocks ('align'), whether the manager keeps EAGLE's block."""

CacheFacts = tuple[list[int], list[int], list[int | None], list[int], bool, int, int]
"""What `NativeRunningRequests.sync` learns of a request from caching managers."""

_SKIP_PROBES = (0, 1, 2, 3, 15, 16, 17, 100, 4097, 1 << 20)


class QuietStepBlocks(KVCacheBlocks):
    """What a quiet step returns: vLLM's empty `KVCacheBlocks` (an empty tuple per group).
    The scheduler asks every running request's result for ``get_block_ids(allow_none=True)``
    on every step; vLLM's method walks the groups to find them all empty, which costs
    about as much as the quiet step itself. Here they are empty by construction, so the
    answer is None at once; every other call is vLLM's."""

    def get_block_ids(  # type: ignore[override]
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        if not allow_none:
            return super().get_block_ids(False, group_ids=group_ids)
        if group_ids is None:
            return None
        return super().get_block_ids(True, group_ids=group_ids)


def quiet_step_blocks(num_groups: int) -> QuietStepBlocks:
    return QuietStepBlocks(tuple(() for _ in range(num_groups)))


def _skip_offset(manager: Any, offset: int) -> int | None:
    """``offset`` if the manager skips ``max(0, processed - offset)`` tokens (checked on
    its own ``get_num_skipped_tokens``, so a vLLM that changed the rule gets no quiet
    steps rather than wrong ones), else None."""
    probes = (*_SKIP_PROBES, offset - 1, offset, offset + 1)
    for processed in probes:
        if processed >= 0 and max(0, manager.get_num_skipped_tokens(processed)) != max(
            0, processed - offset
        ):
            return None
    return offset


def _caching_rule(manager: Any) -> CachingRule | None:
    """The caching rule of a manager that caches blocks, None where it is not modelled."""
    if not manager.kv_cache_spec.prefix_cacheable:
        return None
    eagle = bool(getattr(manager, "use_eagle", False))
    if type(manager) is FullAttentionManager:
        return ("full", 0, eagle)
    if type(manager) is MambaManager and manager.mamba_cache_mode == "align":
        return ("align", int(manager.num_speculative_blocks), eagle)
    return None


def group_rules(
    managers: Sequence[Any], room_pools: dict[int, int]
) -> tuple[list[GroupRule], list[CachingRule], bool]:
    """Per manager its rule and (prefix caching on) its caching rule, and whether every
    manager's rules are modelled (so steps can be quiet). ``room_pools``: group -> pool
    for the groups that keep decode room."""
    rules: list[GroupRule] = []
    caching: list[CachingRule] = []
    known = True
    for gid, manager in enumerate(managers):
        kind = type(manager)
        extra = 0
        skip: int | None = None
        if getattr(manager, "enable_caching", True):
            rule = _caching_rule(manager)
            known = known and rule is not None
            caching.append(rule or ("", 0, False))
        else:
            caching.append(("", 0, False))
            if kind is FullAttentionManager:
                pass
            elif kind is SlidingWindowManager:
                offset = (
                    manager.sliding_window - 1 + int(getattr(manager, "extra_retained_tokens", 0))
                )
                skip = _skip_offset(manager, offset)
                known = known and skip is not None
            elif kind is MambaManager and manager.mamba_cache_mode != "align":
                extra = manager.block_size * int(getattr(manager, "num_speculative_blocks", 0))
                skip = _skip_offset(manager, 1)
                known = known and skip is not None
            else:
                known = False
        rules.append((manager.block_size, extra, skip, room_pools.get(gid)))
    return rules, caching, known and bool(rules)


_CACHEABLE_PROBES = (0, 1, 15, 16, 17, 100, 543, 544, 1000, 1088, 4097, 65536)


def _cacheable_rule(coordinator: Any) -> tuple[int, int | None, int] | None:
    """The coordinator's `get_num_cacheable_tokens` as the table's rule: (hash block
    size, rounding (None: vLLM's base rule), reprefillable tokens); None if unknown."""
    if not isinstance(coordinator, HybridKVCacheCoordinator):
        return None
    partial_hits = getattr(coordinator, "enable_partial_hash_hits", None)
    if partial_hits is None or getattr(coordinator, "dcp_world_size", 1) > 1:
        # A release without the attribute, or context parallelism (not modelled).
        return None
    align = 1 if partial_hits else coordinator.scheduler_block_size
    return (
        int(coordinator.hash_block_size),
        int(align),
        int(getattr(coordinator, "num_reprefillable_tokens", 0)),
    )


def running_requests_table(
    coordinator: Any, room_pools: dict[int, int], room_tokens: int, quiet_steps: bool
) -> NativeRunningRequests:
    """The table for this coordinator's managers; quiet steps only where asked for and
    modelled. A caching coordinator's rule is checked on its own
    ``get_num_cacheable_tokens`` (a vLLM that counts otherwise gets no quiet steps)."""
    managers = coordinator.single_type_managers
    rules, caching, known = group_rules(managers, room_pools)
    caches = any(kind for kind, _, _ in caching)
    cacheable = _cacheable_rule(coordinator) if caches else None
    label = "running requests"
    if caches and cacheable is None:
        known = False
    if not (caches and known):
        return NativeRunningRequests(rules, quiet_steps and known, room_tokens, label=label)
    table = NativeRunningRequests(
        rules, quiet_steps, room_tokens, label=label, caching=caching, cacheable=cacheable
    )
    for gid in range(len(managers)):
        for tokens in _CACHEABLE_PROBES:
            if table.cacheable_tokens(gid, tokens) != coordinator.get_num_cacheable_tokens(
                tokens, gid
            ):
                return NativeRunningRequests(rules, False, room_tokens, label=label)
    return table


def cache_facts(
    managers: Sequence[Any], request_id: str, cached_tokens: int, prompt_tokens: int
) -> CacheFacts:
    """What caching managers hold of ``request_id`` after vLLM's ``allocate_slots`` for
    it (`CacheFacts` in rust/src/running.rs): blocks cached, Mamba 'align' blocks
    retired, the state block of two steps ago still to be freed, and whether every
    'align' manager has allocated for it and holds no checkpoint."""
    cached: list[int] = []
    retired: list[int] = []
    stale: list[int | None] = []
    boundary: list[int] = []
    settled = True
    for m in managers:
        cached.append(m.num_cached_block.get(request_id, 0))
        if type(m) is MambaManager and m.mamba_cache_mode == "align":
            blocks = m.req_to_blocks.get(request_id, ())
            kept_at = _state_boundary(m, prompt_tokens)
            kept_index = -(-kept_at // m.block_size) - 1
            if kept_at and 0 <= kept_index < len(blocks) and blocks[kept_index].is_null:
                # Its state block is freed: vLLM's `cache_blocks` skips it there.
                kept_at = 0
            boundary.append(kept_at)
            retired.append(m._num_retired_blocks.get(request_id, 0))
            index = m.last_state_block_idx.get(request_id)
            live = index is not None and index < len(blocks) and not blocks[index].is_null
            stale.append(index if live else None)
            settled = (
                settled
                and request_id in m._allocated_block_reqs
                and request_id not in m._checkpoints
            )
        else:
            boundary.append(0)
            retired.append(0)
            stale.append(None)
    return cached, retired, stale, boundary, settled, cached_tokens, prompt_tokens


def _state_boundary(manager: Any, prompt_tokens: int) -> int:
    """Where a Mamba 'align' manager keeps the prompt's state as a partial entry: vLLM's
    own `get_mamba_prefill_checkpoint_position`, as its ``cache_blocks`` calls it."""
    pool = manager.block_pool
    lookahead = int(getattr(pool, "num_hash_lookahead_tokens", 0) or 0)
    extra = {"num_hash_lookahead_tokens": lookahead} if lookahead else {}
    return int(
        get_mamba_prefill_checkpoint_position(
            prompt_tokens, pool.hash_block_size, manager.drop_eagle_checkpoint_block, **extra
        )
    )


def blocks_held(
    block_tables: Sequence[Mapping[str, Sequence[Any]]], request_id: str
) -> list[int | None]:
    """Per manager, the blocks ``request_id`` holds (None: the manager has no entry), from
    the managers' ``req_to_blocks`` maps (`block_tables`)."""
    held: list[int | None] = []
    for table in block_tables:
        blocks = table.get(request_id)
        held.append(None if blocks is None else len(blocks))
    return held


def block_tables(managers: Sequence[Any]) -> tuple[Mapping[str, Sequence[Any]], ...]:
    """Each manager's ``req_to_blocks`` map (vLLM makes it once, with the manager)."""
    return tuple(m.req_to_blocks for m in managers)


def partial_hit_maps(managers: Sequence[Any]) -> tuple[Mapping[str, Any], ...]:
    """The ``_partial_hit_reqs`` maps of the managers that have one (vLLM makes each
    once, with the manager): the requests that complete a prefix hit at their next
    allocation."""
    return tuple(m._partial_hit_reqs for m in managers if hasattr(m, "_partial_hit_reqs"))


def has_partial_hit(partial_hits: Sequence[Mapping[str, Any]], request_id: str) -> bool:
    """Whether a manager completes a prefix hit at the request's next allocation."""
    # A loop, not any() over a generator: a third of the time at two managers, once per
    # allocation.
    for hits in partial_hits:  # noqa: SIM110
        if request_id in hits:
            return True
    return False
