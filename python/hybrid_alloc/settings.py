"""The two environment switches users set, parsed without importing vLLM.

* ``HYBRID_ALLOC_BACKEND``: which block pool vLLM's KV-cache coordinator builds. ``rust``
  (the default once hybrid_alloc is installed) selects the Rust pool; ``vllm`` keeps vLLM's
  stock Python pool.
* ``HYBRID_ALLOC_PER_GROUP_POOLS``: with the Rust backend, whether hybrid models get one pool
  per KV-cache group (default on; ``0`` keeps the Rust pool a drop-in for vLLM's one shared
  pool).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_VAR = "HYBRID_ALLOC_BACKEND"
BACKENDS = ("rust", "vllm")
DEFAULT_BACKEND = "rust"

PER_GROUP_ENV_VAR = "HYBRID_ALLOC_PER_GROUP_POOLS"
_TRUE = ("", "1", "true", "yes", "on")  # unset or empty: on
_FALSE = ("0", "false", "no", "off")


def backend_is_explicit(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_BACKEND`` is set to a non-empty value."""
    env = os.environ if environ is None else environ
    return bool(env.get(ENV_VAR, "").strip())


def selected_backend(environ: Mapping[str, str] | None = None) -> str:
    """The backend named by ``HYBRID_ALLOC_BACKEND`` (case and surrounding space ignored).

    Raises:
        ValueError: the variable names no known backend; the message lists the valid ones.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return DEFAULT_BACKEND
    value = raw.strip().lower()
    if value not in BACKENDS:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not a known backend; valid values are: " + ", ".join(BACKENDS)
        )
    return value


def per_group_pools_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_PER_GROUP_POOLS`` asks for per-group pools.

    Raises:
        ValueError: a value that is neither true-ish nor false-ish.
    """
    env = os.environ if environ is None else environ
    value = env.get(PER_GROUP_ENV_VAR, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{PER_GROUP_ENV_VAR}={value!r}: expected one of {_TRUE[1:] + _FALSE}")
