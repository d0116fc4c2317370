"""Which decode steps leave the KV-cache managers exactly as they are.

vLLM's scheduler calls ``KVCacheManager.allocate_slots(request, n, num_lookahead_tokens=k)``
for every running request on every step. With per-group pools' natural pages (16 tokens
where stock's shared pool has blocks of hundreds), most of those calls change nothing:
no group needs a page, no block leaves a window, nothing gets cached. vLLM still walks
its coordinator and every single-type manager to find that out (about 20 us a request on
a 4-group model, measured in ``benches/bench_manager.py``).

:class:`QuietStepCheck` answers "would this call change anything?" from the managers'
own state, with the same arithmetic vLLM's methods apply, for the manager kinds whose
rules it knows:

* full attention (``FullAttentionManager`` itself, not its subclasses): never frees
  while a request runs; needs a page when the slots outgrow its blocks;
* sliding window (``SlidingWindowManager``): also frees blocks that leave the window,
  which is a no-op while the last block before the window is already null;
* Mamba/GDN outside 'align' mode (one state block, plus the speculative ones): the same
  two rules with its own skipped-token count.

It is built only where no manager caches blocks (prefix caching off, the 'none' mode
hybrids run in), so ``cache_blocks`` is a no-op on every step. Any other manager kind
(Mamba 'align', chunked local, cross-attention, sinks, ...) makes the coordinator's check
``None``: every call takes vLLM's path. A quiet call returns what vLLM returns for it,
the empty ``KVCacheBlocks``, and nothing else happens in vLLM either; a call that is not
quiet runs vLLM's whole ``allocate_slots``.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)


class QuietStepCheck:
    """Per coordinator: the managers' rules for "this step changes nothing"."""

    def __init__(self, managers: list[tuple[Any, int, bool]]) -> None:
        # Per manager: (manager, slots added to the step's count: Mamba's speculative
        # blocks outside 'align' mode, whether blocks can leave its window).
        self._managers = managers

    @classmethod
    def for_managers(cls, managers: tuple[Any, ...]) -> QuietStepCheck | None:
        """The check for these managers, or None where some manager's rules are not
        modelled here (then every call takes vLLM's path)."""
        rules: list[tuple[Any, int, bool]] = []
        for manager in managers:
            if getattr(manager, "enable_caching", True):
                return None
            kind = type(manager)
            if kind is FullAttentionManager:
                rules.append((manager, 0, False))
            elif kind is SlidingWindowManager:
                rules.append((manager, 0, True))
            elif kind is MambaManager and getattr(manager, "mamba_cache_mode", None) != "align":
                spec_blocks = int(getattr(manager, "num_speculative_blocks", 0))
                rules.append((manager, manager.block_size * spec_blocks, True))
            else:
                return None
        return cls(rules) if rules else None

    def is_quiet(self, request_id: str, slots: int, processed_tokens: int) -> bool:
        """Whether ``allocate_slots`` for a running request, giving it ``slots`` token
        slots in all (vLLM's ``num_tokens_need_slot``) with ``processed_tokens`` safely
        computed, would allocate, free and cache nothing in any manager."""
        for manager, extra_slots, windowed in self._managers:
            blocks = manager.req_to_blocks.get(request_id)
            if blocks is None or request_id in manager._partial_hit_reqs:
                return False
            size = manager.block_size
            num_blocks = len(blocks)
            # `get_num_blocks_to_allocate` / `allocate_new_blocks`: blocks past those held.
            if -(-(slots + extra_slots) // size) > num_blocks:
                return False
            if windowed:
                # `remove_skipped_blocks`: frees backwards from the last skipped block
                # and stops at the first null one.
                skipped = manager.get_num_skipped_tokens(processed_tokens)
                if skipped > 0:
                    last = min(skipped // size, num_blocks)
                    if last and blocks[last - 1] != manager._null_block:
                        return False
        return True
