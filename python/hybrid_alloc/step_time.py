"""What one engine step costs on a GPU, from what it computes (the simulator's clock).

Pure Python (no vLLM): the serving simulator (:mod:`hybrid_alloc.integration.simulator`)
asks :meth:`StepCost.seconds` for every scheduler step it runs, given each scheduled
request's context before the step and the tokens the step computes for it (prompt
chunks, decodes and recomputed tokens of preempted requests alike). The model is a
roofline with a fixed part::

    t_step   = t_fixed + max(t_compute, t_memory)
    t_compute = FLOPs / (peak_flops * mfu)
    t_memory  = bytes / (hbm_bandwidth * bandwidth_efficiency)

    FLOPs = 2 * active_params * T                        every weight matrix, T tokens
          + 4 * q_dim * sum over attention layers and requests of the keys each new
            token attends to (QK^T and PV; a sliding window caps the keys)
          + 4 * state_elements * T                       Mamba/GDN recurrences
    bytes = dense_weight_bytes                            weights streamed once a step
          + routed_expert_bytes * (1 - (1 - k/E)^T)       MoE: the experts T tokens reach
          + sum over requests of kv_bytes_per_token * (context + new tokens)
                                                           read the context, write new KV
          + sum over requests of 2 * state_bytes          read and write each Mamba state

``T`` is the step's computed tokens (``sum(num_scheduled_tokens)``): a prefix-cache hit
is not computed, so it costs only its context read; a preempted request's recompute costs
what its first prefill cost. The defaults describe one H100 SXM at bf16: 989 TFLOP/s dense
and 3.35 TB/s of HBM (NVIDIA's data sheet), ``mfu`` 0.55 and ``bandwidth_efficiency`` 0.85
(what well-tuned prefill GEMMs and decode kernels reach), ``fixed_ms`` 2.0 (launches,
sampling, the scheduler's share that async scheduling does not hide). The README's
"Step-time model" section shows the public figures these were checked against.

Parameter counts come from :func:`estimate_params` (embeddings, attention and mixer
projections of every layer, dense or routed + shared expert MLPs as the config's fields
describe them), or from ``_params_b`` / ``_active_params_b`` (billions) in the config
(``hybrid-alloc simulate --params / --active-params`` set them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_alloc.model_specs import AttentionLayerSpec, MambaLayerSpec, ModelSpec

TIME_MODELS = ("h100", "fixed")
"""``h100``: :class:`StepCost` on :data:`H100`; ``fixed``: every step ``step_ms``."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator's throughput limits and the fractions of them a step reaches."""

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    mfu: float = 0.55
    bandwidth_efficiency: float = 0.85
    fixed_ms: float = 2.0

    def __post_init__(self) -> None:
        for key in ("peak_flops", "hbm_bytes_per_s", "mfu", "bandwidth_efficiency"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{self.name}: {key} must be positive")
        if self.mfu > 1 or self.bandwidth_efficiency > 1:
            raise ValueError(f"{self.name}: mfu and bandwidth_efficiency are fractions <= 1")
        if self.fixed_ms < 0:
            raise ValueError(f"{self.name}: fixed_ms must not be negative")


H100 = Hardware("H100 SXM (bf16)", peak_flops=989e12, hbm_bytes_per_s=3.35e12)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model: all of them, those one token multiplies, and the routed
    experts' share (MoE: ``experts`` of them, ``experts_per_token`` used by a token)."""

    total: float
    active: float
    routed: float = 0.0
    experts: int = 0
    experts_per_token: int = 0
    source: str = "estimate"


# --------------------------------------------------------------------------- params


def _first_int(cfg: Mapping[str, Any], *keys: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            return int(value)
    return 0


def _mixer_params(layer: MambaLayerSpec, hidden: int) -> float:
    """Input and output projections of one Mamba / GDN / short-conv mixer."""
    shape = layer.temporal_shape
    if layer.kind in ("gdn", "mamba2") and len(shape) == 3:
        heads, head_dim = shape[0], shape[1]
        inner = heads * head_dim
        # in_proj: the conv channels, the output gate and per-head gates; out_proj back.
        return hidden * (layer.conv_dim + inner + 2 * heads) + inner * hidden
    if layer.kind == "mamba1" and shape:
        inner = shape[0]
        return hidden * 2 * inner + inner * hidden
    # A short convolution: three projections in, one out.
    return hidden * 3 * layer.conv_dim + layer.conv_dim * hidden


def estimate_params(cfg: Mapping[str, Any], model: ModelSpec) -> ParamCounts:
    """Parameter counts from a ``config.json`` (its text config) and the model's KV layers.

    Within 30% of the model cards' figures for the shipped configs (tests/planner); a
    config's ``_params_b`` / ``_active_params_b`` (billions) take precedence.
    """
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else cfg
    assert isinstance(text, Mapping)
    card_total = cfg.get("_params_b") or text.get("_params_b")
    card_active = cfg.get("_active_params_b") or text.get("_active_params_b")
    hidden = _first_int(text, "hidden_size", "d_model")
    vocab = _first_int(text, "vocab_size")
    layers = _first_int(text, "num_hidden_layers", "n_layer")
    if not hidden or not layers:
        raise ValueError(f"{model.name}: config lacks hidden_size or num_hidden_layers")
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    params = float(vocab * hidden * (1 if tied else 2))
    q_heads = _first_int(text, "num_attention_heads")
    for layer in model.layers:
        if isinstance(layer, AttentionLayerSpec):
            q = q_heads * layer.head_dim
            params += 2 * hidden * q + 2 * hidden * layer.num_kv_heads * layer.head_dim
        else:
            params += _mixer_params(layer, hidden)
    # Nemotron-H's MLPs and experts are squared-ReLU (two matrices) unless it says otherwise.
    default_act = "relu2" if str(text.get("model_type", "")).startswith("nemotron_h") else "silu"
    act = str(text.get("mlp_hidden_act") or text.get("hidden_act") or default_act)
    mats = 2 if act in ("relu2", "gelu", "relu") else 3
    experts = _first_int(text, "num_experts", "num_local_experts", "n_routed_experts")
    per_token = _first_int(text, "num_experts_per_tok", "moe_topk") if experts > 1 else 0
    dense_inter = _first_int(text, "intermediate_size", "block_ff_dim", "ffn_hidden_size")
    if text.get("block_auto_adjust_ff_dim") and dense_inter:
        # LFM2's SwiGLU sizing: 2/3 of the configured width, scaled, rounded up to a multiple.
        multiple = _first_int(text, "block_multiple_of") or 1
        scaled = int(2 * dense_inter / 3 * float(text.get("block_ffn_dim_multiplier") or 1.0))
        dense_inter = multiple * -(-scaled // multiple)
    expert_inter = _first_int(text, "moe_intermediate_size") or dense_inter
    shared_inter = _first_int(
        text,
        "shared_expert_intermediate_size",
        "shared_intermediate_size",
        "moe_shared_expert_intermediate_size",
    ) * max(1, _first_int(text, "n_shared_experts"))
    pattern = text.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        dense_layers, moe_layers = pattern.count("-"), pattern.count("E")
    elif experts > 1 and _first_int(text, "expert_layer_period"):
        moe_layers = layers // _first_int(text, "expert_layer_period")
        dense_layers = layers - moe_layers
    elif experts > 1:
        dense_layers, moe_layers = 0, layers
    else:
        dense_layers, moe_layers = layers, 0
    params += dense_layers * mats * hidden * dense_inter
    routed = float(moe_layers * experts * mats * hidden * expert_inter) if experts > 1 else 0.0
    params += routed + moe_layers * mats * hidden * shared_inter
    active = params - routed
    if experts > 1:
        active += routed * per_token / experts
    if card_total:
        total = float(card_total) * 1e9
        scale = total / params
        active_b = float(card_active) * 1e9 if card_active else active * scale
        return ParamCounts(total, active_b, routed * scale, experts, per_token, "model card")
    return ParamCounts(params, active, routed, experts, per_token)


# --------------------------------------------------------------------------- step cost


@dataclass(frozen=True)
class StepBreakdown:
    """What one step computes and moves, and the time it is charged."""

    tokens: int
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    seconds: float


@dataclass(frozen=True)
class StepCost:
    """The step-time model for one model on one accelerator (see the module doc)."""

    hardware: Hardware
    params: ParamCounts
    weight_bytes_per_param: int
    # Per attention layer: (query width, KV bytes per token, window or None).
    attention: tuple[tuple[int, int, int | None], ...]
    state_bytes: int
    state_elements: int

    @classmethod
    def for_model(
        cls,
        cfg: Mapping[str, Any],
        model: ModelSpec,
        hardware: Hardware = H100,
        weight_bytes_per_param: int = 2,
    ) -> StepCost:
        """The model's cost constants from its config and KV layers (weights in the model
        dtype, ``weight_bytes_per_param`` bytes each)."""
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else cfg
        assert isinstance(text, Mapping)
        q_heads = _first_int(text, "num_attention_heads")
        attention = tuple(
            (q_heads * a.head_dim, a.bytes_per_token, a.window) for a in model.attention_layers
        )
        mamba = model.mamba_layers
        return cls(
            hardware=hardware,
            params=estimate_params(cfg, model),
            weight_bytes_per_param=weight_bytes_per_param,
            attention=attention,
            state_bytes=sum(m.state_bytes() for m in mamba),
            state_elements=sum(math.prod(m.temporal_shape) for m in mamba if m.temporal_shape),
        )

    @staticmethod
    def _attended(context: int, new: int, window: int | None) -> float:
        """Keys the ``new`` tokens after ``context`` attend to, summed over them (the
        token at position ``p`` attends to ``p + 1`` keys, at most ``window``)."""
        if window is None:
            return new * context + new * (new + 1) / 2
        below = max(0, min(context + new, window) - context)
        return below * context + below * (below + 1) / 2 + (new - below) * window

    def breakdown(self, items: Sequence[tuple[int, int]]) -> StepBreakdown:
        """Cost of a step computing, per request, ``new`` tokens after ``context`` tokens
        already in its cache (``items``: ``(context, new)`` pairs)."""
        hw, p = self.hardware, self.params
        tokens = sum(new for _, new in items)
        flops = 2.0 * p.active * tokens + 4.0 * self.state_elements * tokens
        moved = 0.0
        for context, new in items:
            for q_dim, kv_bytes, window in self.attention:
                flops += 4.0 * q_dim * self._attended(context, new, window)
                held = context + new if window is None else min(context + new, window + new)
                moved += kv_bytes * held
            moved += 2.0 * self.state_bytes
        dense = (p.total - p.routed) * self.weight_bytes_per_param
        reached = 1.0
        if p.experts > 1 and p.routed:
            reached = 1.0 - (1.0 - p.experts_per_token / p.experts) ** tokens
        moved += dense + p.routed * self.weight_bytes_per_param * reached
        compute_s = flops / (hw.peak_flops * hw.mfu)
        memory_s = moved / (hw.hbm_bytes_per_s * hw.bandwidth_efficiency)
        seconds = hw.fixed_ms / 1000.0 + max(compute_s, memory_s)
        return StepBreakdown(tokens, flops, moved, compute_s, memory_s, seconds)

    def seconds(self, items: Sequence[tuple[int, int]]) -> float:
        return self.breakdown(items).seconds

    def describe(self) -> str:
        p, hw = self.params, self.hardware
        moe = f", {p.experts} experts ({p.experts_per_token} a token)" if p.experts else ""
        return (
            f"{hw.name}: {hw.peak_flops / 1e12:,.0f} TFLOP/s x {hw.mfu:g}, "
            f"{hw.hbm_bytes_per_s / 1e12:g} TB/s x {hw.bandwidth_efficiency:g}, "
            f"{hw.fixed_ms:g} ms fixed; {p.total / 1e9:.1f}B params "
            f"({p.active / 1e9:.1f}B active{moe}, {p.source})"
        )
