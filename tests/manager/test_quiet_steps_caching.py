"""Quiet decode steps with prefix caching on (`integration.quiet_step`, caching rules):
full attention that caches its blocks (and the prompt's partial entry where a block holds
several hash blocks) beside Mamba in 'align' mode (a step that takes no block runs just
the phases of vLLM's call that have work: ``remove_skipped_blocks`` where the state of two
steps ago is freed or blocks retire, ``cache_blocks`` where a block fills), on vLLM's own
layout (one shared pool,
the layout the engine keeps where vLLM raises the block size: vLLM's coordinator with the
running requests' table) and on per-group pools (static and elastic).

Differential: two of vLLM's `KVCacheManager`, one with the table's steps off (vLLM's
whole ``allocate_slots`` on every call), one with them on, driven with the same
scheduler-like steps: admissions that look up the prefix cache (requests share prompts,
so they hit each other's blocks and partial entries), prefill chunks, decode steps with
drafts and lookahead slots, rejected drafts, async in-flight tokens, preemptions,
resumptions and finishes. After every step both must agree on every answer, every
request's block IDs, every pool's free blocks and prefix cache (keys and block IDs),
the KV-cache events, and what each manager keeps of each request (cached blocks, and in
'align' mode the retired blocks, the state of two steps ago, checkpoints)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
from tests.helpers import (
    layout_manager,
    per_group_config,
    per_group_manager,
    stock_config,
)
from tests.manager.quiet_driver import Traffic, TwinManagers, drive
from tests.manager.test_elastic_manager import elastic_config


def big_attn(block: int) -> Any:
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def big_align(block: int, speculative_blocks: int = 0) -> Any:
    return MambaSpec(
        block_size=block,
        shapes=((4, 64), (8, 16, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
        num_speculative_blocks=speculative_blocks,
    )


# (specs, layout): vLLM's shared pool ("shared"), or per-group pools ("static",
# "elastic"). Blocks of 64 tokens hold four hash blocks (partial entries, hash boundaries
# inside a state block); blocks of 16 are one hash block each.
CASES: dict[str, tuple[list[Any], str]] = {
    "shared-64": ([big_attn(64), big_align(64)], "shared"),
    "shared-64-spec": ([big_attn(64), big_align(64, speculative_blocks=2)], "shared"),
    "shared-16": ([big_attn(16), big_align(16)], "shared"),
    "static-64": ([big_attn(64), big_align(64)], "static"),
    "elastic-64": ([big_attn(64), big_align(64)], "elastic"),
    # Per-group pools at 16-token 'align' blocks (LFM2's layout): three decode steps in
    # every sixteen take, free or cache a block.
    "static-16": ([big_attn(16), big_align(16)], "static"),
    "elastic-16": ([big_attn(16), big_align(16)], "elastic"),
    "elastic-16-spec": ([big_attn(16), big_align(16, speculative_blocks=2)], "elastic"),
}


def shared_manager(config: Any) -> Any:
    """vLLM's manager over vLLM's layout with the plugin's pool and coordinator factory
    installed, as the engine runs it where it keeps vLLM's layout."""
    integration.install(per_group_pools=False)
    pg_coordinator.install()
    try:
        return layout_manager(config, events=True)
    finally:
        pg_coordinator.uninstall()
        integration.uninstall()


def build(specs: list[Any], layout: str, quiet: bool) -> Any:
    if layout == "shared":
        config = stock_config(specs, 48)
    elif layout == "static":
        config = per_group_config(specs, [36, 36])
    else:
        # Slabs of nine attention pages: four of 64-token pages hold 2,304 tokens; ten of
        # 16-token pages (1,440 tokens) preempt as often.
        config = elastic_config(specs, 4 if specs[0].block_size >= 64 else 10)
    previous = pg_coordinator.QUIET_STEPS
    pg_coordinator.QUIET_STEPS = quiet
    try:
        mgr = shared_manager(config) if layout == "shared" else per_group_manager(config, True)
    finally:
        pg_coordinator.QUIET_STEPS = previous
    coordinator = mgr.coordinator
    if layout == "shared":
        assert type(coordinator) is pg_coordinator.SharedPoolHybridKVCacheCoordinator
    assert (getattr(coordinator, "_quiet_check", None) is not None) == quiet
    return mgr


