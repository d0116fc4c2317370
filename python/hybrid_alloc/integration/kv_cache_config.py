"""`PerGroupKVCacheConfig`: vLLM's `KVCacheConfig` plus the pool each group draws from.

The engine core builds it (see :mod:`.engine_sizing`) and hands copies to the scheduler
and, pickled, to the workers, so both sides read the same per-pool block counts:

* the scheduler's coordinator builds one pool per `PoolLayout`
  (:mod:`hybrid_alloc.integration.coordinator`);
* the worker views each layer's KV tensor with its own group's block count
  (:meth:`PerGroupKVCacheConfig.num_blocks_of`, which vLLM's ``allocate_kv_cache`` asks).

``num_blocks`` (the one count the rest of vLLM reads: ``num_gpu_blocks``, the watermark)
is the primary pool's, i.e. that of the first pool that grows with the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

from hybrid_alloc.integration.pool_set import PoolLayout, pool_of_each_group


@dataclass
class PerGroupKVCacheConfig(KVCacheConfig):
    pool_layouts: tuple[PoolLayout, ...] = ()
    """One entry per pool; every group index appears in exactly one."""

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
        # vLLM zeroes fresh attention blocks because, in one shared pool, a block may
        # last have held Mamba state or KV of another precision. Here every pool serves
        # groups of one kind and its blocks never change hands between kinds, and the
        # worker's zeroing takes one flat list of IDs that it applies to every attention
        # layer, which would be wrong with pool-scoped IDs.
        return False
