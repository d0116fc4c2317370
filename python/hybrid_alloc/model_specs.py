"""Per-layer KV-cache specs of hybrid models, parsed from a Hugging Face ``config.json``.

Pure Python (no vLLM, no torch): the capacity planner must run where vLLM is not installed.
The state shapes follow vLLM 0.32's ``MambaStateShapeCalculator`` and each model's
``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``, for tensor
parallel size 1 and the default ``SD`` conv-state layout (layout does not change the size).

Supported families (``model_type``): ``qwen3_next``, ``qwen3_5`` / ``qwen3_5_moe`` (Qwen3.5 and
Qwen3.6; GDN linear attention + full attention), ``nemotron_h`` (Mamba2 + attention; all
attention layers sliding-window where the config sets ``sliding_window``, as in vLLM),
``jamba`` (Mamba1 + attention), ``falcon_h1`` (attention and Mamba2 in every layer) and
``zamba2`` (Mamba2 everywhere, shared attention blocks in the hybrid layers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["full", "sliding", "chunked"]
MambaKind = Literal["gdn", "mamba1", "mamba2", "short_conv"]

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype named as vLLM or a ``config.json`` names it."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class AttentionLayerSpec:
    """One attention layer's KV cache: K and V rows of ``num_kv_heads * head_dim`` per token."""

    kind: AttentionKind
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    # Tokens a sliding-window layer attends to, or the chunk of a chunked-local layer.
    window: int | None = None

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token


@dataclass(frozen=True)
class MambaLayerSpec:
    """One Mamba / GDN layer's recurrent state: a conv window plus an SSM (temporal) state
    (a short-convolution layer keeps the conv window only: ``temporal_shape`` empty).

    The conv window of GDN, Mamba2 and short-conv layers grows by one row per speculative
    token (vLLM passes ``num_spec`` into the conv shape); Mamba1's does not.
    """

    kind: MambaKind
    conv_dim: int
    conv_kernel: int
    temporal_shape: tuple[int, ...]
    conv_dtype_bytes: int
    temporal_dtype_bytes: int
    conv_grows_with_spec: bool
    # Align-mode prefill checkpoint blocks per request (1 for vLLM's MambaMixer2 layers).
    prefill_checkpoint_blocks: int = 0

    def state_bytes(self, num_spec_tokens: int = 0) -> int:
        """Bytes of one request's state in this layer (one Mamba page, unpadded)."""
        rows = self.conv_kernel - 1 + (num_spec_tokens if self.conv_grows_with_spec else 0)
        conv = rows * self.conv_dim * self.conv_dtype_bytes
        if not self.temporal_shape:
            return conv
        return conv + math.prod(self.temporal_shape) * self.temporal_dtype_bytes


LayerSpec = AttentionLayerSpec | MambaLayerSpec


