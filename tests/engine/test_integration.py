"""The integration's hooks and switches: the worker keeps natural page sizes where the
engine core sizes per-group pools, and pads as stock vLLM does where it falls back."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import fake_vllm_config


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
    from hybrid_alloc.integration import (
        block_pool,
        engine_sizing,
        manager_patches,
        versions,
        worker,
    )
    from hybrid_alloc.integration import coordinator as pg_coordinator

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
        assert worker.is_installed() is on
        assert engine_sizing.is_installed() is on
        assert pg_coordinator.is_installed() is on
        assert warnings == []
    finally:
        integration.uninstall()
    assert coordinator.BlockPool is stock_pool.BlockPool
    for module in (block_pool, manager_patches, worker, engine_sizing, pg_coordinator):
        assert not module.is_installed(), module.__name__
