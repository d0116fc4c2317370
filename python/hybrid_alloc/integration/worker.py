"""Worker side of per-group pools: layers keep their natural page size.

Each worker reports its layers' KV-cache specs to the engine core. Before that, vLLM's
platform hook ``Platform._align_hybrid_block_size`` (in ``vllm.platforms.interface``,
called from ``update_block_size_for_backend`` in the worker process) raises the
attention block size until one attention page covers a Mamba page and pads Mamba pages
to it ("Padding mamba page size by X%"). With one pool per group no page has to match
another group's, so the hook here skips both and keeps only what 'align' mode needs
(Mamba blocks as long as attention blocks, the prefix-cache granularity). Engines whose
configuration per-group pools do not serve (``sizing.config_unsupported_reason``) keep
vLLM's hook: their engine core sizes vLLM's shared pool, which needs the padding.

The rest of the worker needs no change: vLLM's ``allocate_kv_cache`` views every tensor
with ``kv_cache_config.num_blocks_of(tensor)`` (answered per group by
:class:`~hybrid_alloc.integration.kv_cache_config.PerGroupKVCacheConfig`), Mamba layers take their
state count from their view, and each group's block table indexes its own layers.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.platforms.interface import Platform

# vLLM's logger factory, as the plugin uses: the lines print with vLLM's own.
logger = init_logger("vllm.hybrid_alloc")

_ATTR = "_align_hybrid_block_size"
_stock_align: Any = Platform.__dict__[_ATTR]


def _align_without_padding(cls: Any, vllm_config: Any, backend_cls: Any) -> None:
    from hybrid_alloc.integration.engine_sizing import config_unsupported_reason

    if config_unsupported_reason(vllm_config) is not None:
        # The engine core will size one shared pool (vLLM's); it needs vLLM's padding.
        _stock_align.__func__(cls, vllm_config, backend_cls)
        return
    cache_config = vllm_config.cache_config
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


def install() -> None:
    """Replace the hook on vLLM's base platform class (idempotent). Platforms that
    override the hook themselves keep theirs."""
    setattr(Platform, _ATTR, classmethod(_align_without_padding))


def uninstall() -> None:
    setattr(Platform, _ATTR, _stock_align)


def is_installed() -> bool:
    return Platform.__dict__[_ATTR] is not _stock_align
