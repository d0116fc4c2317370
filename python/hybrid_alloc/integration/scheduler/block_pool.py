"""`BlockPool`: the Rust pool, call-compatible with the `BlockPool` of each supported vLLM.

Allocation, freeing, touching, eviction and the prefix cache run in Rust
(`hybrid_alloc._native.NativeBlockPool`). What needs vLLM's Python objects stays here:
building `BlockStored` events from a request (token IDs, LoRA, multimodal extra keys) and
logging. Per-block work never loops in Python except when KV events are on, where the
event payload itself is per block.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.multimodal.utils import get_mm_features_in_window
from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from hybrid_alloc._native import KVCacheBlock, NativeBlockPool
from hybrid_alloc.integration import versions

_LOOKAHEAD = versions.release().hash_lookahead
if _LOOKAHEAD:
    # vLLM 0.33 only (the type check runs against 0.32).
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[attr-defined]
        generate_lookahead_block_hash_extra_keys,
    )

logger = logging.getLogger("hybrid_alloc")


class _HashToBlockView:
    """Read view of the prefix cache keyed by `BlockHashWithGroupId` (vLLM's
    `cached_block_hash_to_block`)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        return self._pool._lookup_key(key)

    def contain(self, key: bytes, block_id: int) -> bool:
        return self._pool._hash_maps_to(key, block_id)

    def __len__(self) -> int:
        return self._pool._num_cached_keys()


