"""Everything that touches vLLM, behind one interface: :func:`install` / :func:`uninstall`.

By the side of vLLM each module runs on:

* this package: :mod:`.versions` (the supported vLLM releases and what differs between
  them), :mod:`.plugin` (the entry point vLLM runs in every process: checks the version,
  reads the environment switches, calls :func:`install`), :mod:`.hooks` (wrapping vLLM
  functions in place and putting them back) and :mod:`.kv_cache_config` (the per-group
  layout the engine core decides and both sides read);
* :mod:`.scheduler`: the engine core's side: the drop-in pool, per-group pools and their
  coordinators, the running requests' table, per-group sizing;
* :mod:`.worker`: the workers' side: natural page sizes, per-pool tensor views, block
  zeroing, CPU kernels' gaps;
* :mod:`.kv_transfer`: blocks that leave the pools and come back: native offloading and
  its tiers, the NixlConnector (prefill/decode disaggregation);
* :mod:`.simulator`: vLLM's real scheduler on a full-size model's layout, no model.

Each hooking module has ``install()``, ``uninstall()`` and ``is_installed()``; this package
composes them. Nothing here is imported before the plugin has checked the vLLM version.
"""

from __future__ import annotations

_state: tuple[str, bool] | None = None


def install(per_group_pools: bool = True) -> None:
    """Make vLLM build the Rust pool (and, with ``per_group_pools``, one pool per KV-cache
    group for hybrid models) in this process. Idempotent; switching modes uninstalls first.

    Raises:
        RuntimeError: the installed vLLM is not a supported release.
    """
    global _state
    from hybrid_alloc.integration import versions

    versions.release()  # refuses an unsupported vLLM before anything is patched
    wanted = ("rust", per_group_pools)
    if _state == wanted:
        return
    uninstall()
    from hybrid_alloc.integration.kv_transfer import offload
    from hybrid_alloc.integration.scheduler import block_pool, manager_patches

    block_pool.install()
    manager_patches.install()
    offload.install()
    if per_group_pools:
        from hybrid_alloc.integration.kv_transfer import nixl
        from hybrid_alloc.integration.scheduler import coordinator, engine_sizing
        from hybrid_alloc.integration.worker import runner

        runner.install()
        nixl.install()
        engine_sizing.install()
        coordinator.install()
    _state = wanted


def uninstall() -> None:
    """Put every vLLM function and class this package replaced back (idempotent)."""
    global _state
    if _state is None:
        return
    from hybrid_alloc.integration.kv_transfer import offload
    from hybrid_alloc.integration.scheduler import block_pool, manager_patches

    if _state[1]:
        from hybrid_alloc.integration.kv_transfer import nixl
        from hybrid_alloc.integration.scheduler import coordinator, engine_sizing
        from hybrid_alloc.integration.worker import runner

        coordinator.uninstall()
        engine_sizing.uninstall()
        nixl.uninstall()
        runner.uninstall()
    offload.uninstall()
    manager_patches.uninstall()
    block_pool.uninstall()
    _state = None


def installed() -> tuple[str, bool] | None:
    """``("rust", per_group_pools)`` while installed in this process, else None."""
    return _state
