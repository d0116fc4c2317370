"""Everything that touches vLLM, behind one interface: :func:`install` / :func:`uninstall`.

* :mod:`.versions`: the supported vLLM releases and what differs between them;
* :mod:`.plugin`: the entry point vLLM runs in every process (checks the version, reads the
  environment switches, calls :func:`install`);
* :mod:`.block_pool`: ``BlockPool``, the drop-in for vLLM's pool;
* :mod:`.manager_patches`: batched replacements for two per-block loops of vLLM's managers;
* :mod:`.pool_set`, :mod:`.coordinator`, :mod:`.kv_cache_config`: one pool per KV-cache
  group in the scheduler;
* :mod:`.engine_sizing`: the engine core's per-group sizing (built on
  :mod:`hybrid_alloc.integration.engine_sizing`);
* :mod:`.worker`: workers keep natural page sizes;
* :mod:`.offload`: vLLM's native KV offloading with per-group pools, and on CPU platforms;
* :mod:`.nixl`: vLLM's NixlConnector (prefill/decode disaggregation) on per-group pools.

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
    from hybrid_alloc.integration import block_pool, manager_patches, offload

    block_pool.install()
    manager_patches.install()
    offload.install()
    if per_group_pools:
        from hybrid_alloc.integration import coordinator, engine_sizing, nixl, worker

        worker.install()
        nixl.install()
        engine_sizing.install()
        coordinator.install()
    _state = wanted


def uninstall() -> None:
    """Put every vLLM function and class this package replaced back (idempotent)."""
    global _state
    if _state is None:
        return
    from hybrid_alloc.integration import block_pool, manager_patches, offload

    if _state[1]:
        from hybrid_alloc.integration import coordinator, engine_sizing, nixl, worker

        coordinator.uninstall()
        engine_sizing.uninstall()
        nixl.uninstall()
        worker.uninstall()
    offload.uninstall()
    manager_patches.uninstall()
    block_pool.uninstall()
    _state = None


def installed() -> tuple[str, bool] | None:
    """``("rust", per_group_pools)`` while installed in this process, else None."""
    return _state
