"""hybrid_alloc: Rust KV-cache block pools for vLLM.

``from hybrid_alloc import BlockPool`` gives the drop-in replacement for vLLM's
``vllm.v1.core.block_pool.BlockPool`` and ``PoolSet`` the per-group pools (importing either
imports vLLM). The vLLM plugin (:mod:`hybrid_alloc.integration.plugin`) installs them;
``HYBRID_ALLOC_BACKEND`` and ``HYBRID_ALLOC_PER_GROUP_POOLS`` (:mod:`hybrid_alloc.settings`)
select what it installs. The sizing model, the planner and the CLI need no vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_alloc._native import __version__
from hybrid_alloc.settings import BACKENDS, ENV_VAR, selected_backend

if TYPE_CHECKING:
    from hybrid_alloc.integration.scheduler.block_pool import BlockPool
    from hybrid_alloc.integration.scheduler.pool_set import PoolSet

__all__ = ["BACKENDS", "ENV_VAR", "BlockPool", "PoolSet", "__version__", "selected_backend"]


def __getattr__(name: str) -> Any:
    # Both import vLLM; load them only when asked for.
    if name == "BlockPool":
        from hybrid_alloc.integration.scheduler.block_pool import BlockPool

        return BlockPool
    if name == "PoolSet":
        from hybrid_alloc.integration.scheduler.pool_set import PoolSet

        return PoolSet
    raise AttributeError(f"module 'hybrid_alloc' has no attribute {name!r}")
