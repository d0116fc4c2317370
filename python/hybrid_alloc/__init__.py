"""hybrid_alloc: Rust KV-cache block pools for vLLM.

``from hybrid_alloc import BlockPool`` gives the drop-in replacement for vLLM's
``vllm.v1.core.block_pool.BlockPool`` (importing it imports vLLM). The vLLM plugin in
:mod:`hybrid_alloc.plugin` installs it; ``HYBRID_ALLOC_BACKEND`` selects the backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_alloc._native import __version__
from hybrid_alloc.backend import BACKENDS, ENV_VAR, selected_backend

if TYPE_CHECKING:
    from hybrid_alloc.block_pool import BlockPool

__all__ = ["BACKENDS", "ENV_VAR", "BlockPool", "__version__", "selected_backend"]


def __getattr__(name: str) -> Any:
    # BlockPool imports vLLM; load it only when asked for.
    if name == "BlockPool":
        from hybrid_alloc.block_pool import BlockPool

        return BlockPool
    raise AttributeError(f"module 'hybrid_alloc' has no attribute {name!r}")