@dataclass(frozen=True)
class ModelSpec:
    """The KV-cache layers of a model, in vLLM's layer order, and its default context length."""

    name: str
    family: str
    layers: tuple[LayerSpec, ...]
    max_position_embeddings: int
    layer_names: tuple[str, ...] | None = None
    """vLLM's names of the layers (read from vLLM's model, :mod:`hybrid_alloc.vllm_specs`),
    in vLLM's registration order; None: parsed from the config by the table below."""

    @property
    def attention_layers(self) -> tuple[AttentionLayerSpec, ...]:
        return tuple(x for x in self.layers if isinstance(x, AttentionLayerSpec))

    @property
    def mamba_layers(self) -> tuple[MambaLayerSpec, ...]:
        return tuple(x for x in self.layers if isinstance(x, MambaLayerSpec))

    def describe(self) -> str:
        """``6 full attention + 18 gdn`` style summary."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            key = f"{layer.kind} attention" if isinstance(layer, AttentionLayerSpec) else layer.kind
            counts[key] = counts.get(key, 0) + 1
        return " + ".join(f"{n} {k}" for k, n in counts.items())


@dataclass(frozen=True)
class DTypes:
    """Element sizes the caches use: model dtype, attention KV, Mamba conv and SSM states."""

    model: int
    kv: int
    conv: int
    ssm: int


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    # Multimodal wrappers (Qwen3.5/3.6 ...ForConditionalGeneration) nest the LM config.
    text = cfg.get("text_config")
    return text if isinstance(text, Mapping) else cfg


def _model_type(cfg: Mapping[str, Any]) -> str:
    text = _text_config(cfg)
    return str(text.get("model_type") or cfg.get("model_type") or "")


def _resolve_dtypes(
    text: Mapping[str, Any],
    *,
    dtype: str,
    kv_cache_dtype: str,
    mamba_cache_dtype: str,
    mamba_ssm_cache_dtype: str,
    ssm_hint: str | None,
) -> DTypes:
    model_name = dtype
    if dtype == "auto":
        model_name = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
        # vLLM's 'auto' downcasts float32 checkpoints to the platform's preferred dtype
        # (bfloat16 on current GPUs).
        if dtype_bytes(model_name) == 4:
            model_name = "bfloat16"
    model = dtype_bytes(model_name)
    kv = model if kv_cache_dtype == "auto" else dtype_bytes(kv_cache_dtype)
    conv = model if mamba_cache_dtype == "auto" else dtype_bytes(mamba_cache_dtype)
    if mamba_ssm_cache_dtype != "auto":
        ssm = dtype_bytes(mamba_ssm_cache_dtype)
    elif ssm_hint is not None:
        # The model's own default (Qwen3.5 'mamba_ssm_dtype', Nemotron-H float32).
        ssm = dtype_bytes(ssm_hint)
    else:
        ssm = conv
    return DTypes(model=model, kv=kv, conv=conv, ssm=ssm)


def _attention(
    text: Mapping[str, Any], dt: DTypes, kind: AttentionKind = "full"
) -> AttentionLayerSpec:
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = text.get("head_dim") or text.get("attention_head_dim")
    if not head_dim:
        head_dim = int(text["hidden_size"]) // heads
    window: int | None = None
    if kind == "sliding":
        window = int(text["sliding_window"])
    elif kind == "chunked":
        window = int(text["attention_chunk_size"])
    return AttentionLayerSpec(kind, kv_heads, int(head_dim), dt.kv, window)


def _mamba2(
    dt: DTypes,
    *,
    intermediate: int,
    n_groups: int,
    num_heads: int,
    head_dim: int,
    state_size: int,
    conv_kernel: int,
) -> MambaLayerSpec:
    # MambaStateShapeCalculator.mamba2_state_shape at TP 1: conv over x, B and C.
    return MambaLayerSpec(
        kind="mamba2",
        conv_dim=intermediate + 2 * n_groups * state_size,
        conv_kernel=conv_kernel,
        temporal_shape=(num_heads, head_dim, state_size),
        conv_dtype_bytes=dt.conv,
        temporal_dtype_bytes=dt.ssm,
        conv_grows_with_spec=True,
        prefill_checkpoint_blocks=1,
    )


def _qwen_layers(text: Mapping[str, Any], dt: DTypes) -> tuple[LayerSpec, ...]:
    n = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if not types:
        interval = int(text.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    k_heads = int(text["linear_num_key_heads"])
    v_heads = int(text["linear_num_value_heads"])
    k_dim = int(text["linear_key_head_dim"])
    v_dim = int(text["linear_value_head_dim"])
    gdn = MambaLayerSpec(
        kind="gdn",
        conv_dim=2 * k_heads * k_dim + v_heads * v_dim,
        conv_kernel=int(text["linear_conv_kernel_dim"]),
        temporal_shape=(v_heads, v_dim, k_dim),
        conv_dtype_bytes=dt.conv,
        temporal_dtype_bytes=dt.ssm,
        conv_grows_with_spec=True,
    )
    by_type: dict[str, LayerSpec] = {"linear_attention": gdn}
    attention_types: tuple[tuple[str, AttentionKind], ...] = (
        ("full_attention", "full"),
        ("sliding_attention", "sliding"),
        ("chunked_attention", "chunked"),
    )
    for name, kind in attention_types:
        if name in types:
            by_type[name] = _attention(text, dt, kind)
    return tuple(by_type[t] for t in types)


def _nemotron_h_layers(text: Mapping[str, Any], dt: DTypes) -> tuple[LayerSpec, ...]:
    pattern = text.get("hybrid_override_pattern")
    if pattern is None:
        # Older configs name the blocks mamba / attention, transformers' current ones
        # linear_attention / full_attention.
        names = {
            "mamba": "M",
            "linear_attention": "M",
            "attention": "*",
            "full_attention": "*",
            "mlp": "-",
            "moe": "E",
        }
        pattern = "".join(names[t] for t in text["layers_block_type"])
    mamba = _mamba2(
        dt,
        intermediate=int(text["mamba_num_heads"]) * int(text["mamba_head_dim"]),
        n_groups=int(text["n_groups"]),
        num_heads=int(text["mamba_num_heads"]),
        head_dim=int(text["mamba_head_dim"]),
        state_size=int(text["ssm_state_size"]),
        conv_kernel=int(text["conv_kernel"]),
    )
    # vLLM's Nemotron-H passes the config's sliding_window to every attention layer.
    attn = _attention(text, dt, "sliding" if text.get("sliding_window") else "full")
    # '-' (MLP) and 'E' (MoE) layers hold no cache.
    return tuple(mamba if c == "M" else attn for c in pattern if c in "M*")


def _jamba_layers(text: Mapping[str, Any], dt: DTypes) -> tuple[LayerSpec, ...]:
    n = int(text["num_hidden_layers"])
    types = text.get("layers_block_type")
    if not types:
        period = int(text["attn_layer_period"])
        offset = int(text["attn_layer_offset"])
        types = ["attention" if i % period == offset else "mamba" for i in range(n)]
    intermediate = int(text.get("mamba_expand", 2)) * int(text["hidden_size"])
    # mamba1_state_shape: conv (d_conv - 1, d_inner), temporal (d_inner, d_state); no spec rows.
    mamba = MambaLayerSpec(
        kind="mamba1",
        conv_dim=intermediate,
        conv_kernel=int(text["mamba_d_conv"]),
        temporal_shape=(intermediate, int(text["mamba_d_state"])),
        conv_dtype_bytes=dt.conv,
        temporal_dtype_bytes=dt.ssm,
        conv_grows_with_spec=False,
    )
    attn = _attention(text, dt)
    return tuple(attn if t == "attention" else mamba for t in types)


def _falcon_h1_layers(text: Mapping[str, Any], dt: DTypes) -> tuple[LayerSpec, ...]:
    d_ssm = text.get("mamba_d_ssm")
    intermediate = (
        int(d_ssm) if d_ssm else int(float(text["mamba_expand"]) * int(text["hidden_size"]))
    )
    mamba = _mamba2(
        dt,
        intermediate=intermediate,
        n_groups=int(text["mamba_n_groups"]),
        num_heads=int(text["mamba_n_heads"]),
        head_dim=int(text["mamba_d_head"]),
        state_size=int(text["mamba_d_state"]),
        conv_kernel=int(text["mamba_d_conv"]),
    )
    attn = _attention(text, dt)
    # Every decoder layer runs attention and Mamba2 side by side: two caches per layer.
    return tuple(x for _ in range(int(text["num_hidden_layers"])) for x in (attn, mamba))


def _zamba2_layers(text: Mapping[str, Any], dt: DTypes) -> tuple[LayerSpec, ...]:
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    types = text.get("layers_block_type")
    if not types:
        # transformers' Zamba2Config default (the Zamba2-2.7B layout): 54 layers, 9 hybrid.
        types = (
            ["mamba"]
            + (["mamba"] * 5 + ["hybrid"]) * 7
            + ["mamba"] * 4
            + ["hybrid"]
            + ["mamba"] * 3
            + ["hybrid"]
            + ["mamba"] * 2
        )
    intermediate = int(text.get("mamba_expand", 2)) * hidden
    n_heads = int(text["n_mamba_heads"])
    mamba = _mamba2(
        dt,
        intermediate=intermediate,
        n_groups=int(text.get("mamba_ngroups", 1)),
        num_heads=n_heads,
        head_dim=int(text.get("mamba_headdim") or intermediate // n_heads),
        state_size=int(text["mamba_d_state"]),
        conv_kernel=int(text["mamba_d_conv"]),
    )
    # The shared blocks attend over concat(hidden, embeddings): 2 * hidden wide, and vLLM
    # builds one KV cache per hybrid layer (weights are shared, caches are not).
    head_dim = int(text.get("attention_head_dim") or 2 * hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    attn = AttentionLayerSpec("full", kv_heads, head_dim, dt.kv)
    layers: list[LayerSpec] = []
    for t in types:
        layers.append(mamba)
        if t == "hybrid":
            layers.append(attn)
    return tuple(layers)


_FAMILIES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "nemotron_h": "nemotron_h",
    "jamba": "jamba",
    "falcon_h1": "falcon_h1",
    "zamba2": "zamba2",
}


def family_name(model_type: str) -> str:
    """The family name this module gives a ``model_type`` (itself where it knows none)."""
    return _FAMILIES.get(model_type, model_type)


def model_from_config(
    cfg: Mapping[str, Any],
    *,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    name: str | None = None,
) -> ModelSpec:
    """Parse a Hugging Face ``config.json`` dict into the model's KV-cache layers.

    Args:
        cfg: the config dict (a multimodal wrapper's ``text_config`` is used when present).
        dtype: model dtype (``auto``: the config's ``torch_dtype``/``dtype``, else bfloat16).
        kv_cache_dtype: attention KV dtype (``auto``: the model dtype), as ``--kv-cache-dtype``.
        mamba_cache_dtype: conv-state dtype (``auto``: the model dtype).
        mamba_ssm_cache_dtype: SSM-state dtype (``auto``: the model's own default, which is
            float32 for Nemotron-H and Qwen3.5's ``mamba_ssm_dtype``, else the conv dtype).
        name: display name (default: ``_source`` or ``_name_or_path`` from the config).

    Raises:
        ValueError: the model type is not a supported hybrid family.
    """
    model_type = _model_type(cfg)
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: "
            + ", ".join(sorted(set(_FAMILIES.values())))
        )
    text = _text_config(cfg)
    ssm_hint: str | None = None
    if family == "qwen3_5":
        # vLLM's Qwen3_5 config hook adopts the checkpoint's mamba_ssm_dtype.
        hint = text.get("mamba_ssm_dtype")
        ssm_hint = str(hint) if hint else None
    elif family == "nemotron_h":
        ssm_hint = str(text.get("mamba_ssm_cache_dtype") or "float32")
    dt = _resolve_dtypes(
        text,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        mamba_cache_dtype=mamba_cache_dtype,
        mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
        ssm_hint=ssm_hint,
    )
    parse = {
        "qwen3_next": _qwen_layers,
        "qwen3_5": _qwen_layers,
        "nemotron_h": _nemotron_h_layers,
        "jamba": _jamba_layers,
        "falcon_h1": _falcon_h1_layers,
        "zamba2": _zamba2_layers,
    }[family]
    try:
        layers = parse(text, dt)
    except KeyError as exc:
        raise ValueError(f"{model_type} config lacks field {exc.args[0]!r}") from exc
    display = name or str(cfg.get("_source") or cfg.get("_name_or_path") or model_type)
    max_pos = int(text.get("max_position_embeddings") or cfg.get("max_position_embeddings") or 0)
    return ModelSpec(display, family, layers, max_pos)
