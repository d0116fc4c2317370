"""Helpers of the planner tests: vLLM's own layer specs for a model, and the fields of
``VllmConfig`` that vLLM's sizing functions and the engine sizing read.

The Mamba/GDN state shapes and dtypes come from each vLLM model class
(``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``), not from the
planner's parse; the layer pattern and attention heads come from the planner's model, which
``test_planner.py`` checks against each config separately.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from hybrid_alloc.model_specs import AttentionLayerSpec, ModelSpec

# Where each model family's vLLM class lives, and the SSM dtype vLLM's config hooks resolve
# 'auto' to for it. Qwen3.5's own class imports torchvision; Qwen3-Next computes the same
# GDN shapes.
VLLM_CLASSES: dict[str, tuple[str, str, str]] = {
    "qwen3_5": ("qwen3_next", "Qwen3NextForCausalLM", "float32"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", "float32"),
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM", "float32"),
    "jamba": ("jamba", "JambaForCausalLM", "auto"),
    "falcon_h1": ("falcon_h1", "FalconH1ForCausalLM", "auto"),
    "zamba2": ("zamba2", "Zamba2ForCausalLM", "auto"),
    # Read from vLLM's model classes only (hybrid_alloc.vllm_specs), no table entry.
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM", "auto"),
    "lfm2": ("lfm2", "Lfm2ForCausalLM", "auto"),
}


SLIDING_WINDOW_VARIANT = "nemotron-h-8b+sliding-window-4096"
"""A sliding-window + Mamba2 model of a real architecture: Nemotron-H-8B with transformers'
NemotronHConfig ``sliding_window`` set (vLLM's NemotronHForCausalLM gives every attention
layer that window) over a 32K context. No such checkpoint is published; the config is the
shipped one plus those two fields."""


def config_by_name(name: str) -> dict[str, Any]:
    """A shipped config by name, or `SLIDING_WINDOW_VARIANT`."""
    from hybrid_alloc.planner import load_config

    if name == SLIDING_WINDOW_VARIANT:
        cfg = dict(load_config("nemotron-h-8b"))
        cfg.update(_source=name, sliding_window=4096, max_position_embeddings=32768)
        return cfg
    return load_config(name)


def vllm_model_class(family: str) -> tuple[Any, str]:
    """(vLLM model class, its SSM dtype under 'auto') of a planner family."""
    module, name, ssm = VLLM_CLASSES[family]
    models = importlib.import_module(f"vllm.model_executor.models.{module}")
    return getattr(models, name), ssm


def text_config(cfg: Mapping[str, Any]) -> SimpleNamespace:
    text = cfg.get("text_config", cfg)
    return SimpleNamespace(**text)


def model_config_view(
    cfg: Mapping[str, Any], model: ModelSpec, ssm: str, spec: int, block_size: int = 16
) -> SimpleNamespace:
    """What the model classes' state-shape hooks and ``_align_hybrid_block_size`` read."""
    import torch

    text = text_config(cfg)
    attn = model.attention_layers[0]
    cache = SimpleNamespace(
        cache_dtype="auto",
        block_size=block_size,
        mamba_cache_mode="none",
        mamba_page_size_padded=None,
        mamba_block_size=None,
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype=ssm,
        use_replayssm=False,
        kv_cache_dtype_skip_layers=None,
    )
    model_config = SimpleNamespace(
        dtype=torch.bfloat16,
        use_mla=False,
        architecture="X",
        hf_config=text,
        hf_text_config=text,
        get_num_kv_heads=lambda _pc: attn.num_kv_heads,
        get_head_size=lambda: attn.head_dim,
    )
    return SimpleNamespace(
        cache_config=cache,
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec) if spec else None,
        num_speculative_tokens=spec,
    )


def mamba_state(cfg: Mapping[str, Any], model: ModelSpec, spec: int) -> tuple[Any, Any]:
    """(shapes, dtypes) of one Mamba/GDN layer's state, from the vLLM model class."""
    cls, ssm = vllm_model_class(model.family)
    view = model_config_view(cfg, model, ssm, spec)
    shapes = cls.get_mamba_state_shape_from_config(view)
    dtypes = cls.get_mamba_state_dtype_from_config(view)
    return tuple(tuple(s) for s in shapes), tuple(dtypes)


