"""The planner's per-group pools are the ones the engine core builds at startup.

For every shipped config, and for models the shipped ones do not cover (sliding-window
attention next to Mamba layers, two growing attention groups), in 'none' and 'align' mode:
``engine_sizing.get_kv_cache_configs`` on vLLM's own layer specs builds exactly the pools
``hybrid_alloc.planner`` reports: same groups, pages, per-request blocks, pool sizes, which
pools grow (the primary pool first among them), and the same capacity.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_alloc.model_specs import (
    AttentionLayerSpec,
    LayerSpec,
    MambaLayerSpec,
    ModelSpec,
    model_from_config,
)
from hybrid_alloc.planner import (
    Layout,
    load_config,
    ours_layout,
    plan,
    plan_params,
    shipped_configs,
    spec_groups,
)
from hybrid_alloc.vllm_specs import load_model_spec
from tests.planner.specs import (
    SLIDING_WINDOW_VARIANT,
    config_by_name,
    engine_config,
    pin_cpu_platform,
    skip_unless_readable,
    vllm_layer_specs,
)

pytest.importorskip("vllm")

GiB = 1 << 30
MODES = ("none", "align")


@pytest.fixture(autouse=True)
def static_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the static per-group split (elastic pools off); the elastic
    layout has its own (tests/planner/test_elastic_sizing.py)."""
    monkeypatch.setenv("HYBRID_ALLOC_ELASTIC_POOLS", "0")


def _mamba2(heads: int) -> MambaLayerSpec:
    return MambaLayerSpec(
        kind="mamba2",
        conv_dim=heads * 64 + 2 * 128,
        conv_kernel=4,
        temporal_shape=(heads, 64, 128),
        conv_dtype_bytes=2,
        temporal_dtype_bytes=4,
        conv_grows_with_spec=True,
        prefill_checkpoint_blocks=1,
    )


def _full_swa_mamba() -> ModelSpec:
    """Full attention, sliding-window attention (same heads) and Mamba2: the window-bounded
    group sits next to a growing one."""
    full = AttentionLayerSpec("full", 8, 128, 2)
    swa = AttentionLayerSpec("sliding", 8, 128, 2, window=1024)
    pattern: list[LayerSpec] = [_mamba2(32), _mamba2(32), swa, _mamba2(32), full, swa] * 4
    return ModelSpec("full + sliding window + mamba2", "test", tuple(pattern), 32768)


def _two_growing() -> ModelSpec:
    """Two full-attention groups of different head sizes (8 x 128 and 2 x 64) next to
    Mamba2: two growing pools of different page sizes share the memory left over."""
    wide = AttentionLayerSpec("full", 8, 128, 2)
    narrow = AttentionLayerSpec("full", 2, 64, 2)
    pattern: list[LayerSpec] = [_mamba2(64), wide, _mamba2(64), narrow] * 6
    return ModelSpec("two full-attention head sizes + mamba2", "test", tuple(pattern), 32768)


def _settings(mode: str, max_len: int, seqs: int) -> dict[str, Any]:
    return {"mamba_cache_mode": mode, "max_model_len": max_len, "max_num_seqs": seqs}


def _engine_pools(
    monkeypatch: pytest.MonkeyPatch,
    specs: dict[str, Any],
    mode: str,
    max_len: int,
    seqs: int,
    kv: int,
    spec: int = 0,
) -> tuple[Any, Any]:
    from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
    from hybrid_alloc.integration.scheduler import engine_sizing

    pin_cpu_platform(monkeypatch)
    vc = engine_config(mode, max_len, seqs, spec=spec)
    assert engine_sizing.unsupported_reason(vc, [specs]) is None
    (config,) = engine_sizing.get_kv_cache_configs(vc, [specs], [kv])
    assert isinstance(config, PerGroupKVCacheConfig), "fell back to vLLM's shared pool"
    return vc, config


