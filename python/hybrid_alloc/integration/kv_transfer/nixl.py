"""vLLM's NixlConnector (prefill/decode disaggregation) on per-group pools.

The scheduler side of vLLM's connector already speaks in block IDs per KV-cache group:
``kv_transfer_params["remote_block_ids"]`` and the connector's metadata carry one list per
group, and a failed read fails its whole request (vLLM's request-level path for hybrid
models), so pool-scoped IDs serve it unchanged. What assumes vLLM's shared pool is the
worker side: it registers one NIXL region per distinct tensor address, views every region
with the one ``num_blocks``, and addresses Mamba/GDN states as sub-regions of pages shared
with attention layers. Per-group pools lay the KV cache out differently
(:class:`~hybrid_alloc.integration.kv_cache_config.PerGroupKVCacheConfig`): every
``KVCacheTensor`` places group ``g``'s layers in one backing allocation, layer ``l``'s page
of block ``b`` at ``offset + l * layer_stride + b * block_stride``, with the group's own
block count (the whole budget for elastic pools, where groups overlay each other).

So on a per-group config the worker's hooks here describe that layout to NIXL:

* **one region per layer** (in vLLM's region order), its pages at the group's block stride,
  its length the layer's page (a Mamba/GDN state moves as one piece: both sides share the
  layout, so no conv/SSM split is needed), its block count the group's pool size;
* **descriptor IDs per group**: block ``b`` of group ``g`` is read in each of ``g``'s
  regions only, at that region's offset in the descriptor list (pool-scoped IDs never meet
  another group's regions);
* **a handshake that refuses what it cannot move**: the compatibility hash names the
  per-group layout (a stock engine on the other side fails the handshake with both hashes
  in vLLM's message rather than reading the wrong bytes), and a peer with another tensor
  parallel size, block size or region list gets an error naming both layouts.

Push mode (``NixlPushConnector``: the decode side registers its blocks with the prefill
side, which writes into them) runs the same base worker, so the same regions, descriptor
IDs and handshake serve it; both directions of its handshake check the compatibility hash.

Any other config goes to vLLM's code unchanged. The engine core keeps per-group pools off
where this does not reach (:func:`.engine_sizing.kv_connector_unsupported_reason`): host
staging buffers (``kv_buffer_device="cpu"`` on a GPU), pipeline and tensor parallelism.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybrid_alloc.integration import hooks, versions
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig

logger = logging.getLogger("vllm.hybrid_alloc")

_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_WORKER_MODULE = f"{_PACKAGE}.base_worker"
_WORKER = "NixlBaseConnectorWorker"
LAYOUT_TAG = "hybrid_alloc per-group pools"
"""Marks the compatibility hash of an engine whose KV cache has per-group pools."""


@dataclass(frozen=True)
class Region:
    """One layer's pages in the KV cache allocation, as NIXL transfers them."""

    layer: str
    group: int
    """Index among the config's transfer groups (vLLM's ``transfer_groups``)."""
    base: int
    """Address of the layer's page of block 0."""
    page_bytes: int
    block_stride: int
    num_blocks: int


def _per_group(worker: Any) -> PerGroupKVCacheConfig | None:
    config = getattr(worker, "kv_cache_config", None)
    return config if isinstance(config, PerGroupKVCacheConfig) else None