def vllm_layer_specs(
    model: ModelSpec,
    *,
    mode: str,
    max_len: int,
    block: int,
    padded: int | None = None,
    spec: int = 0,
    cfg: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM KV-cache specs of the model's layers, as its workers would report them.

    Attention at ``block`` tokens (sliding-window and chunked-local layers with their
    window); Mamba pages padded to ``padded`` bytes (stock) or natural (``None``: what the
    per-group worker hook reports). With ``cfg`` the Mamba state comes from vLLM's model
    class; without, from the planner's layer (synthetic models).
    """
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    state = mamba_state(cfg, model, spec) if cfg is not None and model.mamba_layers else None
    specs: dict[str, Any] = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer, AttentionLayerSpec):
            dtype = torch.bfloat16 if layer.dtype_bytes == 2 else torch.float32
            common: dict[str, Any] = {
                "block_size": block,
                "num_kv_heads": layer.num_kv_heads,
                "head_size": layer.head_dim,
                "dtype": dtype,
            }
            if layer.kind == "sliding":
                assert layer.window is not None
                specs[f"layers.{i}.attn"] = SlidingWindowSpec(**common, sliding_window=layer.window)
            elif layer.kind == "chunked":
                assert layer.window is not None
                specs[f"layers.{i}.attn"] = ChunkedLocalAttentionSpec(
                    **common, attention_chunk_size=layer.window
                )
            else:
                specs[f"layers.{i}.attn"] = FullAttentionSpec(**common)
            continue
        if state is not None:
            shapes, dtypes = state
        else:
            rows = layer.conv_kernel - 1 + (spec if layer.conv_grows_with_spec else 0)
            ssm = torch.float32 if layer.temporal_dtype_bytes == 4 else torch.bfloat16
            shapes, dtypes = ((rows, layer.conv_dim), layer.temporal_shape), (torch.bfloat16, ssm)
        # vLLM's MambaMixer2 layers checkpoint prefills (one extra block in 'align' mode).
        checkpoint: dict[str, Any] = {}
        if layer.prefill_checkpoint_blocks:
            checkpoint = {
                "num_prefill_checkpoint_blocks": layer.prefill_checkpoint_blocks,
                "prefill_checkpoint_alignment": 1,
            }
        specs[f"layers.{i}.mamba"] = MambaSpec(
            shapes=shapes,
            dtypes=dtypes,
            block_size=block if mode == "align" else max_len,
            page_size_padded=padded,
            mamba_cache_mode=mode,
            num_speculative_blocks=spec,
            **checkpoint,
        )
    return specs


def engine_config(
    mode: str,
    max_len: int,
    max_num_seqs: int = 256,
    in_flight: int = 2048,
    override: int | None = None,
    caching: bool | None = None,
    spec: int = 0,
) -> SimpleNamespace:
    """The fields of ``VllmConfig`` that vLLM's sizing functions and the engine sizing read
    (no connectors or parallelism; ``spec`` speculative tokens of an n-gram drafter). vLLM
    runs Mamba in 'align' mode with prefix caching, in 'none' mode without: ``caching``
    defaults to that."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=False, max_num_seqs=max_num_seqs
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
            prefix_cache_retention_interval=None,
            num_gpu_blocks_override=override,
            mamba_cache_mode=mode,
            enable_prefix_caching=mode == "align" if caching is None else caching,
            prefix_match_unit=None,
        ),
        speculative_config=(
            SimpleNamespace(
                method="ngram", num_speculative_tokens=spec, use_eagle_block_drop=lambda: False
            )
            if spec
            else None
        ),
        num_speculative_tokens=spec,
        kv_transfer_config=None,
        model_config=SimpleNamespace(max_model_len=max_len, original_max_model_len=max_len),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            tensor_parallel_size=1,
        ),
        max_in_flight_tokens=in_flight,
    )


def pin_cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """Size as for vLLM's CPU worker, the one tested end to end here. vLLM 0.33's CUDA wheel
    on a machine without a GPU reports no CPU platform, and on a GPU worker several
    attention pools next to Mamba layers fall back to vLLM's shared pool."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: True)


def skip_unless_readable(name: str) -> None:
    """Skip a shipped-config test where neither source can read the config here: an
    architecture outside the table's families where vLLM cannot build configs (vLLM 0.33's
    CUDA wheel without a GPU and without ``VLLM_TARGET_DEVICE=cpu``)."""
    from hybrid_alloc.vllm_specs import platform_ready, table_knows

    cfg = config_by_name(name)
    if not table_knows(cfg) and not platform_ready():
        pytest.skip(f"{name}: read from vLLM's classes only, and vLLM has no platform here")


def release_sizing_module() -> Any:
    """The module of the installed vLLM release that defines ``get_kv_cache_groups``,
    ``get_kv_cache_config_from_groups`` and ``get_kv_cache_configs``."""
    from hybrid_alloc.integration import versions

    return importlib.import_module(versions.release().sizing_module)


# ------------------------------------------------------------------- small layer specs
BLOCK = 16
MAX_LEN = 1024
"""max_model_len of the small layouts: vLLM sizes a 'none'-mode Mamba block to it."""


def attention(window: int | None = None, head_size: int = 64) -> Any:
    """A small full-attention (or sliding-window) layer spec."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": head_size}
    if window is None:
        return FullAttentionSpec(**common, dtype=torch.bfloat16)
    return SlidingWindowSpec(**common, dtype=torch.bfloat16, sliding_window=window)


def small_mamba(mode: str) -> Any:
    """A small Mamba spec as vLLM builds it for a hybrid model (the manager tests' own)."""
    from tests.helpers import state_mamba

    return state_mamba(mode)


def small_engine_config(
    mode: str = "none", override: int | None = None, caching: bool = False
) -> SimpleNamespace:
    """An engine of 16 sequences of up to `MAX_LEN` tokens, 256 tokens in flight."""
    return engine_config(
        mode, MAX_LEN, max_num_seqs=16, in_flight=256, override=override, caching=caching
    )
