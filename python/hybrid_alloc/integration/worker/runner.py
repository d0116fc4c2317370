"""Worker side of per-group pools: layers keep their natural page size.

Each worker reports its layers' KV-cache specs to the engine core. Before that, vLLM's
platform hook ``Platform._align_hybrid_block_size`` (in ``vllm.platforms.interface``,
called from ``update_block_size_for_backend`` in the worker process) raises the
attention block size until one attention page covers a Mamba page and pads Mamba pages
to it ("Padding mamba page size by X%"). With one pool per group no page has to match
another group's, so the hook here skips both and keeps only what 'align' mode needs
(Mamba blocks as long as attention blocks, the prefix-cache granularity). In 'align' mode
where vLLM's rule raises the block size (a state page is larger than an attention block:
nearly every full-size model), the hook keeps vLLM's layout, padding included, and the engine core
sizes vLLM's shared pool: at the configured block size a state would move to a new page
many attention pages large at every block boundary, which under memory pressure preempts
far more often than stock (``HYBRID_ALLOC_FINE_ALIGN_BLOCKS=1`` runs per-group pools there
all the same). Engines whose
configuration per-group pools do not serve (``sizing.config_unsupported_reason``) keep
vLLM's hook: their engine core sizes vLLM's shared pool, which needs the padding.

vLLM's ``allocate_kv_cache`` views every tensor with ``kv_cache_config.num_blocks_of(tensor)``
(answered per group by :class:`~hybrid_alloc.integration.kv_cache_config.PerGroupKVCacheConfig`),
Mamba layers take their state count from their view, and each group's block table indexes
its own layers. What still assumes one shared pool is handled by the runner hooks here
(:func:`install_gpu_runner_hooks`; they act only on a ``PerGroupKVCacheConfig``, any other
config goes to vLLM's code unchanged):

* **zeroing new blocks.** The scheduler sends one flat list of new attention block IDs
  (``SchedulerOutput.new_block_ids_to_zero``, from ``KVCacheManager.take_new_block_ids``)
  and vLLM's ``KVBlockZeroer`` zeroes each ID in every attention layer, with the primary
  pool's block count for all of them. Here the scheduler tags each ID with its group
  (``PerGroupKVCacheConfig.tag_block_ids``), and the GPU runners (V1 and V2,
  ``_init_kv_zero_meta``) build one ``KVBlockZeroer`` per group, over that group's layers
  and with its own block count, which zero that group's IDs only
  (:class:`PerGroupBlockZeroer`). The CPU runner's ``_zero_block_ids`` zeroes each group's
  IDs in that group's full-attention layers;
* **the V2 GPU model runner's fabricated block IDs.** Its dummy runs (profiling, cudagraph
  capture: ``prepare_dummy_attn`` and ``set_dummy_context``) fill every group's block table
  with IDs modulo the primary pool's count, and its kernel warmup (``warmup_kernels``)
  hands out IDs from one counter across all groups. Here the dummy IDs are taken modulo each
  group's own count, and the warmup's IDs are renumbered densely within each group's pool.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from vllm.logger import init_logger
from vllm.platforms.interface import Platform

from hybrid_alloc.integration import hooks
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from hybrid_alloc.sizing import divisor_block, halved_block

# vLLM's logger factory, as the plugin uses: the lines print with vLLM's own.
logger = init_logger("vllm.hybrid_alloc")

_ATTR = "_align_hybrid_block_size"
_PLATFORM_LOGGER = "vllm.platforms.interface"
_stock_align: Any = Platform.__dict__[_ATTR]


def _align_without_padding(cls: Any, vllm_config: Any, backend_cls: Any) -> None:
    from hybrid_alloc.integration.scheduler.engine_sizing import config_unsupported_reason

    if config_unsupported_reason(vllm_config) is not None:
        # The engine core will size one shared pool (vLLM's); it needs vLLM's padding.
        _stock_align.__func__(cls, vllm_config, backend_cls)
        return
    cache_config = vllm_config.cache_config
    if cache_config.mamba_cache_mode == "align" and _keeps_shared_align_layout(
        cls, vllm_config, backend_cls
    ):
        return
    if cache_config.mamba_cache_mode == "align":
        # Prefix-cache hits land on Mamba block boundaries; vLLM ties them to the
        # attention block size (``Platform._align_hybrid_block_size`` does the same).
        cache_config.mamba_block_size = cache_config.block_size
    cache_config.mamba_page_size_padded = None
    logger.info(
        "hybrid_alloc: per-group KV-cache pools: attention block size stays %d tokens, "
        "Mamba/GDN pages are not padded",
        cache_config.block_size,
    )


def _keeps_shared_align_layout(cls: Any, vllm_config: Any, backend_cls: Any) -> bool:
    """'align' mode: whether vLLM's shared layout is kept, as vLLM's own rule lays it out
    (then it has been applied), or the block size is set for per-group pools (then
    False). vLLM's rule raises the attention block size where a Mamba/GDN state page is
    larger than an attention block; at the configured block size a state would move to a
    new page, many attention pages large, at every block boundary, which under memory
    pressure preempts far more often than stock, and at the raised size per-group pools
    have stock's blocks, crossings and prefix hits, and nothing to gain over its pool.

    ``HYBRID_ALLOC_FINE_ALIGN_BLOCKS`` (:func:`hybrid_alloc.settings.fine_align_blocks`):
    by default (``half``) per-group pools run at half of the raised block where that is a
    whole number of configured blocks (every boundary of vLLM's is one of ours, a state
    moves pages at most twice as often, and prefix hits land on twice as many
    boundaries), else vLLM's layout is kept; in the matrix of benches/SERVING.md finer
    splits (a third, a seventh) lost cells and halves none. (A later call finds the half
    as its configured block, raises it back to the same block and halves it again.)
    ``divisor``: the largest block that divides the raised one
    (:func:`hybrid_alloc.sizing.divisor_block`); ``1``: the configured block; ``0``: vLLM's
    layout wherever it raises the block."""
    from hybrid_alloc.settings import (
        FINE_ALIGN_CONFIGURED,
        FINE_ALIGN_DIVISOR,
        FINE_ALIGN_HALF,
        fine_align_blocks,
    )

    fine = fine_align_blocks()
    if fine == FINE_ALIGN_CONFIGURED:
        return False
    cache_config = vllm_config.cache_config
    configured = (
        cache_config.block_size,
        cache_config.mamba_block_size,
        cache_config.mamba_page_size_padded,
    )
    # vLLM's log lines are dropped while it decides: where its layout is not kept they
    # would announce a block size and padding that are then undone.
    with _quiet(_PLATFORM_LOGGER):
        _stock_align.__func__(cls, vllm_config, backend_cls)
    if configured[2] is not None and cache_config.block_size == configured[0]:
        # An earlier call kept vLLM's layout (workers run the hook more than once): only
        # vLLM's rule pads, and where it is not kept the padding is undone.
        return True
    hybrid = cache_config.block_size
    if hybrid > configured[0] and fine in (FINE_ALIGN_DIVISOR, FINE_ALIGN_HALF):
        block = (
            divisor_block(hybrid, configured[0])
            if fine == FINE_ALIGN_DIVISOR
            else halved_block(hybrid, configured[0])
        )
        if block is not None:
            (
                cache_config.block_size,
                cache_config.mamba_block_size,
                cache_config.mamba_page_size_padded,
            ) = (block, block, None)
            if block != configured[0]:
                # Later calls start from this block, raise it back to vLLM's and choose
                # it again (the only candidate that is a multiple of itself): said once.
                logger.info(
                    "hybrid_alloc: Mamba 'align' mode: per-group pools at %d-token blocks, "
                    "1/%d of vLLM's hybrid block of %d tokens "
                    "(HYBRID_ALLOC_FINE_ALIGN_BLOCKS=%s)",
                    block,
                    hybrid // block,
                    hybrid,
                    fine,
                )
            return False
    if hybrid > configured[0]:
        logger.info(
            "hybrid_alloc: Mamba 'align' mode: vLLM's shared KV-cache layout kept (attention "
            "blocks raised from %d to %d tokens, Mamba/GDN pages padded to them): a state "
            "page is larger than a %d-token attention block, %d is an odd number of them, "
            "and per-group pools at finer blocks would preempt more than stock under memory "
            "pressure (HYBRID_ALLOC_FINE_ALIGN_BLOCKS=1 or =divisor runs them)",
            configured[0],
            hybrid,
            configured[0],
            hybrid,
        )
        return True
    (
        cache_config.block_size,
        cache_config.mamba_block_size,
        cache_config.mamba_page_size_padded,
    ) = configured
    return False


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Raise logger ``name`` to WARNING for the block (its INFO lines are dropped)."""
    target = logging.getLogger(name)
    level = target.level
    target.setLevel(logging.WARNING)
    try:
        yield
    finally:
        target.setLevel(level)


