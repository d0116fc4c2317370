"""Decode steps from the running-requests table (`integration.quiet_step`): a running
request's ``allocate_slots`` that would change nothing returns at once on per-group pools,
one that only takes full-attention pages allocates just those, and one that only frees a
window's blocks runs just vLLM's ``remove_skipped_blocks``. Differential: two of
vLLM's own `KVCacheManager` over per-group pools, one built with the table's steps off
(vLLM's whole ``allocate_slots`` on every call), one with them on, driven with the same
scheduler-like steps (admissions in chunks, decode steps with drafts and lookahead slots,
drafts rejected, async in-flight tokens, preemptions, resumptions, finishes). Every call
must answer the same (admitted or not, the same new block IDs), and after every step every
request holds the same block IDs, every pool the same free blocks, and the decode room's
totals are what walking the requests gives. Layouts: full attention + Mamba 'none', with
speculative Mamba blocks, with a sliding window (whose blocks leave the window while a
request decodes), and with two full-attention pools of different page sizes."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
from tests.helpers import (
    attn,
    per_group_config,
    per_group_manager,
    state_mamba,
    wide_attn,
)
from tests.manager.quiet_driver import Traffic, TwinManagers, drive
from tests.manager.test_elastic_manager import elastic_config

LAYOUTS: dict[str, list[Any]] = {
    "full+mamba_none": [attn(), state_mamba("none")],
    "full+mamba_none+spec": [attn(), state_mamba("none", speculative_blocks=2)],
    "full+swa+mamba_none": [attn(), attn(window=32), state_mamba("none")],
    # Two full-attention pools (pages of two sizes) that grow on the same decode steps:
    # elastic pools plan both on one budget.
    "full+wide+mamba_none": [attn(), wide_attn(), state_mamba("none")],
}


SLABS = {"full+wide+mamba_none": 5, "full+mamba_none": 16, "full+swa+mamba_none": 16}
"""Elastic budgets in slabs where not 24, so that every layout preempts: two full-attention
pools get about as many bytes as the others' (their slab, the least common multiple of
three page sizes, is eight times theirs); full attention (with or without a sliding window)
beside one Mamba state, fewer (with a slab that goes idle reused last, 24 slabs strand too
little for the sliding-window layout to preempt)."""

ROOM = 48
"""Elastic pools' decode room here (`PerGroupPoolsMixin._decode_room_asks`)."""


def build(specs: list[Any], elastic: bool, quiet: bool, slabs: int = 24) -> Any:
    if elastic:
        config = elastic_config(specs, slabs)
        config.decode_room_tokens = ROOM
    else:
        config = per_group_config(specs, [60] * len(specs))
    previous = pg_coordinator.QUIET_STEPS
    pg_coordinator.QUIET_STEPS = quiet
    try:
        mgr = per_group_manager(config)
    finally:
        pg_coordinator.QUIET_STEPS = previous
    assert (mgr.coordinator._quiet_check is not None) == quiet
    return mgr


TRAFFIC = Traffic(drafts=(0, 0, 1, 2), in_flight=(0, 0, 1, 3), finish_at=90, shared_prompts=False)


class Twins(TwinManagers):
    def __init__(self, specs: list[Any], elastic: bool, slabs: int = 24) -> None:
        super().__init__(
            build(specs, elastic, quiet=False, slabs=slabs),
            build(specs, elastic, quiet=True, slabs=slabs),
        )

    def check(self) -> None:
        a, b = self.mgrs
        for rid, (ra, _) in self.reqs.items():
            if ra.status == RequestStatus.RUNNING:
                assert a.get_block_ids(rid) == b.get_block_ids(rid), rid
        assert a.block_pool.free_counts() == b.block_pool.free_counts()
        for mgr in self.mgrs:
            coordinator = mgr.coordinator
            if not coordinator._decode_room_tokens:
                continue
            # The room counted request by request is what walking them all gives.
            walked = []
            for manager, size, pool in coordinator._room_groups:
                pages = sum(
                    max(0, -(-(self.lengths[rid] + ROOM) // size) - len(blocks))
                    for rid, blocks in manager.req_to_blocks.items()
                )
                if pages:
                    walked.append((pool, pages))
            assert coordinator._decode_room_asks("") == walked


@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "static"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_quiet_steps_change_nothing(layout: str, elastic: bool) -> None:
    twins = Twins(LAYOUTS[layout], elastic, SLABS.get(layout, 24))
    # Elastic pools take a growing step's pages in one call where every growing manager
    # is vLLM's base allocator (`_grows_in_place`): count the steps that did.
    coordinator = twins.mgrs[1].coordinator
    in_place = 0
    checked = coordinator._grows_in_place

    def counting(*args: Any) -> bool:
        nonlocal in_place
        answer: bool = checked(*args)
        in_place += answer
        return answer

    coordinator._grows_in_place = counting
    for seed in range(3):
        drive(twins, seed, 150, TRAFFIC)
    counted = twins.counted
    if elastic and "swa" not in layout:
        assert in_place > 20, in_place
    # Every path ran: quiet steps, steps that take or free a block (vLLM's path), and
    # decode steps that only take full attention blocks (`_grow_decode_step`; with a
    # sliding window of the same block size, the window's group grows on the same steps,
    # so those take vLLM's path) or only free a window's blocks (`_phases_step`).
    assert min(counted.quiet, counted.not_quiet) > 50, (counted.quiet, counted.not_quiet)
    if "swa" not in layout:
        assert counted.grown > 20, counted.grown
    else:
        # Steps where only the window moves run vLLM's `remove_skipped_blocks` alone.
        assert counted.removed > 20, counted.removed
    assert twins.preempted > 0


def test_quiet_steps_need_known_rules() -> None:
    """Managers whose rules the check does not model get no check: every call takes
    vLLM's path. (Caching full attention and Mamba 'align': test_quiet_steps_caching.py.)"""
    assert build([attn(), state_mamba("none")], True, quiet=True).coordinator._quiet_check
    from tests.helpers import PER_GROUP_LAYOUTS

    swa = per_group_manager(per_group_config(PER_GROUP_LAYOUTS["full+swa+mamba_align"], [40] * 3))
    assert swa.coordinator._quiet_check is None, "a caching sliding window is not modelled"


def test_quiet_step_blocks_answer_as_vllms_empty_blocks() -> None:
    """What a quiet step returns answers every question as vLLM's empty `KVCacheBlocks`."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from hybrid_alloc.integration.scheduler.quiet_step import quiet_step_blocks

    ours, theirs = quiet_step_blocks(3), KVCacheBlocks(((), (), ()))
    assert isinstance(ours, KVCacheBlocks) and ours.blocks == theirs.blocks
    for allow_none in (False, True):
        for group_ids in (None, [0], [2, 1], []):
            assert ours.get_block_ids(allow_none, group_ids=group_ids) == theirs.get_block_ids(
                allow_none, group_ids=group_ids
            ), (allow_none, group_ids)
    assert ours.get_block_ids(True) is None
    assert ours.get_unhashed_block_ids_all_groups() == theirs.get_unhashed_block_ids_all_groups()
    assert (ours + theirs).get_block_ids() == ([], [], [])
    with pytest.raises(IndexError):
        ours.get_block_ids(True, group_ids=[3])
