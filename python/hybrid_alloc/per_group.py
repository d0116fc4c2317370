"""Switch for per-group pools: ``HYBRID_ALLOC_PER_GROUP_POOLS`` (default on; ``0`` turns
them off and leaves the Rust pool a drop-in for vLLM's one shared pool).

With the Rust backend and the switch on, :func:`install` (called by the plugin in every
vLLM process) makes vLLM

* keep natural page sizes in the workers (:mod:`hybrid_alloc.worker`),
* size one pool per KV-cache group in the engine core (:mod:`hybrid_alloc.sizing`),
* build a coordinator with one `BlockPool` per group (:mod:`hybrid_alloc.coordinator`).

Engines that per-group pools do not cover (see :mod:`hybrid_alloc.sizing`) fall back to
vLLM's shared pool, with the reason logged; the coordinator follows whatever config the
engine core built. Models without Mamba/GDN layers are not affected at all.
"""

from __future__ import annotations

import os

ENV_VAR = "HYBRID_ALLOC_PER_GROUP_POOLS"
_TRUE = ("", "1", "true", "yes", "on")  # unset or empty: on
_FALSE = ("0", "false", "no", "off")


def enabled(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_PER_GROUP_POOLS`` asks for per-group pools.

    Raises:
        ValueError: a value that is neither true-ish nor false-ish.
    """
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR}={value!r}: expected one of {_TRUE[1:] + _FALSE}")


def install() -> None:
    """Install the three hooks (idempotent)."""
    from hybrid_alloc import coordinator, sizing, worker

    worker.install()
    sizing.install()
    coordinator.install()


def uninstall() -> None:
    from hybrid_alloc import coordinator, sizing, worker

    worker.uninstall()
    sizing.uninstall()
    coordinator.uninstall()