def layer_regions(
    config: PerGroupKVCacheConfig,
    storage_base: int,
    layer_specs: dict[str, Any],
    order: Callable[[str], Any],
    kernel_blocks: int = 1,
) -> list[Region]:
    """The transferable layers' regions of ``config`` in a backing allocation at
    ``storage_base``, sorted by ``order`` (layer name -> sort key). ``kernel_blocks``: the
    blocks the model runner splits each attention block into, where the attention backend
    wants smaller ones (vLLM's ``_physical_blocks_per_logical_kv_block``; it never splits
    state pages, nor blocks whose pages hold every layer of the group, elastic pools').

    Raises:
        RuntimeError: a tensor lives in host memory, a layer's page does not fit its
            stride, or a split block is not consecutive kernel pages (a layout these
            regions do not describe).
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    transfer_index = config.transfer_group_index_by_layer
    regions = []
    for tensor in config.kv_cache_tensors:
        if tensor.host_resident:
            raise RuntimeError(
                "hybrid_alloc: NIXL on per-group pools: host-resident KV-cache tensors "
                f"({tensor.layers[0]}) are not supported"
            )
        num_blocks = config.num_blocks_of(tensor)
        for index, layer in enumerate(tensor.layers):
            if layer not in transfer_index:
                continue
            page = int(layer_specs[layer].page_size_bytes)
            fits = page <= tensor.block_stride and (
                len(tensor.layers) == 1 or page <= tensor.layer_stride
            )
            if not fits:
                raise RuntimeError(
                    f"hybrid_alloc: NIXL on per-group pools: layer {layer}'s page of "
                    f"{page} B does not fit its strides (layer {tensor.layer_stride} B, "
                    f"block {tensor.block_stride} B)"
                )
            split = 1 if isinstance(layer_specs[layer], MambaSpec) else kernel_blocks
            if split > 1 and (tensor.block_stride != page or page % split):
                raise RuntimeError(
                    f"hybrid_alloc: NIXL on per-group pools: layer {layer}'s blocks are "
                    f"split in {split} kernel blocks, but its page of {page} B is not "
                    f"{split} consecutive kernel pages (block stride {tensor.block_stride} B)"
                )
            regions.append(
                Region(
                    layer=layer,
                    group=transfer_index[layer],
                    base=storage_base + tensor.offset + index * tensor.layer_stride,
                    page_bytes=page // split,
                    block_stride=tensor.block_stride // split,
                    num_blocks=num_blocks * split,
                )
            )
    regions.sort(key=lambda r: order(r.layer))
    return regions


def check_region_views(
    regions: Sequence[Region], kv_caches: dict[str, Any], storage_base: int
) -> None:
    """Check that each layer's tensor (as the model runner viewed it) has its block ``b``
    in exactly the bytes its region names: one range of ``page_bytes`` at
    ``base + b * block_stride``.

    Raises:
        RuntimeError: naming the layer, where a view starts elsewhere, steps by another
            stride, or spreads a block's bytes over more than its page (heads outside
            blocks).
    """
    for region in regions:
        view = kv_caches.get(region.layer)
        if view is None:
            continue
        where = f"hybrid_alloc: NIXL on per-group pools: layer {region.layer}"
        if view.data_ptr() != region.base:
            raise RuntimeError(
                f"{where} starts at byte {view.data_ptr() - storage_base} of the KV cache, "
                f"its tensor description at {region.base - storage_base}"
            )
        if view.shape[0] > 1 and view.stride(0) * view.element_size() != region.block_stride:
            raise RuntimeError(
                f"{where} steps {view.stride(0) * view.element_size()} B from block to "
                f"block, its tensor description {region.block_stride} B"
            )
        block = view[0]
        span = block.element_size() * (
            1 + sum((n - 1) * st for n, st in zip(block.shape, block.stride(), strict=True))
        )
        if span != region.page_bytes or block.nbytes != region.page_bytes:
            raise RuntimeError(
                f"{where} spreads one block's {block.nbytes} B over {span} B (its page is "
                f"{region.page_bytes} B): the KV-cache layout does not keep a block's bytes "
                "together"
            )


def layout_fingerprint(regions: Sequence[Region], block_size: int) -> str:
    """What two engines must share for one to read the other's pages: each region's
    layer, group and page length, and the block size (not the block counts: each side
    sizes its own pools)."""
    text = ";".join(f"{r.layer}:{r.group}:{r.page_bytes}" for r in regions)
    digest = hashlib.sha256(f"{block_size}|{text}".encode()).hexdigest()[:16]
    return f"{LAYOUT_TAG} {digest}"


def descriptor_ids(
    block_ids: Sequence[Sequence[int]],
    region_groups: Sequence[int],
    region_num_blocks: Sequence[int],
) -> np.ndarray:
    """NIXL descriptor IDs of ``block_ids`` (one list of pool-scoped IDs per transfer
    group) when region ``r`` holds ``region_num_blocks[r]`` descriptors, one per block,
    one after another: group ``g``'s blocks in each of its regions, groups in order.

    Raises:
        ValueError: more groups than the layout has, or a block ID outside its pool.
    """
    groups = np.asarray(region_groups, dtype=np.int64)
    counts = np.asarray(region_num_blocks, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    parts = []
    for group, ids in enumerate(block_ids):
        if not len(ids):
            continue
        regions = np.flatnonzero(groups == group)
        if regions.size == 0:
            raise ValueError(
                f"hybrid_alloc: NIXL block IDs for transfer group {group}, which has no "
                f"region (groups {sorted(set(region_groups))})"
            )
        blocks = np.asarray(ids, dtype=np.int64)
        limit = int(counts[regions].min())
        bad = blocks[(blocks < 0) | (blocks >= limit)]
        if bad.size:
            raise ValueError(
                f"hybrid_alloc: NIXL block {int(bad[0])} of transfer group {group} is "
                f"outside its pool of {limit} blocks"
            )
        parts.append((offsets[regions][:, None] + blocks[None, :]).ravel())
    if not parts:
        return np.array([], dtype=np.int64)
    return np.concatenate(parts)


def _stack(addrs: np.ndarray, length: int, device: int) -> np.ndarray:
    out = np.empty((addrs.shape[0], 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = length
    out[:, 2] = device
    return out


def region_descriptors(regions: Sequence[Region], device: int) -> np.ndarray:
    """(address, length, device) of every region's every block, region after region: the
    list ``descriptor_ids`` indexes."""
    parts = [
        _stack(
            np.uint64(r.base)
            + np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.block_stride),
            r.page_bytes,
            device,
        )
        for r in regions
    ]
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)


# ------------------------------------------------------------------ the worker's hooks
def _sync_block_size_with_kernel(stock: Callable[..., None]) -> Callable[..., None]:
    """vLLM's worker splits a logical block into kernel blocks where the attention
    backend asks for smaller ones; the GPU/CPU runners never split block-outermost
    layouts (every elastic pool's), so NIXL must not either."""

    def sync(self: Any) -> None:
        config = _per_group(self)
        if config is not None and _block_outermost(config):
            self._logical_num_blocks = self.num_blocks
            return
        stock(self)

    return sync


def _block_outermost(config: PerGroupKVCacheConfig) -> bool:
    return any(
        t.block_stride > t.layer_stride and len(t.layers) > 1 for t in config.kv_cache_tensors
    )


def _register_kv_caches(stock: Callable[..., None]) -> Callable[..., None]:
    def register_kv_caches(self: Any, kv_caches: dict[str, Any]) -> None:
        config = _per_group(self)
        if config is None:
            return stock(self, kv_caches)
        _register_per_group(self, config, kv_caches)
        return None

    return register_kv_caches


def _register_per_group(
    self: Any, config: PerGroupKVCacheConfig, kv_caches: dict[str, Any]
) -> None:
    """``register_kv_caches`` for a per-group layout: the worker state vLLM's transfer
    code reads afterwards, with one region per layer (see the module docstring)."""
    import msgspec
    import torch

    base_worker = _module()
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
        compute_nixl_compatibility_hash,
    )

    if self.use_host_buffer:
        raise RuntimeError(
            "hybrid_alloc: NIXL on per-group pools does not stage through host buffers "
            "(kv_buffer_device='cpu' on a GPU)"
        )
    odd = [name for name, t in kv_caches.items() if not isinstance(t, torch.Tensor)]
    if odd or not kv_caches:
        raise RuntimeError(
            "hybrid_alloc: NIXL on per-group pools expects one tensor view per layer "
            f"(not {type(kv_caches[odd[0]]).__name__} for {odd[0]})"
            if odd
            else "hybrid_alloc: NIXL on per-group pools: no KV-cache tensors to register"
        )
    first = next(iter(kv_caches.values()))
    storage = first.untyped_storage()
    storage_base = storage.data_ptr()
    if any(t.untyped_storage().data_ptr() != storage_base for t in kv_caches.values()):
        raise RuntimeError(
            "hybrid_alloc: NIXL on per-group pools expects every layer in one KV-cache allocation"
        )
    kernel_blocks = self._physical_blocks_per_logical_kv_block
    regions = layer_regions(
        config, storage_base, self._layer_specs, base_worker._region_sort_key, kernel_blocks
    )
    check_region_views(regions, kv_caches, storage_base)
    if first.device.type == "cpu":
        mem_type, device = "DRAM", 0
    else:
        mem_type, device = self.nixl_memory_type, max(first.get_device(), 0)
        self.device_id = device

    self.transfer_topo = TransferTopology(
        tp_rank=self.transfer_tp_rank,
        tp_size=self.transfer_tp_size,
        block_size=self.block_size,
        engine_id=self.engine_id,
        is_mla=self.use_mla,
        total_num_kv_heads=1 if self.use_mla else self.model_config.get_total_num_kv_heads(),
        attn_backends=self.attn_backends,
        dcp_size=self.dcp_size,
        tensor_shape=None,
        is_mamba=self._has_mamba,
    )
    layout = layout_fingerprint(regions, self.block_size)
    self.compat_hash = (
        compute_nixl_compatibility_hash(
            self.vllm_config, self.backend_name, transfer_mode=self._TRANSFER_MODE
        )
        + f" ({layout})"
    )
    self._hybrid_alloc_layout = layout

    self.block_len_per_layer = [r.page_bytes for r in regions]
    self.block_stride_per_layer = [r.block_stride for r in regions]
    self.region_group_ids = [r.group for r in regions]
    self.region_names = [r.layer for r in regions]
    self.region_num_blocks = [r.num_blocks for r in regions]
    self._region_is_mla = [self.use_mla] * len(regions)
    self._ssm_region_indices = []
    self._scratch_region_indices = []
    self._ple_block_len = None
    self._ple_region_index = None
    self._set_region_layers([[r.layer] for r in regions])
    self.kv_caches_base_addr[self.engine_id][self.tp_rank] = [r.base for r in regions]
    self.num_regions = len(regions)
    self.region_mem_types = [mem_type] * len(regions)
    self._uses_region_group_mapping = True
    self._mixed_mem_types = False
    self._skip_dram_xfer = False
    self.num_descs = sum(self.region_num_blocks)

    descs = self.nixl_wrapper.get_reg_descs(
        [(storage_base, storage.nbytes(), device, "")], mem_type
    )
    self.nixl_wrapper.register_memory(descs, backends=self.nixl_backends)
    self._registered_descs.append(descs)

    self.device_kv_caches = kv_caches
    self.dst_num_blocks[self.engine_id] = self.num_blocks
    self.dst_region_num_blocks[self.engine_id] = list(self.region_num_blocks)
    self.dst_region_group_ids[self.engine_id] = list(self.region_group_ids)
    self.dst_uses_region_group_mapping[self.engine_id] = True
    self.dst_region_mem_types[self.engine_id] = list(self.region_mem_types)

    handle, blocks_data = self.register_local_xfer_handler(self.block_size)
    self.src_xfer_handles_by_block_size[self.block_size] = handle
    self.src_blocks_data = blocks_data
    logger.info(
        "hybrid_alloc: NIXL registered %d per-layer regions over %d KV-cache groups "
        "(%s blocks a region; %s)",
        len(regions),
        len(set(self.region_group_ids)),
        sorted(set(self.region_num_blocks)),
        layout,
    )

    metadata = NixlAgentMetadata(
        engine_id=self.engine_id,
        agent_metadata=self.nixl_wrapper.get_agent_metadata(),
        device_id=self.device_id,
        kv_caches_base_addr=[r.base for r in regions],
        num_blocks=self.num_blocks,
        block_lens=list(self.block_len_per_layer),
        block_strides=list(self.block_stride_per_layer),
        kv_cache_layout=self.kv_cache_layout,
        block_size=self.block_size,
        ssm_sizes=self._mamba_ssm_size,
        ple_block_len=None,
        attn_backend_name=self.backend_name,
        physical_blocks_per_logical_kv_block=kernel_blocks,
        region_num_blocks=list(self.region_num_blocks),
        region_group_ids=list(self.region_group_ids),
        region_names=list(self.region_names),
        region_mem_types=list(self.region_mem_types),
        dcp_size=self.dcp_size,
        pcp_size=self.pcp_size,
        region_members=self.region_members,
        packed_member_layouts={},
    )
    self.xfer_handshake_metadata = NixlHandshakePayload(
        compatibility_hash=self.compat_hash,
        agent_metadata_bytes=msgspec.msgpack.Encoder().encode(metadata),
    )


