"""The coordinator's table of running requests, in Rust: decode steps and decode room.

vLLM's scheduler calls ``KVCacheManager.allocate_slots(request, n, num_lookahead_tokens=k)``
for every running request on every step. With per-group pools' natural pages (16 tokens
where stock's shared pool has blocks of hundreds), most of those calls change nothing:
no group needs a page, no block leaves a window, nothing gets cached; most of the rest
take one page in each full-attention group. vLLM still walks its coordinator and every
single-type manager to find that out (about 14 us a request on a 4-group model, measured
in ``benches/bench_manager.py``).

:func:`running_requests_table` builds the coordinator's
:class:`~hybrid_alloc._native.NativeRunningRequests`: per KV-cache group, the rules of
its manager, as vLLM's methods apply them; per request, the blocks each group holds and
how far its window's blocks are freed (told after every call that can change them). One
call per request and step (``decode_step``) answers what this ``allocate_slots`` would
do: nothing (quiet; the request's decode room is recounted in the same call), only take
blocks in full-attention groups (`PerGroupPoolsMixin._grow_decode_step` then allocates
just those), or anything else (vLLM's whole ``allocate_slots``). It also keeps the decode
room's totals (elastic pools, ``PerGroupPoolsMixin._decode_room_asks``). Rules modelled:

* full attention (``FullAttentionManager`` itself, not its subclasses): never frees
  while a request runs; needs a page when the slots outgrow its blocks;
* sliding window (``SlidingWindowManager``): also frees the blocks that leave the window
  (vLLM skips ``processed - (window - 1 + extra_retained_tokens)`` tokens);
* Mamba/GDN outside 'align' mode (one state block, plus the speculative ones): the same
  two rules, skipping ``processed - 1`` tokens.

The table answers only where every manager is of these kinds and none caches blocks
(prefix caching off, the 'none' mode hybrids run in), so ``cache_blocks`` is a no-op on
every step; any other manager kind (Mamba 'align', chunked local, cross-attention,
sinks, ...) makes every call take vLLM's path, and the table keeps only the room. A
quiet call returns what vLLM returns for it, the empty ``KVCacheBlocks``, and nothing
else happens in vLLM either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)

from hybrid_alloc._native import NativeRunningRequests

GroupRule = tuple[int, int, int | None, int | None]
"""(block size, extra slots, skip offset or None, room pool or None) per group."""

_SKIP_PROBES = (0, 1, 2, 3, 15, 16, 17, 100, 4097, 1 << 20)


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


def group_rules(
    managers: Sequence[Any], room_pools: dict[int, int]
) -> tuple[list[GroupRule], bool]:
    """Per manager its rule, and whether every manager's rules are modelled (so steps
    can be quiet). ``room_pools``: group -> pool for the groups that keep decode room."""
    rules: list[GroupRule] = []
    known = True
    for gid, manager in enumerate(managers):
        kind = type(manager)
        if getattr(manager, "enable_caching", True):
            known = False
        extra = 0
        skip: int | None = None
        if kind is FullAttentionManager:
            pass
        elif kind is SlidingWindowManager:
            offset = manager.sliding_window - 1 + int(getattr(manager, "extra_retained_tokens", 0))
            skip = _skip_offset(manager, offset)
            known = known and skip is not None
        elif kind is MambaManager and getattr(manager, "mamba_cache_mode", None) != "align":
            extra = manager.block_size * int(getattr(manager, "num_speculative_blocks", 0))
            skip = _skip_offset(manager, 1)
            known = known and skip is not None
        else:
            known = False
        rules.append((manager.block_size, extra, skip, room_pools.get(gid)))
    return rules, known and bool(rules)


def running_requests_table(
    managers: Sequence[Any], room_pools: dict[int, int], room_tokens: int, quiet_steps: bool
) -> NativeRunningRequests:
    """The table for these managers; quiet steps only where asked for and modelled."""
    rules, known = group_rules(managers, room_pools)
    return NativeRunningRequests(
        rules, quiet_steps and known, room_tokens, label="per-group coordinator"
    )


def blocks_held(managers: Sequence[Any], request_id: str) -> list[int | None]:
    """Per manager, the blocks ``request_id`` holds (None: the manager has no entry)."""
    return [
        None if (blocks := m.req_to_blocks.get(request_id)) is None else len(blocks)
        for m in managers
    ]


def has_partial_hit(managers: Sequence[Any], request_id: str) -> bool:
    """Whether a manager completes a prefix hit at the request's next allocation."""
    return any(request_id in getattr(m, "_partial_hit_reqs", ()) for m in managers)