def _per_group(config: Any) -> PerGroupKVCacheConfig | None:
    return config if isinstance(config, PerGroupKVCacheConfig) else None


# ---------------------------------------------------------------- zeroing new blocks
def _tagging_take_new_block_ids(stock: Callable[..., list[int]]) -> Callable[..., list[int]]:
    """``KVCacheManager.take_new_block_ids`` (scheduler): each manager's new IDs tagged
    with its group, so that the workers can tell pool-scoped IDs of different pools apart."""

    def take_new_block_ids(self: Any) -> list[int]:
        config = _per_group(getattr(self, "kv_cache_config", None))
        if config is None or not config.zero_new_blocks:
            return stock(self)
        ids: list[int] = []
        for manager in self.coordinator.single_type_managers:
            new = manager.take_new_block_ids()
            if new:  # called every step; most steps take no block in most groups
                config.extend_tagged(ids, manager.kv_cache_group_id, new)
        return ids

    return take_new_block_ids


class PerGroupBlockZeroer:
    """vLLM's ``KVBlockZeroer`` once per KV-cache group: each over the group's own layers
    and viewed with the group's own block count; :meth:`zero_block_ids` takes the
    scheduler's tagged IDs and zeroes each group's IDs in that group's layers only. Same
    interface as ``KVBlockZeroer`` (the runners and vLLM's warmup call it the same way)."""

    def __init__(
        self,
        device: Any,
        attn_groups_iter: Iterable[Any],
        kernel_block_sizes: list[int],
        static_forward_context: dict[str, Any],
        config: PerGroupKVCacheConfig,
        runner_only_attn_layers: set[str] | None = None,
    ) -> None:
        # Looked up at call time: the module's kernel is what a test replaces on CPU.
        from vllm.v1.worker import utils as worker_utils

        self.config = config
        attn_groups = list(attn_groups_iter)
        counts = config.group_num_blocks()
        self.zeroers: dict[int, Any] = {}
        for gid in sorted({g.kv_cache_group_id for g in attn_groups}):
            self.zeroers[gid] = worker_utils.KVBlockZeroer(
                device,
                attn_groups_iter=[g for g in attn_groups if g.kv_cache_group_id == gid],
                kernel_block_sizes=kernel_block_sizes,
                static_forward_context=static_forward_context,
                num_blocks=counts[gid],
                runner_only_attn_layers=runner_only_attn_layers,
            )

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        for gid, ids in self.config.split_tagged_block_ids(block_ids).items():
            zeroer = self.zeroers.get(gid)
            if zeroer is not None:
                zeroer.zero_block_ids(ids)

    def warmup(self, num_kv_blocks: int) -> None:
        """Compile the zeroing kernel (vLLM's ``KVBlockZeroer.warmup`` zeroes block 0, the
        null block, of each group)."""
        for gid, zeroer in self.zeroers.items():
            zeroer.warmup(self.config.group_num_blocks()[gid])