def _register_local_xfer_handler(stock: Callable[..., Any]) -> Callable[..., Any]:
    def register_local_xfer_handler(self: Any, block_size: int) -> Any:
        if _per_group(self) is None:
            return stock(self, block_size)
        if block_size != self.block_size:
            raise RuntimeError(
                "hybrid_alloc: NIXL on per-group pools needs the same block size on both "
                f"sides (local {self.block_size} tokens, remote {block_size})"
            )
        regions = _local_regions(self)
        data = region_descriptors(regions, self.device_id)
        descs = self.nixl_wrapper.get_xfer_descs(data, self.region_mem_types[0])
        return self.nixl_wrapper.prep_xfer_dlist("NIXL_INIT_AGENT", descs), data

    return register_local_xfer_handler


def _local_regions(self: Any) -> list[Region]:
    return [
        Region(layer, group, base, length, stride, count)
        for layer, group, base, length, stride, count in zip(
            self.region_names,
            self.region_group_ids,
            self.kv_caches_base_addr[self.engine_id][self.tp_rank],
            self.block_len_per_layer,
            self.block_stride_per_layer,
            self.region_num_blocks,
            strict=True,
        )
    ]


def _compute_desc_ids(stock: Callable[..., Any]) -> Callable[..., Any]:
    def compute_desc_ids(
        self: Any,
        block_ids: Sequence[Sequence[int]],
        dst_num_blocks: int,
        block_size_ratio: float | None,
        physical_blocks_per_logical: int,
        region_num_blocks: list[int] | None = None,
        region_group_ids: list[int] | None = None,
        uses_region_group_mapping: bool | None = None,
    ) -> Any:
        if _per_group(self) is None:
            return stock(
                self,
                block_ids,
                dst_num_blocks,
                block_size_ratio,
                physical_blocks_per_logical,
                region_num_blocks,
                region_group_ids,
                uses_region_group_mapping,
            )
        return descriptor_ids(
            block_ids,
            self.region_group_ids if region_group_ids is None else region_group_ids,
            self.region_num_blocks if region_num_blocks is None else region_num_blocks,
        )

    return compute_desc_ids


