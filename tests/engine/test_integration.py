"""The integration's hooks and switches: the worker keeps natural page sizes where the
engine core sizes per-group pools, and pads as stock vLLM does where it falls back."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import fake_vllm_config, kv_connector


def test_worker_hook_pads_where_sizing_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own rule (padding included) where the engine core sizes vLLM's shared pool: a
    configuration per-group pools do not serve, or 'align' mode where the rule raises the
    block size (a state page larger than an attention block). Where it does not raise it,
    its changes are undone and pages stay natural; HYBRID_ALLOC_FINE_ALIGN_BLOCKS=1 never
    runs it."""
    from vllm.platforms.interface import Platform

    from hybrid_alloc.integration.worker import runner

    calls: list[Any] = []
    raised = {"block": 48}  # three 16-token blocks: no whole number of them halves it

    def stock_align(cls: Any, vllm_config: Any, backend: Any) -> None:
        calls.append(vllm_config)
        cache = vllm_config.cache_config
        cache.block_size = max(cache.block_size, raised["block"])
        cache.mamba_block_size = cache.block_size
        cache.mamba_page_size_padded = 12345

    monkeypatch.setattr(runner, "_stock_align", classmethod(stock_align))
    monkeypatch.delenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", raising=False)
    cfg = fake_vllm_config("align", caching=True)
    cache = cfg.cache_config

    def run() -> tuple[int, int | None, int | None]:
        cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded = 16, None, None
        Platform._align_hybrid_block_size(cfg, None)
        return cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded

    runner.install()
    try:
        assert run() == (48, 48, 12345)  # raised: vLLM's layout kept
        # Workers run the hook more than once: a second run keeps it.
        Platform._align_hybrid_block_size(cfg, None)
        assert (cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded) == (
            48,
            48,
            12345,
        )
        calls.pop()
        raised["block"] = 16
        assert run() == (16, 16, None)  # not raised: undone, natural pages
        assert len(calls) == 2
        monkeypatch.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", "1")
        raised["block"] = 48
        assert run() == (16, 16, None) and len(calls) == 2
        cfg.kv_transfer_config = kv_connector()
        assert run() == (48, 48, 12345) and len(calls) == 3
    finally:
        runner.uninstall()


