"""The demo's scheduler: vLLM's own, plus a report of the block pool and a wave gate.

``engine_run`` starts vLLM with ``scheduler_cls`` naming :class:`ProbeScheduler`, which is
vLLM's :class:`~vllm.v1.core.sched.scheduler.Scheduler` with two additions:

* **Report.** It logs a line when it is built, around ``reset_prefix_cache()`` and when it
  shuts down, each with a JSON payload naming the block-pool class it really built and
  the pool's state::

      hybrid_alloc.probe init {"pid": ..., "block_pool": "hybrid_alloc.block_pool.BlockPool", ...}

  On CPU the scheduler lives in the engine-core process and the model in a separate worker
  process, so a worker-side probe could not see the pool; the scheduler can.

* **Fingerprints.** It folds every step into two digests, reported in those lines:
  ``schedule_digest`` (which requests, by arrival number, got how many tokens, and which
  were preempted) and ``blocks_digest`` (which block IDs each request was handed). Two
  runs with equal ``schedule_digest`` made the same scheduling decisions; equal
  ``blocks_digest`` means the pools also handed out the very same blocks. It also sums
  the wall and CPU time spent in ``schedule()`` and ``update_from_output()``, where the
  KV-cache manager and the block pool do their work (``scheduler_wall_s``,
  ``scheduler_cpu_s``). ``resumed`` maps each request that was preempted and resumed (by
  arrival number) to one ``[output tokens, computed tokens]`` pair per resumption: vLLM
  recomputes the prompt and those outputs as a prefill (from the prefix-cache hit on),
  which :func:`tests.helpers.check_recompute_replay` builds on.

* **Wave gate.** With ``additional_config={"hybrid_alloc_wave_sizes": [n1, n2, ...]}`` it
  holds back scheduling until all ``n1`` requests of the first wave have arrived, then
  all ``n2`` of the second, and so on. ``LLM.generate()`` sends its requests to the
  engine-core process one by one while that process already runs, so without the gate
  the first steps would see a timing-dependent subset of the wave: batches, and with them
  bf16 rounding and greedy tokens, could differ from run to run. With the gate every run
  schedules exactly the same batches, so two pools that decide alike give identical
  tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

PROBE_SCHEDULER = "tests.support.probe.ProbeScheduler"
PROBE_TAG = "hybrid_alloc.probe"
WAVE_SIZES_KEY = "hybrid_alloc_wave_sizes"

# Under vLLM's logger namespace so that vLLM's logging configuration prints it.
logger = logging.getLogger("vllm.hybrid_alloc.probe")


def _type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class ProbeScheduler(Scheduler):
    """vLLM's scheduler plus log lines describing its KV-cache block pool, and an optional
    gate that starts each wave only once all of its requests have arrived."""

    # Class-level defaults, in case vLLM's __init__ calls an overridden method.
    _hybrid_alloc_gates: set[int] | None = None
    _hybrid_alloc_arrived = 0
    _hybrid_alloc_sched_wall = 0.0
    _hybrid_alloc_sched_cpu = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = getattr(self.vllm_config, "additional_config", None)
        sizes = extra.get(WAVE_SIZES_KEY) if isinstance(extra, dict) else None
        # Request counts at which a whole wave has arrived.
        self._hybrid_alloc_gates: set[int] | None = (
            set(itertools.accumulate(int(n) for n in sizes)) if sizes else None
        )
        self._hybrid_alloc_arrived = 0
        # Arrival number of each request: IDs may differ between runs, arrival order not.
        self._hybrid_alloc_ordinal: dict[str, int] = {}
        self._hybrid_alloc_steps = 0
        # Arrival number -> [output tokens, computed tokens] at each resumption.
        self._hybrid_alloc_resumed: dict[int, list[list[int]]] = {}
        self._hybrid_alloc_schedule_digest = hashlib.sha256()
        self._hybrid_alloc_blocks_digest = hashlib.sha256()
        self._hybrid_alloc_report("init")

    # ------------------------------------------------------------------ wave gate
    def add_request(self, request: Any) -> None:
        self._hybrid_alloc_ordinal.setdefault(request.request_id, self._hybrid_alloc_arrived)
        self._hybrid_alloc_arrived += 1
        super().add_request(request)

    def has_requests(self) -> bool:
        gates = self._hybrid_alloc_gates
        if gates is not None and self._hybrid_alloc_arrived not in gates and not self.running:
            # The rest of the wave is on its way: the engine core waits for input.
            return False
        return super().has_requests()

    # ------------------------------------------------------------------ fingerprints
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        out = super().schedule(*args, **kwargs)
        self._hybrid_alloc_sched_wall += time.perf_counter() - wall
        self._hybrid_alloc_sched_cpu += time.thread_time() - cpu
        try:
            self._hybrid_alloc_trace(out)
        except Exception as exc:  # informative only; never break the engine
            logger.warning("%s: cannot trace a step: %r", PROBE_TAG, exc)
        return out

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        # Where finished requests free their blocks: timed with schedule().
        wall, cpu = time.perf_counter(), time.thread_time()
        out = super().update_from_output(*args, **kwargs)
        self._hybrid_alloc_sched_wall += time.perf_counter() - wall
        self._hybrid_alloc_sched_cpu += time.thread_time() - cpu
        return out

    def _hybrid_alloc_trace(self, out: Any) -> None:
        """Fold one step into two digests: what was scheduled (requests by arrival number,
        token counts, preemptions) and which block IDs were handed out."""
        ordinal = self._hybrid_alloc_ordinal

        def num(req_id: str) -> int:
            return ordinal.get(req_id, -1)

        scheduled = sorted((num(r), n) for r, n in out.num_scheduled_tokens.items())
        preempted = sorted(num(r) for r in (out.preempted_req_ids or ()))
        self._hybrid_alloc_schedule_digest.update(repr((scheduled, preempted)).encode())
        blocks = [(num(r.req_id), r.block_ids) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        blocks += [
            (num(r), ids)
            for r, ids in zip(cached.req_ids, cached.new_block_ids, strict=False)
            if ids is not None
        ]
        blocks.sort(key=lambda item: item[0])
        self._hybrid_alloc_blocks_digest.update(repr(blocks).encode())
        for req_id in getattr(cached, "resumed_req_ids", None) or ():
            request = self.requests.get(req_id)
            if request is not None:
                # Computed before this step: the prefix-cache hit the recompute starts from.
                start = request.num_computed_tokens - out.num_scheduled_tokens.get(req_id, 0)
                resumes = self._hybrid_alloc_resumed.setdefault(num(req_id), [])
                resumes.append([len(request.output_token_ids), start])
        self._hybrid_alloc_steps += 1

    # --------------------------------------------------------------------- report
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
            "wave_gates": None
            if self._hybrid_alloc_gates is None
            else sorted(self._hybrid_alloc_gates),
            "requests_arrived": self._hybrid_alloc_arrived,
            "steps": self._hybrid_alloc_steps,
            # Time spent in schedule() + update_from_output(), i.e. in the scheduler and
            # its KV-cache manager and block pool (the model runs in the worker process).
            "scheduler_wall_s": round(self._hybrid_alloc_sched_wall, 6),
            "scheduler_cpu_s": round(self._hybrid_alloc_sched_cpu, 6),
            "schedule_digest": self._hybrid_alloc_schedule_digest.hexdigest()[:16],
            "blocks_digest": self._hybrid_alloc_blocks_digest.hexdigest()[:16],
            "resumed": {str(k): v for k, v in sorted(self._hybrid_alloc_resumed.items())},
        }
        if pool is not None:
            state["pool_num_gpu_blocks"] = pool.num_gpu_blocks
            state["pool_free_blocks"] = pool.get_num_free_blocks()
            state["pool_usage"] = pool.get_usage()
            budget = getattr(pool, "elastic", None)
            if budget is not None:
                # Elastic pools: who owns the budget's slabs and how often that changed.
                groups = range(budget.num_groups)
                state["elastic"] = {
                    "num_slabs": budget.num_slabs,
                    "slab_bytes": budget.slab_bytes,
                    "fully_free": budget.num_fully_free,
                    "owned": [budget.num_owned(g) for g in groups],
                    "live_pages": [budget.num_live_pages(g) for g in groups],
                    "page_bytes": [budget.page_bytes(g) for g in groups],
                    "pages_per_slab": [budget.pages_per_slab(g) for g in groups],
                    # (slabs granted, slabs given back to another pool) per pool.
                    "owner_changes": [list(budget.owner_changes(g)) for g in groups],
                }
        return state

    def _hybrid_alloc_report(self, event: str) -> None:
        try:
            payload = json.dumps(self._hybrid_alloc_state(), default=str)
        except Exception as exc:  # informative only; never break the engine
            payload = json.dumps({"error": repr(exc)})
        logger.info("%s %s %s", PROBE_TAG, event, payload)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        # engine_run calls this once the workload is done: report the pool's state then
        # (the shutdown report may be lost when vLLM force-kills a slow engine core).
        self._hybrid_alloc_report("before_reset")
        ok = super().reset_prefix_cache(*args, **kwargs)
        self._hybrid_alloc_report("after_reset")
        return ok

    def shutdown(self) -> None:
        self._hybrid_alloc_report("shutdown")
        super().shutdown()
