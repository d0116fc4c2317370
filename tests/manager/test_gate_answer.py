"""Elastic pools answer vLLM's admission gate and the step's own count with one plan where
the two questions are the same (`PerGroupPoolsMixin._gate_answer`): a waiting request's
prompt taken whole. Two managers, one reusing the gate's plan and one planning twice, are
driven through the same admissions (whole prompts and chunks, refusals included), decode
steps and frees, and every answer, block table and pool must agree; the reuse must also
happen, must not outlive a change to the pools, and must stay off where a manager counts
differently with the cap (sliding windows) or records as it counts (Mamba 'align').
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.v1.request import Request, RequestStatus

from tests.helpers import allocate_slots_installed, new_request, per_group_manager
from tests.manager.test_elastic_manager import elastic_config


class CountingPlans:
    """Counts the elastic plans a pool set runs (each reservation runs its own)."""

    def __init__(self, mgr: Any) -> None:
        self.calls = 0
        pool_set = mgr.coordinator.pool_set
        plan = pool_set.plan

        def counted(*args: Any) -> Any:
            self.calls += 1
            return plan(*args)

        pool_set.plan = counted


def _manager(layout: str, num_slabs: int, reuse: bool) -> Any:
    mgr = per_group_manager(elastic_config(layout, num_slabs))
    if not reuse:
        mgr.coordinator._gate_reusable = False
    return mgr


@pytest.mark.parametrize(
    ("layout", "reusable"),
    [("full+mamba_none", True), ("full+mamba_align", False), ("full+swa+mamba_align", False)],
)
def test_reuse_only_where_the_counts_cannot_differ(layout: str, reusable: bool) -> None:
    assert _manager(layout, 8, reuse=True).coordinator._gate_reusable is reusable


def _state(mgr: Any) -> tuple[Any, ...]:
    coordinator = mgr.coordinator
    pool_set = coordinator.pool_set
    tables = tuple(
        {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
        for m in coordinator.single_type_managers
    )
    e = pool_set.elastic
    owned = tuple(e.num_owned(i) for i in range(len(pool_set)))
    return tables, pool_set.free_counts(), owned, e.num_unowned


def test_reused_gate_plans_decide_as_planning_twice() -> None:
    """Same random traffic on both managers, chunked and whole prompts, with
    ``full_sequence_must_fit`` as vLLM's scheduler passes it; every answer compared."""
    rng = random.Random(7)
    twice = _manager("full+mamba_none", 6, reuse=False)
    once = _manager("full+mamba_none", 6, reuse=True)
    plans = CountingPlans(once), CountingPlans(twice)
    running: dict[str, tuple[Request, Request]] = {}
    waiting: list[tuple[Request, Request]] = []
    admitted = refused = 0
    with allocate_slots_installed():
        for step in range(400):
            if rng.random() < 0.45 or not running:
                rid = f"r{step}"
                length = rng.randint(5, 400)
                tokens = [rng.randrange(5000) for _ in range(length)]
                waiting.append((new_request(rid, tokens, 8), new_request(rid, tokens, 8)))
            if waiting:
                pair = waiting[0]
                left = pair[0].num_tokens - pair[0].num_computed_tokens
                chunk = left if rng.random() < 0.6 else rng.randint(1, left)
                answers = [
                    mgr.allocate_slots(req, chunk, full_sequence_must_fit=True)
                    for mgr, req in zip((twice, once), pair, strict=True)
                ]
                assert (answers[0] is None) == (answers[1] is None)
                if answers[0] is None:
                    refused += 1
                else:
                    admitted += 1
                    assert answers[0].get_block_ids() == answers[1].get_block_ids()
                    waiting.pop(0)
                    for req in pair:
                        req.num_computed_tokens += chunk
                        req.status = RequestStatus.RUNNING
                    if pair[0].num_computed_tokens < pair[0].num_tokens:
                        for req in pair:  # the rest of its prompt comes as a new ask
                            req.status = RequestStatus.WAITING
                        waiting.insert(0, pair)
                    else:
                        for req in pair:
                            req.append_output_token_ids(1)
                        running[pair[0].request_id] = pair
            for rid in list(running):
                pair = running[rid]
                answers = [
                    mgr.allocate_slots(req, 1) for mgr, req in zip((twice, once), pair, strict=True)
                ]
                assert (answers[0] is None) == (answers[1] is None)
                if answers[0] is None or rng.random() < 0.15:
                    for mgr, req in zip((twice, once), pair, strict=True):
                        mgr.free(req)
                    del running[rid]
                    continue
                for req in pair:
                    req.num_computed_tokens += 1
                    req.append_output_token_ids(2)
            assert _state(once) == _state(twice)
            once.coordinator.pool_set.check_invariants()
    assert admitted > 50 and refused > 5, (admitted, refused)
    # Whole prompts asked the same question twice: those plans ran once.
    assert plans[0].calls < plans[1].calls


def _gate_then_step(
    mgr: Any, req: Request, between: Any = None, step_tokens: int = 0, other_hits: bool = False
) -> int:
    """The two counts vLLM's `allocate_slots` asks for a prompt, the step's for its first
    ``step_tokens`` (0: the whole prompt; ``other_hits``: with another hits tuple),
    with ``between`` run in between (where vLLM
    runs `remove_skipped_blocks`), inside the coordinator's `allocate_slots` bracket;
    the step's answer."""
    coordinator = mgr.coordinator
    n = req.num_tokens
    ask = dict(
        request_id=req.request_id,
        num_tokens=n,
        new_computed_blocks=mgr.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0,
        total_computed_tokens=0,
        num_local_computed_tokens=0,
        num_tokens_main_model=n,
        prefill_end=n,
    )
    coordinator._allocating = req.request_id
    try:
        coordinator.get_num_blocks_to_allocate(**ask, apply_admission_cap=True)
        if between is not None:
            between()
        if step_tokens:
            ask.update(num_tokens=step_tokens, num_tokens_main_model=step_tokens)
        if other_hits:  # equal, but not the object the gate was asked with
            ask.update(new_computed_blocks=tuple(() for _ in ask["new_computed_blocks"]))
        return int(coordinator.get_num_blocks_to_allocate(**ask, apply_admission_cap=False))
    finally:
        coordinator._allocating = None
        coordinator._end_step()


def test_a_change_to_the_pools_between_the_asks_plans_again() -> None:
    """The step reuses the gate's plan only for the same question on the same pools."""
    with allocate_slots_installed():
        mgr = _manager("full+mamba_none", 6, reuse=True)
        plans = CountingPlans(mgr)
        other = new_request("other", list(range(100)), 4)
        assert mgr.allocate_slots(other, 100, full_sequence_must_fit=True) is not None
        req = new_request("asked", list(range(120)), 4)

        before = plans.calls
        _gate_then_step(mgr, req)
        assert plans.calls - before == 1, "the step did not reuse the gate's plan"

        before = plans.calls
        _gate_then_step(mgr, req, step_tokens=40)
        assert plans.calls - before == 2, "a chunk's step reused the whole prompt's plan"

        before = plans.calls
        _gate_then_step(mgr, req, other_hits=True)
        assert plans.calls - before == 2, "a step with other hits reused the gate's plan"

        before = plans.calls
        answer = _gate_then_step(mgr, req, between=lambda: mgr.free(other))
        assert plans.calls - before == 2, "a plan was reused after blocks were freed"
        # And the answer is the one the pools give now.
        assert answer == _gate_then_step(_manager("full+mamba_none", 6, reuse=False), req)
