"""A hypothesis state machine over vLLM's KVCacheManager on hybrid group layouts, run on the
stock pool and on ours in lockstep.

Layouts: helpers.LAYOUTS (full attention alone, with sliding window, with Mamba 'align',
both; two full-attention groups of one spec, looked up together; full attention with
32-token blocks over 16-token hashes next to a 16-token full-attention group). Every
example starts with requests admitted. Rules follow a scheduler's life: admit (with prefix
hits and with block-aligned external connector claims, loaded synchronously or
asynchronously), decode, preempt, finish, an async load that finishes later, a load that
fails (the request is truncated in every group and resumed, holding blocks for all of its
tokens: the allocation adds no block to an attention group), eviction by block ID,
prefix-cache reset (refused by both while blocks are in use), new steps.
After every step: both managers agree on everything observable (pool snapshots, block IDs
of every request, KV events, the metrics collector's callbacks), and both pools' invariants
hold (free + held + null == total, reference counts equal the number of holders across
every group's block lists, the cache and the free queue consistent both ways).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import initialize, invariant, precondition, rule
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration.scheduler import manager_patches
from hybrid_alloc.integration.scheduler.block_pool import BlockPool as RustPool
from tests.helpers import (
    LAYOUTS,
    CountingMachine,
    RecordingCollector,
    assert_block_ids_as_vllm,
    budget,
    build_manager,
    check_our_pool,
    check_stock_pool,
    new_request,
    normalize_events,
    rust_snapshot,
    scheduler_block_size,
    stepping,
    stock_snapshot,
)

# (prefix, prefix length, suffix length, external blocks claimed, load asynchronously,
#  decode steps)
ADMISSION = st.tuples(
    st.integers(0, 2),
    st.sampled_from([16, 32, 48, 64]),
    st.integers(0, 40),
    st.integers(0, 3),
    st.booleans(),
    st.integers(1, 40),
)


@dataclass
class Tracked:
    """A request as the scheduler would track it, in both managers."""

    stock: Request
    ours: Request
    state: str  # "running" | "loading" (async external load in flight) | "preempted"
    remaining: int


def has(state: str) -> Any:
    """Precondition: some request is in ``state`` (rules run only where they apply)."""
    return lambda self: any(t.state == state for t in self.tracked.values())


class ManagerMachine(CountingMachine):
    MACHINE = "manager"

    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[str, Tracked] = {}
        self.next_id = 0
        self.token = 17

    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        num_blocks=st.integers(24, 80),
        events=st.booleans(),
        collect=st.booleans(),
        first=st.lists(ADMISSION, min_size=1, max_size=3),
    )
    def build(
        self, layout: str, num_blocks: int, events: bool, collect: bool, first: list[Any]
    ) -> None:
        """Both managers, then a few requests admitted (every example starts with state)."""
        self.layout = layout
        # External claims and hits are aligned to vLLM's scheduling granularity.
        self.align = scheduler_block_size(LAYOUTS[layout])
        self.collectors = (RecordingCollector(), RecordingCollector()) if collect else None
        integration.uninstall()
        self.stock = build_manager(
            StockPool, layout, num_blocks, events, collector=self.collectors and self.collectors[0]
        )
        integration.install(per_group_pools=False)
        self.ours = build_manager(
            RustPool, layout, num_blocks, events, collector=self.collectors and self.collectors[1]
        )
        integration.uninstall()
        self.prefixes = [[(p * 977 + i * 31) % 5000 + 3 for i in range(64)] for p in range(3)]
        for params in first:
            self.admit_new(*params)

    def teardown(self) -> None:
        integration.uninstall()

    # ---------------------------------------------------------------- helpers
    def both(self, fn: str, rid: str, *args: Any, **kwargs: Any) -> Any:
        """``fn(request, ...)`` on both managers (ours with the integration installed);
        for ``allocate_slots`` both must allocate the same block IDs or both refuse, and
        our result is returned."""
        t = self.tracked[rid]
        integration.install(per_group_pools=False)
        try:
            got_o = getattr(self.ours, fn)(t.ours, *args, **kwargs)
        finally:
            integration.uninstall()
        got_s = getattr(self.stock, fn)(t.stock, *args, **kwargs)
        if fn == "allocate_slots":
            assert (got_s is None) == (got_o is None)
            if got_s is not None:
                assert got_s.get_block_ids() == got_o.get_block_ids()
        return got_o

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
        align = self.align
        ext = max(0, min(ext_blocks * align, (num_tokens - 1 - hit) // align * align))
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

    def admit_new(
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

    # ------------------------------------------------------------------ rules
    @rule(params=ADMISSION)
    @stepping
    def admit(self, params: Any) -> None:
        self.admit_new(*params)

    @precondition(has("running"))
    @rule(data=st.data())
    @stepping
    def decode(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is None:
            return
        if self.both("allocate_slots", rid, 1) is None:
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

    @precondition(has("running"))
    @rule(data=st.data())
    @stepping
    def preempt(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is not None:
            # Blocks are in use: a prefix-cache reset is refused by both, changing nothing.
            assert not self.stock.reset_prefix_cache()
            assert not self.ours.reset_prefix_cache()
            self.preempt_request(rid)

    @precondition(has("preempted"))
    @rule(data=st.data(), ext_blocks=st.integers(0, 2))
    @stepping
    def resume(self, data: st.DataObject, ext_blocks: int) -> None:
        rid = self.pick(data, "preempted")
        if rid is not None:
            self.admit_tracked(rid, ext_blocks, load_async=False)
            if self.tracked[rid].state == "dropped":
                del self.tracked[rid]

    @precondition(has("loading"))
    @rule(data=st.data())
    @stepping
    def load_finishes(self, data: st.DataObject) -> None:
        """An async external load completes: cache what it brought, then schedule the rest."""
        rid = self.pick(data, "loading")
        if rid is None:
            return
        t = self.tracked[rid]
        self.both("cache_blocks", rid, t.stock.num_computed_tokens)
        self.continue_after_load(rid)

    @precondition(has("loading"))
    @rule(data=st.data(), keep_blocks=st.integers(0, 3))
    @stepping
    def load_fails(self, data: st.DataObject, keep_blocks: int) -> None:
        """An async load fails part-way. Block IDs are pool-scoped, so with several groups
        vLLM recomputes from scratch; with one group it keeps the valid prefix. Either way
        every group's block list is truncated consistently and the request resumes while
        holding blocks for all of its tokens: the allocation adds no block to any attention
        group (see continue_after_load) and does not assert."""
        rid = self.pick(data, "loading")
        if rid is None:
            return
        t = self.tracked[rid]
        start = t.ext_start  # type: ignore[attr-defined]
        claimed = t.stock.num_computed_tokens
        single_group = len(LAYOUTS[self.layout]) == 1
        valid = min(claimed, start + keep_blocks * self.align) if single_group else 0

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
        new = self.both("allocate_slots", rid, remaining)
        if new is None:
            self.preempt_request(rid)
            return
        # The request was given slots for all of its tokens when it was admitted, and no
        # token was added while it loaded: attention groups get no new block and keep
        # their blocks where they were (a sliding window may only have dropped some to
        # the null block). Mamba groups may take a state block (as on the stock pool).
        held_after = self.ours.get_block_ids(rid)
        for gid, spec in enumerate(LAYOUTS[self.layout]):
            if not isinstance(spec, AttentionSpec):
                continue
            assert new.get_block_ids()[gid] == [], (gid, new.get_block_ids())
            before, after = held_before[gid], held_after[gid]
            assert len(after) == len(before)
            assert all(a in (b, 0) for a, b in zip(after, before, strict=True)), (before, after)
        self.grow(rid)
        t.state = "running"

    @precondition(has("running"))
    @rule(data=st.data())
    @stepping
    def finish(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is not None:
            self.both("free", rid)
            del self.tracked[rid]

    @precondition(lambda self: self.ours.block_pool.cache_entries())
    @rule(data=st.data())
    @stepping
    def evict(self, data: st.DataObject) -> None:
        """A connector evicts by block ID: at least one cached block, and any other IDs
        (held, free, the null block)."""
        n = self.stock.block_pool.num_gpu_blocks
        cached = sorted({i for _, ids in self.ours.block_pool.cache_entries() for i in ids})
        ids = {data.draw(st.sampled_from(cached))}
        ids |= data.draw(st.sets(st.integers(0, n - 1), max_size=2))
        self.stock.evict_blocks(ids)
        self.ours.evict_blocks(ids)

    @precondition(
        lambda self: (
            not (has("running")(self) or has("loading")(self))
            and self.ours.block_pool.cache_entries()
        )
    )
    @rule()
    @stepping
    def reset(self) -> None:
        """No request holds a block: both reset (a reset while blocks are in use is
        refused by both: see ``preempt``)."""
        assert not self.held_by_requests()
        assert self.stock.reset_prefix_cache()
        assert self.ours.reset_prefix_cache()

    @precondition(
        lambda self: any(
            getattr(m, "cached_blocks_this_step", None)
            for m in self.ours.coordinator.single_type_managers
        )
    )
    @rule()
    @stepping
    def new_step(self) -> None:
        """A scheduler step starts: Mamba states cached in the last step become usable."""
        self.stock.new_step_starts()
        self.ours.new_step_starts()

    # ------------------------------------------------------------- invariants
    @invariant()
    def agree_and_hold(self) -> None:
        if not hasattr(self, "ours"):
            return
        pool = self.ours.block_pool
        # Our pool: its own invariants, and free + held + null == total, reference
        # counts == holders across every group's block lists, handles from this pool,
        # free queue and cache consistent both ways; vLLM's pool: the same through its
        # internals.
        check_our_pool(pool, self.ours.coordinator.single_type_managers)
        check_stock_pool(self.stock.block_pool, self.stock.coordinator.single_type_managers)
        snap = rust_snapshot(pool)
        assert snap == stock_snapshot(self.stock.block_pool)
        assert normalize_events(self.ours.take_events()) == normalize_events(
            self.stock.take_events()
        )
        if self.collectors is not None:
            assert self.collectors[1].take() == self.collectors[0].take()
        blocks = {rid: self.ours.get_block_ids(rid) for rid in sorted(self.tracked)}
        for rid, ids in blocks.items():
            assert ids == self.stock.get_block_ids(rid)
            # The scheduler output's IDs: the plugin's method against vLLM's own.
            assert_block_ids_as_vllm(self.ours.get_blocks(rid), rid)
        # The prefill statistics' cached-token estimate: ours (one pool call per group)
        # against vLLM's own on its pool.
        for rid, t in sorted(self.tracked.items()):
            assert manager_patches.estimate_cached_tokens(
                self.ours, t.ours
            ) == manager_patches.vllm_estimate_cached_tokens(self.stock, t.stock), rid
        self.account(
            (
                snap,
                blocks,
                [
                    (r, t.state, t.stock.num_computed_tokens)
                    for r, t in sorted(self.tracked.items())
                ],
                # vLLM's Mamba managers defer hits on states cached in this step.
                [
                    len(getattr(m, "cached_blocks_this_step", ()))
                    for m in self.ours.coordinator.single_type_managers
                ],
            )
        )

    def held_by_requests(self) -> list[Any]:
        return [
            blocks
            for manager in self.ours.coordinator.single_type_managers
            for blocks in manager.req_to_blocks.values()
            if any(not b.is_null for b in blocks)
        ]


ManagerMachine.TestCase.settings = settings(max_examples=budget(150), stateful_step_count=50)
test_manager_machine = ManagerMachine.TestCase
