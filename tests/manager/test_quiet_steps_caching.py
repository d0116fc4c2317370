"""Quiet decode steps with prefix caching on (`integration.quiet_step`, caching rules):
full attention that caches its blocks (and the prompt's partial entry where a block holds
several hash blocks) beside Mamba in 'align' mode, on vLLM's own layout (one shared pool,
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

import random
from typing import Any

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
from tests.helpers import (
    allocate_slots_installed,
    layout_manager,
    new_request,
    per_group_config,
    per_group_manager,
    stock_config,
)
from tests.manager.test_elastic_manager import elastic_config
from tests.manager.test_quiet_steps import Counted, ids


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
        config = elastic_config(specs, 4)
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


class CachingTwins:
    def __init__(self, specs: list[Any], layout: str) -> None:
        self.mgrs = [build(specs, layout, quiet=False), build(specs, layout, quiet=True)]
        self.counted = Counted(self.mgrs[1].coordinator._quiet_check)
        self.mgrs[1].coordinator._quiet_check = self.counted
        self.reqs: dict[str, list[Request]] = {}
        self.outputs: dict[str, int] = {}
        self.calls = 0
        self.preempted = 0
        self.hits = 0

    def allocate(
        self, rid: str, *args: Any, each: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> bool:
        got = []
        with allocate_slots_installed():
            for i, (m, r) in enumerate(zip(self.mgrs, self.reqs[rid], strict=True)):
                extra = each[i] if each else {}
                got.append(ids(m.allocate_slots(r, *args, **kwargs, **extra)))
        self.calls += 1
        assert got[0] == got[1], f"call {self.calls} for {rid} {args} {kwargs}: {got}"
        return got[0] is not None

    def lookup(self, rid: str) -> tuple[list[dict[str, Any]], int]:
        found = [
            m.get_computed_blocks(r)[:2] for m, r in zip(self.mgrs, self.reqs[rid], strict=True)
        ]
        (blocks_a, hit_a), (blocks_b, hit_b) = found
        assert hit_a == hit_b, (rid, hit_a, hit_b)
        assert blocks_a.get_block_ids() == blocks_b.get_block_ids(), rid
        self.hits += hit_a > 0
        return [
            {"num_new_computed_tokens": hit, "new_computed_blocks": blocks} for blocks, hit in found
        ], hit_a

    def each(self, rid: str, fn: Any) -> None:
        for r in self.reqs[rid]:
            fn(r)

    def free(self, rid: str) -> None:
        for m, r in zip(self.mgrs, self.reqs[rid], strict=True):
            m.free(r)

    def check(self) -> None:
        a, b = self.mgrs
        for rid, (ra, _) in self.reqs.items():
            if ra.status == RequestStatus.RUNNING:
                assert a.get_block_ids(rid) == b.get_block_ids(rid), rid
        assert a.block_pool.get_num_free_blocks() == b.block_pool.get_num_free_blocks()
        assert cache_state(a) == cache_state(b)
        assert manager_state(a) == manager_state(b)
        assert a.take_events() == b.take_events()


def drive(twins: CachingTwins, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 5000) for _ in range(rng.randint(40, 260))] for _ in range(3)]
    waiting: list[str] = []
    n = 0
    for _ in range(steps):
        scheduled = False
        for rid in [r for r, (req, _) in twins.reqs.items() if req.status == RequestStatus.RUNNING]:
            req = twins.reqs[rid][0]
            if req.num_computed_tokens < req.num_tokens - 1:
                chunk = min(rng.choice([16, 40, 128]), req.num_tokens - req.num_computed_tokens)
                ok = twins.allocate(rid, chunk, num_lookahead_tokens=0)
                advance, out = chunk, int(req.num_computed_tokens + chunk == req.num_tokens)
            else:
                drafts = rng.choice([0, 0, 0, 1, 2])
                in_flight = min(rng.choice([0, 0, 1]), req.num_computed_tokens)
                twins.each(rid, lambda r, k=in_flight: setattr(r, "num_in_flight_tokens", k))
                ok = twins.allocate(rid, 1 + drafts, num_lookahead_tokens=rng.choice([0, 0, 2]))
                twins.each(rid, lambda r: setattr(r, "num_in_flight_tokens", 0))
                accepted = rng.randint(0, drafts)
                advance, out = 1 + accepted, 1 + accepted
            if not ok:
                twins.preempted += 1
                twins.free(rid)
                twins.each(
                    rid,
                    lambda r: (
                        setattr(r, "status", RequestStatus.PREEMPTED),
                        setattr(r, "num_computed_tokens", 0),
                    ),
                )
                waiting.append(rid)
                continue
            scheduled = True

            sampled = [rng.randrange(1, 5000) for _ in range(out)]

            def step(r: Request, advance: int = advance, sampled: list[int] = sampled) -> None:
                r.num_computed_tokens += advance
                for token in sampled:
                    r.append_output_token_ids(token)

            twins.each(rid, step)
            twins.outputs[rid] += out
            if twins.outputs[rid] >= 120:
                twins.free(rid)
                twins.each(rid, lambda r: setattr(r, "status", RequestStatus.FINISHED_STOPPED))
        if rng.random() < 0.35:
            n += 1
            rid = f"s{seed}-r{n}"
            tokens = rng.choice(prompts) + [
                rng.randrange(1, 5000) for _ in range(rng.randint(0, 90))
            ]
            twins.reqs[rid] = [new_request(rid, tokens, 200), new_request(rid, tokens, 200)]
            twins.outputs[rid] = 0
            waiting.append(rid)
        if waiting and rng.random() < 0.6:
            rid = waiting[0]
            req = twins.reqs[rid][0]
            each, hit = twins.lookup(rid)
            total = req.num_tokens - 1 if req.num_output_tokens else req.num_tokens
            first = min(rng.choice([32, 64, 512]), max(total - hit, 1))
            if twins.allocate(
                rid, first, each=each, full_sequence_must_fit=True, has_scheduled_reqs=scheduled
            ):
                waiting.pop(0)

                def admitted(r: Request, first: int = first, hit: int = hit) -> None:
                    r.status = RequestStatus.RUNNING
                    r.num_computed_tokens = hit + first
                    if r.num_computed_tokens == r.num_tokens:
                        r.append_output_token_ids(7)

                twins.each(rid, admitted)
                if hit + first == req.num_tokens:
                    twins.outputs[rid] += 1
        twins.check()


@pytest.mark.parametrize("case", sorted(CASES))
def test_caching_quiet_steps_change_nothing(case: str) -> None:
    specs, layout = CASES[case]
    twins = CachingTwins(specs, layout)
    for seed in range(3):
        drive(twins, seed, 150)
    counted = twins.counted
    assert counted.quiet > 100 and counted.not_quiet > 50, (counted.quiet, counted.not_quiet)
    assert counted.grown == 0, "caching tables leave growth to vLLM"
    assert twins.hits > 5, twins.hits
    assert twins.preempted > 0
