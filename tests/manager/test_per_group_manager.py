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
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheTensor,
    MambaSpec,
    get_kv_cache_spec_kind,
)
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig, PoolLayout
from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
from hybrid_alloc.integration.scheduler.pool_set import PoolSet
from tests.helpers import (
    PER_GROUP_LAYOUTS,
    check_our_pool,
    drop_in,
    engine_hooks_installed,
    genuine_stock_manager,
    group_specs,
    layout_manager,
    new_request,
    per_group_caching,
    per_group_manager,
    stock_config,
)
from tests.helpers import per_group_config as make_config

LAYOUTS = PER_GROUP_LAYOUTS


def caching(layout: str) -> bool:
    return per_group_caching(LAYOUTS[layout])


def per_group_config(layout: str, sizes: list[int]) -> PerGroupKVCacheConfig:
    """Group i draws from pool i with ``sizes[i]`` blocks (pools of the layout's shared
    groups take the first group's size)."""
    return make_config(LAYOUTS[layout], sizes)


def build(config: KVCacheConfig, layout: str, events: bool = False) -> KVCacheManager:
    return layout_manager(config, events)


class Driver:
    """Admit / decode / finish requests on one manager; log what vLLM decided. Calls into
    our manager run with the integration installed (the batched prefix lookup), calls
    into vLLM's genuine stock manager with it uninstalled."""

    def __init__(self, mgr: KVCacheManager, layout: str) -> None:
        self.mgr = mgr
        self.ours = isinstance(mgr.block_pool, PoolSet)
        self.running: dict[str, Request] = {}
        self.log: list[Any] = []

    def calls(self) -> Any:
        return drop_in(self.ours)

    def admit(self, rid: str, tokens: list[int], max_tokens: int) -> bool:
        req = new_request(rid, tokens, max_tokens)
        with self.calls():
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
        self.log.append(("blocks", rid, self.shapes(rid)))
        return True

    def decode(self, rid: str, token: int) -> bool:
        req = self.running[rid]
        with self.calls():
            new = self.mgr.allocate_slots(req, 1)
        self.log.append(("decode", rid, new is not None))
        if new is None:
            return False
        req.num_computed_tokens += 1
        req.append_output_token_ids(token)
        self.log.append(("blocks", rid, self.shapes(rid)))
        return True

    def finish(self, rid: str) -> None:
        with self.calls():
            self.mgr.free(self.running.pop(rid))
        self.log.append(("free", rid))

    def shapes(self, rid: str) -> list[list[bool]]:
        """The request's block table per group, as null / real (IDs are pool-scoped)."""
        return [[i == 0 for i in ids] for ids in self.mgr.get_block_ids(rid)]


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
    """Every manager draws from its group's pool, every block a group holds is a block of
    that pool, each pool's reference counts equal the holders across the managers of its
    groups, and free + held + null == total (see helpers.check_our_pool)."""
    pools: PoolSet = d.mgr.coordinator.pool_set  # type: ignore[attr-defined]
    managers = d.mgr.coordinator.single_type_managers
    for gid, manager in enumerate(managers):
        assert manager.block_pool is pools.pool_for_group(gid)
    for idx, pool in enumerate(pools):
        groups = {g for g in range(len(managers)) if pools.pool_index_of_group(g) == idx}
        check_our_pool(pool, [managers[g] for g in sorted(groups)], groups)


# ---------------------------------------------------------------- differential
@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=6)
@given(seed=st.integers(0, 10_000))
def test_ample_pools_decide_like_vllm(layout: str, seed: int) -> None:
    """Nothing is evicted with ample pools, so hits, admissions, decodes and the shapes of
    every block table are those of vLLM's own manager, coordinator and pool (built and
    driven with the integration uninstalled)."""
    n = len(LAYOUTS[layout])
    stock_mgr = genuine_stock_manager(stock_config(LAYOUTS[layout], 4000))
    ours = per_group_manager(per_group_config(layout, [2000] * n))
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
    with engine_hooks_installed():
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
    with engine_hooks_installed():
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
    with engine_hooks_installed():
        mgr = build(per_group_config(layout, [200, 3]), layout)  # 2 usable Mamba blocks
    d = Driver(mgr, layout)
    assert _req(d, "a", 20) and _req(d, "b", 20)
    # Two blocks of attention each (20 tokens), one Mamba state block each.
    assert mgr.block_pool.free_counts() == (199 - 4, 0)  # type: ignore[attr-defined]
    assert not _req(d, "c", 20)  # Mamba pool empty: one block per request in 'none' mode
    assert mgr.block_pool.free_counts() == (199 - 4, 0)  # type: ignore[attr-defined]
    d.finish("a")
    assert _req(d, "c", 20)
    check_pools(d)


