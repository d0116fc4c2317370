"""Per-group KV-cache sizing: the config vLLM's engine core builds at startup.

vLLM (``get_kv_cache_configs``; in 0.33 also ``get_global_kv_cache_groups``) unifies every page
to one size, gives all groups one ``num_blocks`` and lays every group over the same
bytes. For a hybrid model (attention + Mamba/GDN) this module builds instead:

* one group per distinct layer spec (no equal-size split: groups need not share a pool);
* one pool per group, at the group's natural page size (no padding), sized by
  :mod:`hybrid_alloc.sizing` (the sizing model the planner uses too). This module only
  translates: each vLLM spec gives the sizing model its kind, its stride-aligned page and
  vLLM's own per-request block count (``max_memory_usage_bytes`` over the page size):
  Mamba groups outside 'all' mode are fixed, sliding-window groups are bounded unless their
  cap reaches a max-length request, full attention grows;
* every group gets its own region of the one backing allocation vLLM's worker makes, and
  its tensors are viewed with its own pool's block count;
* the capacity vLLM logs counts only the pools that grow with the sequence.

Anything this does not cover falls back to vLLM's sizing (and thus to one shared pool),
with the reason logged.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv, round_up
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
)

from hybrid_alloc import sizing
from hybrid_alloc.integration import versions
from hybrid_alloc.integration.kv_cache_config import (
    ElasticLayout,
    PerGroupKVCacheConfig,
    PoolLayout,
)
from hybrid_alloc.sizing import ALIGN_CACHE_FACTOR as ALIGN_CACHE_FACTOR
from hybrid_alloc.sizing import REGION_ALIGNMENT as REGION_ALIGNMENT

# vLLM's logger factory, as the plugin uses: the lines print with vLLM's own.
logger = init_logger("vllm.hybrid_alloc")

# vLLM's own functions, looked up where the installed release defines them
# (`versions.VllmRelease.sizing_module`) and kept to fall back on and to restore.
_stock_get_max_concurrency = kv_cache_utils.get_max_concurrency_for_kv_cache_config


def _sizing_module() -> Any:
    return importlib.import_module(versions.release().sizing_module)


def _stock_get_kv_cache_configs(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
    global_groups: list[KVCacheGroupSpec] | None,
) -> list[KVCacheConfig]:
    stock = _sizing_module().get_kv_cache_configs
    if versions.release().sizing_takes_global_groups:
        return stock(vllm_config, kv_cache_specs, available_memory, global_groups)  # type: ignore[no-any-return]
    return stock(vllm_config, kv_cache_specs, available_memory)  # type: ignore[no-any-return]


def config_unsupported_reason(vllm_config: Any) -> str | None:
    """Why per-group pools cannot serve this engine, as far as its configuration tells
    (None if it does not). Checked in the workers too: where it names a reason they pad
    Mamba pages as stock vLLM does, so that vLLM's own sizing can take over."""
    cache = vllm_config.cache_config
    if cache.mamba_cache_mode == "all":
        return "mamba_cache_mode 'all' keeps state per block; it grows like attention"
    if cache.enable_prefix_caching and cache.prefix_match_unit is not None:
        return "prefix_match_unit (sub-block prefix hits copy Mamba blocks by bare ID)"
    connector_reason = kv_connector_unsupported_reason(vllm_config.kv_transfer_config, vllm_config)
    if connector_reason is not None:
        return connector_reason
    if vllm_config.attention_config.hisparse_config is not None:
        return "HiSparse host pools"
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        return "context parallelism"
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return "the hybrid KV-cache manager is disabled"
    if vllm_config.model_config.original_max_model_len == -1:
        return "max_model_len auto-fit"
    if cache.mamba_cache_mode == "align" and _stock_gpu_worker(vllm_config, v2_runner=True):
        # Its profiling runs fabricate block IDs for every group modulo the primary
        # pool's block count (set_dummy_context), past the end of a smaller 'align' pool;
        # the worker hooks (`runner.install_gpu_runner_hooks`) keep them in each pool.
        return (
            "Mamba 'align' mode under vLLM's V2 GPU model runner (VLLM_USE_V2_MODEL_RUNNER=0 "
            "selects the V1 runner, which per-group pools support)"
        )
    return None


DECODE_BENCH_CONNECTOR = "DecodeBenchConnector"
"""vLLM's decode benchmark connector: it claims a new request's prompt as loaded and fills
the claimed blocks of each group with dummy values, by that group's block IDs in that
group's layers' tensors (and a state layer's whole tensor), so pool-scoped IDs serve it."""


NIXL_CONNECTOR = "NixlConnector"
"""vLLM's prefill/decode connector (pull mode: the decode side reads), whose worker side
:mod:`..kv_transfer.nixl` adapts."""

NIXL_PUSH_CONNECTOR = "NixlPushConnector"
"""The same connector in push mode (the prefill side writes into blocks the decode side
registers with it); its worker shares the pull worker's layout code that
:mod:`..kv_transfer.nixl` adapts."""

