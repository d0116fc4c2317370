"""Batched replacements for four per-block loops in vLLM's KV-cache managers.

* ``FullAttentionManager.find_longest_cache_hit`` asks the pool for one block hash at a
  time. With the Rust pool, the plain case (no context parallelism, no fine-grained partial
  hits) becomes one call per request: ``get_cached_prefix`` walks the hashes in Rust and
  stops at the first miss. The rounding that follows (EAGLE's dropped block, alignment) is
  the same arithmetic vLLM applies. Every other case goes to vLLM's own method unchanged.
* ``SingleTypeKVCacheManager._get_num_evictable_blocks`` reads ``ref_cnt`` and ``is_null``
  of every prefix-hit block on each admission; with the Rust pool the count is one call.
* ``KVCacheManager.estimate_cached_tokens`` (the prefill statistics, once per request as
  its first token comes out) reads ``block_hash_num_tokens`` of every block of every
  cacheable group: with 16-token blocks in per-group pools that is ~70 property reads for
  a 1,000-token prompt. With the Rust pools it is one call per group; the groups it counts
  and the min-over-groups of max-over-blocks are vLLM's rule.
* ``KVCacheBlocks.get_block_ids`` turns a step's blocks into IDs for the scheduler's output,
  for every scheduled request at every step: per running request usually an empty block
  list per group (``allow_none``: then None), which vLLM finds with a generator (about
  300 ns, two groups), and an admitted prompt's whole table, block by block. Here the
  empty test is ``any`` over the groups (about 110 ns) and each group's IDs come from one
  native call (`hybrid_alloc._native.block_ids`, which reads any block vLLM's way too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec

from hybrid_alloc._native import block_ids
from hybrid_alloc.integration.scheduler.block_pool import BlockPool

_ATTR = "find_longest_cache_hit"
_stock_method: Any = None
_EVICTABLE = "_get_num_evictable_blocks"
_stock_evictable: Any = None
_ESTIMATE = "estimate_cached_tokens"
# vLLM's own method, kept before anything is installed (differential tests call it).
vllm_estimate_cached_tokens: Any = KVCacheManager.__dict__[_ESTIMATE]
_BLOCK_IDS = "get_block_ids"
vllm_get_block_ids: Any = KVCacheBlocks.__dict__[_BLOCK_IDS]
# Groups whose blocks vLLM never prefix-caches, whatever their spec says.
_NEVER_CACHED = (CrossAttentionSpec, EncoderOnlyAttentionSpec)


def estimate_cached_tokens(manager: Any, request: Any) -> int:
    """The prefix a request's blocks hold cached, in tokens: per counted group the widest
    hash any of its blocks carries, then the narrowest over the groups (0 if no group
    counts). One pool call per group; vLLM's own loop where a group's blocks are not
    from this package's pools."""
    if not manager.enable_caching:
        # Without prefix caching no manager caches a block (vLLM's coordinator passes the
        # flag to each), so no block carries a hash and vLLM's loop answers 0: once per
        # request in every 'none'-mode engine, its block list not read.
        return 0
    narrowest: int | None = None
    groups = manager.kv_cache_config.kv_cache_groups
    held = manager.get_blocks(request.request_id).blocks
    for group, blocks in zip(groups, held, strict=False):  # as vLLM pairs them
        spec = group.kv_cache_spec
        if not spec.prefix_cacheable or isinstance(spec, _NEVER_CACHED):
            continue
        if not blocks:
            widest = 0
        else:
            pool = getattr(blocks[0], "pool", None)
            if not isinstance(pool, BlockPool):
                return vllm_estimate_cached_tokens(manager, request)  # type: ignore[no-any-return]
            widest = pool.max_block_hash_num_tokens(blocks)
        narrowest = widest if narrowest is None else min(narrowest, widest)
    return narrowest or 0


def get_block_ids(
    self: Any, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
) -> tuple[list[int], ...] | None:
    """vLLM's ``KVCacheBlocks.get_block_ids``: per group (all, or ``group_ids`` in that
    order) its blocks' IDs; with ``allow_none``, None if every such group is empty."""
    groups = self.blocks
    if group_ids is not None:
        groups = [groups[gid] for gid in group_ids]
    if allow_none and not any(groups):
        return None
    return tuple(map(block_ids, groups))


def _batched_num_evictable_blocks(cls: Any, blocks: Any) -> int:
    if blocks:
        pool = getattr(blocks[0], "pool", None)
        if isinstance(pool, BlockPool):
            return pool.count_evictable(blocks)  # type: ignore[no-any-return]
    return _stock_evictable.__func__(cls, blocks)  # type: ignore[no-any-return]


def _batched_find_longest_cache_hit(
    cls: Any,
    block_hashes: Any,
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: Any,
    kv_cache_spec: Any,
    drop_eagle_block: bool,
    alignment_tokens: int,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
) -> tuple[tuple[list[Any], ...], int]:
    block_size = kv_cache_spec.block_size
    fine_grained = alignment_tokens < block_size and block_size % alignment_tokens == 0
    if (
        not isinstance(block_pool, BlockPool)
        or dcp_world_size > 1
        or pcp_world_size > 1
        or fine_grained
    ):
        return _stock_method.__func__(  # type: ignore[no-any-return]
            cls,
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec,
            drop_eagle_block,
            alignment_tokens,
            dcp_world_size,
            pcp_world_size,
        )
    hashes = resolve_block_hashes(
        block_hashes,
        block_pool.hash_block_size,
        block_size,
        supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
        alignment_tokens=alignment_tokens,
    )
    found = block_pool.get_cached_prefix(hashes, list(kv_cache_group_ids), max_length // block_size)
    hit_length = len(found[0]) * block_size
    if drop_eagle_block and hit_length > 0:
        hit_length -= min(alignment_tokens, block_size)
    hit_length -= hit_length % alignment_tokens
    num_blocks = -(-hit_length // block_size)
    for blocks in found:
        del blocks[num_blocks:]
    return found, hit_length


def install() -> None:
    """Install the batched versions (idempotent)."""
    global _stock_method, _stock_evictable
    if _stock_method is None:
        _stock_method = FullAttentionManager.__dict__[_ATTR]
        _stock_evictable = SingleTypeKVCacheManager.__dict__[_EVICTABLE]
    setattr(FullAttentionManager, _ATTR, classmethod(_batched_find_longest_cache_hit))
    setattr(SingleTypeKVCacheManager, _EVICTABLE, classmethod(_batched_num_evictable_blocks))
    setattr(KVCacheManager, _ESTIMATE, estimate_cached_tokens)
    setattr(KVCacheBlocks, _BLOCK_IDS, get_block_ids)


def uninstall() -> None:
    """Put vLLM's own methods back."""
    if _stock_method is not None:
        setattr(FullAttentionManager, _ATTR, _stock_method)
        setattr(SingleTypeKVCacheManager, _EVICTABLE, _stock_evictable)
        setattr(KVCacheManager, _ESTIMATE, vllm_estimate_cached_tokens)
        setattr(KVCacheBlocks, _BLOCK_IDS, vllm_get_block_ids)


def is_installed() -> bool:
    return FullAttentionManager.__dict__[_ATTR] is not _stock_method and _stock_method is not None
