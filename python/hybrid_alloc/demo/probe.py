"""Reports, from inside the engine-core process, which block pool the scheduler built.

``engine_run`` starts vLLM with ``scheduler_cls`` naming :class:`ProbeScheduler`: vLLM's
own :class:`~vllm.v1.core.sched.scheduler.Scheduler`, unchanged except that it logs one
line when it is built and one when it shuts down, each carrying a JSON payload::

    hybrid_alloc.probe init {"pid": ..., "block_pool": "hybrid_alloc.block_pool.BlockPool", ...}

On CPU the scheduler lives in the engine-core process and the model in a separate worker
process, so a worker-side probe could not see the pool; the scheduler can.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

PROBE_SCHEDULER = "hybrid_alloc.demo.probe.ProbeScheduler"
PROBE_TAG = "hybrid_alloc.probe"

# Under vLLM's logger namespace so that vLLM's logging configuration prints it.
logger = logging.getLogger("vllm.hybrid_alloc.probe")


def _type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class ProbeScheduler(Scheduler):
    """vLLM's scheduler plus two log lines describing its KV-cache block pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hybrid_alloc_report("init")

    def _hybrid_alloc_state(self) -> dict[str, Any]:
        manager = getattr(self, "kv_cache_manager", None)
        coordinator = getattr(manager, "coordinator", None)
        pool = getattr(coordinator, "block_pool", None)
        cache_config = self.cache_config
        state: dict[str, Any] = {
            "pid": os.getpid(),
            "scheduler": _type_name(self),
            "coordinator": None if coordinator is None else _type_name(coordinator),
            "block_pool": None if pool is None else _type_name(pool),
            "block_size": cache_config.block_size,
            "mamba_block_size": getattr(cache_config, "mamba_block_size", None),
            "mamba_cache_mode": getattr(cache_config, "mamba_cache_mode", None),
            "enable_prefix_caching": cache_config.enable_prefix_caching,
            "num_gpu_blocks": cache_config.num_gpu_blocks,
            "kv_cache_size_tokens": getattr(cache_config, "kv_cache_size_tokens", None),
            "max_concurrency": getattr(cache_config, "kv_cache_max_concurrency", None),
        }
        if pool is not None:
            state["pool_num_gpu_blocks"] = pool.num_gpu_blocks
            state["pool_free_blocks"] = pool.get_num_free_blocks()
        return state

    def _hybrid_alloc_report(self, event: str) -> None:
        try:
            payload = json.dumps(self._hybrid_alloc_state(), default=str)
        except Exception as exc:  # informative only; never break the engine
            payload = json.dumps({"error": repr(exc)})
        logger.info("%s %s %s", PROBE_TAG, event, payload)

    def shutdown(self) -> None:
        self._hybrid_alloc_report("shutdown")
        super().shutdown()