def cache_state(mgr: Any) -> list[Any]:
    pools = getattr(mgr.block_pool, "pools", None) or [mgr.block_pool]
    return [sorted(p.cache_entries()) for p in pools]


def manager_state(mgr: Any) -> list[Any]:
    """What each manager keeps per request (besides its blocks)."""
    state: list[Any] = []
    for m in mgr.coordinator.single_type_managers:
        kept: list[Any] = [sorted(m.num_cached_block.items())]
        if isinstance(m, MambaManager):
            kept += [
                sorted(m._num_retired_blocks.items()),
                sorted(m.last_state_block_idx.items()),
                sorted(m._checkpoints.items()),
                sorted(m._allocated_block_reqs),
                sorted(m._partial_hit_reqs),
            ]
        state.append(kept)
    return state


TRAFFIC = Traffic(drafts=(0, 0, 0, 1, 2), in_flight=(0, 0, 1), finish_at=120, shared_prompts=True)


class CachingTwins(TwinManagers):
    def __init__(self, specs: list[Any], layout: str) -> None:
        super().__init__(build(specs, layout, quiet=False), build(specs, layout, quiet=True))

    def check(self) -> None:
        a, b = self.mgrs
        for rid, (ra, _) in self.reqs.items():
            if ra.status == RequestStatus.RUNNING:
                assert a.get_block_ids(rid) == b.get_block_ids(rid), rid
        assert a.block_pool.get_num_free_blocks() == b.block_pool.get_num_free_blocks()
        assert cache_state(a) == cache_state(b)
        assert manager_state(a) == manager_state(b)
        assert a.take_events() == b.take_events()


@pytest.mark.parametrize("case", sorted(CASES))
def test_caching_quiet_steps_change_nothing(case: str) -> None:
    specs, layout = CASES[case]
    twins = CachingTwins(specs, layout)
    for seed in range(3):
        drive(twins, seed, 150, TRAFFIC)
    counted = twins.counted
    assert counted.quiet > 100 and counted.not_quiet > 50, (counted.quiet, counted.not_quiet)
    # Steps whose only change is blocks taken (full attention; Mamba 'align' moving its
    # state into a new block): per-group pools take them themselves
    # (`_grow_decode_step`); on vLLM's layout they run vLLM's whole call.
    assert counted.grown > 5, counted.grown
    # Steps that take no block run only the phases that have work: vLLM's
    # `remove_skipped_blocks` (the 'align' state of two steps ago freed, blocks retired)
    # and `cache_blocks` (a block filled), and change what vLLM's whole call would.
    assert counted.removed > 10 and counted.cached > 0, (counted.removed, counted.cached)
    assert twins.hits > 5, twins.hits
    assert twins.preempted > 0


@pytest.mark.parametrize("case", ["shared-64", "static-64", "elastic-64"])
def test_caching_quiet_steps_hear_of_evictions(case: str) -> None:
    """A connector evicts cached blocks while requests run (vLLM's ``evict_blocks``), the
    prompt partial entries of running requests among them: vLLM's next ``cache_blocks``
    for such a request registers its entry again, so the table must not answer that
    step quiet. Found by the per-group state machine (a partial entry evicted, then the
    request decoding: stock held it again, ours did not)."""
    specs, layout = CASES[case]
    twins = CachingTwins(specs, layout)
    traffic = dataclasses.replace(TRAFFIC, evict=0.1)
    for seed in range(3):
        drive(twins, seed, 150, traffic)
    assert twins.evicted > 20, twins.evicted
    assert twins.counted.quiet > 100, twins.counted.quiet
