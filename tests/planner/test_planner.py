"""The capacity planner: shipped configs, sizing invariants, capacity formulas, vLLM cross-checks
and the ``hybrid-alloc`` CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybrid_alloc.cli import main, parse_memory
from hybrid_alloc.model_specs import (
    AttentionLayerSpec,
    LayerSpec,
    MambaLayerSpec,
    ModelSpec,
    model_from_config,
)
from hybrid_alloc.planner import (
    ALIGN_CACHE_FACTOR,
    cdiv,
    kv_cache_groups,
    load_config,
    load_model,
    plan,
    shipped_configs,
    stock_block_size,
)
from hybrid_alloc.sizing import REGION_ALIGNMENT
from hybrid_alloc.vllm_specs import load_model_spec
from tests.planner.specs import (
    SLIDING_WINDOW_VARIANT,
    config_by_name,
    engine_config,
    model_config_view,
    release_sizing_module,
    skip_unless_readable,
    vllm_layer_specs,
    vllm_model_class,
)

GiB = 1 << 30
SHIPPED = sorted(shipped_configs())

# name: (attention layers, Mamba layers, Mamba kind, state bytes at 0 / 3 spec tokens,
#        stock block size, group layer counts) - state bytes and block sizes were checked
# against vLLM 0.32's own functions (see the cross-check tests below).
EXPECTED: dict[str, tuple[int, int, str, int, int, int, list[int]]] = {
    "qwen3.5-0.8b": (6, 18, "gdn", 1_085_440, 1_122_304, 544, [6, 6, 6, 6]),
    "qwen3.6-35b-a3b": (10, 30, "gdn", 2_146_304, 2_195_456, 1056, [10, 10, 10, 10]),
    "nemotron-h-8b": (4, 24, "mamba2", 4_255_744, 4_317_184, 1040, [4] * 7),
    "nemotron-3-nano-30b-a3b": (6, 23, "mamba2", 2_134_016, 2_170_880, 2096, [6, 6, 6, 5, 6]),
    "jamba-v0.1": (4, 28, "mamba1", 311_296, 311_296, 80, [4] * 8),
    "falcon-h1-7b": (44, 44, "mamba2", 1_594_368, 1_615_872, 1568, [44, 44]),
    "zamba2-2.7b": (9, 54, "mamba2", 686_848, 718_336, 48, [9] * 7),
    "qwen3.5-27b": (16, 48, "gdn", 3_207_168, 3_268_608, 784, [16, 16, 16, 16]),
    # Outside the table's families: read from vLLM's model classes (vllm_specs).
    "granite-4.0-h-small": (4, 36, "mamba2", 2_147_840, 2_198_528, 528, [4] * 10),
    "lfm2-1.2b": (6, 10, "short_conv", 8_192, 8_192, 16, [5, 5, 6]),
}


# --------------------------------------------------------------------------- shipped configs


def test_every_shipped_config_is_expected() -> None:
    assert set(SHIPPED) == set(EXPECTED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_layers_and_state(name: str) -> None:
    skip_unless_readable(name)
    n_attn, n_mamba, kind, state0, state3, block, groups = EXPECTED[name]
    model = load_model(name)
    assert load_config(name)["_source"] == model.name
    assert len(model.attention_layers) == n_attn
    assert len(model.mamba_layers) == n_mamba
    assert {m.kind for m in model.mamba_layers} == {kind}
    mamba = model.mamba_layers[0]
    assert mamba.state_bytes(0) == state0
    assert mamba.state_bytes(3) == state3
    assert stock_block_size(model, 16, 0) == block
    assert sorted(g.num_layers for g in kv_cache_groups(model)) == sorted(groups)
    assert model.max_position_embeddings > 0


def test_load_config_from_file_and_folder(tmp_path: Path) -> None:
    cfg = load_config("qwen3.5-0.8b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_config(tmp_path) == cfg
    assert load_config(tmp_path / "config.json") == cfg
    assert load_config("QWEN3.5-0.8B.json") == cfg
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing")


def test_unsupported_model_type() -> None:
    with pytest.raises(ValueError, match="unsupported model_type"):
        model_from_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="lacks field"):
        model_from_config({"model_type": "jamba", "num_hidden_layers": 2})


def test_dtype_overrides() -> None:
    cfg = load_config("nemotron-h-8b")
    default = model_from_config(cfg)
    # Nemotron-H keeps its SSM state in float32 unless told otherwise, like vLLM.
    assert default.mamba_layers[0].temporal_dtype_bytes == 4
    half = model_from_config(cfg, mamba_ssm_cache_dtype="bfloat16", kv_cache_dtype="fp8")
    assert half.mamba_layers[0].temporal_dtype_bytes == 2
    assert half.attention_layers[0].dtype_bytes == 1
    # A float32 checkpoint is served in bfloat16 under 'auto'.
    f32 = model_from_config({**cfg, "torch_dtype": "float32"})
    assert f32.attention_layers[0].dtype_bytes == 2


# --------------------------------------------------------------------------- synthetic models


def _attn(
    heads: int, dim: int, kind: str = "full", window: int | None = None
) -> AttentionLayerSpec:
    return AttentionLayerSpec(kind, heads, dim, 2, window)  # type: ignore[arg-type]


def _mamba(kind: str, width: int, ckpt: int) -> MambaLayerSpec:
    return MambaLayerSpec(
        kind=kind,  # type: ignore[arg-type]
        conv_dim=width,
        conv_kernel=4,
        temporal_shape=(width // 64, 64, 32),
        conv_dtype_bytes=2,
        temporal_dtype_bytes=4,
        conv_grows_with_spec=kind != "mamba1",
        prefill_checkpoint_blocks=ckpt,
    )


@st.composite
def models(draw: st.DrawFn, windows: bool = True) -> ModelSpec:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    dim = draw(st.sampled_from([64, 128, 256]))
    windowed = windows and draw(st.booleans())
    # With windowed layers, maybe no full attention at all (the window groups then grow).
    layers: list[LayerSpec] = [_attn(heads, dim)] * draw(st.integers(0 if windowed else 1, 12))
    kind = draw(st.sampled_from(["gdn", "mamba1", "mamba2"]))
    width = draw(st.sampled_from([512, 1024, 4096]))
    mamba = _mamba(kind, width, 1 if kind == "mamba2" else 0)
    layers += [mamba] * draw(st.integers(0, 30))
    if windowed:
        window = draw(st.integers(32, 20_000))
        layers += [_attn(heads, dim, draw(st.sampled_from(["sliding", "chunked"])), window)] * (
            draw(st.integers(1, 6))
        )
    return ModelSpec("synthetic", "test", tuple(layers), 131_072)


@st.composite
def settings(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "max_num_seqs": draw(st.integers(1, 512)),
        "num_spec_tokens": draw(st.integers(0, 3)),
        "mamba_cache_mode": draw(st.sampled_from(["none", "align", "all"])),
        "block_size": draw(st.sampled_from([16, 32, 64])),
        "max_model_len": draw(st.integers(256, 262_144)),
    }


def _budget(model: ModelSpec, kw: dict[str, Any], extra: int) -> int:
    """A budget ``extra`` bytes above ours' minimum: the bounded pools, the region padding,
    and a null block plus one ``max_model_len`` request in every growing pool."""
    probe = plan(model, 1, **kw).ours.rows
    need = sum(
        r.bytes if not r.grows else (r.blocks_per_request + 1) * r.block_bytes for r in probe
    )
    return need + REGION_ALIGNMENT * len(probe) + extra


# --------------------------------------------------------------------------- invariants


@given(models(), settings(), st.integers(1 << 20, 64 * GiB))
def test_sizes_add_up_to_the_budget(model: ModelSpec, kw: dict[str, Any], extra: int) -> None:
    p = plan(model, _budget(model, kw, extra), **kw)
    kv = p.params.kv_bytes
    # Stock: whole blocks of the largest group's bytes, less than one block left over.
    assert p.stock.total_bytes == p.stock.num_blocks * p.stock.bytes_per_block <= kv
    assert kv - p.stock.total_bytes < p.stock.bytes_per_block
    if not p.ours.feasible:
        assert p.ours.shortfall_bytes > 0
        return
    # Ours: the pools fill the budget to within one block (and a byte of rounding) of each
    # growing pool, less the region padding set aside per pool.
    assert p.ours.total_bytes == sum(r.bytes for r in p.ours.rows) <= kv
    padding = REGION_ALIGNMENT * len(p.ours.rows)
    growing = [r.block_bytes for r in p.ours.rows if r.grows]
    assert padding <= p.ours_unused_bytes < padding + sum(growing) + len(growing)


@given(models(), settings(), st.integers(1 << 20, 64 * GiB))
def test_every_block_in_exactly_one_pool(model: ModelSpec, kw: dict[str, Any], extra: int) -> None:
    p = plan(model, _budget(model, kw, extra), **kw)
    if not p.ours.feasible:
        return
    # The memory map tiles [0, total) with one region per pool, each holding its blocks.
    regions = p.ours.memory_map()
    assert [g for g, _, _ in regions] == [r.group for r in p.ours.rows]
    offset = 0
    for (_, start, size), row in zip(regions, p.ours.rows, strict=True):
        assert start == offset and size == row.num_blocks * row.block_bytes
        offset += size
    assert offset == p.ours.total_bytes <= p.params.kv_bytes
    # A global block id resolves to exactly one (pool, local id).
    bounds = [0]
    for row in p.ours.rows:
        bounds.append(bounds[-1] + row.num_blocks)
    for block_id in {0, bounds[-1] - 1, bounds[-1] // 2, *bounds[1:-1]}:
        owners = [i for i in range(len(p.ours.rows)) if bounds[i] <= block_id < bounds[i + 1]]
        assert len(owners) == 1
    # Every distinct layer spec has its own pool; every layer is in exactly one.
    assert len(p.ours.rows) == len(p.groups) == len(set(model.layers))
    assert sum(r.num_layers for r in p.ours.rows) == len(model.layers)
    assert sum(r.num_layers for r in p.stock.rows) == len(model.layers)


@given(models(), settings(), st.integers(1 << 20, 64 * GiB))
def test_fixed_pools_never_starve_admission(
    model: ModelSpec, kw: dict[str, Any], extra: int
) -> None:
    p = plan(model, _budget(model, kw, extra), **kw)
    prm = p.params
    full_blocks = cdiv(prm.max_model_len, prm.block_size)
    any_growing = any(
        isinstance(g.spec, AttentionLayerSpec) and g.spec.kind == "full" for g in p.groups
    ) or (prm.mamba_cache_mode == "all" and bool(model.mamba_layers))
    for row, group in zip(p.ours.rows, p.groups, strict=True):
        spec = group.spec
        if row.grows:
            # Full attention, Mamba in 'all' mode, a window whose cap reaches a full
            # max_model_len request, or any window where nothing else grows.
            assert (
                spec.kind == "full"
                or prm.mamba_cache_mode == "all"
                or row.blocks_per_request >= full_blocks
                or not any_growing
            )
            continue
        factor = 1
        if isinstance(spec, MambaLayerSpec):
            # What vLLM's MambaManager holds per running request.
            need = 1 + prm.num_spec_tokens
            if prm.mamba_cache_mode == "align":
                need = 2 + prm.num_spec_tokens + spec.prefill_checkpoint_blocks
                factor = prm.align_cache_factor
        else:
            assert spec.window is not None
            # vLLM's per-request admission cap (SlidingWindowSpec / ChunkedLocalAttentionSpec).
            if spec.kind == "sliding":
                tokens = min(spec.window - 1 + prm.max_num_batched_tokens, prm.max_model_len)
                need = cdiv(tokens, row.block_size) + 1
            else:
                tokens = min(spec.window + prm.max_num_batched_tokens, prm.max_model_len)
                need = cdiv(tokens, row.block_size)
        assert row.blocks_per_request == need
        assert row.num_blocks == prm.max_num_seqs * need * factor + 1
        # max_num_seqs requests each take their cap, and the null block stays reserved.
        free = row.num_blocks - 1
        for _ in range(prm.max_num_seqs):
            free -= need
        assert free >= 0


@given(models(), settings(), st.integers(1 << 20, 64 * GiB))
def test_capacity_formulas(model: ModelSpec, kw: dict[str, Any], extra: int) -> None:
    p = plan(model, _budget(model, kw, extra), **kw)
    L = p.params.max_model_len
    # Stock: vLLM's get_max_concurrency_for_kv_cache_config, times max_model_len.
    per_req = sum(r.blocks_per_request for r in p.stock.rows)
    assert p.stock.concurrency == p.stock.num_blocks / per_req
    assert p.stock.tokens == int(p.stock.num_blocks / per_req * L)
    # Ours: only the growing pools count, their null block excluded.
    growing = [r for r in p.ours.rows if r.grows]
    assert growing
    if p.ours.feasible:
        conc = min((r.num_blocks - 1) / r.blocks_per_request for r in growing)
        assert p.ours.concurrency == conc
        assert p.ours.tokens == int(conc * L)
    else:
        assert p.ours.tokens == 0
    # Physical: KV bytes less the bounded state of max_num_seqs requests, per growing token.
    phys = p.physical
    assert phys.tokens == int(max(0, p.params.kv_bytes - phys.fixed_bytes) // phys.bytes_per_token)
    assert phys.concurrency == phys.tokens / L


@given(models(), settings(), st.integers(1 << 20, 64 * GiB))
def test_ours_never_beats_the_physical_limit(
    model: ModelSpec, kw: dict[str, Any], extra: int
) -> None:
    p = plan(model, _budget(model, kw, extra), **kw)
    assert p.ours.tokens <= p.physical.tokens
    assert p.stock.tokens_at_max_num_seqs <= p.physical.tokens


@given(models(windows=False), settings(), st.integers(1 << 20, 64 * GiB))
def test_ours_reaches_the_physical_limit_up_to_null_blocks(
    model: ModelSpec, kw: dict[str, Any], extra: int
) -> None:
    if kw["mamba_cache_mode"] == "all":
        kw = {**kw, "mamba_cache_mode": "none"}
    # Factor 1: the align pool holds exactly the live states (the physical limit's count).
    kw = {**kw, "align_cache_factor": 1}
    p = plan(model, _budget(model, kw, extra), **kw)
    prm, phys = p.params, p.physical
    assert p.ours.feasible
    bpt = phys.bytes_per_token
    b = prm.block_size
    exact = (prm.kv_bytes - phys.fixed_bytes) / bpt
    # Ours loses one request's worth of state (the Mamba pools' null blocks), the region
    # padding and at most two attention blocks (null block + rounding), scaled by
    # max_model_len's block rounding.
    one_state = sum(m.state_bytes(prm.num_spec_tokens) for m in model.mamba_layers)
    padding = REGION_ALIGNMENT * len(p.ours.rows)
    f = prm.max_model_len / (cdiv(prm.max_model_len, b) * b)
    assert p.ours.tokens >= f * (exact - (one_state + padding) / bpt - 2 * b) - 1
    # Stock's figure never exceeds the physical limit once it pays for max_num_seqs states,
    # so ours is at least stock's figure, less the same slack, whenever stock admits as many.
    if p.stock.concurrency >= prm.max_num_seqs:
        assert p.stock.tokens <= exact
    assert p.stock.tokens_at_max_num_seqs <= exact


@given(models(), settings(), st.integers(1 << 20, 32 * GiB), st.integers(0, 32 * GiB))
def test_capacity_is_monotonic_in_memory(
    model: ModelSpec, kw: dict[str, Any], extra: int, more: int
) -> None:
    kv = _budget(model, kw, extra)
    small, large = plan(model, kv, **kw), plan(model, kv + more, **kw)
    assert large.ours.tokens >= small.ours.tokens
    assert large.stock.tokens >= small.stock.tokens
    assert large.stock.tokens_at_max_num_seqs >= small.stock.tokens_at_max_num_seqs
    assert large.physical.tokens >= small.physical.tokens


def test_align_and_all_modes() -> None:
    model = load_model("nemotron-h-8b")  # Mamba2: one prefill checkpoint block in align mode
    kw: dict[str, Any] = {"max_model_len": 8192, "max_num_seqs": 64}
    none = plan(model, 80 * GiB, **kw)
    align1 = plan(model, 80 * GiB, mamba_cache_mode="align", align_cache_factor=1, **kw)
    align = plan(model, 80 * GiB, mamba_cache_mode="align", **kw)
    assert align.params.align_cache_factor == ALIGN_CACHE_FACTOR == 2
    for p, blocks in ((none, 64 + 1), (align1, 64 * 3 + 1), (align, 64 * 3 * 2 + 1)):
        (mamba,) = [r for r in p.ours.rows if r.kind == "mamba2"]
        assert not mamba.grows and mamba.num_blocks == blocks and mamba.num_layers == 24
    assert none.ours.tokens > align1.ours.tokens > align.ours.tokens
    # The physical limit counts the live states only.
    assert align.physical.tokens == align1.physical.tokens
    # 'all': Mamba grows with the sequence and is counted in capacity.
    every = plan(model, 80 * GiB, max_model_len=8192, max_num_seqs=64, mamba_cache_mode="all")
    assert all(r.grows for r in every.ours.rows)
    mamba = next(r for r in every.ours.rows if r.kind == "mamba2")
    assert mamba.block_size == every.stock.block_size == 1040
    assert every.ours.tokens < none.ours.tokens


def test_windowed_groups_are_bounded_unless_the_window_covers_the_context() -> None:
    full, swa = _attn(2, 128), _attn(2, 128, "sliding", 1024)
    model = ModelSpec("swa", "test", (full, swa, swa, swa, _mamba("gdn", 1024, 0)), 32768)
    p = plan(model, 8 * GiB, max_num_seqs=8, max_model_len=32768, max_num_batched_tokens=512)
    row = next(r for r in p.ours.rows if r.kind == "sliding")
    assert not row.grows
    assert row.blocks_per_request == cdiv(1023 + 512, 16) + 1
    assert row.num_blocks == 8 * row.blocks_per_request + 1
    wide = plan(model, 8 * GiB, max_num_seqs=8, max_model_len=1000)
    assert next(r for r in wide.ours.rows if r.kind == "sliding").grows


def test_bad_arguments() -> None:
    model = load_model("jamba-v0.1")
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        plan(model, GiB, mamba_cache_mode="sometimes")
    with pytest.raises(ValueError, match="positive"):
        plan(model, 0)
    with pytest.raises(ValueError, match="negative"):
        plan(model, GiB, num_spec_tokens=-1)
    with pytest.raises(ValueError, match="align_cache_factor"):
        plan(model, GiB, align_cache_factor=0)
    mamba_only = ModelSpec("m", "test", (_mamba("gdn", 512, 0),), 4096)
    with pytest.raises(ValueError, match="no attention"):
        plan(mamba_only, GiB)


def test_too_small_budget_is_reported_not_raised() -> None:
    p = plan(load_model("falcon-h1-7b"), 16 * GiB, max_num_seqs=256)
    assert not p.ours.feasible and p.ours.tokens == 0 and p.ours.shortfall_bytes > 0
    assert p.stock.tokens > 0  # the shared pool still runs, with fewer requests


# --------------------------------------------------------------------------- shipped targets


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("mode", ["none", "align"])
def test_shipped_configs_reach_the_physical_limit(name: str, mode: str) -> None:
    skip_unless_readable(name)
    model = load_model(name)
    for gib in (40, 80, 160):
        p = plan(model, gib * GiB, mamba_cache_mode=mode, max_model_len=32768, align_cache_factor=1)
        # "Reasonable budget": the bounded state takes at most half of the KV memory.
        if p.physical.fixed_bytes > p.params.kv_bytes / 2:
            continue
        assert p.ours.tokens >= 0.99 * p.physical.tokens
        assert p.ours.tokens >= 0.99 * p.stock.tokens_at_max_num_seqs


@pytest.mark.parametrize("name", SHIPPED)
def test_ours_beats_stock_when_stock_admits_max_num_seqs(name: str) -> None:
    skip_unless_readable(name)
    model = load_model(name)
    p = plan(
        model, 80 * GiB, max_num_seqs=32, max_model_len=min(8192, model.max_position_embeddings)
    )
    assert p.stock.concurrency >= 32
    assert p.ours.tokens >= p.stock.tokens


# --------------------------------------------------------------------------- vLLM cross-checks
# (the engine's per-group pools: test_engine_cross_check.py)


@pytest.fixture(scope="module")
def vllm_installed() -> None:
    pytest.importorskip("vllm")


@pytest.mark.parametrize("name", SHIPPED)
def test_state_bytes_match_vllm_models(name: str, vllm_installed: None) -> None:
    skip_unless_readable(name)
    model = load_model(name)
    cls, ssm = vllm_model_class(model.family)
    for spec in (0, 2):
        vc = model_config_view(load_config(name), model, ssm, spec)
        shapes = cls.get_mamba_state_shape_from_config(vc)
        dtypes = cls.get_mamba_state_dtype_from_config(vc)
        expected = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
        assert model.mamba_layers[0].state_bytes(spec) == expected


@pytest.mark.parametrize("name", SHIPPED)
def test_stock_block_size_matches_vllm_platform(name: str, vllm_installed: None) -> None:
    skip_unless_readable(name)
    from unittest import mock

    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backend import MultipleOf

    class Backend:  # a CUDA backend's block-size surface (FlashAttention: MultipleOf(16))
        @staticmethod
        def get_supported_kernel_block_sizes() -> list[Any]:
            return [MultipleOf(16)]

        @staticmethod
        def customize_spec(spec: Any) -> Any:
            return spec

    class FakePlatform(Platform):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config: Any) -> list[Any]:
            return [Backend]

    model = load_model(name)
    cls, ssm = vllm_model_class(model.family)
    for spec, block in ((0, 16), (2, 16), (0, 64)):
        vc = model_config_view(load_config(name), model, ssm, spec, block)
        with mock.patch.object(ModelRegistry, "resolve_model_cls", return_value=(cls, "X")):
            FakePlatform._align_hybrid_block_size(vc, Backend)  # type: ignore[arg-type]
        p = plan(model, 80 * GiB, num_spec_tokens=spec, block_size=block)
        assert vc.cache_config.block_size == p.stock.block_size
        assert vc.cache_config.mamba_page_size_padded == p.stock.padded_page_bytes


@pytest.mark.parametrize("name", [*SHIPPED, SLIDING_WINDOW_VARIANT])
@pytest.mark.parametrize("mode", ["none", "align"])
def test_stock_pool_matches_vllm_kv_cache_utils(name: str, mode: str, vllm_installed: None) -> None:
    """vLLM's own grouping, pool size and capacity formula (in the module the installed
    release defines them: ``kv_cache_utils`` in 0.32, ``kv_cache_planning`` in 0.33)."""
    skip_unless_readable(name)
    from vllm.v1.core import kv_cache_utils

    stock = release_sizing_module()
    cfg = config_by_name(name)
    model, spec, L, kv = load_model_spec(cfg), 1, 32768, 77 * GiB + 12345
    p = plan(model, kv, mamba_cache_mode=mode, num_spec_tokens=spec, max_model_len=L)
    specs = vllm_layer_specs(
        model,
        mode=mode,
        max_len=L,
        block=p.stock.block_size,
        padded=p.stock.padded_page_bytes,
        spec=spec,
        cfg=cfg,
    )
    vc = engine_config(mode, L)
    groups = stock.get_kv_cache_groups(vc, specs)
    config = stock.get_kv_cache_config_from_groups(vc, groups, kv)
    concurrency = kv_cache_utils.get_max_concurrency_for_kv_cache_config(vc, config)  # type: ignore[arg-type]
    assert sorted(len(g.layer_names) for g in groups) == sorted(r.num_layers for r in p.stock.rows)
    assert config.num_blocks == p.stock.num_blocks
    assert concurrency == pytest.approx(p.stock.concurrency, rel=1e-12)
    assert int(concurrency * L) == p.stock.tokens


# --------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("name", SHIPPED)
def test_cli_plan_each_shipped_config(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    skip_unless_readable(name)
    assert main(["plan", name, "--memory", "40GiB", "--max-model-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert "stock vLLM 0.32" in out and "physical limit" in out and "static / physical" in out
    assert (
        "elastic (HYBRID_ALLOC_ELASTIC_POOLS=1): one budget of" in out and "elastic / stock" in out
    )


def test_cli_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "capacity.png"
    args = ["plan", "qwen3.5-0.8b", "--memory", "24GiB", "--mamba-cache-mode", "align"]
    assert main([*args, "--num-speculative-tokens", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert f"wrote {png}" in out
    # 'align' mode, Qwen3.5-0.8B: vLLM raises 16 to 544 tokens, which 272-token blocks halve.
    assert "the engine runs per-group pools at 272-token blocks, half of it" in out
    # Zamba2-2.7B: 48 tokens, three 16-token blocks: vLLM's layout is kept.
    assert main(["plan", "zamba2-2.7b", "--memory", "24GiB", "--mamba-cache-mode", "align"]) == 0
    out = capsys.readouterr().out
    assert "the engine runs the stock layout above" in out
    assert "HYBRID_ALLOC_FINE_ALIGN_BLOCKS=divisor runs 16-token blocks" in out
    assert main(["plan", "qwen3.5-0.8b", "--memory", "24GiB"]) == 0
    assert "the engine runs" not in capsys.readouterr().out


def test_cli_config_folder_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(load_config("zamba2-2.7b")))
    assert main(["plan", str(tmp_path), "--memory", "80GB"]) == 0
    assert main(["plan", str(tmp_path / "nope")]) == 1
    assert "neither a config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "zamba2-2.7b", "--memory", "lots"])
    with pytest.raises(SystemExit):
        main(["plan", "zamba2-2.7b", "--mamba-cache-mode", "sometimes"])


def test_cli_reports_a_budget_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "falcon-h1-7b", "--memory", "16GiB"]) == 0
    assert "do not fit" in capsys.readouterr().out


def test_cli_backend(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HYBRID_ALLOC_BACKEND", "vllm")
    assert main(["backend"]) == 0
    assert capsys.readouterr().out.strip() == "vllm"
    monkeypatch.delenv("HYBRID_ALLOC_BACKEND")
    assert main(["backend"]) == 0
    assert capsys.readouterr().out.strip() == "rust"
    monkeypatch.setenv("HYBRID_ALLOC_BACKEND", "gpu-please")
    assert main(["backend"]) == 2
    assert "not a known backend" in capsys.readouterr().err


def test_cli_lists_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SHIPPED)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("24GiB", 24 * GiB),
        ("24G", 24 * GiB),
        ("80GB", 80 * 10**9),
        ("1.5TiB", 3 << 39),
        ("4096", 4096),
    ],
)
def test_parse_memory(text: str, value: int) -> None:
    assert parse_memory(text) == value