NIXL_CONNECTORS = (NIXL_CONNECTOR, "NixlPullConnector", NIXL_PUSH_CONNECTOR)


MULTI_CONNECTOR = "MultiConnector"
"""vLLM's connector of connectors: each child is built from its own entry of
``kv_connector_extra_config["connectors"]`` over the same pools, and each child's hooks are
its class's, so it serves per-group pools where every child does."""


def kv_connector_unsupported_reason(kv_transfer_config: Any, vllm_config: Any = None) -> str | None:
    """Why per-group pools cannot serve the engine's KV connector (None: no connector,
    vLLM's decode benchmark connector, its NixlConnector in pull or push mode
    (:mod:`..kv_transfer.nixl`), its native offloading, ``--kv-offloading-size``, which
    :mod:`..kv_transfer.offload` adapts, or a MultiConnector of those)."""
    if kv_transfer_config is None:
        return None
    name = kv_transfer_config.kv_connector
    if name == DECODE_BENCH_CONNECTOR:
        return None
    if name == MULTI_CONNECTOR:
        return _multi_connector_unsupported_reason(kv_transfer_config, vllm_config)
    if name in NIXL_CONNECTORS:
        return _nixl_unsupported_reason(kv_transfer_config, vllm_config)
    if name != "OffloadingConnector":
        return (
            f"KV connector {name!r} addresses blocks by IDs unique across groups (per-group "
            "pools serve vLLM's NixlConnector and NixlPushConnector, DecodeBenchConnector, "
            "native OffloadingConnector, --kv-offloading-size, and a MultiConnector of those)"
        )
    extra = kv_transfer_config.kv_connector_extra_config or {}
    spec_name = extra.get("spec_name", "CPUOffloadingSpec")
    if spec_name == "TieringOffloadingSpec":
        from hybrid_alloc.integration.kv_transfer.offload_tiers import (
            secondary_tiers_unsupported_reason,
        )

        reason = secondary_tiers_unsupported_reason(extra)
        if reason is not None:
            return reason
    elif spec_name != "CPUOffloadingSpec":
        return (
            f"offloading spec {spec_name!r} (per-group pools serve vLLM's CPU tier and its "
            "tiering spec with filesystem tiers only)"
        )
    if extra.get("canonical_layout"):
        return "the offloading connector's canonical_layout"
    return None


def _multi_connector_unsupported_reason(kv_transfer_config: Any, vllm_config: Any) -> str | None:
    """The first reason a child of a MultiConnector has, naming the child (its config
    built as vLLM's MultiConnector builds it)."""
    from vllm.config import KVTransferConfig

    extra = kv_transfer_config.kv_connector_extra_config or {}
    children = extra.get("connectors") or []
    if not children:
        return "MultiConnector without connectors"
    for index, child in enumerate(children):
        label = f"MultiConnector child {index} ({child.get('kv_connector')!r})"
        try:
            config = KVTransferConfig(
                **{"engine_id": getattr(kv_transfer_config, "engine_id", None), **child}
            )
        except (TypeError, ValueError) as exc:
            return f"{label}: {' '.join(str(exc).split())}"
        reason = kv_connector_unsupported_reason(config, vllm_config)
        if reason is not None:
            return f"{label}: {reason}"
    return None


def _nixl_unsupported_reason(kv_transfer_config: Any, vllm_config: Any) -> str | None:
    """What of NixlConnector (pull or push mode) per-group pools do not serve: the static
    split, pipeline stages (vLLM matches their regions by layer position in the shared
    layout), tensor parallelism (not run) and host staging buffers
    (``kv_buffer_device="cpu"`` on a GPU: vLLM's staging copies view the shared layout).
    (A KV-cache layout that spreads a block's bytes, heads outside blocks, is refused when
    the worker registers its cache, :func:`.nixl.check_region_views`: the layout is not
    resolved yet where the workers ask this, and both sides must get the same answer.)"""
    from vllm.platforms import current_platform

    release = versions.release()
    if not release.nixl_per_group:
        return (
            f"{kv_transfer_config.kv_connector} on vLLM {release.version} (per-group NIXL "
            "regions are built for 0.32)"
        )
    from hybrid_alloc.settings import ELASTIC_ENV_VAR, elastic_pools_enabled

    if not elastic_pools_enabled():
        # A finished prefill keeps its state page until the decode side has read it; a
        # state pool sized to max_num_seqs then stops admitting prefills that vLLM's
        # shared pool would run (measured: the prefill side stalled until its blocks'
        # leases ran out).
        return f"NixlConnector on the static split ({ELASTIC_ENV_VAR}=0)"
    if vllm_config is not None:
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            return "NixlConnector with pipeline parallelism"
        if parallel.tensor_parallel_size > 1:
            # Each rank registers its own shard as one region per layer; no P/D pair of
            # tensor-parallel engines was run here (on 2 cores each idle worker's NIXL
            # progress thread keeps a core busy, and the other engine's workers do not
            # start), so these keep vLLM's layout.
            return "NixlConnector with tensor parallelism (not run with per-group pools)"
    device = getattr(kv_transfer_config, "kv_buffer_device", None) or "cuda"
    if device == "cpu" and not current_platform.is_cpu():
        return "NixlConnector staging through host buffers (kv_buffer_device='cpu' on a GPU)"
    return None


