"""Per-group KV-cache sizing: the config vLLM's engine core builds at startup.

vLLM (``get_kv_cache_configs``; in 0.33 also ``get_global_kv_cache_groups``) unifies every page
to one size, gives all groups one ``num_blocks`` and lays every group over the same
bytes. For a hybrid model (attention + Mamba/GDN) this module builds instead:

* one group per distinct layer spec (no equal-size split: groups need not share a pool);
* one pool per group, at the group's natural page size (no padding);
* Mamba groups outside 'all' mode get a fixed pool: ``max_num_seqs`` requests times the
  blocks vLLM says one request needs (``1 + num_speculative_blocks`` in 'none' mode,
  more in 'align'), plus the null block ('align' pools get room for as many cached states
  again, see `ALIGN_CACHE_FACTOR`);
* the memory left goes to the groups that grow with the sequence, split in proportion to
  what one ``max_model_len`` request needs in each;
* every group gets its own region of the one backing allocation vLLM's worker makes, and
  its tensors are viewed with its own pool's block count.

Anything this does not cover falls back to vLLM's sizing (and thus to one shared pool),
with the reason logged.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv, round_up
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import (
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

from hybrid_alloc.integration import versions
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from hybrid_alloc.integration.pool_set import PoolLayout

# vLLM's logger factory, as the plugin uses: the lines print with vLLM's own.
logger = init_logger("vllm.hybrid_alloc")

ALIGN_CACHE_FACTOR = 2
"""An 'align'-mode Mamba pool holds this many times what the running requests need: the
rest keeps cached states for prefix hits (a policy choice; 'none' mode caches nothing)."""

REGION_ALIGNMENT = 4096
"""Byte alignment of each group's region in the backing allocation (dtype views of a
region must start on an aligned address)."""

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


@dataclass(frozen=True)
class GroupPlan:
    """One group's needs, in its own pool's blocks."""

    group: KVCacheGroupSpec
    grows: bool
    blocks_per_request: int
    """Blocks one request needs at ``max_model_len`` (vLLM's own per-request figure)."""
    bytes_per_block: int
    """Bytes one block costs over all the group's layers (each page rounded to its
    stride alignment)."""

    @property
    def spec(self) -> KVCacheSpec:
        return self.group.kv_cache_spec


def config_unsupported_reason(vllm_config: Any) -> str | None:
    """Why per-group pools cannot serve this engine, as far as its configuration tells
    (None if it does not). Checked in the workers too: where it names a reason they pad
    Mamba pages as stock vLLM does, so that vLLM's own sizing can take over."""
    cache = vllm_config.cache_config
    if cache.mamba_cache_mode == "all":
        return "mamba_cache_mode 'all' keeps state per block; it grows like attention"
    if cache.enable_prefix_caching and cache.prefix_match_unit is not None:
        return "prefix_match_unit (sub-block prefix hits copy Mamba blocks by bare ID)"
    if vllm_config.kv_transfer_config is not None:
        return "KV connectors address blocks by IDs unique across groups"
    if vllm_config.attention_config.hisparse_config is not None:
        return "HiSparse host pools"
    if vllm_config.speculative_config is not None:
        return "speculative decoding (draft groups) is not handled yet"
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        return "pipeline parallelism (workers hold different layers)"
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        return "context parallelism"
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return "the hybrid KV-cache manager is disabled"
    if vllm_config.model_config.original_max_model_len == -1:
        return "max_model_len auto-fit"
    if cache.mamba_cache_mode == "align" and _gpu_worker(vllm_config, v2_runner=True):
        # Its profiling runs fabricate block IDs for every group modulo the primary
        # pool's block count (set_dummy_context), past the end of a smaller 'align' pool.
        return (
            "Mamba 'align' mode under vLLM's V2 GPU model runner (VLLM_USE_V2_MODEL_RUNNER=0 "
            "selects the V1 runner, which per-group pools support)"
        )
    return None


def _gpu_worker(vllm_config: Any, v2_runner: bool = False) -> bool:
    """Whether the workers are vLLM's GPU workers (optionally: running the V2 model
    runner). The CPU worker is the one tested end to end here."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return False
    return not v2_runner or bool(getattr(vllm_config, "use_v2_model_runner", False))


def spec_unsupported_reason(
    kv_cache_specs: Sequence[dict[str, KVCacheSpec]], gpu_worker: bool = False
) -> str | None:
    """Why per-group pools cannot serve the layers the workers reported (None if they
    can)."""
    if not kv_cache_specs or any(specs != kv_cache_specs[0] for specs in kv_cache_specs):
        return "workers hold different layers (pipeline parallelism)"
    specs = list(kv_cache_specs[0].values())
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    other = [s for s in specs if not isinstance(s, MambaSpec)]
    if not mamba or not other:
        return "not a hybrid of Mamba/GDN and attention layers"
    if any(s.mamba_cache_mode == "all" for s in mamba):
        return "mamba_cache_mode 'all' keeps state per block; it grows like attention"
    if not all(isinstance(s, (FullAttentionSpec, SlidingWindowSpec)) for s in other):
        return "attention layers other than full or sliding-window attention"
    if gpu_worker and len(set(other)) > 1:
        # KVBlockZeroer zeroes each new attention block ID in every attention layer, with
        # one block count for all of them: right for one attention pool only.
        return "several attention pools next to Mamba layers on vLLM's GPU worker"
    return None


def unsupported_reason(
    vllm_config: Any, kv_cache_specs: Sequence[dict[str, KVCacheSpec]]
) -> str | None:
    """Why per-group pools cannot serve this engine (None if they can)."""
    return config_unsupported_reason(vllm_config) or spec_unsupported_reason(
        kv_cache_specs, _gpu_worker(vllm_config)
    )


def _pages_unpadded(kv_cache_specs: Sequence[dict[str, KVCacheSpec]]) -> bool:
    """Whether the workers left Mamba pages at their natural size (our worker hook) while
    attention pages differ: vLLM's one-pool sizing cannot lay those out."""
    specs = [s for d in kv_cache_specs for s in d.values()]
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    pages = {s.page_size_bytes for s in specs}
    return bool(mamba) and len(pages) > 1 and all(s.page_size_padded is None for s in mamba)


def build_groups(kv_cache_spec: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """One group per distinct spec, in layer order. Mamba pages lose any padding: each
    group has its own pool and region, so no page needs to match another group's."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, MambaSpec) and spec.page_size_padded is not None:
            spec = replace(spec, page_size_padded=None)
        by_spec.setdefault(spec, []).append(name)
    return [KVCacheGroupSpec(names, spec) for spec, names in by_spec.items()]


def plan_groups(vllm_config: Any, groups: list[KVCacheGroupSpec]) -> list[GroupPlan]:
    plans = []
    for group in groups:
        spec = group.kv_cache_spec
        stride = round_up(spec.page_size_bytes, spec.get_block_stride_alignment())
        plans.append(
            GroupPlan(
                group=group,
                grows=not isinstance(spec, MambaSpec),
                blocks_per_request=cdiv(
                    spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes
                ),
                bytes_per_block=stride * len(group.layer_names),
            )
        )
    return plans


def fixed_pool_blocks(vllm_config: Any, plan: GroupPlan) -> int:
    """Blocks of a pool that does not grow, null block included."""
    spec = plan.spec
    assert isinstance(spec, MambaSpec)
    live = vllm_config.scheduler_config.max_num_seqs * plan.blocks_per_request
    factor = ALIGN_CACHE_FACTOR if spec.mamba_cache_mode == "align" else 1
    return live * factor + 1


def plan_pool_sizes(vllm_config: Any, plans: list[GroupPlan], available_memory: int) -> list[int]:
    """Blocks per group's pool (null block included): fixed pools first, the rest of
    ``available_memory`` to the growing ones in proportion to one max-length request."""
    sizes = [0] * len(plans)
    budget = available_memory - REGION_ALIGNMENT * len(plans)  # region padding
    for i, plan in enumerate(plans):
        if not plan.grows:
            sizes[i] = fixed_pool_blocks(vllm_config, plan)
            budget -= sizes[i] * plan.bytes_per_block
    growing = [i for i, plan in enumerate(plans) if plan.grows]
    if budget <= 0:
        raise ValueError(
            f"per-group KV-cache pools: {available_memory} bytes of KV-cache memory do not "
            "hold the Mamba/GDN state of max_num_seqs requests; lower max_num_seqs or give "
            "the KV cache more memory"
        )
    weights = [plans[i].blocks_per_request * plans[i].bytes_per_block for i in growing]
    override = vllm_config.cache_config.num_gpu_blocks_override
    for i, weight in zip(growing, weights, strict=True):
        plan = plans[i]
        if override is not None:
            # The override counts the primary (first growing) pool's blocks; other
            # growing pools keep their proportion to it.
            first = plans[growing[0]]
            sizes[i] = max(1, override * plan.blocks_per_request // first.blocks_per_request)
        else:
            sizes[i] = budget * weight // sum(weights) // plan.bytes_per_block
        if sizes[i] - 1 < plan.blocks_per_request:
            max_model_len = vllm_config.model_config.max_model_len
            raise ValueError(
                f"per-group KV-cache pools: group of {plan.group.layer_names[:3]}... gets "
                f"{sizes[i] - 1} usable blocks, fewer than one {max_model_len}-token "
                f"request needs ({plan.blocks_per_request}); lower max_model_len or "
                "give the KV cache more memory"
            )
    return sizes


def build_config(vllm_config: Any, plans: list[GroupPlan], sizes: list[int]) -> KVCacheConfig:
    """Tensors for every group, each in its own region of one backing allocation."""
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    tensors: list[KVCacheTensor] = []
    offset = 0
    regions: list[tuple[int, int, int]] = []  # (offset, layer_stride, block_stride)
    for plan, num_blocks in zip(plans, sizes, strict=True):
        spec = plan.spec
        num_layers = len(plan.group.layer_names)
        stride = round_up(spec.page_size_bytes, spec.get_block_stride_alignment())
        fixed_block_stride = stride if stride != spec.page_size_bytes else None
        strides = compute_layout_strides(
            spec,
            num_blocks,
            num_layers,
            layout,
            fixed_strides=(None, fixed_block_stride, None, None, None),
        )
        shape = (num_layers, *compute_layer_kv_cache_shape_bytes(spec, num_blocks))
        offset = round_up(offset, REGION_ALIGNMENT)
        regions.append((offset, strides[0], strides[1]))
        # Last byte any view of this group can address, whatever the layout's dim order.
        offset += 1 + sum((n - 1) * stride for n, stride in zip(shape, strides, strict=True))
    total = round_up(offset, REGION_ALIGNMENT)
    for plan, (start, layer_stride, block_stride) in zip(plans, regions, strict=True):
        tensors.append(
            KVCacheTensor(
                size=total,
                layers=list(plan.group.layer_names),
                layer_stride=layer_stride,
                block_stride=block_stride,
                offset=start,
            )
        )
    pools = tuple(
        PoolLayout(
            group_ids=(gid,),
            num_blocks=n,
            grows=plan.grows,
            label=f"group{gid}:{type(plan.spec).__name__}",
        )
        for gid, (plan, n) in enumerate(zip(plans, sizes, strict=True))
    )
    primary = next((p for p in pools if p.grows), pools[0])
    groups = [plan.group for plan in plans]
    config = PerGroupKVCacheConfig(
        num_blocks=primary.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        prefix_cache_retention_interval=(vllm_config.cache_config.prefix_cache_retention_interval),
        pool_layouts=pools,
    )
    tp_replicas = importlib.import_module(versions.release().tp_replicas_module)
    config.kv_tp_replicas = tp_replicas.kv_cache_groups_tp_replicas(
        groups,
        vllm_config.parallel_config.tensor_parallel_size,
        vllm_config.parallel_config.decode_context_parallel_size,
    )
    return config


def _partial_hits_would_be_on(vllm_config: Any, groups: list[KVCacheGroupSpec]) -> bool:
    """vLLM enables sub-block prefix hits (copy-on-write Mamba blocks) when an 'align'
    Mamba block is larger than the hash block; those copies are applied by bare ID."""
    cache_config = vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        return False
    sizes = [g.kv_cache_spec.block_size for g in groups]
    hash_block_size = cache_config.prefix_match_unit or math.gcd(*sizes)
    return kv_cache_utils.partial_hash_hits_enabled(groups, hash_block_size)


def describe(plans: list[GroupPlan], sizes: list[int]) -> str:
    parts = []
    for gid, (plan, n) in enumerate(zip(plans, sizes, strict=True)):
        spec = plan.spec
        kind = type(spec).__name__
        if isinstance(spec, MambaSpec):
            kind += f"({spec.mamba_cache_mode})"
        parts.append(
            f"group {gid} {kind} x{len(plan.group.layer_names)} layers, page "
            f"{spec.page_size_bytes} B, block {spec.block_size} tokens: {n} blocks "
            f"({'grows' if plan.grows else 'fixed'})"
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
        return build_groups(dict(kv_cache_specs[0]))
    return _sizing_module().get_global_kv_cache_groups(vllm_config, kv_cache_specs)  # type: ignore[no-any-return]


def get_kv_cache_configs(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
    global_kv_cache_groups: list[KVCacheGroupSpec] | None = None,
) -> list[KVCacheConfig]:
    """vLLM's ``get_kv_cache_configs`` with per-group pools for hybrid models (0.33 also
    passes the groups of :func:`get_global_kv_cache_groups`)."""
    reason = unsupported_reason(vllm_config, kv_cache_specs)
    groups: list[KVCacheGroupSpec] = []
    if reason is None:
        groups = build_groups(dict(kv_cache_specs[0]))
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
    plans = plan_groups(vllm_config, groups)
    sizes = plan_pool_sizes(vllm_config, plans, min(available_memory))
    logger.info("hybrid_alloc: per-group KV-cache pools: %s", describe(plans, sizes))
    # Tensor-parallel workers hold the same layers: one plan serves all of them.
    return [build_config(vllm_config, plans, sizes) for _ in kv_cache_specs]


def get_max_concurrency_for_kv_cache_config(
    vllm_config: Any, kv_cache_config: KVCacheConfig
) -> float:
    """Requests of ``max_model_len`` tokens the KV cache holds at once. With per-group
    pools only the pools that grow with the sequence count (the fixed pools are sized to
    ``max_num_seqs``); vLLM's convention of counting every block, null included, is kept."""
    if not isinstance(kv_cache_config, PerGroupKVCacheConfig):
        return float(_stock_get_max_concurrency(vllm_config, kv_cache_config))
    limits = []
    for layout in kv_cache_config.pool_layouts:
        if not layout.grows:
            continue
        per_request = sum(
            cdiv(
                spec.max_memory_usage_bytes(vllm_config),
                spec.page_size_bytes,
            )
            for spec in (kv_cache_config.kv_cache_groups[g].kv_cache_spec for g in layout.group_ids)
        )
        limits.append(layout.num_blocks / per_request)
    return min(limits) if limits else float("inf")


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
