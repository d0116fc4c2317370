"""Elastic per-group pools in the engine core's sizing: one byte budget, each group's layers
viewing all of it at their own page size (:mod:`hybrid_alloc.integration.scheduler.engine_sizing`),
and the sizing model behind it (:func:`hybrid_alloc.sizing.size_elastic`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybrid_alloc import sizing as model
from hybrid_alloc._native import NativeElasticPools
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from tests.planner.specs import MAX_LEN, attention, small_engine_config, small_mamba

BLOCK_COMPACT = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]


@pytest.fixture(autouse=True)
def elastic_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRID_ALLOC_ELASTIC_POOLS", "1")


def qwen_like_specs(mode: str = "none") -> dict[str, Any]:
    m = small_mamba(mode)
    return {"l.0": m, "l.1": m, "l.2": m, "l.3": attention()}


# ------------------------------------------------------------------- the sizing model
# Page sizes of two or three pools, each pool's blocks for one request, and the memory.
SLAB_CHOICES = given(
    pages=st.lists(st.integers(1 << 10, 1 << 22), min_size=2, max_size=3),
    needs=st.lists(st.integers(1, 64), min_size=3, max_size=3),
    memory=st.integers(1 << 20, 1 << 32),
)


@given(
    slab=st.integers(1, 1 << 22),
    page=st.integers(1, 1 << 20),
)
def test_pages_per_slab_is_the_budgets(slab: int, page: int) -> None:
    """The Python rule and the Rust budget (as the engine's elastic pools build it) count
    the same pages a slab (where the budget accepts the page at all)."""
    fit = model.pages_per_slab(slab, page)
    if page > slab or fit == 0:
        with pytest.raises(ValueError):
            NativeElasticPools(slab, 4, [page])
        return
    assert NativeElasticPools(slab, 4, [page]).pages_per_slab(0) == fit


@given(
    pages=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=4),
    memory=st.integers(1 << 16, 1 << 34),
)
def test_chosen_slab_holds_a_page_of_every_pool(pages: list[int], memory: int) -> None:
    slab = model.choose_slab_bytes(pages, memory)
    assert all(model.pages_per_slab(slab, p) >= 1 for p in pages)
    assert slab <= max(2 * max(pages) * model.ELASTIC_PAGES_PER_SLAB, 4 * max(pages))
    # The Rust budget takes it as it is.
    NativeElasticPools(slab, 2, pages)


@SLAB_CHOICES
def test_chosen_slab_holds_the_most_requests(
    pages: list[int], needs: list[int], memory: int
) -> None:
    """With each pool's blocks per request the slab is the one of least edge loss unless
    another holds more requests (slab 0 and slab edges counted); a budget that holds one
    request at the least-loss slab still holds one at the chosen slab."""
    needs = needs[: len(pages)]
    pools = list(zip(pages, needs, strict=True))
    chosen = model.choose_slab_bytes(pages, memory, blocks_per_request=needs)
    least_loss = model.choose_slab_bytes(pages, memory)
    assert all(model.pages_per_slab(chosen, p) >= 1 for p in pages)

    def fits(slab: int) -> bool:
        have = memory // slab
        return have >= 1 + sum(model.cdiv(n, model.pages_per_slab(slab, p)) for p, n in pools)

    if fits(least_loss):
        assert fits(chosen)
        held = model.elastic_concurrency(chosen, memory // chosen, pools)
        other = model.elastic_concurrency(least_loss, memory // least_loss, pools)
        # Within the stranding allowance (half a slab per pool) of the least-loss slab.
        allowance = len(pages) * max(chosen, least_loss) / memory
        assert held >= other * (1 - allowance) - 1e-9


@given(
    slab=st.integers(1 << 10, 1 << 22),
    block=st.integers(1 << 8, 1 << 20),
)
def test_padded_stride_fits_more_pages_and_never_straddles(slab: int, block: int) -> None:
    """A padded stride divides the slab (every page in the same place in every slab),
    stays aligned, and fits more pages a slab than the unpadded page; the Rust budget
    counts the same pages for it."""
    stride = model.padded_stride(slab, block)
    unpadded = model.pages_per_slab(slab, block) if block <= slab else 0
    if stride == block:
        return
    assert stride > block and slab % stride == 0
    assert stride % min(block & -block, model.STRIDE_ALIGNMENT) == 0
    assert slab // stride > unpadded
    assert NativeElasticPools(slab, 4, [stride]).pages_per_slab(0) == slab // stride


@SLAB_CHOICES
def test_padding_never_holds_fewer_requests(
    pages: list[int], needs: list[int], memory: int
) -> None:
    """Padding the first pool's blocks (a Mamba pool) only adds slabs to choose from and
    pages to each slab: the slab chosen with it holds at least as many requests."""
    needs = needs[: len(pages)]
    paddable = [True] + [False] * (len(pages) - 1)

    def held(slab: int, pad: list[bool]) -> float:
        strides = model.block_strides(slab, pages, pad)
        if any(model.pages_per_slab(slab, s) < 1 for s in strides):
            return 0.0
        pools = list(zip(strides, needs, strict=True))
        slabs = memory // slab
        if slabs < 1 + sum(model.cdiv(n, model.pages_per_slab(slab, s)) for s, n in pools):
            return 0.0
        stranded = len(pools) * slab / 2 / memory
        return model.elastic_concurrency(slab, slabs, pools) * max(0.0, 1 - stranded)

    padded = model.choose_slab_bytes(pages, memory, blocks_per_request=needs, paddable=paddable)
    plain = model.choose_slab_bytes(pages, memory, blocks_per_request=needs)
    assert held(padded, paddable) >= held(plain, [False] * len(pages)) - 1e-9


def test_size_elastic_counts_every_pool() -> None:
    needs = [
        model.GroupNeeds("gdn", "fixed", 3000, 3, 1),
        model.GroupNeeds("attn", "growing", 1024, 1, 64),
    ]
    result = model.size_elastic(needs, 64 << 20, max_model_len=1024)
    assert result.block_bytes == (9000, 1024)
    assert result.page_bytes[1] == 1024  # attention is never padded
    assert result.page_bytes[0] == model.padded_stride(result.slab_bytes, 9000)
    assert result.budget_bytes <= 64 << 20
    assert result.num_pages == tuple(result.budget_bytes // p for p in result.page_bytes)
    per_request = sum(
        n.blocks_per_request / k for n, k in zip(needs, result.pages_per_slab, strict=True)
    )
    assert result.concurrency == pytest.approx((result.num_slabs - 1) / per_request)
    assert result.tokens == int(result.concurrency * 1024)
    # The budget without the state: more requests; states are not free.
    alone = model.size_elastic(needs[1:], 64 << 20, max_model_len=1024)
    assert alone.concurrency > result.concurrency


def test_size_elastic_refuses_a_budget_without_one_request() -> None:
    needs = [model.GroupNeeds("attn", "growing", 1 << 16, 1, 64)]
    with pytest.raises(model.SizingError, match="one 1,024-token request needs"):
        model.size_elastic(needs, 32 << 16, max_model_len=1024)


# ------------------------------------------------------------------- the engine config
@pytest.mark.parametrize("layout_name", BLOCK_COMPACT)
def test_elastic_views_alias_one_budget(layout_name: str) -> None:
    """vLLM's own worker allocation on an elastic config: every group's layers view the
    whole budget with the pool's page count; block ``b`` of group ``g`` is bytes
    ``b * page_g ..`` with the group's layers inside it, so pages of different groups in
    disjoint byte ranges never touch, and the same bytes are reachable from both."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    layout = KVCacheLayout[layout_name]
    cfg = small_engine_config("none")
    cfg.cache_config.get_resolved_kv_cache_layout = lambda: layout
    specs = qwen_like_specs()
    groups = sizing.build_groups(specs)
    elastic = sizing.size_elastic_groups(cfg, groups, [4 << 20], [specs])
    config = sizing.build_elastic_config(cfg, groups, elastic)
    assert isinstance(config, PerGroupKVCacheConfig)
    assert config.elastic is not None
    assert [p.num_blocks for p in config.pool_layouts] == list(elastic.num_pages)
    assert config.num_blocks == elastic.num_pages[1]  # attention: the primary pool
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    assert caches["l.0"].shape[0] == elastic.num_pages[0]
    assert caches["l.3"].shape[0] == elastic.num_pages[1]
    raw = caches["l.0"].view(torch.uint8)
    base = raw.untyped_storage().data_ptr()
    pages = elastic.page_bytes

    # Each layer's block lies inside its group's page, layers one after another.
    for gid, names in ((0, ["l.0", "l.1", "l.2"]), (1, ["l.3"])):
        for block in (1, 5, elastic.num_pages[gid] - 1):
            lo, hi = block * pages[gid], (block + 1) * pages[gid]
            for name in names:
                view = caches[name][block].view(torch.uint8)
                start = view.data_ptr() - base
                last = start + sum(
                    (n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True)
                )
                assert lo <= start and last < hi, (name, block)
    # Writing one group's page shows up in the other's overlapping bytes only.
    caches["l.3"].view(torch.uint8).zero_()
    caches["l.0"].view(torch.uint8).zero_()
    caches["l.1"].view(torch.uint8).zero_()
    caches["l.2"].view(torch.uint8).zero_()
    caches["l.0"][3].view(torch.uint8).fill_(7)
    touched = {
        b
        for b in range(elastic.num_pages[1])
        if bool((caches["l.3"][b].view(torch.uint8) == 7).any())
    }
    lo, hi = 3 * pages[0], 4 * pages[0]
    expected = {
        b for b in range(elastic.num_pages[1]) if b * pages[1] < hi and (b + 1) * pages[1] > lo
    }
    assert touched and touched <= expected


@pytest.mark.parametrize("layout_name", ["LHBNC", "BHLNC"])
def test_layouts_splitting_a_block_keep_the_static_split(layout_name: str) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("none")
    cfg.cache_config.get_resolved_kv_cache_layout = lambda: KVCacheLayout[layout_name]
    assert "does not keep a block's pages together" in (
        sizing.elastic_unsupported_reason(cfg) or ""
    )
    (config,) = sizing.get_kv_cache_configs(cfg, [qwen_like_specs()], [4 << 20])
    assert isinstance(config, PerGroupKVCacheConfig) and config.elastic is None


def test_switch_keeps_the_static_split(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("none")
    for value in ("1", ""):  # on, and unset: the default
        monkeypatch.setenv("HYBRID_ALLOC_ELASTIC_POOLS", value)
        (config,) = sizing.get_kv_cache_configs(cfg, [qwen_like_specs()], [4 << 20])
        assert isinstance(config, PerGroupKVCacheConfig) and config.elastic is not None
    monkeypatch.setenv("HYBRID_ALLOC_ELASTIC_POOLS", "0")
    (config,) = sizing.get_kv_cache_configs(cfg, [qwen_like_specs()], [4 << 20])
    assert isinstance(config, PerGroupKVCacheConfig) and config.elastic is None


def test_elastic_capacity_counts_states() -> None:
    """The engine's capacity report: requests of max_model_len the budget holds with their
    states, from the same sizing model as the planner."""
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("none")
    specs = qwen_like_specs()
    (config,) = sizing.get_kv_cache_configs(cfg, [specs], [4 << 20])
    elastic = sizing.size_elastic_groups(cfg, sizing.build_groups(specs), [4 << 20], [specs])
    assert sizing.get_max_concurrency_for_kv_cache_config(cfg, config) == pytest.approx(
        elastic.concurrency
    )
    assert elastic.needs[1].blocks_per_request == MAX_LEN // 16


def test_override_lends_the_static_splits_bytes() -> None:
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    specs = qwen_like_specs()
    groups = sizing.build_groups(specs)
    cfg = small_engine_config("none", override=80)
    static = sizing.size_groups(cfg, groups, 16 << 20)
    elastic = sizing.size_elastic_groups(cfg, groups, [16 << 20], [specs])
    assert elastic.available_bytes >= sum(p.bytes for p in static.pools)
    assert elastic.budget_bytes <= elastic.available_bytes
    assert elastic.num_slabs >= elastic.request_slabs


def test_pipeline_stages_page_is_the_largest_stages() -> None:
    """Two stages holding 3 + 1 of the GDN layers: the scheduler's page of the GDN pool is
    the larger stage's, each stage's tensors view its own layers at that block stride
    within its own memory."""
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config("none")
    m = small_mamba("none")
    stage0 = {"l.0": m, "l.1": m, "l.2": m, "l.3": attention()}
    stage1 = {"l.4": m, "l.5": attention(), "l.6": attention()}
    memory = [32 << 20, 24 << 20]
    configs = sizing.get_kv_cache_configs(cfg, [stage0, stage1], memory)
    layouts = [c.elastic for c in configs]
    assert layouts[0] == layouts[1] and layouts[0] is not None
    stride_m = m.page_size_bytes
    assert layouts[0].page_bytes[0] >= 3 * stride_m  # the GDN pool: stage 0's three layers
    assert layouts[0].page_bytes[1] >= 2 * attention().page_size_bytes  # attention: stage 1's
    for config, own in zip(configs, (stage0, stage1), strict=True):
        assert sorted(n for t in config.kv_cache_tensors for n in t.layers) == sorted(own)
        for tensor in config.kv_cache_tensors:
            assert tensor.size == layouts[0].slab_bytes * layouts[0].num_slabs <= min(memory)


@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize("name", ["nemotron-h-8b", "qwen3.6-35b-a3b", "zamba2-2.7b", "jamba-v0.1"])
def test_engine_and_planner_size_the_same_budget(
    name: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sizing model: the engine core's elastic config (vLLM's own layer specs) and
    ``hybrid-alloc plan`` (the model's config.json) give the same slabs, pages and
    capacity."""
    from hybrid_alloc.integration.scheduler import engine_sizing
    from hybrid_alloc.model_specs import model_from_config
    from hybrid_alloc.planner import load_config, plan
    from tests.planner.specs import engine_config, pin_cpu_platform, vllm_layer_specs

    cfg = load_config(name)
    spec_model = model_from_config(cfg)
    L, kv, seqs = 32768, 40 * (1 << 30) + 12345, 64
    p = plan(spec_model, kv, mamba_cache_mode=mode, max_model_len=L, max_num_seqs=seqs)
    specs = vllm_layer_specs(spec_model, mode=mode, max_len=L, block=16, cfg=cfg)
    pin_cpu_platform(monkeypatch)
    vc = engine_config(mode, L, seqs)
    (config,) = engine_sizing.get_kv_cache_configs(vc, [specs], [kv])
    assert p.elastic is not None and config.elastic is not None
    assert config.elastic.page_bytes == p.elastic.page_bytes
    assert config.elastic.slab_bytes == p.elastic.slab_bytes
    assert config.elastic.num_slabs == p.elastic.num_slabs
    engine = engine_sizing.get_max_concurrency_for_kv_cache_config(vc, config)
    assert engine == pytest.approx(p.elastic.concurrency)
    # The budget holds at least stock's max_model_len requests less what slab edges cost.
    assert p.elastic.tokens >= 0.97 * p.stock.tokens