def _stock_gpu_worker(vllm_config: Any, v2_runner: bool = False) -> bool:
    """Whether the workers are vLLM's GPU workers (optionally: running the V2 model
    runner) without this package's GPU-runner hooks. The plugin installs those hooks in
    every process it loads in (engine core and workers alike, :func:`.install`), so the
    engine core's own hooks stand for its workers'. The CPU worker is the one tested end to
    end here; the hooks' parts of the GPU runners are driven on CPU by
    ``tests/engine/test_gpu_runner.py``."""
    from vllm.platforms import current_platform

    from hybrid_alloc.integration.worker import runner

    if current_platform.is_cpu() or runner.gpu_runner_hooks_installed():
        return False
    return not v2_runner or bool(getattr(vllm_config, "use_v2_model_runner", False))


def spec_unsupported_reason(
    kv_cache_specs: Sequence[dict[str, KVCacheSpec]], gpu_worker: bool = False
) -> str | None:
    """Why per-group pools cannot serve the layers the workers reported (None if they
    can)."""
    merged = merge_worker_specs(kv_cache_specs)
    if merged is None:
        return "workers report different specs for one layer"
    specs = list(merged.values())
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    other = [s for s in specs if not isinstance(s, MambaSpec)]
    if not mamba or not other:
        return "not a hybrid of Mamba/GDN and attention layers"
    if any(s.mamba_cache_mode == "all" for s in mamba):
        return "mamba_cache_mode 'all' keeps state per block; it grows like attention"
    if any(s.mamba_cache_mode == "align" and s.page_size_padded is not None for s in mamba):
        # The workers' hook (runner._keeps_shared_align_layout) kept vLLM's layout.
        return (
            "Mamba 'align' mode with state pages larger than an attention block (the "
            "workers kept vLLM's layout; HYBRID_ALLOC_FINE_ALIGN_BLOCKS=1 runs per-group "
            "pools at the configured block size)"
        )
    if not all(isinstance(s, (FullAttentionSpec, SlidingWindowSpec)) for s in other):
        return "attention layers other than full or sliding-window attention"
    if gpu_worker and len(set(other)) > 1:
        # Stock KVBlockZeroer zeroes each new attention block ID in every attention layer,
        # with one block count for all of them: right for one attention pool only (the
        # worker hooks zero per group instead).
        return "several attention pools next to Mamba layers on vLLM's GPU worker"
    return None


def unsupported_reason(
    vllm_config: Any, kv_cache_specs: Sequence[dict[str, KVCacheSpec]]
) -> str | None:
    """Why per-group pools cannot serve this engine (None if they can)."""
    return config_unsupported_reason(vllm_config) or spec_unsupported_reason(
        kv_cache_specs, _stock_gpu_worker(vllm_config)
    )


def _pages_unpadded(kv_cache_specs: Sequence[dict[str, KVCacheSpec]]) -> bool:
    """Whether the workers left Mamba pages at their natural size (our worker hook) while
    attention pages differ: vLLM's one-pool sizing cannot lay those out."""
    specs = [s for d in kv_cache_specs for s in d.values()]
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    pages = {s.page_size_bytes for s in specs}
    return bool(mamba) and len(pages) > 1 and all(s.page_size_padded is None for s in mamba)


def merge_worker_specs(
    kv_cache_specs: Sequence[dict[str, KVCacheSpec]],
) -> dict[str, KVCacheSpec] | None:
    """Every worker's layers in one dict, in the order the workers report them
    (tensor-parallel workers report the same layers, pipeline stages each their own);
    None if two workers report one layer with different specs, or none reports any."""
    merged: dict[str, KVCacheSpec] = {}
    for specs in kv_cache_specs:
        for name, spec in specs.items():
            if merged.setdefault(name, spec) != spec:
                return None
    return merged or None