def _v2_init_kv_zero_meta(stock: Callable[..., None]) -> Callable[..., None]:
    """The V2 GPU model runner's ``_init_kv_zero_meta`` (called by the GPU worker after the
    KV cache is allocated, when the config asks for zeroing)."""

    def _init_kv_zero_meta(self: Any) -> None:
        config = _per_group(self.kv_cache_config)
        if config is None:
            return stock(self)
        self.kv_block_zeroer = PerGroupBlockZeroer(
            self.device,
            (g for groups in self.attn_groups for g in groups),
            self.kernel_block_sizes,
            self.compilation_config.static_forward_context,
            config,
        )
        return None

    return _init_kv_zero_meta


def _v1_init_kv_zero_meta(stock: Callable[..., None]) -> Callable[..., None]:
    """The V1 GPU model runner's ``_init_kv_zero_meta``."""

    def _init_kv_zero_meta(self: Any) -> None:
        config = _per_group(self.kv_cache_config)
        if config is None:
            return stock(self)
        self._kv_block_zeroer = PerGroupBlockZeroer(
            self.device,
            self._kv_cache_spec_attn_group_iterator(),
            self._kernel_block_sizes,
            self.compilation_config.static_forward_context,
            config,
            runner_only_attn_layers=self.runner_only_attn_layers,
        )
        return None

    return _init_kv_zero_meta


