"""Decode steps from the running-requests table (`integration.quiet_step`): a running
request's ``allocate_slots`` that would change nothing returns at once on per-group pools,
and one that only takes full-attention pages allocates just those. Differential: two of
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

import random
from typing import Any

import pytest
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc._native import NativeRunningRequests
from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
from tests.helpers import (
    allocate_slots_installed,
    attn,
    new_request,
    per_group_config,
    per_group_manager,
    state_mamba,
    wide_attn,
)
from tests.manager.test_elastic_manager import elastic_config

LAYOUTS: dict[str, list[Any]] = {
    "full+mamba_none": [attn(), state_mamba("none")],
    "full+mamba_none+spec": [attn(), state_mamba("none", speculative_blocks=2)],
    "full+swa+mamba_none": [attn(), attn(window=32), state_mamba("none")],
    # Two full-attention pools (pages of two sizes) that grow on the same decode steps:
    # elastic pools plan both on one budget.
    "full+wide+mamba_none": [attn(), wide_attn(), state_mamba("none")],
}


SLABS = {"full+wide+mamba_none": 5, "full+mamba_none": 16}
"""Elastic budgets in slabs where not 24, so that every layout preempts: two full-attention
pools get about as many bytes as the others' (their slab, the least common multiple of
three page sizes, is eight times theirs); full attention beside one Mamba state, fewer."""

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


class Counted:
    """The coordinator's check, counting its answers."""

    def __init__(self, check: NativeRunningRequests) -> None:
        self.check = check
        self.quiet = 0
        self.grown = 0
        self.not_quiet = 0

    def decode_step(self, request_id: str, *counts: int) -> tuple[int, ...] | None:
        answer = self.check.decode_step(request_id, *counts)
        if answer == ():
            self.quiet += 1
        else:
            self.not_quiet += 1
            self.grown += answer is not None
        return answer


def ids(result: Any) -> Any:
    """None if refused, else the new block IDs (None where there are none)."""
    return None if result is None else ("allocated", result.get_block_ids(allow_none=True))


class Twins:
    """The same requests on both managers, each call made on both and compared."""

    def __init__(self, specs: list[Any], elastic: bool, slabs: int = 24) -> None:
        self.mgrs = [
            build(specs, elastic, quiet=False, slabs=slabs),
            build(specs, elastic, quiet=True, slabs=slabs),
        ]
        self.counted = Counted(self.mgrs[1].coordinator._quiet_check)
        self.mgrs[1].coordinator._quiet_check = self.counted
        self.reqs: dict[str, list[Request]] = {}
        self.outputs: dict[str, int] = {}
        self.calls = 0
        self.preempted = 0
        self.lengths: dict[str, int] = {}

    def allocate(self, rid: str, *args: Any, **kwargs: Any) -> bool:
        req = self.reqs[rid][0]
        self.lengths[rid] = max(
            req.num_prompt_tokens, req.num_tokens - 1, req.num_computed_tokens + args[0]
        )
        with allocate_slots_installed():
            got = [
                ids(m.allocate_slots(r, *args, **kwargs))
                for m, r in zip(self.mgrs, self.reqs[rid], strict=True)
            ]
        self.calls += 1
        assert got[0] == got[1], f"call {self.calls} for {rid} {args} {kwargs}: {got}"
        return got[0] is not None

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


def drive(twins: Twins, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    waiting: list[str] = []
    n = 0
    for _ in range(steps):
        scheduled = False
        for rid in [r for r, (req, _) in twins.reqs.items() if req.status == RequestStatus.RUNNING]:
            req = twins.reqs[rid][0]
            if req.num_computed_tokens < req.num_tokens - 1:
                # A prefill chunk of a running request: the scheduler's call shape.
                chunk = min(rng.choice([16, 40, 128]), req.num_tokens - req.num_computed_tokens)
                ok = twins.allocate(rid, chunk, num_lookahead_tokens=0)
                # The chunk that ends the prompt samples a token.
                advance, out = chunk, int(req.num_computed_tokens + chunk == req.num_tokens)
            else:
                drafts = rng.choice([0, 0, 1, 2])
                # Async scheduling: tokens of the last step not yet processed (kept out of
                # what `remove_skipped_blocks` may free).
                in_flight = min(rng.choice([0, 0, 1, 3]), req.num_computed_tokens)
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

            def step(r: Request, advance: int = advance, out: int = out) -> None:
                r.num_computed_tokens += advance
                for _ in range(out):
                    r.append_output_token_ids(7)

            twins.each(rid, step)
            twins.outputs[rid] += out
            if twins.outputs[rid] >= 90:
                twins.free(rid)
                twins.each(rid, lambda r: setattr(r, "status", RequestStatus.FINISHED_STOPPED))
        if rng.random() < 0.35:
            n += 1
            rid = f"s{seed}-r{n}"
            tokens = [rng.randrange(1, 5000) for _ in range(rng.randint(8, 300))]
            twins.reqs[rid] = [new_request(rid, tokens, 200), new_request(rid, tokens, 200)]
            twins.outputs[rid] = 0
            waiting.append(rid)
        if waiting and rng.random() < 0.6:
            rid = waiting[0]
            req = twins.reqs[rid][0]
            # The first chunk of an admission (or a resumption, which recomputes).
            first = min(
                rng.choice([32, 64, 512]),
                req.num_tokens - 1 if req.num_output_tokens else req.num_tokens,
            )
            if twins.allocate(
                rid, first, full_sequence_must_fit=True, has_scheduled_reqs=scheduled
            ):
                waiting.pop(0)

                def admitted(r: Request, first: int = first) -> None:
                    r.status = RequestStatus.RUNNING
                    r.num_computed_tokens = first
                    if first == r.num_tokens:
                        r.append_output_token_ids(7)

                twins.each(rid, admitted)
                if first == req.num_tokens:
                    twins.outputs[rid] += 1
        twins.check()


@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "static"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_quiet_steps_change_nothing(layout: str, elastic: bool) -> None:
    twins = Twins(LAYOUTS[layout], elastic, SLABS.get(layout, 24))
    for seed in range(3):
        drive(twins, seed, 150)
    counted = twins.counted
    # Every path ran: quiet steps, steps that take or free a block (vLLM's path), and
    # decode steps that only take full attention blocks (`_grow_decode_step`; with a
    # sliding window of the same block size, the window's group grows on the same steps,
    # so those take vLLM's path).
    assert min(counted.quiet, counted.not_quiet) > 50, (counted.quiet, counted.not_quiet)
    if "swa" not in layout:
        assert counted.grown > 20, counted.grown
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