def build_groups(
    kv_cache_spec: dict[str, KVCacheSpec], vllm_config: Any = None
) -> list[KVCacheGroupSpec]:
    """One group per distinct spec, in layer order. Mamba pages lose any padding: each
    group has its own pool and region, so no page needs to match another group's. Draft
    (EAGLE / MTP) attention layers with the target attention's spec join its group;
    others get a group of their own. With ``vllm_config`` the draft groups are flagged
    (:func:`flag_draft_groups`)."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, MambaSpec) and spec.page_size_padded is not None:
            spec = replace(spec, page_size_padded=None)
        by_spec.setdefault(spec, []).append(name)
    groups = [KVCacheGroupSpec(names, spec) for spec, names in by_spec.items()]
    if vllm_config is not None:
        flag_draft_groups(vllm_config, kv_cache_spec, groups)
    return groups


_TRAILING_DRAFT_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
"""Model types whose drafter (besides method 'mtp') appends its layers after the target's
without marking their specs."""


def _drafts_trail(vllm_config: Any) -> bool:
    """Whether the drafter's layers are the last ones registered and carry no marker:
    MTP drafters reuse the target's decoder layer, so their specs equal the target's."""
    spec_config = vllm_config.speculative_config
    if spec_config.method == "mtp":
        return True
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    return getattr(hf_config, "model_type", None) in _TRAILING_DRAFT_MODEL_TYPES


def flag_draft_groups(
    vllm_config: Any, kv_cache_spec: dict[str, KVCacheSpec], groups: list[KVCacheGroupSpec]
) -> None:
    """Set ``is_eagle_group`` on the groups holding a drafter's KV layers, where the
    scheduler must drop the last cached block of a prefix hit (EAGLE-style drafters: the
    draft KV of a position depends on the token after it).

    A layer is a draft layer if its spec says so (vLLM 0.33's ``is_draft``, or
    ``non_causal_multi_token_decode``); failing that, for MTP-style drafters, the last
    layer registered is one. Nothing is flagged without such a drafter; vLLM's coordinator
    then treats every group as a draft group when the drafter is EAGLE-style."""
    spec_config = getattr(vllm_config, "speculative_config", None)
    if spec_config is None or not spec_config.use_eagle_block_drop():
        return
    marked = {
        name
        for name, spec in kv_cache_spec.items()
        if getattr(spec, "is_draft", False) or getattr(spec, "non_causal_multi_token_decode", False)
    }
    if not marked and kv_cache_spec and _drafts_trail(vllm_config):
        marked = {next(reversed(kv_cache_spec))}
    for group in groups:
        if not marked.isdisjoint(group.layer_names):
            group.is_eagle_group = True


def _page_stride(spec: KVCacheSpec) -> int:
    """Bytes between two blocks of one layer: the page, rounded up to the stride the
    attention backend requires."""
    return round_up(spec.page_size_bytes, spec.get_block_stride_alignment())


def _blocks_per_request(vllm_config: Any, spec: KVCacheSpec) -> int:
    """vLLM's own figure: blocks one ``max_model_len`` request takes in a group of ``spec``."""
    return cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)


def group_needs(
    vllm_config: Any, gid: int, group: KVCacheGroupSpec, num_layers: int | None = None
) -> sizing.GroupNeeds:
    """The sizing model's view of one group, from vLLM's spec and vLLM's own per-request
    figure (``num_layers``: the layers one worker holds, default all of the group's)."""
    spec = group.kv_cache_spec
    per_request = _blocks_per_request(vllm_config, spec)
    factor = 1
    kind: sizing.GroupKind = "growing"
    if isinstance(spec, MambaSpec):
        kind = sizing.mamba_group_kind(spec.mamba_cache_mode)
        factor = sizing.mamba_state_factor(spec.mamba_cache_mode)
    elif isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        max_model_len = vllm_config.model_config.max_model_len
        kind = sizing.windowed_kind(per_request, spec.block_size, max_model_len)
    names = group.layer_names
    shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
    return sizing.GroupNeeds(
        name=f"group {gid} ({type(spec).__name__} x{len(names)} layers: {shown})",
        kind=kind,
        page_bytes=_page_stride(spec),
        num_layers=len(names) if num_layers is None else num_layers,
        blocks_per_request=per_request,
        state_factor=factor,
    )


