"""A hypothesis state machine over vLLM's KVCacheManager on hybrid group layouts, run on the
stock pool and on ours in lockstep.

Rules follow a scheduler's life: admit (with prefix hits and with block-aligned external
connector claims, loaded synchronously or asynchronously), decode, preempt, finish, an async
load that finishes later, a load that fails (the request is truncated in every group and
resumed, holding more blocks than it needs), eviction by block ID, prefix-cache reset.
After every step: both managers agree on everything observable, and our pool's invariants
hold (free + held + null == total, reference counts equal the number of holders, the cache
and the free queue are consistent).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from vllm.sampling_params import SamplingParams
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration.block_pool import BlockPool as RustPool
from tests.helpers import (
    BLOCK,
    HASHER,
    LAYOUTS,
    budget,
    build_manager,
    count_step,
    normalize_events,
    rust_snapshot,
    stock_snapshot,
)


@dataclass
class Tracked:
    """A request as the scheduler would track it, in both managers."""

    stock: Request
    ours: Request
    state: str  # "running" | "loading" (async external load in flight) | "preempted"
    remaining: int


def new_request(rid: str, tokens: list[int]) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        block_hasher=HASHER,
    )


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[str, Tracked] = {}
        self.next_id = 0
        self.token = 17

    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        num_blocks=st.integers(24, 80),
        events=st.booleans(),
    )
    def build(self, layout: str, num_blocks: int, events: bool) -> None:
        self.layout = layout
        integration.uninstall()
        self.stock = build_manager(StockPool, layout, num_blocks, events)
        integration.install(per_group_pools=False)
        self.ours = build_manager(RustPool, layout, num_blocks, events)
        self.prefixes = [[(p * 977 + i * 31) % 5000 + 3 for i in range(64)] for p in range(3)]

    def teardown(self) -> None:
        integration.uninstall()

    # ---------------------------------------------------------------- helpers
    def both(self, fn: str, rid: str, *args: Any, **kwargs: Any) -> Any:
        t = self.tracked[rid]
        integration.install(per_group_pools=False)
        got_o = getattr(self.ours, fn)(t.ours, *args, **kwargs)
        integration.uninstall()
        got_s = getattr(self.stock, fn)(t.stock, *args, **kwargs)
        if fn == "allocate_slots":
            assert (got_s is None) == (got_o is None)
            if got_s is not None:
                assert got_s.get_block_ids() == got_o.get_block_ids()
            return got_s is not None
        return None

    def on_both(self, rid: str, action: Any) -> None:
        t = self.tracked[rid]
        action(t.stock)
        action(t.ours)

    def pick(self, data: st.DataObject, state: str) -> str | None:
        rids = sorted(r for r, t in self.tracked.items() if t.state == state)
        return data.draw(st.sampled_from(rids)) if rids else None

    def grow(self, rid: str) -> None:
        self.token = (self.token * 31 + 7) % 5000 + 3
        tok = self.token

        def step(req: Request) -> None:
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(tok)
            req.status = RequestStatus.RUNNING

        self.on_both(rid, step)

    def lookup(self, rid: str) -> tuple[Any, Any, int]:
        t = self.tracked[rid]
        integration.install(per_group_pools=False)
        blocks_o, hit_o, _ = self.ours.get_computed_blocks(t.ours)
        integration.uninstall()
        blocks_s, hit_s, _ = self.stock.get_computed_blocks(t.stock)
        assert hit_s == hit_o
        assert blocks_s.get_block_ids() == blocks_o.get_block_ids()
        return blocks_s, blocks_o, hit_s

    def admit_tracked(self, rid: str, ext_blocks: int, load_async: bool) -> None:
        """Prefix lookup, then a connector claim of ``ext_blocks`` more aligned blocks."""
        t = self.tracked[rid]
        blocks_s, blocks_o, hit = self.lookup(rid)
        num_tokens = t.stock.num_tokens
        ext = max(0, min(ext_blocks * BLOCK, (num_tokens - 1 - hit) // BLOCK * BLOCK))
        new = num_tokens - hit - ext
        results = []
        for mgr, req, blocks, install in (
            (self.ours, t.ours, blocks_o, lambda: integration.install(per_group_pools=False)),
            (self.stock, t.stock, blocks_s, integration.uninstall),
        ):
            install()
            try:
                results.append(
                    mgr.allocate_slots(
                        req,
                        new,
                        num_new_computed_tokens=hit,
                        new_computed_blocks=blocks,
                        num_external_computed_tokens=ext,
                        delay_cache_blocks=load_async and ext > 0,
                    )
                )
            except ValueError as e:
                # vLLM 0.32's Mamba 'align' admission check can count fewer blocks than
                # it then allocates for an external claim (see
                # test_regressions.py::test_mamba_align_external_claim_overallocation):
                # both pools must refuse the same allocation cleanly.
                assert "Cannot get" in str(e)
                results.append(e)
        ok_o, ok_s = results
        if isinstance(ok_s, ValueError) or isinstance(ok_o, ValueError):
            assert isinstance(ok_s, ValueError) and isinstance(ok_o, ValueError)
            event("admission: vLLM over-allocation refused by both pools")
            self.both("free", rid)
            t.state = "dropped"
            return
        assert (ok_s is None) == (ok_o is None)
        event(f"admission: hit={hit > 0} external={ext > 0} ok={ok_s is not None}")
        if ok_s is None:
            return
        assert ok_s.get_block_ids() == ok_o.get_block_ids()
        if load_async and ext > 0:
            # The scheduler records what the load will provide and parks the request.
            def park(req: Request) -> None:
                req.num_computed_tokens = hit + ext
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS

            self.on_both(rid, park)
            t.state = "loading"
            t.ext_start = hit  # type: ignore[attr-defined]
        else:
            self.grow(rid)
            t.state = "running"

    # ------------------------------------------------------------------ rules
    @rule(
        prefix=st.integers(0, 2),
        prefix_len=st.sampled_from([16, 32, 48, 64]),
        suffix=st.integers(0, 40),
        ext_blocks=st.integers(0, 3),
        load_async=st.booleans(),
        decode=st.integers(1, 40),
    )
    def admit(
        self,
        prefix: int,
        prefix_len: int,
        suffix: int,
        ext_blocks: int,
        load_async: bool,
        decode: int,
    ) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = self.prefixes[prefix][:prefix_len] + [
            (self.next_id * 13 + i) % 5000 + 3 for i in range(suffix)
        ]
        self.tracked[rid] = Tracked(new_request(rid, tokens), new_request(rid, tokens), "", decode)
        self.admit_tracked(rid, ext_blocks, load_async)
        if self.tracked[rid].state in ("", "dropped"):
            del self.tracked[rid]  # not admitted: the scheduler keeps it waiting

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is None:
            return
        if not self.both("allocate_slots", rid, 1):
            event("decode: preempted (pool full)")
            self.preempt_request(rid)
            return
        self.grow(rid)
        t = self.tracked[rid]
        t.remaining -= 1
        if t.remaining <= 0:
            self.both("free", rid)
            del self.tracked[rid]

    def preempt_request(self, rid: str) -> None:
        self.both("free", rid)

        def reset(req: Request) -> None:
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0

        self.on_both(rid, reset)
        self.tracked[rid].state = "preempted"

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is not None:
            self.preempt_request(rid)

    @rule(data=st.data(), ext_blocks=st.integers(0, 2))
    def resume(self, data: st.DataObject, ext_blocks: int) -> None:
        rid = self.pick(data, "preempted")
        if rid is not None:
            self.admit_tracked(rid, ext_blocks, load_async=False)
            if self.tracked[rid].state == "dropped":
                del self.tracked[rid]

    @rule(data=st.data())
    def load_finishes(self, data: st.DataObject) -> None:
        """An async external load completes: cache what it brought, then schedule the rest."""
        rid = self.pick(data, "loading")
        if rid is None:
            return
        t = self.tracked[rid]
        self.both("cache_blocks", rid, t.stock.num_computed_tokens)
        self.continue_after_load(rid)

    @rule(data=st.data(), keep_blocks=st.integers(0, 3))
    def load_fails(self, data: st.DataObject, keep_blocks: int) -> None:
        """An async load fails part-way. Block IDs are pool-scoped, so with several groups
        vLLM recomputes from scratch; with one group it keeps the valid prefix. Either way
        every group's block list is truncated consistently and the request resumes while
        holding more blocks than it needs: the allocation must add nothing and not assert."""
        rid = self.pick(data, "loading")
        if rid is None:
            return
        t = self.tracked[rid]
        start = t.ext_start  # type: ignore[attr-defined]
        claimed = t.stock.num_computed_tokens
        single_group = len(LAYOUTS[self.layout]) == 1
        valid = min(claimed, start + keep_blocks * BLOCK) if single_group else 0

        def truncate(req: Request) -> None:
            req.num_computed_tokens = valid

        self.on_both(rid, truncate)
        event(f"load failed: kept valid prefix={valid > 0}")
        if valid:
            self.both("cache_blocks", rid, valid)
            self.continue_after_load(rid)
        else:
            self.both("free", rid)
            self.tracked[rid].state = "preempted"

    def continue_after_load(self, rid: str) -> None:
        t = self.tracked[rid]
        held_before = self.ours.get_block_ids(rid)

        def wake(req: Request) -> None:
            req.status = RequestStatus.WAITING

        self.on_both(rid, wake)
        remaining = t.stock.num_tokens - t.stock.num_computed_tokens
        event("load finished: request resumes")
        if not self.both("allocate_slots", rid, remaining):
            self.preempt_request(rid)
            return
        if remaining <= BLOCK:
            # The request held blocks for all of its tokens already: nothing new.
            assert all(
                len(after) <= max(len(before), -(-t.stock.num_tokens // BLOCK))
                for before, after in zip(held_before, self.ours.get_block_ids(rid), strict=True)
            )
        self.grow(rid)
        t.state = "running"

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is not None:
            self.both("free", rid)
            del self.tracked[rid]

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        n = self.stock.block_pool.num_gpu_blocks
        ids = data.draw(st.sets(st.integers(0, n - 1), max_size=3))
        self.stock.evict_blocks(ids)
        self.ours.evict_blocks(ids)

    @precondition(lambda self: not self.tracked)
    @rule()
    def reset(self) -> None:
        assert self.stock.reset_prefix_cache() == self.ours.reset_prefix_cache()

    @rule()
    def new_step(self) -> None:
        self.stock.new_step_starts()
        self.ours.new_step_starts()

    # ------------------------------------------------------------- invariants
    @invariant()
    def agree_and_hold(self) -> None:
        if not hasattr(self, "ours"):
            return
        count_step("manager")
        pool = self.ours.block_pool
        pool.check_invariants()
        snap = rust_snapshot(pool)
        assert snap == stock_snapshot(self.stock.block_pool)
        assert normalize_events(self.ours.take_events()) == normalize_events(
            self.stock.take_events()
        )
        for rid in self.tracked:
            assert self.ours.get_block_ids(rid) == self.stock.get_block_ids(rid)
        # Reference counts equal the number of holders (block lists of every group).
        holders: Counter[int] = Counter()
        for manager in self.ours.coordinator.single_type_managers:
            for blocks in manager.req_to_blocks.values():
                holders.update(b.block_id for b in blocks if not b.is_null)
        counts = pool.ref_counts()
        assert {i: c for i, c in enumerate(counts) if c} == dict(holders)


ManagerMachine.TestCase.settings = settings(max_examples=budget(200), stateful_step_count=50)
test_manager_machine = ManagerMachine.TestCase
