"""The KV-cache stand-ins of the offloading tests: vLLM's canonical KV caches over random
rows, a real per-group config with three pools and layer views into one allocation (as the
worker builds them), vLLM's load/store specs, and the fields of a VllmConfig vLLM's offload
config builder reads."""

from __future__ import annotations

import importlib
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from tests.planner.specs import BLOCK, MAX_LEN, attention, small_engine_config, small_mamba

CONFIG_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"


def base() -> Any:
    return importlib.import_module("vllm.v1.kv_offload.base")


def cpu_spec(chunk_ids: list[int]) -> Any:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return CPULoadStoreSpec(chunk_ids)


def gpu_spec(blocks: list[list[int]], indices: list[int]) -> Any:
    flat = [b for group in blocks for b in group]
    return base().GPULoadStoreSpec(flat, [len(g) for g in blocks], indices)


def build_caches(
    groups: list[tuple[int, list[tuple[int, int]]]], seed: int = 0
) -> tuple[Any, list[torch.Tensor], list[list[int]]]:
    """CanonicalKVCaches over random int8 rows: per group ``(num_blocks, [(row bytes, ref
    page bytes) per layer])``. Each row view is strided (16 bytes between rows), like a
    layer's view into a larger allocation. Returns (caches, row views, tensor indices of
    each group)."""
    b = base()
    gen = torch.Generator().manual_seed(seed)
    tensors, refs, views, members = [], [], [], []
    for num_blocks, layers in groups:
        group_refs, group_members = [], []
        for row, page in layers:
            backing = torch.randint(-128, 128, (num_blocks * (row + 16),), generator=gen)
            view = backing.to(torch.int8).as_strided((num_blocks, row), (row + 16, 1))
            tensors.append(b.CanonicalKVCacheTensor(tensor=view, page_size_bytes=row))
            group_refs.append(
                b.CanonicalKVCacheRef(tensor_idx=len(tensors) - 1, page_size_bytes=page)
            )
            views.append(view)
            group_members.append(len(tensors) - 1)
        refs.append(group_refs)
        members.append(group_members)
    return b.CanonicalKVCaches(tensors=tensors, group_data_refs=refs), views, members


def per_group_config(padded_mamba: bool = True) -> PerGroupKVCacheConfig:
    """A real per-group config (engine sizing): group 0 two Mamba layers ('align', page
    padded by 512 bytes here), group 1 two full-attention layers, group 2 one
    sliding-window layer; three pools of different sizes."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("align", caching=True)
    specs = {
        "m.0": small_mamba("align"),
        "a.0": attention(),
        "a.1": attention(),
        "w.0": attention(window=64),
        "m.1": small_mamba("align"),
    }
    groups = sizing.build_groups(specs)
    if padded_mamba:
        mamba = groups[0].kv_cache_spec
        padded = replace(mamba, page_size_padded=mamba.page_size_bytes + 512)
        groups[0] = KVCacheGroupSpec(list(groups[0].layer_names), padded)
    config = sizing.build_config(cfg, groups, sizing.size_groups(cfg, groups, 16 << 20))
    assert isinstance(config, PerGroupKVCacheConfig)
    return config


MAMBA_PAGE = 4 * 64 * 2 + 8 * 16 * 16 * 2  # small_mamba's conv + temporal state, bf16
ATTENTION_PAGE = 2 * BLOCK * 2 * 64 * 2  # K and V, 16 tokens, 2 heads of 64, bf16


def layer_views(config: PerGroupKVCacheConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each layer's KV view into one int8 backing allocation, sized by its own pool:
    Mamba layers as int8 and full-attention layers as bf16 rows, both with a block stride
    64 bytes larger than the page; the sliding-window layer split into two kernel blocks
    per block (bf16, contiguous blocks)."""
    plan = []
    offset = 0
    for gid, group in enumerate(config.kv_cache_groups):
        num_blocks = config.layout_of_group(gid).num_blocks
        page = group.kv_cache_spec.page_size_bytes
        stride = page if "w.0" in group.layer_names else page + 64
        for name in group.layer_names:
            plan.append((name, num_blocks, page, stride, offset))
            offset += num_blocks * stride + 128
    backing = torch.randint(-128, 128, (offset,), generator=torch.Generator().manual_seed(5))
    backing = backing.to(torch.int8)
    views: dict[str, torch.Tensor] = {}
    for name, num_blocks, page, stride, start in plan:
        if name.startswith("m."):
            views[name] = backing.as_strided((num_blocks, page), (stride, 1), start)
        elif name.startswith("a."):
            bf16 = backing.view(torch.bfloat16)
            views[name] = bf16.as_strided((num_blocks, page // 2), (stride // 2, 1), start // 2)
        else:
            bf16 = backing.view(torch.bfloat16)
            views[name] = bf16.as_strided((num_blocks * 2, page // 4), (stride // 4, 1), start // 2)
    return backing, views


def block_bytes(view: torch.Tensor, num_blocks: int, b: int, page: int) -> torch.Tensor:
    """Block ``b`` of a layer view (split into kernel blocks or not) as ``page`` bytes."""
    split = view.shape[0] // num_blocks
    return view[b * split : (b + 1) * split].contiguous().view(torch.int8).flatten()[:page]


def offload_vllm_config(**extra: Any) -> SimpleNamespace:
    """The fields of VllmConfig vLLM's build_offloading_config reads, with an
    OffloadingConnector as --kv-offloading-size sets it up."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            engine_id="engine-0",
            kv_connector="OffloadingConnector",
            kv_connector_extra_config={"cpu_bytes_to_use": 64 << 20, **extra},
        ),
        parallel_config=SimpleNamespace(
            rank=0,
            world_size=1,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=0,
            distributed_executor_backend="mp",
            nnodes_within_dp=1,
        ),
        cache_config=SimpleNamespace(
            block_size=BLOCK,
            enable_prefix_caching=True,
            prefix_match_unit=None,
            cache_dtype="auto",
            kv_cache_layout=None,
        ),
        model_config=SimpleNamespace(
            model="tiny-hybrid",
            dtype=torch.bfloat16,
            use_mla=False,
            max_model_len=MAX_LEN,
            get_total_num_kv_heads=lambda: 2,
        ),
        kv_events_config=None,
        use_v2_model_runner=False,
    )


def plain_config() -> Any:
    """vLLM's own config for two full-attention layers in one group, 100 blocks."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    return KVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[
            KVCacheTensor(
                size=100 * 2 * ATTENTION_PAGE,
                layers=["a.0", "a.1"],
                layer_stride=100 * ATTENTION_PAGE,
                block_stride=ATTENTION_PAGE,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["a.0", "a.1"], attention())],
    )