def project_groups(
    groups: Sequence[KVCacheGroupSpec], worker_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Every group, holding only the layers one worker holds (pipeline stages hold some
    of each group; tensor-parallel workers all of them)."""
    return [
        KVCacheGroupSpec(
            [name for name in g.layer_names if name in worker_spec],
            g.kv_cache_spec,
            is_eagle_group=g.is_eagle_group,
        )
        for g in groups
    ]


def _stage_needs(
    vllm_config: Any,
    groups: Sequence[KVCacheGroupSpec],
    kv_cache_specs: Sequence[dict[str, KVCacheSpec]],
) -> list[list[sizing.GroupNeeds | None]]:
    """Each worker's view of every group (None where it holds none of its layers)."""
    stages = []
    for worker_spec in kv_cache_specs:
        row: list[sizing.GroupNeeds | None] = []
        for gid, (group, own) in enumerate(
            zip(groups, project_groups(groups, worker_spec), strict=True)
        ):
            n = len(own.layer_names)
            row.append(group_needs(vllm_config, gid, group, n) if n else None)
        stages.append(row)
    return stages


def size_groups(
    vllm_config: Any,
    groups: list[KVCacheGroupSpec],
    available_memory: int | Sequence[int],
    kv_cache_specs: Sequence[dict[str, KVCacheSpec]] | None = None,
) -> sizing.Sizing:
    """Every group's pool, as :func:`hybrid_alloc.sizing.size_stages` sizes it for the
    workers of ``kv_cache_specs`` (each with its own memory; default: one worker holding
    every layer of ``groups``).

    Over-subscription: where the fixed-size (Mamba/GDN) pools for ``max_num_seqs``
    requests leave no room for one ``max_model_len`` request, the pools are sized for as
    many requests as fit, and one warning says so: the scheduler then runs at most that
    many requests at once (a request waits until a state block is free), as stock vLLM's
    shared pool does when it runs out of blocks.

    Raises:
        ValueError: not even one request fits (:class:`hybrid_alloc.sizing.SizingError`:
            what one request lacks).
    """
    if kv_cache_specs is None:
        kv_cache_specs = [{name: g.kv_cache_spec for g in groups for name in g.layer_names}]
    memory = (
        [available_memory] * len(kv_cache_specs)
        if isinstance(available_memory, int)
        else list(available_memory)
    )
    stages = _stage_needs(vllm_config, groups, kv_cache_specs)
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    common = {
        "max_model_len": vllm_config.model_config.max_model_len,
        "num_blocks_override": vllm_config.cache_config.num_gpu_blocks_override,
        "region_alignment": REGION_ALIGNMENT,
    }
    fitting = sizing.largest_fitting_num_seqs(stages, memory, max_num_seqs=max_num_seqs, **common)
    if 0 < fitting < max_num_seqs:
        full = sizing.size_stages(stages, memory, max_num_seqs=fitting, **common)
        fixed = [p for p in full.pools if not p.grows]
        logger.warning(
            "hybrid_alloc: per-group KV-cache pools: the fixed-size pools for "
            "max_num_seqs=%d requests do not fit in %s bytes of KV-cache memory next to "
            "one %d-token request; sized for %d requests (%s): at most %d requests run at "
            "once",
            max_num_seqs,
            f"{min(memory):,}",
            common["max_model_len"],
            fitting,
            "; ".join(f"{p.needs.name}: {p.num_blocks:,} blocks" for p in fixed),
            fitting,
        )
        return full
    if fitting == 0:
        try:
            sizing.size_stages(stages, memory, max_num_seqs=1, **common)
        except sizing.SizingError as exc:
            raise sizing.SizingError(
                f"per-group KV-cache pools: not even one request fits (max_num_seqs="
                f"{max_num_seqs}): {exc}",
                exc.shortfall_bytes,
                exc.fixed_pools,
            ) from exc
    return sizing.size_stages(stages, memory, max_num_seqs=max_num_seqs, **common)


def build_config(
    vllm_config: Any, groups: list[KVCacheGroupSpec], pools: sizing.Sizing
) -> KVCacheConfig:
    """Tensors for every group, each in its own region of one backing allocation."""
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    tensors: list[KVCacheTensor] = []
    offset = 0
    regions: list[tuple[int, int, int]] = []  # (offset, layer_stride, block_stride)
    for group, pool in zip(groups, pools.pools, strict=True):
        spec = group.kv_cache_spec
        num_layers = len(group.layer_names)
        if num_layers == 0:  # a pipeline stage without this group's layers
            regions.append((offset, 0, 0))
            continue
        stride = _page_stride(spec)
        fixed_block_stride = stride if stride != spec.page_size_bytes else None
        strides = compute_layout_strides(
            spec,
            pool.num_blocks,
            num_layers,
            layout,
            fixed_strides=(None, fixed_block_stride, None, None, None),
        )
        shape = (num_layers, *compute_layer_kv_cache_shape_bytes(spec, pool.num_blocks))
        offset = round_up(offset, REGION_ALIGNMENT)
        regions.append((offset, strides[0], strides[1]))
        # Last byte any view of this group can address, whatever the layout's dim order.
        offset += 1 + sum((n - 1) * stride for n, stride in zip(shape, strides, strict=True))
    total = round_up(offset, REGION_ALIGNMENT)
    for group, (start, layer_stride, block_stride) in zip(groups, regions, strict=True):
        if not group.layer_names:
            continue
        tensors.append(
            KVCacheTensor(
                size=total,
                layers=list(group.layer_names),
                layer_stride=layer_stride,
                block_stride=block_stride,
                offset=start,
            )
        )
    # `grows` marks the pools sized from the memory left over (counted in capacity); the
    # first of them is the primary pool, whose free count vLLM's admission compares.
    # Bounded (window) pools do not grow unless no group does: the coordinator checks them
    # exactly, like the Mamba pools.
    layouts = tuple(
        PoolLayout(
            group_ids=(gid,),
            num_blocks=pool.num_blocks,
            grows=pool.grows,
            label=f"group{gid}:{type(group.kv_cache_spec).__name__}",
        )
        for gid, (group, pool) in enumerate(zip(groups, pools.pools, strict=True))
    )
    config = PerGroupKVCacheConfig(
        num_blocks=layouts[pools.primary_index].num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        prefix_cache_retention_interval=(vllm_config.cache_config.prefix_cache_retention_interval),
        pool_layouts=layouts,
        # New blocks are zeroed as stock vLLM zeroes them, their IDs tagged per group.
        zero_new_blocks=True,
    )
    _set_tp_replicas(vllm_config, config, groups)
    return config


def _set_tp_replicas(
    vllm_config: Any, config: PerGroupKVCacheConfig, groups: list[KVCacheGroupSpec]
) -> None:
    tp_replicas = importlib.import_module(versions.release().tp_replicas_module)
    config.kv_tp_replicas = tp_replicas.kv_cache_groups_tp_replicas(
        groups,
        vllm_config.parallel_config.tensor_parallel_size,
        vllm_config.parallel_config.decode_context_parallel_size,
    )


def _as_elastic_layout(result: sizing.ElasticSizing) -> ElasticLayout:
    """The budget as the scheduler's pool set and the workers read it; state pages kept
    for live states only where ``HYBRID_ALLOC_KEEP_STATE_PAGES`` asks for them."""
    from hybrid_alloc.settings import keep_state_pages_enabled

    return ElasticLayout(
        slab_bytes=result.slab_bytes,
        num_slabs=result.num_slabs,
        page_bytes=result.page_bytes,
        kept_per_live=result.kept_per_live if keep_state_pages_enabled() else (),
    )


def elastic_unsupported_reason(vllm_config: Any) -> str | None:
    """Why the engine keeps the static per-group split rather than elastic pools (None:
    elastic pools serve it)."""
    from hybrid_alloc.settings import ELASTIC_ENV_VAR, elastic_pools_enabled

    if not elastic_pools_enabled():
        return f"{ELASTIC_ENV_VAR} is not on"
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    if not layout.is_block_compact:
        # A pool's block must be one run of bytes across its layers, so that memory can
        # pass to another pool's pages.
        return f"the KV-cache layout {layout.name} does not keep a block's pages together"
    return None


def size_elastic_groups(
    vllm_config: Any,
    groups: list[KVCacheGroupSpec],
    available_memory: Sequence[int],
    kv_cache_specs: Sequence[dict[str, KVCacheSpec]],
) -> sizing.ElasticSizing:
    """One byte budget for every group's pool, on every worker.

    The scheduler's one budget hands the same block IDs to every worker, and block ``b``
    of group ``g`` is bytes ``b * page_g ..`` of each worker's backing allocation. With
    pipeline stages a group's page is the largest stage's (a stage with fewer of its layers
    leaves the rest of each page unused), and the budget is the smallest stage's memory.
    ``num_gpu_blocks_override`` sizes the budget as the static split's pools at that count
    (the same bytes, lent elastically), or as the least budget that holds one request if
    that is more.

    Raises:
        SizingError: one ``max_model_len`` request does not fit.
    """
    stages = _stage_needs(vllm_config, groups, kv_cache_specs)
    needs = [
        max((n for row in stages if (n := row[g]) is not None), key=lambda n: n.num_layers)
        for g in range(len(groups))
    ]
    max_model_len = vllm_config.model_config.max_model_len
    if vllm_config.cache_config.num_gpu_blocks_override is None:
        return sizing.size_elastic(needs, min(available_memory), max_model_len=max_model_len)
    static = size_groups(vllm_config, groups, list(available_memory), kv_cache_specs)
    memory = sum(p.num_blocks * n.block_bytes for p, n in zip(static.pools, needs, strict=True))
    for _ in range(8):
        try:
            return sizing.size_elastic(needs, memory, max_model_len=max_model_len)
        except sizing.SizingError as exc:
            # Pools sized by block count hold one request; slabs may need a little more
            # (pages lost at slab edges): as the override ignores the memory, so may this.
            memory += exc.shortfall_bytes
    return sizing.size_elastic(needs, memory, max_model_len=max_model_len)


def stock_decode_room_tokens(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Half the attention block vLLM's shared pool would use for these groups: the room a
    request's last block leaves it to decode into there, on average.

    vLLM's rule (``Platform._align_hybrid_block_size``) raises the attention block, in
    multiples of the configured one, until one attention page holds the largest Mamba/GDN
    page; without Mamba/GDN groups the block stays as configured. 0 without a
    full-attention group (nothing grows)."""
    attention = [g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    if not attention:
        return 0
    block = max(spec.block_size for spec in attention)
    token_bytes = max(spec.page_size_bytes // spec.block_size for spec in attention)
    state_pages = [
        g.kv_cache_spec.page_size_bytes for g in groups if isinstance(g.kv_cache_spec, MambaSpec)
    ]
    if state_pages and token_bytes > 0:
        block = max(block, block * cdiv(max(state_pages), block * token_bytes))
    return block // 2


def build_elastic_config(
    vllm_config: Any, groups: list[KVCacheGroupSpec], elastic: sizing.ElasticSizing
) -> PerGroupKVCacheConfig:
    """Elastic pools for one worker (``groups``: every group, holding this worker's
    layers): every group's layers view the whole budget, block ``b`` of group ``g`` at
    bytes ``b * page_g`` with its layers one after another inside the page, so pages of
    any group may take bytes another group held before."""
    tensors = [
        KVCacheTensor(
            size=elastic.budget_bytes,
            layers=list(group.layer_names),
            layer_stride=_page_stride(group.kv_cache_spec),
            block_stride=page,
            offset=0,
        )
        for group, page in zip(groups, elastic.page_bytes, strict=True)
        if group.layer_names
    ]
    counted = sizing.counted_in_capacity([n.kind for n in elastic.needs])
    layouts = tuple(
        PoolLayout(
            group_ids=(gid,),
            num_blocks=pages,
            grows=grows,
            label=f"group{gid}:{type(group.kv_cache_spec).__name__}",
        )
        for gid, (group, pages, grows) in enumerate(
            zip(groups, elastic.num_pages, counted, strict=True)
        )
    )
    primary = next(i for i, layout in enumerate(layouts) if layout.grows)
    config = PerGroupKVCacheConfig(
        num_blocks=layouts[primary].num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        prefix_cache_retention_interval=(vllm_config.cache_config.prefix_cache_retention_interval),
        pool_layouts=layouts,
        elastic=_as_elastic_layout(elastic),
        zero_new_blocks=True,
        decode_room_tokens=stock_decode_room_tokens(groups),
    )
    _set_tp_replicas(vllm_config, config, groups)
    return config


def _kind_label(spec: KVCacheSpec) -> str:
    """A group's spec as the sizing lines name it (Mamba specs with their cache mode)."""
    kind = type(spec).__name__
    if isinstance(spec, MambaSpec):
        kind += f"({spec.mamba_cache_mode})"
    return kind


def describe_elastic(groups: list[KVCacheGroupSpec], elastic: sizing.ElasticSizing) -> str:
    parts = [
        f"one budget of {elastic.num_slabs:,} slabs x {elastic.slab_bytes:,} B shared by "
        f"{len(groups)} pools"
    ]
    for gid, (group, needs, stride, per_slab) in enumerate(
        zip(groups, elastic.needs, elastic.page_bytes, elastic.pages_per_slab, strict=True)
    ):
        spec = group.kv_cache_spec
        padded = f" (padded to {stride:,} B)" if stride != needs.block_bytes else ""
        parts.append(
            f"group {gid} {_kind_label(spec)} x{len(group.layer_names)} layers, block "
            f"{spec.block_size} "
            f"tokens, {needs.block_bytes:,} B a block{padded}, {per_slab} a slab, "
            f"{needs.blocks_per_request} a request"
        )
    room = stock_decode_room_tokens(groups)
    if room:
        parts.append(f"admissions leave each running request {room} tokens to decode into")
    return "; ".join(parts)


def _partial_hits_would_be_on(vllm_config: Any, groups: list[KVCacheGroupSpec]) -> bool:
    """vLLM enables sub-block prefix hits (copy-on-write Mamba blocks) when an 'align'
    Mamba block is larger than the hash block; those copies are applied by bare ID."""
    cache_config = vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        return False
    sizes = [g.kv_cache_spec.block_size for g in groups]
    hash_block_size = cache_config.prefix_match_unit or math.gcd(*sizes)
    return kv_cache_utils.partial_hash_hits_enabled(groups, hash_block_size)


def describe(groups: list[KVCacheGroupSpec], pools: sizing.Sizing) -> str:
    parts = []
    for gid, (group, pool) in enumerate(zip(groups, pools.pools, strict=True)):
        spec = group.kv_cache_spec
        parts.append(
            f"group {gid} {_kind_label(spec)} x{len(group.layer_names)} layers, page "
            f"{spec.page_size_bytes} B, block {spec.block_size} tokens: {pool.num_blocks} "
            f"blocks ({'grows' if pool.grows else pool.needs.kind})"
        )
    return "; ".join(parts)


def get_global_kv_cache_groups(
    vllm_config: Any, kv_cache_specs: list[dict[str, KVCacheSpec]]
) -> list[KVCacheGroupSpec]:
    """vLLM 0.33's ``get_global_kv_cache_groups`` (the engine core groups all workers'
    layers before sizing): one group per distinct spec where per-group pools serve the
    engine. vLLM's own grouping would unify page sizes, which the unpadded pages our
    workers report may not allow."""
    if unsupported_reason(vllm_config, kv_cache_specs) is None:
        merged = merge_worker_specs(kv_cache_specs)
        assert merged is not None
        return build_groups(merged, vllm_config)
    return _sizing_module().get_global_kv_cache_groups(vllm_config, kv_cache_specs)  # type: ignore[no-any-return]


def get_kv_cache_configs(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
    global_kv_cache_groups: list[KVCacheGroupSpec] | None = None,
) -> list[KVCacheConfig]:
    """vLLM's ``get_kv_cache_configs`` with per-group pools for hybrid models (0.33 also
    passes the groups of :func:`get_global_kv_cache_groups`). One sizing for all workers:
    the scheduler's pools hand the same block IDs to every worker; each worker's config
    holds every group but lays out only its own layers."""
    reason = unsupported_reason(vllm_config, kv_cache_specs)
    groups: list[KVCacheGroupSpec] = []
    if reason is None:
        merged = merge_worker_specs(kv_cache_specs)
        assert merged is not None
        groups = build_groups(merged, vllm_config)
        if _partial_hits_would_be_on(vllm_config, groups):
            reason = "an 'align' Mamba block larger than the hash block (sub-block hits)"
    if reason is not None:
        if config_unsupported_reason(vllm_config) is None and _pages_unpadded(kv_cache_specs):
            # The workers kept natural page sizes, expecting per-group pools.
            raise RuntimeError(
                f"per-group KV-cache pools cannot serve this model ({reason}) and its "
                "workers did not pad Mamba pages for vLLM's shared pool; start the "
                "engine with HYBRID_ALLOC_PER_GROUP_POOLS=0"
            )
        logger.info("hybrid_alloc: per-group KV-cache pools not used: %s", reason)
        return _stock_get_kv_cache_configs(
            vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups
        )
    elastic_reason = elastic_unsupported_reason(vllm_config)
    if elastic_reason is None:
        elastic = size_elastic_groups(vllm_config, groups, available_memory, kv_cache_specs)
        logger.info(
            "hybrid_alloc: elastic per-group KV-cache pools: %s", describe_elastic(groups, elastic)
        )
        return [
            build_elastic_config(vllm_config, project_groups(groups, worker_spec), elastic)
            for worker_spec in kv_cache_specs
        ]
    pools = size_groups(vllm_config, groups, available_memory, kv_cache_specs)
    logger.info(
        "hybrid_alloc: per-group KV-cache pools: %s (a static split; elastic pools not used: %s)",
        describe(groups, pools),
        elastic_reason,
    )
    return [
        build_config(vllm_config, project_groups(groups, worker_spec), pools)
        for worker_spec in kv_cache_specs
    ]


def get_max_concurrency_for_kv_cache_config(
    vllm_config: Any, kv_cache_config: KVCacheConfig
) -> float:
    """Requests of ``max_model_len`` tokens the KV cache holds at once. With per-group
    pools only the pools that grow with the sequence count (the fixed and bounded pools
    are sized to ``max_num_seqs``); vLLM's convention of counting every block, null
    included, is kept."""
    if not isinstance(kv_cache_config, PerGroupKVCacheConfig):
        return float(_stock_get_max_concurrency(vllm_config, kv_cache_config))
    groups = kv_cache_config.kv_cache_groups

    def per_request(layout: PoolLayout) -> int:
        return sum(
            _blocks_per_request(vllm_config, groups[g].kv_cache_spec) for g in layout.group_ids
        )

    elastic = kv_cache_config.elastic
    if elastic is not None:
        # Every pool counts: a request's states take budget bytes as its attention does.
        return sizing.elastic_concurrency(
            elastic.slab_bytes,
            elastic.num_slabs,
            (
                (page, per_request(layout))
                for layout, page in zip(
                    kv_cache_config.pool_layouts, elastic.page_bytes, strict=True
                )
            ),
        )
    return sizing.max_concurrency(
        (
            (layout.num_blocks, per_request(layout))
            for layout in kv_cache_config.pool_layouts
            if layout.grows
        ),
        count_null_block=True,
    )


def install() -> None:
    """Route vLLM's engine-core sizing and capacity report through this module
    (idempotent). The engine core (``vllm.v1.engine.core``) imported the sizing functions
    by name, so those names are replaced there; the capacity helper is looked up in its
    own module."""
    from vllm.v1.engine import core

    core.get_kv_cache_configs = get_kv_cache_configs  # type: ignore[assignment]
    if versions.release().sizing_takes_global_groups:
        core.get_global_kv_cache_groups = get_global_kv_cache_groups  # type: ignore[attr-defined]
    kv_cache_utils.get_max_concurrency_for_kv_cache_config = (  # type: ignore[assignment]
        get_max_concurrency_for_kv_cache_config
    )


def uninstall() -> None:
    from vllm.v1.engine import core

    module = _sizing_module()
    core.get_kv_cache_configs = module.get_kv_cache_configs  # type: ignore[assignment]
    if versions.release().sizing_takes_global_groups:
        core.get_global_kv_cache_groups = module.get_global_kv_cache_groups  # type: ignore[attr-defined]
    kv_cache_utils.get_max_concurrency_for_kv_cache_config = _stock_get_max_concurrency  # type: ignore[assignment]


def is_installed() -> bool:
    from vllm.v1.engine import core

    return core.get_kv_cache_configs is get_kv_cache_configs