def _cpu_zero_block_ids(stock: Callable[..., None]) -> Callable[..., None]:
    """The CPU model runner's ``_zero_block_ids``: vLLM's zeroes every ID in every
    full-attention layer; here each group's IDs are zeroed in that group's full-attention
    layers (the kinds vLLM's CPU runner zeroes), at that group's own block indices."""

    def _zero_block_ids(self: Any, block_ids: list[int]) -> None:
        config = _per_group(self.kv_cache_config)
        if config is None:
            return stock(self, block_ids)
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        context = self.compilation_config.static_forward_context
        done: set[tuple[int, int]] = set()
        for gid, ids in config.split_tagged_block_ids(block_ids).items():
            group = config.kv_cache_groups[gid]
            if not isinstance(group.kv_cache_spec, FullAttentionSpec):
                continue
            for name in group.layer_names:
                kv: Any = getattr(context.get(name), "kv_cache", None)
                # Layers that share one tensor (vLLM's KV sharing) are zeroed once.
                if not hasattr(kv, "data_ptr") or (kv.data_ptr(), gid) in done:
                    continue
                done.add((kv.data_ptr(), gid))
                kv[ids] = 0
        return None

    return _zero_block_ids


# ------------------------------------------------ the V2 runner's fabricated block IDs
_POOL_COUNTS_ATTR = "_hybrid_alloc_group_num_blocks"


def _wrap_into_pools(tables: Sequence[Any], num_reqs: int, counts: Sequence[int]) -> None:
    """Every ID in the first ``num_reqs`` rows of group ``g``'s table taken modulo that
    group's block count (ID 0, the null block, stays 0)."""
    for table, n in zip(tables, counts, strict=False):
        table[:num_reqs].remainder_(n)


