"""Backend selection: which block pool vLLM's KV-cache coordinator builds.

``HYBRID_ALLOC_BACKEND=rust`` (the default once hybrid_alloc is installed) selects the Rust
pool; ``HYBRID_ALLOC_BACKEND=vllm`` keeps vLLM's stock Python pool.
"""

from __future__ import annotations

import os

ENV_VAR = "HYBRID_ALLOC_BACKEND"
BACKENDS = ("rust", "vllm")
DEFAULT_BACKEND = "rust"


def selected_backend(environ: dict[str, str] | os._Environ[str] | None = None) -> str:
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