def _build_mamba_remote(stock: Callable[..., Any]) -> Callable[..., Any]:
    """On per-group pools a state layer is one region like any other (its descriptors
    are in the per-layer list), so there are no separate conv/SSM descriptors."""

    def build_mamba_remote(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _per_group(self) is None:
            return stock(self, *args, **kwargs)
        return np.empty((0, 3), dtype=np.uint64)

    return build_mamba_remote


def _add_remote_agent(stock: Callable[..., Any]) -> Callable[..., Any]:
    def add_remote_agent(
        self: Any,
        nixl_agent_meta: Any,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
        remote_dcp_size: int = 1,
    ) -> Any:
        if _per_group(self) is not None:
            check_peer_layout(self, nixl_agent_meta, remote_tp_size)
        return stock(self, nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    return add_remote_agent


def check_peer_layout(worker: Any, meta: Any, remote_tp_size: int) -> None:
    """Refuse a peer whose pages this worker's descriptors do not match.

    Raises:
        RuntimeError: naming both layouts, when the tensor-parallel size, the block
            size, or the regions (layers, groups, page lengths) differ.
    """
    local = getattr(worker, "_hybrid_alloc_layout", LAYOUT_TAG)
    problems = []
    if remote_tp_size != worker.transfer_tp_size:
        problems.append(
            f"tensor parallel size {remote_tp_size} there, {worker.transfer_tp_size} here"
        )
    if meta.block_size != worker.block_size:
        problems.append(f"block size {meta.block_size} there, {worker.block_size} here")
    theirs_split = meta.physical_blocks_per_logical_kv_block
    ours_split = worker._physical_blocks_per_logical_kv_block
    if theirs_split != ours_split:
        problems.append(f"{theirs_split} kernel blocks a block there, {ours_split} here")
    theirs = (meta.region_names, meta.region_group_ids, list(meta.block_lens))
    ours = (worker.region_names, worker.region_group_ids, worker.block_len_per_layer)
    if not problems and theirs != ours:
        problems.append(
            f"{len(meta.block_lens)} regions there ({_describe(*theirs)}), "
            f"{len(worker.block_len_per_layer)} here ({_describe(*ours)})"
        )
    if problems:
        raise RuntimeError(
            f"hybrid_alloc: NIXL peer {meta.engine_id} cannot exchange KV with this "
            f"engine ({local}): " + "; ".join(problems)
        )


def _describe(names: Any, groups: Any, lens: Sequence[int]) -> str:
    names = list(names or [])
    groups = list(groups or [])
    shown = [
        f"{n}: group {g}, {b} B" for n, g, b in zip(names[:3], groups[:3], lens[:3], strict=False)
    ]
    return ", ".join(shown) + (", ..." if len(lens) > 3 else "")


INJECT_FAILURES_KEY = "hybrid_alloc_inject_transfer_failures"
"""A test aid: ``kv_connector_extra_config[INJECT_FAILURES_KEY] = N`` makes the decode
side's first N reads that carry blocks fail as a failed NIXL transfer does (nothing is
read; the blocks keep whatever bytes they held). vLLM then fails the request, or under
``kv_load_failure_policy="recompute"`` computes it again."""


def _injecting_read_blocks(stock: Callable[..., bool]) -> Callable[..., bool]:
    def read_blocks(self: Any, read_spec: Any, *args: Any, **kwargs: Any) -> bool:
        left = _failures_left(self)
        carries = any(len(group) for group in read_spec.local_block_ids)
        if left and carries and _per_group(self) is not None:
            self._hybrid_alloc_failures_left = left - 1
            request_id = kwargs.get("request_id", args[1] if len(args) > 1 else None)
            logger.warning(
                "hybrid_alloc: NIXL read for request %s failed on purpose (%s)",
                request_id,
                INJECT_FAILURES_KEY,
            )
            self._handle_failed_transfer(request_id, None, self._recv_failures)
            return False
        return stock(self, read_spec, *args, **kwargs)

    return read_blocks


def _failures_left(worker: Any) -> int:
    left = getattr(worker, "_hybrid_alloc_failures_left", None)
    if left is None:
        extra = worker.kv_transfer_config.kv_connector_extra_config or {}
        left = int(extra.get(INJECT_FAILURES_KEY, 0))
        worker._hybrid_alloc_failures_left = left
    return int(left)


def _module() -> Any:
    import importlib

    return importlib.import_module(_WORKER_MODULE)


# (module, class, attribute, wrapper factory)
_HOOKS: tuple[tuple[str, str | None, str, Callable[[Any], Any]], ...] = (
    (_WORKER_MODULE, _WORKER, "_sync_block_size_with_kernel", _sync_block_size_with_kernel),
    (_WORKER_MODULE, _WORKER, "register_kv_caches", _register_kv_caches),
    (_WORKER_MODULE, _WORKER, "register_local_xfer_handler", _register_local_xfer_handler),
    (_WORKER_MODULE, _WORKER, "_compute_desc_ids", _compute_desc_ids),
    (_WORKER_MODULE, _WORKER, "_build_mamba_remote", _build_mamba_remote),
    (_WORKER_MODULE, _WORKER, "add_remote_agent", _add_remote_agent),
    (f"{_PACKAGE}.pull_worker", "NixlPullConnectorWorker", "_read_blocks", _injecting_read_blocks),
)
_hooks = hooks.HookSet(_HOOKS, hooks.log_missing(logger, logging.DEBUG))


def install() -> None:
    """Wrap the NIXL worker's layout functions (idempotent) on the vLLM releases whose
    NIXL worker they fit (:attr:`.versions.VllmRelease.nixl_per_group`); a vLLM build
    without NIXL's connector module is left alone."""
    if versions.release().nixl_per_group:
        _hooks.install()


def uninstall() -> None:
    _hooks.uninstall()


def is_installed() -> bool:
    return _hooks.installed()
