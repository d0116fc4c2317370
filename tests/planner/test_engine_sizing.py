"""The engine core's per-group sizing (:mod:`hybrid_alloc.integration.engine_sizing`): groups,
pool sizes, tensor regions, and where it falls back to vLLM's shared pool."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from tests.helpers import BLOCK, MAX_LEN, attn, fake_vllm_config
from tests.helpers import state_mamba as mamba


# ------------------------------------------------------------------- sizing
def qwen_like_specs(mode: str) -> dict[str, Any]:
    """3 GDN-like layers (page padded as vLLM's platform hook would) and 1 attention."""
    from dataclasses import replace

    m = replace(mamba(mode), page_size_padded=attn().page_size_bytes)
    return {"l.0": m, "l.1": m, "l.2": m, "l.3": attn()}


def test_groups_are_per_spec_and_unpadded() -> None:
    from hybrid_alloc.integration import engine_sizing as sizing

    groups = sizing.build_groups(qwen_like_specs("none"))
    assert [g.layer_names for g in groups] == [["l.0", "l.1", "l.2"], ["l.3"]]
    spec = groups[0].kv_cache_spec
    assert spec.page_size_padded is None
    assert spec.page_size_bytes == 4 * 64 * 2 + 8 * 16 * 16 * 2


@pytest.mark.parametrize("mode", ["none", "align"])
def test_pool_sizes(mode: str) -> None:
    from hybrid_alloc.integration import engine_sizing as sizing

    cfg = fake_vllm_config(mode, caching=mode == "align")
    plans = sizing.plan_groups(cfg, sizing.build_groups(qwen_like_specs(mode)))
    memory = 8 << 20
    sizes = sizing.plan_pool_sizes(cfg, plans, memory)
    per_req = plans[0].blocks_per_request
    assert per_req == (1 if mode == "none" else 2)
    factor = 1 if mode == "none" else sizing.ALIGN_CACHE_FACTOR
    assert sizes[0] == 16 * per_req * factor + 1
    used = sum(n * p.bytes_per_block for n, p in zip(sizes, plans, strict=True))
    assert used <= memory
    # Everything left (but rounding and region padding) goes to attention.
    assert memory - used < plans[1].bytes_per_block + sizing.REGION_ALIGNMENT * 2
    with pytest.raises(ValueError, match="max_num_seqs"):
        sizing.plan_pool_sizes(cfg, plans, plans[0].bytes_per_block * 4)
    with pytest.raises(ValueError, match="max_model_len"):
        sizing.plan_pool_sizes(cfg, plans, sizes[0] * plans[0].bytes_per_block + 100_000)
    over = sizing.plan_pool_sizes(fake_vllm_config(mode, override=80), plans, memory)
    assert over == [sizes[0], 80]


def test_growing_pools_split_by_one_request() -> None:
    """Full attention and sliding window: the memory after the Mamba pool is split in
    proportion to what one max-length request needs in each group."""
    from hybrid_alloc.integration import engine_sizing as sizing

    cfg = fake_vllm_config("none")
    specs = {"l.0": mamba("none"), "l.1": attn(), "l.2": attn(window=64)}
    plans = sizing.plan_groups(cfg, sizing.build_groups(specs))
    assert [p.grows for p in plans] == [False, True, True]
    sizes = sizing.plan_pool_sizes(cfg, plans, 16 << 20)
    full, swa = plans[1].blocks_per_request, plans[2].blocks_per_request
    assert full == MAX_LEN // BLOCK and swa < full
    # Both pools hold (about) the same number of max-length requests.
    assert abs(sizes[1] / full - sizes[2] / swa) < 1
    config = sizing.build_config(cfg, plans, sizes)
    assert config.num_blocks == sizes[1]  # the primary pool: the first that grows
    concurrency = sizing.get_max_concurrency_for_kv_cache_config(cfg, config)
    assert concurrency == min(sizes[1] / full, sizes[2] / swa)


@pytest.mark.parametrize("layout_name", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_config_tensors_are_disjoint_views(layout_name: str) -> None:
    """vLLM's own worker allocation on the config: every group's views stay inside its
    region, with its own block count, and writing one group never touches another."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid_alloc.integration import engine_sizing as sizing

    layout = KVCacheLayout[layout_name]
    cfg = fake_vllm_config("none")
    cfg.cache_config.get_resolved_kv_cache_layout = lambda: layout
    plans = sizing.plan_groups(cfg, sizing.build_groups(qwen_like_specs("none")))
    sizes = sizing.plan_pool_sizes(cfg, plans, 4 << 20)
    config = sizing.build_config(cfg, plans, sizes)
    assert isinstance(config, PerGroupKVCacheConfig)
    assert config.num_blocks == sizes[1]
    assert [p.num_blocks for p in config.pool_layouts] == sizes
    assert len({t.size for t in config.kv_cache_tensors}) == 1
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    assert caches["l.0"].shape[0] == sizes[0] and caches["l.3"].shape[0] == sizes[1]
    for name, cache in caches.items():
        cache.view(torch.uint8).fill_(int(name[-1]) + 1)
    for name, cache in caches.items():
        assert bool((cache.view(torch.uint8) == int(name[-1]) + 1).all()), name
    limits = sizing.get_max_concurrency_for_kv_cache_config(cfg, config)
    assert limits == sizes[1] / plans[1].blocks_per_request


def test_unsupported_engines_fall_back() -> None:
    from hybrid_alloc.integration import engine_sizing as sizing

    cfg = fake_vllm_config()
    specs = qwen_like_specs("none")
    assert sizing.unsupported_reason(cfg, [specs]) is None
    assert "hybrid" in (sizing.unsupported_reason(cfg, [{"l.3": attn()}]) or "")
    assert "'all'" in (sizing.unsupported_reason(cfg, [qwen_like_specs("all")]) or "")
    assert "pipeline" in (sizing.unsupported_reason(cfg, [specs, {"l.3": attn()}]) or "")
    cfg.speculative_config = object()
    assert "speculative" in (sizing.unsupported_reason(cfg, [specs]) or "")
    assert "speculative" in (sizing.config_unsupported_reason(cfg) or "")


def test_gpu_worker_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM's GPU worker (not run here) cannot take from per-group pools: zeroing
    new attention blocks by bare ID over several attention pools, and the V2 runner's
    fabricated profiling block IDs in 'align' mode. The CPU worker takes both."""
    from vllm.platforms import current_platform

    from hybrid_alloc.integration import engine_sizing as sizing

    two_attention = {"l.0": mamba("align"), "l.1": attn(), "l.2": attn(window=64)}
    cfg = fake_vllm_config("align", caching=True)
    # vLLM 0.33's CUDA wheel on a machine without a GPU reports no CPU platform: pin it.
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: True)
    assert sizing.unsupported_reason(cfg, [two_attention]) is None
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    assert "several attention pools" in (sizing.unsupported_reason(cfg, [two_attention]) or "")
    assert sizing.unsupported_reason(cfg, [qwen_like_specs("align")]) is None
    cfg.use_v2_model_runner = True
    assert "V2" in (sizing.config_unsupported_reason(cfg) or "")
    assert sizing.config_unsupported_reason(fake_vllm_config("none")) is None


def test_fallback_sizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model per-group pools do not serve goes to vLLM's sizing when its Mamba pages
    were padded for it, and fails with a clear error when the workers left them natural."""
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from hybrid_alloc.integration import engine_sizing as sizing

    calls: list[Any] = []
    monkeypatch.setattr(sizing, "_stock_get_kv_cache_configs", lambda *a: calls.append(a))
    cfg = fake_vllm_config()
    local = ChunkedLocalAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        attention_chunk_size=64,
    )
    padded = qwen_like_specs("none")
    padded["l.3"] = local
    sizing.get_kv_cache_configs(cfg, [padded], [8 << 20])
    assert len(calls) == 1
    natural = {
        name: replace(spec, page_size_padded=None) if name != "l.3" else spec
        for name, spec in padded.items()
    }
    with pytest.raises(RuntimeError, match="HYBRID_ALLOC_PER_GROUP_POOLS=0"):
        sizing.get_kv_cache_configs(cfg, [natural], [8 << 20])
    cfg.speculative_config = object()  # the workers padded: vLLM sizes it
    sizing.get_kv_cache_configs(cfg, [padded], [8 << 20])
    assert len(calls) == 2