class _ExtraHashesView:
    """Read view of each block's non-primary keys (vLLM's `cached_block_hashes_by_block`)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def get(self, block_id: int, default: Any = None) -> Any:
        keys = self._pool._extra_block_hashes(block_id)
        return set(keys) if keys else default

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, int) and bool(self._pool._extra_block_hashes(block_id))

    def __getitem__(self, block_id: int) -> set[bytes]:
        keys = self._pool._extra_block_hashes(block_id)
        if not keys:
            raise KeyError(block_id)
        return set(keys)


_PARAMS_032 = (
    "num_gpu_blocks",
    "enable_caching",
    "hash_block_size",
    "enable_kv_cache_events",
    "metrics_collector",
    "medium",
    "label",
)
# vLLM 0.33 inserted num_hash_lookahead_tokens before medium.
_PARAMS_033 = (*_PARAMS_032[:5], "num_hash_lookahead_tokens", "medium", "label")
_MISSING = object()
_DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "metrics_collector": None,
    "num_hash_lookahead_tokens": 0,
    "medium": MEDIUM_GPU,
    "label": None,
}

# The defaults of the parameters after the first k positional arguments, for each k.
_TAIL_DEFAULTS = tuple(
    tuple(_DEFAULTS.get(n, _MISSING) for n in (_PARAMS_033 if _LOOKAHEAD else _PARAMS_032)[k:])
    for k in range(len(_PARAMS_033 if _LOOKAHEAD else _PARAMS_032) + 1)
)


def _constructor_args(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any, Any, bool, Any, int, str, str | None]:
    """vLLM's constructor arguments in the installed release's order, as one tuple:
    (num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events,
    metrics_collector, num_hash_lookahead_tokens, medium, label)."""
    names = _PARAMS_033 if _LOOKAHEAD else _PARAMS_032
    if len(args) > len(names):
        raise TypeError(f"BlockPool() takes at most {len(names)} arguments ({len(args)} given)")
    # Positional values, then the defaults (a list: vLLM builds one pool per group, and a
    # dict per call cost more than the native constructor itself).
    values = [*args, *_TAIL_DEFAULTS[len(args)]]
    for key, value in kwargs.items():
        try:
            i = names.index(key)
        except ValueError:
            raise TypeError(f"BlockPool() got an unexpected keyword argument {key!r}") from None
        if i < len(args):
            raise TypeError(f"BlockPool() got multiple values for argument {key!r}")
        values[i] = value
    missing = [n for n, v in zip(names[:3], values, strict=False) if v is _MISSING]
    if missing:
        raise TypeError(f"BlockPool() missing required arguments: {', '.join(missing)}")
    if _LOOKAHEAD:
        blocks, caching, hash_size, events, collector, lookahead, medium, label = values
    else:
        blocks, caching, hash_size, events, collector, medium, label = values
        lookahead = 0
    if not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(
            f"BlockPool: num_hash_lookahead_tokens must be an int >= 0, got {lookahead!r}"
        )
    return (blocks, caching, hash_size, bool(events), collector, lookahead, medium, label)


# Blocks whose handles a pool makes as it is built, before the engine core freezes its
# heap, as stock vLLM builds all its blocks; the rest are made on first use. Making one
# costs ~65 ns and ~106 B of host memory (1M: 66 ms, 106 MB), once. Made during the
# scheduler's steps instead, each counted towards the cyclic GC's next collection, and
# the collections they set off walked vLLM's lists of handles: Falcon-H1-7B 16 GiB
# 'none' long-burst (24,057 pages) ran 146 us of scheduler CPU per step with handles
# made on first use, 135 with them made up front.
EAGER_HANDLES = 1 << 20


class BlockPool(NativeBlockPool):
    """Drop-in replacement for `vllm.v1.core.block_pool.BlockPool`.

    Args match the installed vLLM's: ``num_gpu_blocks, enable_caching, hash_block_size,
    enable_kv_cache_events=False, metrics_collector=None, [num_hash_lookahead_tokens=0,]
    medium=MEDIUM_GPU`` (0.33 added ``num_hash_lookahead_tokens``), plus an optional
    ``label`` naming the pool in error messages.
    """

    num_hash_lookahead_tokens: int
    _parsed_args: tuple[Any, Any, Any, bool, Any, int, str, str | None]

    def __new__(cls, *args: Any, **kwargs: Any) -> BlockPool:
        # The native constructor takes the arguments that shape the pool; the rest of
        # vLLM's (whose positional order differs between releases) are read in __init__.
        parsed = _constructor_args(args, kwargs)
        num_gpu_blocks, enable_caching, hash_block_size, events, _, _, _, label = parsed
        pool = cast(
            BlockPool,
            super().__new__(  # type: ignore[call-arg]
                cls, num_gpu_blocks, enable_caching, hash_block_size, events, label=label
            ),
        )
        # Parsed once: __init__ gets the same arguments (a pool is built per KV-cache group).
        pool._parsed_args = parsed
        return pool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The native __new__ has already validated the arguments and built the pool.
        parsed = self.__dict__.pop("_parsed_args", None) or _constructor_args(args, kwargs)
        _, _, _, enable_kv_cache_events, collector, lookahead, medium, _ = parsed
        self.metrics_collector = collector
        # A Python copy of the native value, read without a native call by the per-request
        # paths (each of which then makes one native call).
        self._hash_block_size: int = self.hash_block_size
        self.medium = medium
        self.num_hash_lookahead_tokens = lookahead
        self.kv_event_queue: list[KVCacheEvent] = []
        self.blocks = self._block_table()
        self.free_block_queue = self._free_queue_view()
        self.null_block = self._block(0)
        self.cached_block_hash_to_block = _HashToBlockView(self)
        self.cached_block_hashes_by_block = _ExtraHashesView(self)
        if enable_kv_cache_events:
            self._set_removed_sink(self._append_removed_events)
        self.make_handles(EAGER_HANDLES)

    @property
    def metrics_collector(self) -> Any:
        """vLLM's ``KVCacheMetricsCollector`` (or None). The pool calls its
        ``on_block_evicted``, ``on_block_allocated`` and ``on_block_accessed`` as the stock
        pool does; ``reset`` is called here, from :meth:`reset_prefix_cache`."""
        return self._metrics_collector

    @metrics_collector.setter
    def metrics_collector(self, collector: Any) -> None:
        self._metrics_collector = collector
        # The native pool holds the bound methods (the core decides when each is called).
        self._set_block_observers(
            None
            if collector is None
            else (
                collector.on_block_evicted,
                collector.on_block_allocated,
                collector.on_block_accessed,
            )
        )

    # ----------------------------------------------------------------- events
    def _append_removed_events(self, keys: list[bytes]) -> None:
        queue = self.kv_event_queue
        # The pool's keys are vLLM's (hash, group) keys, as bytes: typed once, not per key.
        for key in cast(list[BlockHashWithGroupId], keys):
            queue.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                    medium=self.medium,
                    group_idx=get_group_id(key),
                )
            )

    def _stored_event(
        self,
        request: Any,
        block_hashes: list[Any],
        parent_block_hash: Any,
        start_token_idx: int,
        end_token_idx: int,
        block_size: int,
        kv_cache_group_id: int,
        extra_keys_list: list[tuple[Any, ...] | None],
        block_ends: Iterable[int],
    ) -> BlockStored:
        lora = request.lora_request
        return BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent_block_hash,
            token_ids=request.all_token_ids[start_token_idx:end_token_idx],
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=self.medium,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys_list),
            group_idx=kv_cache_group_id,
            session_id=request.session_id,
            **self._lookahead_field(request, block_ends),
        )

    def _lookahead_field(self, request: Any, block_ends: Iterable[int]) -> dict[str, Any]:
        """vLLM 0.33's ``lookahead_token_ids`` event field: the tokens past each block
        that its hash covers (None when hashes cover no lookahead)."""
        if not _LOOKAHEAD:
            return {}
        n = self.num_hash_lookahead_tokens
        if not n:
            return {"lookahead_token_ids": None}
        tokens = request.all_token_ids
        return {"lookahead_token_ids": [tokens[end : end + n] for end in block_ends]}

    def _block_extra_keys(
        self, request: Any, start: int, end: int, mm_idx: int
    ) -> tuple[tuple[Any, ...] | None, int]:
        # Event extra keys cover the same tokens as the block's hash.
        n = self.num_hash_lookahead_tokens
        if n:
            return generate_lookahead_block_hash_extra_keys(  # type: ignore[no-any-return]
                request, start, end, end + n, mm_idx
            )
        return generate_block_hash_extra_keys(request, start, end, mm_idx)  # type: ignore[no-any-return]

    def _extra_keys_for(
        self, request: Any, block_indices: Iterable[int], block_size: int
    ) -> list[tuple[Any, ...] | None]:
        out: list[tuple[Any, ...] | None] = []
        mm_idx = 0
        for i in block_indices:
            keys, mm_idx = self._block_extra_keys(
                request, i * block_size, (i + 1) * block_size, mm_idx
            )
            out.append(keys)
        return out

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # --------------------------------------------------------- prefix caching
    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under the request's block
        hashes (null and masked-out blocks are skipped)."""
        if block_size != self._hash_block_size and (
            not isinstance(block_size, int) or block_size <= 0 or block_size % self._hash_block_size
        ):
            # vLLM's resolve_block_hashes would only assert this.
            raise ValueError(
                f"{self.label}: cache_full_blocks: block_size {block_size!r} is not a "
                f"multiple of the pool's hash block size {self._hash_block_size}"
            )
        hashes = resolve_block_hashes(request.block_hashes, self._hash_block_size, block_size)
        # The pool decides which blocks it caches; with events on it says which.
        kept = self._cache_full_blocks(
            blocks,
            hashes,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
        if kept is None:
            return
        parent = (
            None
            if num_cached_blocks == 0
            else maybe_convert_block_hash(hashes[num_cached_blocks - 1])
        )
        self.kv_event_queue.append(
            self._stored_event(
                request,
                [maybe_convert_block_hash(hashes[i]) for i in kept],
                parent,
                num_cached_blocks * block_size,
                num_full_blocks * block_size,
                block_size,
                kv_cache_group_id,
                self._extra_keys_for(request, kept, block_size),
                [(i + 1) * block_size for i in kept],
            )
        )

    def emit_cached_block_events(
        self,
        request: Any,
        num_cached_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Emit one `BlockStored` event for blocks a request reused from the prefix cache
        (state is unchanged; external indexers learn about the reuse)."""
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        hashes = resolve_block_hashes(request.block_hashes, self._hash_block_size, block_size)
        indices = range(num_cached_blocks)
        self.kv_event_queue.append(
            self._stored_event(
                request,
                [maybe_convert_block_hash(hashes[i]) for i in indices],
                None,
                0,
                num_cached_blocks * block_size,
                block_size,
                kv_cache_group_id,
                self._extra_keys_for(request, indices, block_size),
                [(i + 1) * block_size for i in indices],
            )
        )

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> bytes | None:
        """Make ``block`` reachable from the prefix hash at ``num_tokens`` (a multiple of
        ``hash_block_size`` inside the block). Returns the key, or None for the null block."""
        cached = self._cache_partial_block(
            request.block_hashes,
            block,
            num_tokens,
            kv_cache_group_id,
            block_size,
            replace_existing_hashes,
        )
        if cached is None:
            return None
        key, stored_event_due = cached
        if stored_event_due:
            self._append_partial_stored_event(request, key, num_tokens, kv_cache_group_id)
        return key

    def _append_partial_stored_event(
        self, request: Any, key: bytes, num_tokens: int, kv_cache_group_id: int
    ) -> None:
        hbs = self._hash_block_size
        num_hash_blocks = num_tokens // hbs
        parent = request.block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
        start = (num_hash_blocks - 1) * hbs
        mm_idx = 0
        mm_features = request.mm_features
        if start > 0 and mm_features:
            last = mm_features[-1].mm_position
            if last.offset + last.length > start:
                mm_idx, _ = get_mm_features_in_window(mm_features, start, num_tokens)
        extra_keys, _ = self._block_extra_keys(request, start, num_tokens, mm_idx)
        lora = request.lora_request
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=[
                    maybe_convert_block_hash(get_block_hash(cast(BlockHashWithGroupId, key)))
                ],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=request.all_token_ids[start:num_tokens],
                block_size=num_tokens - start,
                lora_id=lora.adapter_id if lora else None,
                medium=self.medium,
                lora_name=lora.name if lora else None,
                extra_keys=to_event_extra_keys([extra_keys]),
                group_idx=kv_cache_group_id,
                session_id=request.session_id,
                **self._lookahead_field(request, [num_tokens]),
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use."""
        if not self._reset_prefix_cache():
            in_use = self.num_gpu_blocks - 1 - self.get_num_free_blocks() - self._held_by_budget()
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                in_use,
            )
            return False
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        logger.info("Successfully reset prefix cache")
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def __repr__(self) -> str:
        return (
            f"hybrid_alloc.BlockPool({self.label!r}, blocks={self.num_gpu_blocks}, "
            f"free={self.get_num_free_blocks()}, caching={self.enable_caching})"
        )


# ------------------------------------------------------------------ installation
# vLLM's KV-cache coordinator looks ``BlockPool`` up in its own module when it builds a
# coordinator; replacing that name is the whole drop-in installation.
_COORDINATOR_MODULE = "vllm.v1.core.kv_cache_coordinator"


def install() -> None:
    """Make vLLM's KV-cache coordinator build this pool (idempotent)."""
    import importlib

    setattr(importlib.import_module(_COORDINATOR_MODULE), "BlockPool", BlockPool)  # noqa: B010


def uninstall() -> None:
    """Make vLLM's KV-cache coordinator build its stock pool again."""
    import importlib

    import vllm.v1.core.block_pool as stock

    setattr(importlib.import_module(_COORDINATOR_MODULE), "BlockPool", stock.BlockPool)  # noqa: B010


def is_installed() -> bool:
    import importlib

    return getattr(importlib.import_module(_COORDINATOR_MODULE), "BlockPool", None) is BlockPool