def test_full_attention_pool_refuses_even_with_mamba_room() -> None:
    layout = "full+mamba_none"
    with engine_hooks_installed():
        mgr = build(per_group_config(layout, [5, 50]), layout)  # 4 usable attention blocks
    d = Driver(mgr, layout)
    assert _req(d, "a", 40)  # 3 blocks
    assert not _req(d, "b", 40)
    assert mgr.coordinator.pool_set.free_counts() == (1, 48)  # type: ignore[attr-defined]
    d.finish("a")
    assert _req(d, "b", 40)


@pytest.mark.parametrize(
    ("sizes", "decision"),
    [
        ([100, 100, 20], [7, 7]),  # every pool holds its share: the primary's share
        ([100, 100, 1], [101, 101]),  # the Mamba pool has no usable block
        ([100, 7, 20], [101, 7]),  # 6 usable SWA blocks: enough only once 4 slid out
    ],
)
def test_per_pool_needs(sizes: list[int], decision: list[int]) -> None:
    """A 100-token request on full + SWA(32) + Mamba 'align' (16-token blocks):

    * nothing computed: full attention needs cdiv(100, 16) = 7 blocks, the sliding
      window too (nothing has left it yet), Mamba one running-state block;
    * 96 tokens computed (an external claim): the first 96 - 32 + 1 = 65 tokens are
      outside the window, so 4 SWA blocks are skipped and 3 are needed.

    The coordinator answers the primary (first growing) pool's share when every other
    pool can hold its own, else one more block than the primary pool has (101)."""
    layout = "full+swa+mamba_align"
    mgr = per_group_manager(per_group_config(layout, sizes))
    coord: Any = mgr.coordinator
    empty = mgr.empty_kv_cache_blocks.blocks
    fresh = ("x", 100, empty, 0, 0, 0, 100)
    claimed = ("y", 100, empty, 0, 96, 0, 100)
    assert coord.get_num_blocks_to_allocate_per_pool(*fresh) == [7, 7, 1]
    assert coord.get_num_blocks_to_allocate_per_pool(*claimed) == [7, 3, 1]
    assert [
        coord.get_num_blocks_to_allocate(*fresh),
        coord.get_num_blocks_to_allocate(*claimed),
    ] == decision


# ------------------------------------------------------------------- eviction
def test_manager_eviction_is_per_group() -> None:
    layout = "full+mamba_align"
    with engine_hooks_installed():
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
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert {e.group_idx for e in stored} == {0, 1}
    assert {e.group_idx for e in events if type(e).__name__ == "BlockRemoved"} == {0}
    # What a KV-aware router tells groups apart by: each stored block names its group's
    # kind (vLLM's manager reads it from the per-group config) and block size.
    groups = mgr.kv_cache_config.kv_cache_groups
    for e in stored:
        spec = groups[e.group_idx].kv_cache_spec
        assert (e.kv_cache_spec_kind, e.block_size) == (
            get_kv_cache_spec_kind(spec).value,
            spec.block_size,
        )
    assert len({e.kv_cache_spec_kind for e in stored}) == 2


def test_stock_config_gets_stock_coordinator() -> None:
    layout = "full+mamba_align"
    with engine_hooks_installed():
        mgr = build(
            KVCacheConfig(
                num_blocks=50, kv_cache_tensors=[], kv_cache_groups=group_specs(LAYOUTS[layout])
            ),
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
            kv_cache_groups=group_specs(LAYOUTS["full+mamba_none"]),
            pool_layouts=(PoolLayout((0,), 4, True),),
        )