def _assert_same_pools(
    layout: Layout, vc: Any, config: Any, specs: dict[str, Any], kv: int
) -> None:
    from hybrid_alloc.integration.scheduler import engine_sizing

    rows, pools, groups = layout.rows, config.pool_layouts, config.kv_cache_groups
    assert layout.feasible
    assert [len(g.layer_names) for g in groups] == [r.num_layers for r in rows]
    assert [g.kv_cache_spec.page_size_bytes for g in groups] == [r.page_bytes for r in rows]
    assert [g.kv_cache_spec.block_size for g in groups] == [r.block_size for r in rows]
    per_request = [
        -(-g.kv_cache_spec.max_memory_usage_bytes(vc) // g.kv_cache_spec.page_size_bytes)
        for g in groups
    ]
    assert per_request == [r.blocks_per_request for r in rows]
    assert [p.num_blocks for p in pools] == [r.num_blocks for r in rows]
    assert [p.grows for p in pools] == [r.grows for r in rows]
    # The primary pool (vLLM's one num_blocks) is the first pool that grows.
    primary = next(r for r in rows if r.grows)
    assert config.num_blocks == primary.num_blocks
    # Capacity: vLLM's convention counts the null block, the planner's does not.
    concurrency = engine_sizing.get_max_concurrency_for_kv_cache_config(vc, config)
    growing = [r for r in rows if r.grows]
    assert concurrency == min(r.num_blocks / r.blocks_per_request for r in growing)
    assert layout.concurrency == min((r.num_blocks - 1) / r.blocks_per_request for r in growing)
    # Every layer in exactly one group, all of it inside the memory it was given.
    assert sorted(n for g in groups for n in g.layer_names) == sorted(specs)
    assert all(getattr(g.kv_cache_spec, "page_size_padded", None) is None for g in groups)
    assert config.kv_cache_tensors[0].size <= kv


@pytest.mark.parametrize("name", sorted(shipped_configs()))
@pytest.mark.parametrize("mode", MODES)
def test_shipped_configs(name: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_readable(name)
    cfg = load_config(name)
    # Layers as the CLI reads them: vLLM's own model class (the table where it cannot).
    model = load_model_spec(cfg)
    L, kv, seqs = 32768, 160 * GiB + 12345, 64
    p = plan(model, kv, mamba_cache_mode=mode, max_model_len=L, max_num_seqs=seqs)
    specs = vllm_layer_specs(model, mode=mode, max_len=L, block=16, cfg=cfg)
    vc, config = _engine_pools(monkeypatch, specs, mode, L, seqs, kv)
    _assert_same_pools(p.ours, vc, config, specs, kv)
    assert [r.grows for r in p.ours.rows] == [
        isinstance(g.spec, AttentionLayerSpec) for g in p.groups
    ]


@pytest.mark.parametrize("name", sorted(shipped_configs()))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", [1, 2, 3])
def test_shipped_configs_with_speculation(
    name: str, mode: str, spec: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--num-speculative-tokens``: vLLM's Mamba specs hold one scratch state per
    speculative token (and Mamba2 convolution states grow with them); the engine sizing
    and the planner agree on every pool, and the Mamba pools hold exactly
    ``max_num_seqs x`` what a running request holds (``1 + spec`` states in 'none' mode)."""
    skip_unless_readable(name)
    cfg = load_config(name)
    model = load_model_spec(cfg)
    L, kv, seqs = 32768, 160 * GiB + 12345, 64
    p = plan(
        model, kv, mamba_cache_mode=mode, max_model_len=L, max_num_seqs=seqs, num_spec_tokens=spec
    )
    specs = vllm_layer_specs(model, mode=mode, max_len=L, block=16, cfg=cfg, spec=spec)
    vc, config = _engine_pools(monkeypatch, specs, mode, L, seqs, kv, spec=spec)
    _assert_same_pools(p.ours, vc, config, specs, kv)
    for row in p.ours.rows:
        if not row.grows and mode == "none":
            assert row.blocks_per_request == 1 + spec
            assert row.num_blocks == seqs * (1 + spec) + 1
    if mode == "none":
        # Per-group pools reach the physical limit with speculation on, as without ('align'
        # mode keeps cached states on top, a policy: ALIGN_CACHE_FACTOR).
        assert p.ours.concurrency >= 0.99 * p.physical.concurrency


@pytest.mark.parametrize("mode", MODES)
def test_sliding_window_mamba_model(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attention layer sliding: no group grows with the sequence, so the window
    groups take the memory left over (and the primary pool is theirs)."""
    cfg = config_by_name(SLIDING_WINDOW_VARIANT)
    model = model_from_config(cfg)
    assert {a.kind for a in model.attention_layers} == {"sliding"}
    L, kv, seqs = 32768, 40 * GiB + 777, 64
    p = plan(model, kv, **_settings(mode, L, seqs))
    specs = vllm_layer_specs(model, mode=mode, max_len=L, block=16, cfg=cfg)
    assert sum(type(s).__name__ == "SlidingWindowSpec" for s in specs.values()) == 4
    vc, config = _engine_pools(monkeypatch, specs, mode, L, seqs, kv)
    _assert_same_pools(p.ours, vc, config, specs, kv)
    (swa,) = [r for r in p.ours.rows if r.kind == "sliding"]
    # vLLM's cap: the last window - 1 tokens plus 2,048 in flight, one block more.
    assert swa.grows and swa.blocks_per_request == -(-(4095 + 2048) // 16) + 1
    assert p.ours.concurrency <= p.physical.concurrency
    # A window-bounded request holds 6,160 tokens, not 32,768: over four times as many
    # requests fit as with full attention in the same layers.
    full = plan(model_from_config(load_config("nemotron-h-8b")), kv, **_settings(mode, L, seqs))
    assert p.ours.concurrency > 4 * full.ours.concurrency


@pytest.mark.parametrize("mode", MODES)
def test_full_and_sliding_window_mamba_model(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full attention grows; the sliding-window group is bounded: a fixed pool of
    max_num_seqs capped requests, sized before the growing pool and not counted in it."""
    model = _full_swa_mamba()
    L, kv, seqs = 32768, 24 * GiB + 4321, 32
    p = plan(model, kv, mamba_cache_mode=mode, max_model_len=L, max_num_seqs=seqs)
    specs = vllm_layer_specs(model, mode=mode, max_len=L, block=16)
    vc, config = _engine_pools(monkeypatch, specs, mode, L, seqs, kv)
    _assert_same_pools(p.ours, vc, config, specs, kv)
    by_kind = {r.kind: r for r in p.ours.rows}
    swa = by_kind["sliding"]
    assert not swa.grows and by_kind["attention"].grows
    assert swa.blocks_per_request == -(-(1023 + 2048) // 16) + 1
    assert swa.num_blocks == seqs * swa.blocks_per_request + 1
    assert config.num_blocks == by_kind["attention"].num_blocks


@pytest.mark.parametrize("mode", MODES)
def test_two_growing_groups(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two growing pools of different page sizes: each its null block, then the memory in
    proportion to one max_model_len request, so both hold the same number of requests."""
    model = _two_growing()
    L, kv, seqs = 32768, 24 * GiB + 99, 32
    params = plan_params(model, kv, mamba_cache_mode=mode, max_model_len=L, max_num_seqs=seqs)
    layout = ours_layout(spec_groups(model), params)
    specs = vllm_layer_specs(model, mode=mode, max_len=L, block=16)
    vc, config = _engine_pools(monkeypatch, specs, mode, L, seqs, kv)
    _assert_same_pools(layout, vc, config, specs, kv)
    wide, narrow = [r for r in layout.rows if r.grows]
    assert wide.page_bytes == 8 * narrow.page_bytes
    assert wide.blocks_per_request == narrow.blocks_per_request == L // 16
    # Same number of max-length requests in both, up to one block of rounding.
    assert abs((wide.num_blocks - 1) - (narrow.num_blocks - 1)) <= 1
    # Whatever is left over is less than one block of each growing pool (plus padding).
    unused = kv - layout.total_bytes
    assert unused < wide.block_bytes + narrow.block_bytes + 4096 * len(layout.rows)
    # The stock model covers one attention page size only.
    with pytest.raises(NotImplementedError):
        plan(model, kv, mamba_cache_mode=mode, max_model_len=L, max_num_seqs=seqs)


def _draft_config(method: str, spec: int, mode: str, L: int, seqs: int) -> Any:
    from types import SimpleNamespace

    vc = engine_config(mode, L, seqs, spec=spec)
    vc.speculative_config = SimpleNamespace(
        method=method, num_speculative_tokens=spec, use_eagle_block_drop=lambda: True
    )
    vc.model_config.hf_config = SimpleNamespace(model_type="qwen3_next")
    return vc


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", [1, 3])
def test_mtp_draft_layer_joins_the_attention_pool(
    mode: str, spec: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3.6-35B-A3B at full size with an MTP drafter (vLLM registers the MTP block's
    attention layer after the target's, with the target attention's spec): the draft
    layer joins the attention group, which is flagged as the draft group (the scheduler
    drops the last block of its prefix hits); the GDN pool holds max_num_seqs x
    (1 + spec) states in 'none' mode, and the attention pool pays for the extra layer."""
    from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
    from hybrid_alloc.integration.scheduler import engine_sizing

    cfg = load_config("qwen3.6-35b-a3b")
    model = model_from_config(cfg)
    L, kv, seqs = 32768, 80 * GiB + 321, 64
    specs = vllm_layer_specs(model, mode=mode, max_len=L, block=16, cfg=cfg, spec=spec)
    target = next(s for s in specs.values() if type(s).__name__ == "FullAttentionSpec")
    specs["mtp.layers.0.self_attn.attn"] = target
    pin_cpu_platform(monkeypatch)
    vc = _draft_config("mtp", spec, mode, L, seqs)
    assert engine_sizing.unsupported_reason(vc, [specs]) is None
    (config,) = engine_sizing.get_kv_cache_configs(vc, [specs], [kv])
    assert isinstance(config, PerGroupKVCacheConfig)
    mamba, attention = config.kv_cache_groups
    assert "mtp.layers.0.self_attn.attn" in attention.layer_names
    assert attention.is_eagle_group and not mamba.is_eagle_group
    per_state = (2 + spec + 0) if mode == "align" else 1 + spec
    factor = 2 if mode == "align" else 1
    assert config.pool_layouts[0].num_blocks == seqs * per_state * factor + 1
    # Without the draft layer the attention pool would hold more blocks.
    plain = {k: v for k, v in specs.items() if not k.startswith("mtp.")}
    (without,) = engine_sizing.get_kv_cache_configs(
        _draft_config("mtp", spec, mode, L, seqs), [plain], [kv]
    )
    assert without.pool_layouts[1].num_blocks > config.pool_layouts[1].num_blocks


def test_eagle_draft_with_its_own_spec_gets_a_growing_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """An EAGLE drafter whose attention differs from the target's (here: twice the KV
    heads) gets a group and a growing pool of its own, sized in proportion to one
    max_model_len request like the target's; its group is flagged where its spec marks
    it as a draft layer (vLLM 0.33's ``is_draft``), else nothing is flagged and vLLM's
    coordinator treats every group as a draft group."""
    from dataclasses import fields, replace

    from hybrid_alloc.integration.scheduler import engine_sizing

    cfg = load_config("qwen3.6-35b-a3b")
    model = model_from_config(cfg)
    L, kv, seqs = 32768, 80 * GiB + 321, 64
    specs = vllm_layer_specs(model, mode="none", max_len=L, block=16, cfg=cfg, spec=2)
    target = next(s for s in specs.values() if type(s).__name__ == "FullAttentionSpec")
    draft = replace(target, num_kv_heads=2 * target.num_kv_heads)
    marked = "is_draft" in {f.name for f in fields(draft)}
    if marked:
        draft = replace(draft, is_draft=True)
    specs["draft_model.layers.0.attn"] = draft
    pin_cpu_platform(monkeypatch)
    vc = _draft_config("eagle", 2, "none", L, seqs)
    (config,) = engine_sizing.get_kv_cache_configs(vc, [specs], [kv])
    groups = config.kv_cache_groups
    assert [len(g.layer_names) for g in groups][-1] == 1
    assert [p.grows for p in config.pool_layouts] == [False, True, True]
    assert [g.is_eagle_group for g in groups] == [False, False, marked]
    target_pool, draft_pool = config.pool_layouts[1:]
    # Same number of max_model_len requests in both growing pools (up to rounding).
    assert abs(target_pool.num_blocks - draft_pool.num_blocks) <= 1