def _v2_prepare_dummy_attn(stock: Callable[..., Any]) -> Callable[..., Any]:
    """The V2 runner's ``prepare_dummy_attn``: its state slots ``1..num_reqs`` (with
    ``valid_state_slots``) kept inside each group's pool; it also leaves the groups' counts
    on the runner's ``BlockTables`` for :func:`_v2_set_dummy_context`."""

    def prepare_dummy_attn(self: Any, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        block_tables, slot_mappings = stock(self, input_batch, *args, **kwargs)
        config = _per_group(self.kv_cache_config)
        if config is not None:
            counts = config.group_num_blocks()
            setattr(self.block_tables, _POOL_COUNTS_ATTR, counts)
            _wrap_into_pools(block_tables, input_batch.num_reqs, counts)
        return block_tables, slot_mappings

    return prepare_dummy_attn


def _v2_set_dummy_context(stock: Callable[..., None]) -> Callable[..., None]:
    """``set_dummy_context`` as the V2 runner calls it: vLLM's fills every group's table
    with IDs modulo the primary pool's count; each group's are then taken modulo its own."""

    def set_dummy_context(input_batch: Any, block_tables: Any, *args: Any, **kwargs: Any) -> None:
        stock(input_batch, block_tables, *args, **kwargs)
        counts = getattr(block_tables, _POOL_COUNTS_ATTR, None)
        if counts is None:
            return
        tables = kwargs.get("input_block_tables", args[3] if len(args) > 3 else None)
        if tables is None:
            tables = block_tables.input_block_tables
        _wrap_into_pools(tables, input_batch.num_reqs, counts)

    return set_dummy_context


class WarmupBlockRenumbering:
    """Renumbers the block IDs of the V2 runner's warmup steps within each group's pool:
    vLLM's warmup gives out IDs ``1, 2, ...`` from one counter across all groups (bounded
    by the primary pool only); here group ``g``'s IDs become ``1, 2, ...`` in order of first
    use, wrapping at its pool's end, the same original ID always the same new one."""

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = list(counts)
        self.maps: list[dict[int, int]] = [{} for _ in self.counts]

    def group_ids(self, gid: int, ids: Iterable[int]) -> list[int]:
        mapping, n = self.maps[gid], self.counts[gid]
        for b in ids:
            if b not in mapping:
                mapping[b] = 1 + len(mapping) % (n - 1) if n > 1 else 0
        return [mapping[b] for b in ids]

    def per_group(self, block_ids: Sequence[Iterable[int]]) -> tuple[list[int], ...]:
        return tuple(self.group_ids(g, ids) for g, ids in enumerate(block_ids))

    def __call__(self, scheduler_output: Any) -> None:
        for req in scheduler_output.scheduled_new_reqs:
            req.block_ids = self.per_group(req.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        cached.new_block_ids = [
            None if ids is None else self.per_group(ids) for ids in cached.new_block_ids
        ]


def _v2_warmup_kernels(stock: Callable[..., None]) -> Callable[..., None]:
    """``warmup_kernels`` as the workers call it: its scheduler outputs renumbered per
    group (:class:`WarmupBlockRenumbering`) before they reach the worker."""

    def warmup_kernels(
        model_runner: Any,
        worker_execute_model: Callable[..., Any],
        worker_sample_tokens: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        config = _per_group(model_runner.kv_cache_config)
        if config is not None:
            renumber = WarmupBlockRenumbering(config.group_num_blocks())
            execute = worker_execute_model

            def worker_execute_model(scheduler_output: Any, *a: Any, **kw: Any) -> Any:
                renumber(scheduler_output)
                return execute(scheduler_output, *a, **kw)

        return stock(model_runner, worker_execute_model, worker_sample_tokens, *args, **kwargs)

    return warmup_kernels


# (module, class or None for a module attribute, attribute, wrapper factory). All present
# in vLLM 0.32.0 and 0.33.0; a target a release lacks is skipped. ``warmup_kernels`` is
# wrapped where the GPU worker imported it by name and where it is defined (0.33's CPU
# worker imports it from there when it runs); the worker's name is bound first.
_RUNNER_HOOKS: tuple[tuple[str, str | None, str, Callable[[Any], Any]], ...] = (
    (
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager",
        "take_new_block_ids",
        _tagging_take_new_block_ids,
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "_init_kv_zero_meta",
        _v1_init_kv_zero_meta,
    ),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "_zero_block_ids", _cpu_zero_block_ids),
    (
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        "_init_kv_zero_meta",
        _v2_init_kv_zero_meta,
    ),
    (
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        "prepare_dummy_attn",
        _v2_prepare_dummy_attn,
    ),
    ("vllm.v1.worker.gpu.model_runner", None, "set_dummy_context", _v2_set_dummy_context),
    ("vllm.v1.worker.gpu_worker", None, "warmup_kernels", _v2_warmup_kernels),
    ("vllm.v1.worker.gpu.warmup", None, "warmup_kernels", _v2_warmup_kernels),
)
_runner_hooks = hooks.HookSet(
    _RUNNER_HOOKS,
    hooks.log_missing(
        logger,
        logging.WARNING,
        "; per-group pools are right with it only if this process never runs it",
    ),
)


def install_gpu_runner_hooks() -> None:
    """Wrap the runner functions listed in ``_RUNNER_HOOKS`` (idempotent). Only on the
    releases in :mod:`..versions`; a module that does not import (a build without it) or
    lacks the attribute is left alone."""
    _runner_hooks.install()


def uninstall_gpu_runner_hooks() -> None:
    _runner_hooks.uninstall()


def gpu_runner_hooks_installed() -> bool:
    return _runner_hooks.installed()


def install() -> None:
    """Replace the hook on vLLM's base platform class (idempotent; platforms that override
    the hook themselves keep theirs), and wrap the runner functions that assume one shared
    pool (:func:`install_gpu_runner_hooks`)."""
    setattr(Platform, _ATTR, classmethod(_align_without_padding))
    install_gpu_runner_hooks()


def uninstall() -> None:
    setattr(Platform, _ATTR, _stock_align)
    uninstall_gpu_runner_hooks()


def is_installed() -> bool:
    return Platform.__dict__[_ATTR] is not _stock_align
