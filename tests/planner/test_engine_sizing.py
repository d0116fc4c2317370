"""The engine core's per-group sizing (:mod:`hybrid_alloc.integration.scheduler.engine_sizing`):
groups, pool sizes, tensor regions, and where it falls back to vLLM's shared pool."""

from __future__ import annotations

from typing import Any
from unittest.mock import patch

import pytest
import torch

from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from tests.helpers import kv_connector
from tests.planner.specs import BLOCK, MAX_LEN, attention, small_engine_config, small_mamba


@pytest.fixture(autouse=True)
def static_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the static per-group split (elastic pools off); the elastic
    layout has its own (tests/planner/test_elastic_sizing.py)."""
    monkeypatch.setenv("HYBRID_ALLOC_ELASTIC_POOLS", "0")


# ------------------------------------------------------------------- sizing
def qwen_like_specs(mode: str) -> dict[str, Any]:
    """3 GDN-like layers (page padded as vLLM's platform hook would) and 1 attention."""
    from dataclasses import replace

    m = replace(small_mamba(mode), page_size_padded=attention().page_size_bytes)
    return {"l.0": m, "l.1": m, "l.2": m, "l.3": attention()}


def test_groups_are_per_spec_and_unpadded() -> None:
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    groups = sizing.build_groups(qwen_like_specs("none"))
    assert [g.layer_names for g in groups] == [["l.0", "l.1", "l.2"], ["l.3"]]
    spec = groups[0].kv_cache_spec
    assert spec.page_size_padded is None
    assert spec.page_size_bytes == 4 * 64 * 2 + 8 * 16 * 16 * 2


@pytest.mark.parametrize("mode", ["none", "align"])
def test_pool_sizes(mode: str) -> None:
    from hybrid_alloc import sizing as model
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config(mode, caching=mode == "align")
    groups = sizing.build_groups(qwen_like_specs(mode))
    memory = 8 << 20
    pools = sizing.size_groups(cfg, groups, memory)
    sizes = [p.num_blocks for p in pools.pools]
    mamba_needs, attention_needs = (p.needs for p in pools.pools)
    assert mamba_needs.kind == "fixed" and attention_needs.kind == "growing"
    assert mamba_needs.blocks_per_request == (1 if mode == "none" else 2)
    factor = 1 if mode == "none" else model.ALIGN_CACHE_FACTOR
    assert sizes[0] == 16 * mamba_needs.blocks_per_request * factor + 1
    assert pools.used_bytes <= memory
    # Everything left (but rounding and region padding) goes to attention.
    assert memory - pools.used_bytes < attention_needs.block_bytes + model.REGION_ALIGNMENT * 2
    # Not even one request fits: an error that names the group and the numbers.
    one = (mamba_needs.blocks_per_request * factor + 1) * mamba_needs.block_bytes
    with pytest.raises(ValueError, match=r"not even one request fits \(max_num_seqs=16") as small:
        sizing.size_groups(cfg, groups, mamba_needs.block_bytes * 2)
    assert "group 0 (MambaSpec x3 layers" in str(small.value)
    assert f"{one:,} B" in str(small.value)
    with pytest.raises(ValueError, match="max_model_len") as short:
        sizing.size_groups(cfg, groups, one + 100_000)
    assert "group 1 (FullAttentionSpec" in str(short.value)
    assert isinstance(short.value, model.SizingError) and short.value.shortfall_bytes > 0
    over = sizing.size_groups(small_engine_config(mode, override=80), groups, memory)
    assert [p.num_blocks for p in over.pools] == [sizes[0], 80]


def test_sliding_window_pools_are_bounded() -> None:
    """Sliding window next to full attention: the window group's pool holds max_num_seqs
    capped requests (sized before the growing pool, not counted in capacity); the full
    attention pool gets the rest and is the primary pool."""
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("none")
    specs = {"l.0": small_mamba("none"), "l.1": attention(), "l.2": attention(window=64)}
    groups = sizing.build_groups(specs)
    pools = sizing.size_groups(cfg, groups, 16 << 20)
    assert [p.needs.kind for p in pools.pools] == ["fixed", "growing", "bounded"]
    assert [p.grows for p in pools.pools] == [False, True, False]
    full, swa = pools.pools[1], pools.pools[2]
    assert full.needs.blocks_per_request == MAX_LEN // BLOCK
    # vLLM's cap: window - 1 tokens plus the 256 in flight, and one block more.
    assert swa.needs.blocks_per_request == -(-(63 + 256) // BLOCK) + 1
    assert swa.num_blocks == 16 * swa.needs.blocks_per_request + 1
    config = sizing.build_config(cfg, groups, pools)
    assert config.num_blocks == full.num_blocks  # the primary pool: the first that grows
    assert [p.grows for p in config.pool_layouts] == [False, True, False]
    concurrency = sizing.get_max_concurrency_for_kv_cache_config(cfg, config)
    assert concurrency == full.num_blocks / full.needs.blocks_per_request


def test_sliding_window_grows_where_nothing_else_does() -> None:
    """Only sliding-window attention next to Mamba: the window pool takes the memory left
    over and is the primary pool; a window covering the context grows as full attention."""
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("none")
    groups = sizing.build_groups({"l.0": small_mamba("none"), "l.1": attention(window=64)})
    pools = sizing.size_groups(cfg, groups, 16 << 20)
    assert [p.needs.kind for p in pools.pools] == ["fixed", "bounded"]
    assert [p.grows for p in pools.pools] == [False, True]
    config = sizing.build_config(cfg, groups, pools)
    assert config.num_blocks == pools.pools[1].num_blocks
    wide = sizing.build_groups(
        {"l.0": small_mamba("none"), "l.1": attention(), "l.2": attention(window=2048)}
    )
    kinds = [p.needs.kind for p in sizing.size_groups(cfg, wide, 16 << 20).pools]
    assert kinds == ["fixed", "growing", "growing"]


def test_growing_pools_split_by_one_request() -> None:
    """Two growing groups (full attention of two head sizes): the memory after the Mamba
    pool is split in proportion to what one max-length request needs in each."""
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("none")
    specs = {"l.0": small_mamba("none"), "l.1": attention(), "l.2": attention(head_size=32)}
    groups = sizing.build_groups(specs)
    pools = sizing.size_groups(cfg, groups, 16 << 20)
    assert [p.grows for p in pools.pools] == [False, True, True]
    wide_pool, narrow_pool = pools.pools[1], pools.pools[2]
    assert wide_pool.needs.block_bytes == 2 * narrow_pool.needs.block_bytes
    # Both pools hold (about) the same number of max-length requests.
    per_request = MAX_LEN // BLOCK
    assert abs(wide_pool.num_blocks - narrow_pool.num_blocks) <= 1
    config = sizing.build_config(cfg, groups, pools)
    assert config.num_blocks == wide_pool.num_blocks  # the primary pool: the first that grows
    concurrency = sizing.get_max_concurrency_for_kv_cache_config(cfg, config)
    assert concurrency == min(wide_pool.num_blocks, narrow_pool.num_blocks) / per_request


@pytest.mark.parametrize("layout_name", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_config_tensors_are_disjoint_views(layout_name: str) -> None:
    """vLLM's own worker allocation on the config: every group's views stay inside its
    region, with its own block count, and writing one group never touches another."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    layout = KVCacheLayout[layout_name]
    cfg = small_engine_config("none")
    cfg.cache_config.get_resolved_kv_cache_layout = lambda: layout
    groups = sizing.build_groups(qwen_like_specs("none"))
    pools = sizing.size_groups(cfg, groups, 4 << 20)
    sizes = [p.num_blocks for p in pools.pools]
    config = sizing.build_config(cfg, groups, pools)
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
    assert limits == sizes[1] / pools.pools[1].needs.blocks_per_request


def test_unsupported_engines_fall_back() -> None:
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config()
    specs = qwen_like_specs("none")
    assert sizing.unsupported_reason(cfg, [specs]) is None
    assert "hybrid" in (sizing.unsupported_reason(cfg, [{"l.3": attention()}]) or "")
    assert "'all'" in (sizing.unsupported_reason(cfg, [qwen_like_specs("all")]) or "")
    # Pipeline stages hold different layers: served, unless they disagree on a layer.
    assert sizing.unsupported_reason(cfg, [specs, {"l.3": attention()}]) is None
    other = {"l.3": attention(head_size=128)}
    assert "different specs" in (sizing.unsupported_reason(cfg, [specs, other]) or "")
    cfg.kv_transfer_config = kv_connector()
    assert "'LMCacheConnectorV1'" in (sizing.config_unsupported_reason(cfg) or "")
    # vLLM's NixlConnector, pull or push mode: served per group (hybrid_alloc's NIXL hooks),
    # but not pipeline stages, tensor parallelism or host staging buffers on a GPU.
    from hybrid_alloc.integration import versions

    for name in ("NixlPushConnector", "NixlPullConnector"):
        cfg.kv_transfer_config = kv_connector(name)
        with patch.dict("os.environ", {"HYBRID_ALLOC_ELASTIC_POOLS": "1"}):
            reason = sizing.config_unsupported_reason(cfg)
        if versions.release().nixl_per_group:
            assert reason is None, name
        else:
            assert f"{name} on vLLM 0.33" in (reason or "")
    cfg.kv_transfer_config = kv_connector("NixlConnector")
    cfg.kv_transfer_config.kv_buffer_device = "cpu"
    elastic = patch.dict("os.environ", {"HYBRID_ALLOC_ELASTIC_POOLS": "1"})
    if not versions.release().nixl_per_group:  # vLLM 0.33: its NIXL worker is not adapted
        assert "NixlConnector on vLLM 0.33" in (sizing.config_unsupported_reason(cfg) or "")
    else:
        with elastic:
            assert sizing.config_unsupported_reason(cfg) is None
        nixl = kv_connector("NixlConnector")
        with elastic:
            assert sizing.kv_connector_unsupported_reason(nixl, cfg) is None
            cfg.parallel_config.pipeline_parallel_size = 2
            reason = sizing.kv_connector_unsupported_reason(nixl, cfg)
            assert "pipeline parallelism" in (reason or "")
            cfg.parallel_config.pipeline_parallel_size = 1
            cfg.parallel_config.tensor_parallel_size = 2
            reason = sizing.kv_connector_unsupported_reason(nixl, cfg)
            assert "tensor parallelism" in (reason or "")
            cfg.parallel_config.tensor_parallel_size = 1
            nixl.kv_buffer_device = "cpu"
            with patch("vllm.platforms.current_platform.is_cpu", return_value=False):
                assert "host buffers" in (sizing.kv_connector_unsupported_reason(nixl) or "")
        with patch.dict("os.environ", {"HYBRID_ALLOC_ELASTIC_POOLS": "0"}):
            assert "static split" in (sizing.kv_connector_unsupported_reason(nixl) or "")
    # VLLM_USE_SIMPLE_KV_OFFLOAD=1: --kv-offloading-size picks this one; refused by name.
    cfg.kv_transfer_config = kv_connector("SimpleCPUOffloadConnector", cpu_bytes_to_use=1 << 30)
    assert "'SimpleCPUOffloadConnector'" in (sizing.config_unsupported_reason(cfg) or "")
    # vLLM's decode benchmark connector fills each group's blocks by that group's IDs.
    cfg.kv_transfer_config = kv_connector("DecodeBenchConnector", fill_mean=0.015)
    assert sizing.config_unsupported_reason(cfg) is None
    # --kv-offloading-size with vLLM's native backend: served per group (hybrid_alloc's
    # offload hooks); its other tiers and the canonical host layout are refused by name.
    cfg.kv_transfer_config = kv_connector("OffloadingConnector", cpu_bytes_to_use=1 << 30)
    assert sizing.config_unsupported_reason(cfg) is None
    # vLLM's tiering spec: served with filesystem tiers; any other tier refused by name.
    tiering = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30}
    fs = {"type": "fs", "root_dir": "/tmp/kv"}
    cfg.kv_transfer_config = kv_connector("OffloadingConnector", **tiering)
    assert sizing.config_unsupported_reason(cfg) is None
    cfg.kv_transfer_config = kv_connector("OffloadingConnector", **tiering, secondary_tiers=[fs])
    assert sizing.config_unsupported_reason(cfg) is None
    for tier in ({"type": "obj"}, {**fs, "module_path": "my.tiers"}):
        cfg.kv_transfer_config = kv_connector(
            "OffloadingConnector", **tiering, secondary_tiers=[fs, tier]
        )
        assert "secondary offload tier '" in (sizing.config_unsupported_reason(cfg) or "")
    cfg.kv_transfer_config = kv_connector("OffloadingConnector", spec_name="MySpec")
    assert "'MySpec'" in (sizing.config_unsupported_reason(cfg) or "")
    cfg.kv_transfer_config = kv_connector("OffloadingConnector", canonical_layout=True)
    assert "canonical_layout" in (sizing.config_unsupported_reason(cfg) or "")
    # vLLM's MultiConnector: served where every child is; else the first child refused,
    # by its place and name, with its own reason.
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
    }
    nixl_child = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    cfg.kv_transfer_config = kv_connector("MultiConnector", connectors=[offload, lmcache])
    reason = sizing.config_unsupported_reason(cfg) or ""
    assert reason.startswith("MultiConnector child 1 ('LMCacheConnectorV1'): KV connector")
    cfg.kv_transfer_config = kv_connector("MultiConnector", connectors=[])
    assert "without connectors" in (sizing.config_unsupported_reason(cfg) or "")
    cfg.kv_transfer_config = kv_connector("MultiConnector", connectors=[{"kv_role": "bad"}])
    assert "MultiConnector child 0 (None)" in (sizing.config_unsupported_reason(cfg) or "")
    cfg.kv_transfer_config = kv_connector("MultiConnector", connectors=[nixl_child, offload])
    with patch.dict("os.environ", {"HYBRID_ALLOC_ELASTIC_POOLS": "1"}):
        reason = sizing.config_unsupported_reason(cfg)
        if versions.release().nixl_per_group:
            assert reason is None
        else:
            assert (reason or "").startswith("MultiConnector child 0 ('NixlConnector'): Nixl")
    with patch.dict("os.environ", {"HYBRID_ALLOC_ELASTIC_POOLS": "0"}):
        reason = sizing.config_unsupported_reason(cfg) or ""
        assert reason.startswith("MultiConnector child 0 ('NixlConnector'): NixlConnector")


def test_gpu_worker_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM's GPU worker (not run here) cannot take from per-group pools: zeroing
    new attention blocks by bare ID over several attention pools, and the V2 runner's
    fabricated profiling block IDs in 'align' mode. The CPU worker takes both."""
    from vllm.platforms import current_platform

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    two_attention = {"l.0": small_mamba("align"), "l.1": attention(), "l.2": attention(window=64)}
    cfg = small_engine_config("align", caching=True)
    # vLLM 0.33's CUDA wheel on a machine without a GPU reports no CPU platform: pin it.
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: True)
    assert sizing.unsupported_reason(cfg, [two_attention]) is None
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    assert "several attention pools" in (sizing.unsupported_reason(cfg, [two_attention]) or "")
    natural = {"l.0": small_mamba("align"), "l.1": attention()}
    assert sizing.unsupported_reason(cfg, [natural]) is None
    cfg.use_v2_model_runner = True
    assert "V2" in (sizing.config_unsupported_reason(cfg) or "")
    assert sizing.config_unsupported_reason(small_engine_config("none")) is None


def test_padded_align_pages_keep_vllms_layout() -> None:
    """'align' Mamba pages the workers padded (their hook kept vLLM's layout: a state page
    larger than an attention block) send the engine core to vLLM's shared pool; the same
    pages unpadded, or padded in 'none' mode, get per-group pools."""
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("align", caching=True)
    reason = sizing.unsupported_reason(cfg, [qwen_like_specs("align")])
    assert reason is not None and "'align'" in reason and "FINE_ALIGN_BLOCKS" in reason
    natural = {"l.0": small_mamba("align"), "l.1": attention()}
    assert sizing.unsupported_reason(cfg, [natural]) is None
    none_cfg = small_engine_config("none")
    assert sizing.unsupported_reason(none_cfg, [qwen_like_specs("none")]) is None


def test_fallback_sizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model per-group pools do not serve goes to vLLM's sizing when its Mamba pages
    were padded for it, and fails with a clear error when the workers left them natural."""
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    calls: list[Any] = []
    monkeypatch.setattr(sizing, "_stock_get_kv_cache_configs", lambda *a: calls.append(a))
    cfg = small_engine_config()
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
    cfg.kv_transfer_config = kv_connector()  # the workers padded: vLLM sizes it
    sizing.get_kv_cache_configs(cfg, [padded], [8 << 20])
    assert len(calls) == 2


@pytest.mark.parametrize("mode", ["none", "align"])
def test_over_subscription_lowers_concurrency(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """The Mamba states of max_num_seqs requests do not fit next to one max_model_len
    request: the pools are sized for as many requests as fit, and one warning names both
    counts; the scheduler's admission then waits on the Mamba pool."""
    import logging

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config(mode, caching=mode == "align")
    groups = sizing.build_groups(qwen_like_specs(mode))
    fits = sizing.size_groups(cfg, groups, 8 << 20)
    mamba, attention = (p.needs for p in fits.pools)
    attention_bytes = (attention.blocks_per_request + 1) * attention.block_bytes
    per_seq = mamba.blocks_per_request * mamba.state_factor * mamba.block_bytes
    # Room for 5 requests' states (and the null block), the region padding, one request.
    memory = 5 * per_seq + mamba.block_bytes + attention_bytes + 2 * 4096 + 1000
    with caplog.at_level(logging.WARNING, logger="vllm.hybrid_alloc"):
        pools = sizing.size_groups(cfg, groups, memory)
    assert pools.pools[0].num_blocks == 5 * mamba.blocks_per_request * mamba.state_factor + 1
    assert pools.pools[1].num_blocks - 1 >= attention.blocks_per_request
    (line,) = [r.getMessage() for r in caplog.records if "max_num_seqs=16" in r.getMessage()]
    assert "sized for 5 requests" in line and "at most 5 requests run at once" in line


def test_pipeline_stages_share_block_counts() -> None:
    """Pipeline parallelism: each stage reports its own layers. One sizing for all: the
    Mamba pool the same everywhere, the attention pool the fewest blocks any stage
    affords; each stage's config holds every group but tensors for its own layers only."""
    from hybrid_alloc import sizing as model
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("none")
    m = small_mamba("none")
    stage0 = {"l.0": m, "l.1": m, "l.2": m, "l.3": attention()}
    stage1 = {"l.4": m, "l.5": attention(), "l.6": attention(), "l.7": m}
    memory = [8 << 20, 8 << 20]
    configs = sizing.get_kv_cache_configs(cfg, [stage0, stage1], memory)
    assert [c.num_blocks for c in configs] == [configs[0].num_blocks] * 2
    for config, own in zip(configs, (stage0, stage1), strict=True):
        assert isinstance(config, PerGroupKVCacheConfig)
        assert [len(g.layer_names) for g in config.kv_cache_groups] == [
            sum(isinstance(s, type(m)) for s in own.values()),
            sum(not isinstance(s, type(m)) for s in own.values()),
        ]
        assert sorted(n for t in config.kv_cache_tensors for n in t.layers) == sorted(own)
        assert config.kv_cache_tensors[0].size <= memory[0]
    sizes = [p.num_blocks for p in configs[0].pool_layouts]
    assert sizes == [p.num_blocks for p in configs[1].pool_layouts]
    assert sizes[0] == 16 + 1
    # Stage 1 holds two attention layers per block: it bounds the attention pool.
    alone = sizing.size_groups(cfg, sizing.build_groups(stage1), memory[1])
    assert sizes[1] == alone.pools[1].num_blocks
    stages = [
        [model.GroupNeeds("m", "fixed", 1000, 3, 1), model.GroupNeeds("a", "growing", 500, 1, 8)],
        [model.GroupNeeds("m", "fixed", 1000, 1, 1), None],
    ]
    both = model.size_stages(stages, [1 << 20, 1 << 20], max_num_seqs=4, max_model_len=128)
    assert [p.needs.num_layers for p in both.pools] == [4, 1]
    with pytest.raises(model.SizingError, match="pipeline stage"):
        model.size_stages(stages, [1 << 20, 3000], max_num_seqs=4, max_model_len=128)
