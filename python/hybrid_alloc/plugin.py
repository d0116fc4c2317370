"""The vLLM plugin (entry point ``vllm.general_plugins: hybrid_alloc``).

vLLM runs general plugins once per process before it builds the KV-cache coordinator and
the scheduler, including in the engine-core process that owns them. With the Rust backend
selected, :func:`register` makes the coordinator build :class:`hybrid_alloc.BlockPool`
instead of vLLM's stock pool; vLLM looks the name up when it builds each coordinator.
Hybrid models then also get one pool per KV-cache group (:mod:`hybrid_alloc.per_group`)
unless ``HYBRID_ALLOC_PER_GROUP_POOLS=0``.
"""

from __future__ import annotations

import os
import sys

from vllm.logger import init_logger

from hybrid_alloc.backend import ENV_VAR, selected_backend

# vLLM's own logger factory: importing it configures vLLM's logging, so the line is printed
# even in a process where the plugin runs before vLLM has logged anything.
logger = init_logger("vllm.hybrid_alloc")

_installed: str | None = None


def register() -> None:
    """Entry point: install the selected backend in this process (idempotent)."""
    global _installed
    from hybrid_alloc import per_group

    backend = selected_backend()  # raises ValueError, failing startup, on a bad value
    # Per-group pools need the Rust pool; the switch is read (and checked) either way.
    wants_per_group = per_group.enabled() and backend == "rust"
    if _installed == backend:
        return
    if backend == "rust":
        install_rust_pool()
        if wants_per_group:
            install_per_group_pools()
    else:
        restore_stock_pool()
    _installed = backend
    logger.info(
        "hybrid_alloc: KV-cache block pool backend is '%s' (%s, pid %d)%s",
        backend,
        ENV_VAR,
        os.getpid(),
        ", per-group pools on" if wants_per_group else "",
    )


def install_rust_pool() -> None:
    """Make vLLM's KV-cache coordinator build the Rust pool."""
    import vllm.v1.core.kv_cache_coordinator as coordinator

    from hybrid_alloc import patches
    from hybrid_alloc.block_pool import BlockPool

    coordinator.BlockPool = BlockPool  # type: ignore[misc,assignment]
    patches.apply()


def install_per_group_pools() -> None:
    """Hybrid models get one pool per KV-cache group: natural page sizes in the workers,
    per-group sizing in the engine core, a coordinator with one pool per group."""
    from hybrid_alloc import per_group

    per_group.install()


def restore_stock_pool() -> None:
    """Make vLLM's KV-cache coordinator build its stock pool again."""
    import vllm.v1.core.block_pool as stock
    import vllm.v1.core.kv_cache_coordinator as coordinator

    coordinator.BlockPool = stock.BlockPool  # type: ignore[misc]
    if "hybrid_alloc.patches" in sys.modules:
        sys.modules["hybrid_alloc.patches"].revert()
    if "hybrid_alloc.per_group" in sys.modules:
        sys.modules["hybrid_alloc.per_group"].uninstall()


def active_backend() -> str | None:
    """The backend installed in this process, or None if the plugin has not run."""
    return _installed