def test_worker_hook_keeps_natural_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HYBRID_ALLOC_FINE_ALIGN_BLOCKS=1 'align' mode keeps the configured block size
    (vLLM's rule is not run) and Mamba pages stay unpadded."""
    from vllm.platforms.interface import Platform

    from hybrid_alloc.integration.worker import runner

    calls: list[Any] = []
    monkeypatch.setattr(runner, "_stock_align", classmethod(lambda c, v, b: calls.append(v)))
    monkeypatch.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", "1")
    cfg = fake_vllm_config("align", caching=True)
    cache = cfg.cache_config
    cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded = 16, None, 9
    runner.install()
    try:
        Platform._align_hybrid_block_size(cfg, None)
        assert calls == []
        assert (cache.block_size, cache.mamba_block_size) == (16, 16)
        assert cache.mamba_page_size_padded is None
        assert runner.is_installed()
    finally:
        runner.uninstall()
    assert not runner.is_installed()


@pytest.mark.parametrize(
    ("hybrid", "unit", "block"),
    [
        (784, 16, 112),  # Qwen3.5-27B: 49 units, 7 x 7
        (1568, 16, 784),  # Falcon-H1-7B
        (1040, 16, 208),  # Nemotron-H-8B: 65 units, 5 x 13
        (528, 16, 176),  # Granite 4.0-H-Small: 33 units, 3 x 11
        (2096, 16, 16),  # Nemotron-3-Nano: 131 units, a prime
        (48, 16, 16),  # Zamba2-2.7B
        (32, 16, 16),
        (1024, 256, 512),
    ],
)
def test_divisor_block(hybrid: int, unit: int, block: int) -> None:
    from hybrid_alloc.sizing import divisor_block

    assert divisor_block(hybrid, unit) == block
    assert hybrid % block == 0 and block % unit == 0 and hybrid // block >= 2
    # The largest such block: no multiple of the unit between it and half of vLLM's.
    assert not any(hybrid % b == 0 for b in range(block + unit, hybrid // 2 + 1, unit))


@pytest.mark.parametrize(("hybrid", "unit"), [(100, 16), (16, 0), (0, 16)])
def test_divisor_block_refuses_what_is_not_a_multiple(hybrid: int, unit: int) -> None:
    from hybrid_alloc.sizing import divisor_block

    with pytest.raises(ValueError, match="not a positive multiple"):
        divisor_block(hybrid, unit)


@pytest.mark.parametrize(
    ("setting", "hybrid", "block"),
    [
        ("divisor", 784, 112),  # 49 blocks of 16: the largest divisor, a seventh
        (None, 784, 784),  # unset: 49 is odd, no half; vLLM's layout (padded)
        ("0", 96, 96),  # off: vLLM's layout even where a half divides it
        (None, 96, 48),  # unset: 6 blocks of 16, halved
        (None, 32, 16),  # unset: 2 blocks of 16, halved to the configured block
        (None, 48, 48),  # unset: 3 blocks of 16: kept
        ("half", 96, 48),
        ("divisor", 96, 48),
    ],
)
def test_worker_hook_finer_blocks(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, hybrid: int, block: int
) -> None:
    """Where vLLM's rule raises the block (16 to ``hybrid`` tokens):
    HYBRID_ALLOC_FINE_ALIGN_BLOCKS unset halves it where a whole number of 16-token
    blocks does, ``divisor`` takes the largest block dividing it, ``0`` keeps vLLM's layout;
    per-group blocks leave pages unpadded, and a second run of the hook (workers run it
    more than once) keeps what the first chose. Where the rule does not raise it, the
    configured block stays."""
    from vllm.platforms.interface import Platform

    from hybrid_alloc.integration.worker import runner

    raised = {"block": hybrid}

    def stock_align(cls: Any, vllm_config: Any, backend: Any) -> None:
        # vLLM's rule: the smallest multiple of the configured block covering the state.
        cache = vllm_config.cache_config
        need = raised["block"]
        cache.block_size = max(cache.block_size, -(-need // cache.block_size) * cache.block_size)
        cache.mamba_block_size = cache.block_size
        if cache.block_size != need or need > 16:
            cache.mamba_page_size_padded = 12345

    monkeypatch.setattr(runner, "_stock_align", classmethod(stock_align))
    if setting is None:
        monkeypatch.delenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", raising=False)
    else:
        monkeypatch.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", setting)
    cfg = fake_vllm_config("align", caching=True)
    cache = cfg.cache_config
    cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded = 16, None, None
    padded = 12345 if block == hybrid else None
    runner.install()
    try:
        Platform._align_hybrid_block_size(cfg, None)
        state = (cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded)
        assert state == (block, block, padded)
        Platform._align_hybrid_block_size(cfg, None)
        assert (cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded) == state
        raised["block"] = 16
        cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded = 16, None, None
        Platform._align_hybrid_block_size(cfg, None)
        assert (cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded) == (
            16,
            16,
            None,
        )
    finally:
        runner.uninstall()


def test_switch() -> None:
    from hybrid_alloc.settings import PER_GROUP_ENV_VAR, per_group_pools_enabled

    assert per_group_pools_enabled({})  # on unless turned off
    assert per_group_pools_enabled({PER_GROUP_ENV_VAR: ""})
    assert per_group_pools_enabled({PER_GROUP_ENV_VAR: " 1 "})
    assert not per_group_pools_enabled({PER_GROUP_ENV_VAR: "off"})
    with pytest.raises(ValueError):
        per_group_pools_enabled({PER_GROUP_ENV_VAR: "maybe"})


# ------------------------------------------------------------------ versions
def test_installed_vllm_is_supported() -> None:
    """The environments the suite runs in are the supported releases, and each gets the
    table entry of its own version."""
    from hybrid_alloc.integration import versions

    version = versions.installed_version()
    assert versions.is_supported(version)
    assert versions.release().version == versions.base_version(version)
    assert versions.base_version("0.32.0+cpu") == "0.32.0"
    assert not versions.is_supported("0.31.2")
    assert not versions.is_supported("0.34.0")


def _register_with(
    monkeypatch: pytest.MonkeyPatch, version: str, env: dict[str, str]
) -> tuple[Any, list[str]]:
    """Run the plugin's entry point as if ``version`` were installed; returns the plugin
    module and the warnings it logged."""
    from hybrid_alloc import integration
    from hybrid_alloc.integration import plugin, versions

    for key in ("HYBRID_ALLOC_BACKEND", "HYBRID_ALLOC_PER_GROUP_POOLS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(versions, "installed_version", lambda: version)
    monkeypatch.setattr(plugin, "_active", None)
    warnings: list[str] = []
    monkeypatch.setattr(plugin.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    integration.uninstall()
    return plugin, warnings


def test_unsupported_vllm_is_left_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a vLLM release it was not tested against, the plugin patches nothing and says
    once which releases it supports."""
    import vllm.v1.core.block_pool as stock_pool
    import vllm.v1.core.kv_cache_coordinator as coordinator
    import vllm.v1.core.kv_cache_manager as kv_cache_manager
    from vllm.platforms.interface import Platform
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    from hybrid_alloc import integration

    before = (
        coordinator.BlockPool,
        kv_cache_manager.get_kv_cache_coordinator,
        Platform.__dict__["_align_hybrid_block_size"],
        FullAttentionManager.__dict__["find_longest_cache_hit"],
    )
    plugin, warnings = _register_with(monkeypatch, "0.99.0", {})
    plugin.register()
    plugin.register()  # every process runs it; one warning each
    assert coordinator.BlockPool is stock_pool.BlockPool
    after = (
        coordinator.BlockPool,
        kv_cache_manager.get_kv_cache_coordinator,
        Platform.__dict__["_align_hybrid_block_size"],
        FullAttentionManager.__dict__["find_longest_cache_hit"],
    )
    assert after == before
    assert integration.installed() is None
    assert plugin.active_backend() == "unsupported"
    assert len(warnings) == 1
    assert "0.32.0, 0.33.0" in warnings[0] and "0.99.0" in warnings[0]


def test_explicit_rust_backend_on_unsupported_vllm_stops_startup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugin, _ = _register_with(monkeypatch, "0.31.0", {"HYBRID_ALLOC_BACKEND": "rust"})
    with pytest.raises(
        RuntimeError, match=r"HYBRID_ALLOC_BACKEND=rust: .*0\.32\.0, 0\.33\.0.*0\.31\.0"
    ):
        plugin.register()


def test_stock_backend_on_unsupported_vllm_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin, warnings = _register_with(monkeypatch, "0.31.0", {"HYBRID_ALLOC_BACKEND": "vllm"})
    plugin.register()
    assert warnings == []
    assert plugin.active_backend() == "vllm"


@pytest.mark.parametrize("per_group", ["1", "0"])
def test_supported_vllm_installs_and_uninstalls(
    monkeypatch: pytest.MonkeyPatch, per_group: str
) -> None:
    """install() replaces exactly the hooks of the selected mode, uninstall() puts back
    every one of them."""
    import vllm.v1.core.block_pool as stock_pool
    import vllm.v1.core.kv_cache_coordinator as coordinator

    from hybrid_alloc import integration
    from hybrid_alloc.integration import versions
    from hybrid_alloc.integration.scheduler import block_pool, engine_sizing, manager_patches
    from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
    from hybrid_alloc.integration.worker import runner

    version = versions.installed_version()
    plugin, warnings = _register_with(
        monkeypatch, version, {"HYBRID_ALLOC_PER_GROUP_POOLS": per_group}
    )
    try:
        plugin.register()
        on = per_group == "1"
        assert integration.installed() == ("rust", on)
        assert block_pool.is_installed() and manager_patches.is_installed()
        assert coordinator.BlockPool is block_pool.BlockPool
        assert runner.is_installed() is on
        assert engine_sizing.is_installed() is on
        assert pg_coordinator.is_installed() is on
        assert warnings == []
    finally:
        integration.uninstall()
    assert coordinator.BlockPool is stock_pool.BlockPool
    for module in (block_pool, manager_patches, runner, engine_sizing, pg_coordinator):
        assert not module.is_installed(), module.__name__


# ------------------------------------------------------------------ speculative decoding
@pytest.mark.parametrize("use_eagle", [False, True])
def test_spec_decode_admission_per_pool(use_eagle: bool) -> None:
    """With speculative decoding a 'none'-mode Mamba request holds 1 + num_speculative
    state blocks; admission asks each pool for its own share, lookahead tokens included:
    a Mamba pool for two such requests admits two and refuses a third while attention
    blocks are plenty, and decode steps with lookahead need no further state block."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc import integration
    from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
    from tests.helpers import (
        MAX_LEN,
        attn,
        new_request,
        per_group_config,
        scheduler_block_size,
        state_mamba,
    )

    spec = 2
    specs = [attn(), state_mamba("none", speculative_blocks=spec)]
    config = per_group_config(specs, [200, 2 * (1 + spec) + 1])
    integration.install(per_group_pools=False)
    pg_coordinator.install()
    try:
        mgr = KVCacheManager(
            config,
            max_model_len=MAX_LEN,
            scheduler_block_size=scheduler_block_size(specs),
            hash_block_size=16,
            enable_caching=False,
            use_eagle=use_eagle,
        )
    finally:
        pg_coordinator.uninstall()
        integration.uninstall()
    pools = mgr.block_pool
    attention, mamba_pool = pools.pool_for_group(0), pools.pool_for_group(1)
    requests = [new_request(f"r{i}", list(range(3, 43))) for i in range(3)]
    for i, request in enumerate(requests[:2]):
        assert mgr.allocate_slots(request, 40, num_lookahead_tokens=spec) is not None
        assert mamba_pool.get_num_free_blocks() == (1 - i) * (1 + spec)
        state_blocks = mgr.get_block_ids(request.request_id)[1]
        assert len(state_blocks) == 1 + spec and all(state_blocks)
    free_attention = attention.get_num_free_blocks()
    assert free_attention > 100
    assert mgr.allocate_slots(requests[2], 40, num_lookahead_tokens=spec) is None
    assert attention.get_num_free_blocks() == free_attention  # refused: nothing taken
    # Decode steps: one verified token plus `spec` drafts, `spec` lookahead slots.
    request = requests[0]
    for step in range(5):
        request.append_output_token_ids(7)
        request.num_computed_tokens = request.num_tokens - 1
        assert mgr.allocate_slots(request, 1 + spec, num_lookahead_tokens=spec) is not None
        assert mamba_pool.get_num_free_blocks() == 0, step
    mgr.free(requests[0])
    assert mamba_pool.get_num_free_blocks() == 1 + spec
    assert mgr.allocate_slots(requests[2], 40, num_lookahead_tokens=spec) is not None
