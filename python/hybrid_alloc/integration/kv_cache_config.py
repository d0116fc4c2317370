"""`PerGroupKVCacheConfig`: vLLM's `KVCacheConfig` plus the pool each group draws from.

The engine core builds it (see :mod:`.scheduler.engine_sizing`) and hands copies to the scheduler
and, pickled, to the workers, so both sides read the same per-pool block counts:

* the scheduler's coordinator builds one pool per `PoolLayout`
  (:mod:`hybrid_alloc.integration.scheduler.coordinator`);
* the worker views each layer's KV tensor with its own group's block count
  (:meth:`PerGroupKVCacheConfig.num_blocks_of`, which vLLM's ``allocate_kv_cache`` asks).

``num_blocks`` (the one count the rest of vLLM reads: ``num_gpu_blocks``, the watermark)
is the primary pool's, i.e. that of the first pool that grows with the sequence.

New blocks are zeroed as stock vLLM zeroes them (:attr:`needs_kv_cache_zeroing`), but the
scheduler sends their IDs to the workers as one flat list (``new_block_ids_to_zero``),
which cannot tell pool-scoped IDs of different groups apart. So the IDs on that list are
*tagged*: group ``g``'s block ``b`` travels as ``zero_id_offsets[g] + b`` (the offsets stack
the groups' pool sizes, the primary pool's groups first: see ``tag_order``), and the worker
hooks (:mod:`.worker.runner`) split the list back into each group's own IDs
(:meth:`PerGroupKVCacheConfig.split_tagged_block_ids`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor


@dataclass(frozen=True)
class PoolLayout:
    """One pool of a `PoolSet`.

    Attributes:
        group_ids: the KV-cache groups that draw blocks from this pool.
        num_blocks: blocks in the pool, null block included (as vLLM's ``num_gpu_blocks``).
        grows: whether the groups hold KV that grows with the sequence (attention) rather
            than a fixed amount of state per request (Mamba/GDN outside 'all' mode).
        label: names the pool in logs and error messages.
    """

    group_ids: tuple[int, ...]
    num_blocks: int
    grows: bool
    label: str = ""


@dataclass(frozen=True)
class ElasticLayout:
    """One byte budget for every pool of a `PoolSet` (elastic pools, ``rust/src/elastic.rs``).

    Attributes:
        slab_bytes: the unit memory is lent to a pool in.
        num_slabs: slabs in the budget (slab 0 holds the null blocks).
        page_bytes: per pool (in layout order), the bytes one of its blocks takes across
            its layers.
        kept_per_live: per pool, idle blocks kept per block in use that no other pool may
            take back (empty: none); 'align'-mode Mamba/GDN pools keep the block a request
            moves its state into at each block boundary.
    """

    slab_bytes: int
    num_slabs: int
    page_bytes: tuple[int, ...]
    kept_per_live: tuple[int, ...] = ()


def pool_of_each_group(layouts: Sequence[PoolLayout]) -> dict[int, int]:
    """{group: index of the layout that serves it}, checking that the layouts cover the
    groups 0..n-1, each exactly once (every group draws from exactly one pool).

    Raises:
        ValueError: a layout serves no group, a group is served twice, or groups are
            missing.
    """
    if not layouts:
        raise ValueError("per-group pools: at least one pool is needed")
    owner: dict[int, int] = {}
    for idx, layout in enumerate(layouts):
        if not layout.group_ids:
            raise ValueError(f"per-group pools: pool {idx} serves no group")
        for gid in layout.group_ids:
            if gid in owner:
                raise ValueError(
                    f"per-group pools: group {gid} is in pools {owner[gid]} and {idx}; "
                    "every group must draw from exactly one pool"
                )
            owner[gid] = idx
    if sorted(owner) != list(range(len(owner))):
        raise ValueError(f"per-group pools: groups must be 0..n-1, got {sorted(owner)}")
    return owner


@dataclass
class PerGroupKVCacheConfig(KVCacheConfig):
    pool_layouts: tuple[PoolLayout, ...] = ()
    """One entry per pool; every group index appears in exactly one."""
    elastic: ElasticLayout | None = None
    """One byte budget for every pool (elastic pools); None: each pool its own blocks."""
    decode_room_tokens: int = 0
    """Elastic pools: tokens of room to decode into that each running request keeps past
    its length when another request is admitted beside it (see
    `PerGroupPoolsMixin._decode_room_asks`); the engine core sets half of the attention
    block vLLM's shared pool would use."""
    zero_new_blocks: bool = False
    """Whether new blocks are zeroed (stock vLLM's rule, :attr:`needs_kv_cache_zeroing`);
    the engine core's config sets it (:func:`.engine_sizing.build_config`). Zeroing needs
    the worker hooks that split tagged IDs per group (:mod:`.worker.runner`), installed with it."""

    def __post_init__(self) -> None:
        owner = pool_of_each_group(self.pool_layouts)
        if len(owner) != len(self.kv_cache_groups):
            raise ValueError(
                f"PerGroupKVCacheConfig: pools cover groups {sorted(owner)}, expected each "
                f"of 0..{len(self.kv_cache_groups) - 1} exactly once"
            )

    def layout_of_group(self, group_id: int) -> PoolLayout:
        for layout in self.pool_layouts:
            if group_id in layout.group_ids:
                return layout
        raise KeyError(group_id)

    def group_of_layer(self, layer_name: str) -> int:
        for gid, group in enumerate(self.kv_cache_groups):
            if layer_name in group.layer_names:
                return gid
        raise KeyError(layer_name)

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        """Blocks of the pool whose group owns ``tensor``'s layers (vLLM's worker views
        every tensor with this count)."""
        if tensor.host_resident:
            return super().num_blocks_of(tensor)
        return self.layout_of_group(self.group_of_layer(tensor.layers[0])).num_blocks

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        # Stock vLLM's rule (configs with Mamba layers or mixed KV precisions), when this
        # config asks for zeroing: the IDs then travel tagged with their group
        # (`tag_block_ids`) and the workers zero each group's IDs in that group's layers
        # only, with its own block count.
        return self.zero_new_blocks and bool(super().needs_kv_cache_zeroing)

    def group_num_blocks(self) -> list[int]:
        """Each group's pool size, in group order (the block count its tensors are viewed
        with)."""
        return list(self._stacking()[2])

    def tag_order(self) -> list[int]:
        """Groups in the order their tagged ID ranges are stacked: the groups of the first
        pool that grows with the sequence (the primary pool), then the others in group
        order. vLLM lists new blocks for zeroing from attention managers only, so in a
        hybrid model nearly every ID on the list is the primary pool's first group's: at
        offset 0 those travel as they are, and neither side makes a new int per ID."""
        return list(self._stacking()[0])

    def zero_id_offsets(self) -> list[int]:
        """Per group (indexed by group): where its tagged IDs start, the pool sizes of the
        groups stacked before it (:meth:`tag_order`)."""
        return list(self._stacking()[1])

    def _stacking(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(:meth:`tag_order`, :meth:`zero_id_offsets`, :meth:`group_num_blocks`), worked
        out once for the pools this config holds. The scheduler tags the new IDs of every
        step that takes a block, and the workers split them back, so working them out
        again each time (walking the layouts per group) cost about 2 us a call; they
        depend only on ``pool_layouts`` (frozen layouts in a tuple) and the number of
        groups, which key the cached answer (a replaced tuple or another group count
        works it out again)."""
        key = (self.pool_layouts, len(self.kv_cache_groups))
        cached = self.__dict__.get("_stacked")
        if cached is not None and cached[0] is key[0] and cached[1] == key[1]:
            return cached[2]  # type: ignore[no-any-return]
        counts = tuple(self.layout_of_group(g).num_blocks for g in range(len(self.kv_cache_groups)))
        growing = [layout for layout in self.pool_layouts if layout.grows]
        first = list(growing[0].group_ids) if growing else []
        order = tuple(first + [g for g in range(len(counts)) if g not in first])
        offsets = [0] * len(counts)
        total = 0
        for g in order:
            offsets[g] = total
            total += counts[g]
        stacking = (order, tuple(offsets), counts)
        self.__dict__["_stacked"] = (key[0], key[1], stacking)
        return stacking

    def tag_block_ids(self, group_id: int, block_ids: Iterable[int]) -> list[int]:
        """Group ``group_id``'s pool-scoped IDs as tagged IDs (unique across groups)."""
        out: list[int] = []
        self.extend_tagged(out, group_id, block_ids)
        return out

    def extend_tagged(self, out: list[int], group_id: int, block_ids: Iterable[int]) -> None:
        """Append group ``group_id``'s pool-scoped IDs to ``out`` as tagged IDs."""
        offset = self._stacking()[1][group_id]
        # `map` with the bound `int.__add__` runs in C.
        out.extend(block_ids if offset == 0 else map(offset.__add__, block_ids))

    def split_tagged_block_ids(self, tagged: Iterable[int]) -> dict[int, list[int]]:
        """Tagged IDs back as ``{group: pool-scoped IDs}``, each group's IDs ascending
        (zeroing does not depend on order), groups in :meth:`tag_order`.

        The workers run this at every step that zeroes blocks, thousands of IDs in a
        long prefill: the IDs are sorted (in C), each group's range is found by bisection
        and sliced out, and only groups not at offset 0 have their offset taken off (in C
        too); no Python code runs per ID.

        Raises:
            ValueError: an ID outside the groups' stacked ranges.
        """
        ids = sorted(tagged)
        if not ids:
            return {}
        order, offsets, counts = self._stacking()
        end = sum(counts)
        if ids[0] < 0 or ids[-1] >= end:
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise ValueError(f"tagged block ID {bad} is outside 0..{end - 1}")
        out: dict[int, list[int]] = {}
        for g in order:
            start = offsets[g]
            lo = bisect_left(ids, start)
            hi = bisect_left(ids, start + counts[g], lo)
            if lo < hi:
                part = ids[lo:hi]
                out[g] = part if start == 0 else list(map((-start).__add__, part))
        return out
