"""vLLM's own KVCacheManager driven through realistic request lifecycles, once on the stock
pool and once on ours, step by step: same prefix hits, same block IDs per group, same free
counts, same events."""

from __future__ import annotations

import random
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc.integration.scheduler import manager_patches
from hybrid_alloc.integration.scheduler.block_pool import BlockPool as RustPool
from tests.helpers import (
    LAYOUTS,
    build_manager,
    new_request,
    normalize_events,
    pool_class,
    rust_snapshot,
    stock_snapshot,
)


def make_requests(seed: int, n: int) -> list[tuple[list[int], int]]:
    """Prompts that share a few prefixes, with decode lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5000) for _ in range(rng.choice([16, 48, 64, 96]))] for _ in "abc"]
    out = []
    for _ in range(n):
        # Some prompts are a bare block-aligned prefix: Mamba 'align' mode caches state only
        # at block boundaries, so these seed hits for the prompts that extend them.
        suffix = 0 if rng.random() < 0.3 else rng.randrange(1, 60)
        tokens = rng.choice(prefixes) + [rng.randrange(5000) for _ in range(suffix)]
        out.append((tokens, rng.randrange(1, 40)))
    return out


class Driver:
    """Runs one manager through a trace and records everything observable."""

    def __init__(
        self, cls: type, layout: str, num_blocks: int, events: bool, eagle: bool = False
    ) -> None:
        self.mgr = build_manager(cls, layout, num_blocks, events, eagle)
        self.running: dict[str, Request] = {}
        self.log: list[Any] = []

    def admit(self, rid: str, tokens: list[int], max_tokens: int) -> bool:
        req = new_request(rid, tokens, max_tokens)
        blocks, num_hit, _ = self.mgr.get_computed_blocks(req)
        new = self.mgr.allocate_slots(
            req,
            req.num_tokens - num_hit,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=blocks,
        )
        self.log.append(("admit", rid, num_hit, new is not None))
        if new is None:
            return False
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(7)
        self.running[rid] = req
        self.log.append(("blocks", rid, self.mgr.get_block_ids(rid)))
        return True

    def decode(self, rid: str, token: int) -> bool:
        req = self.running[rid]
        new = self.mgr.allocate_slots(req, 1)
        self.log.append(("decode", rid, new is not None))
        if new is None:
            return False
        req.num_computed_tokens += 1
        req.append_output_token_ids(token)
        self.log.append(("blocks", rid, self.mgr.get_block_ids(rid)))
        return True

    def finish(self, rid: str) -> None:
        req = self.running.pop(rid)
        self.mgr.free(req)
        self.log.append(("free", rid, self.mgr.block_pool.get_num_free_blocks()))

    def observe(self) -> Any:
        pool = self.mgr.block_pool
        snap = rust_snapshot(pool) if isinstance(pool, RustPool) else stock_snapshot(pool)
        return snap, normalize_events(self.mgr.take_events()), self.mgr.usage


def run_trace(
    cls: type, layout: str, seed: int, num_blocks: int, events: bool, eagle: bool = False
) -> list[Any]:
    with pool_class(cls):
        return _run_trace(cls, layout, seed, num_blocks, events, eagle)


def _run_trace(
    cls: type, layout: str, seed: int, num_blocks: int, events: bool, eagle: bool
) -> list[Any]:
    """Admit requests in waves, decode them, preempt the newest when the pool runs dry
    (free + re-admit later), finish them; observe after every wave."""
    rng = random.Random(seed * 7919)
    d = Driver(cls, layout, num_blocks, events, eagle)
    pending = [(f"r{i}", t, m) for i, (t, m) in enumerate(make_requests(seed, 24))]
    remaining: dict[str, int] = {rid: m for rid, _, m in pending}
    prompts = {rid: t for rid, t, _ in pending}
    observations = []
    token = 11
    for _wave in range(200):
        if not pending and not d.running:
            break
        d.mgr.new_step_starts()
        for _ in range(rng.randrange(1, 4)):
            if pending and d.admit(*pending[0]):
                pending.pop(0)
        for rid in list(d.running):
            token = (token * 31 + 7) % 5000
            if not d.decode(rid, token):
                # Preempt: free everything the request holds; it restarts from its prompt.
                d.finish(rid)
                pending.append((rid, prompts[rid], remaining[rid]))
                continue
            remaining[rid] -= 1
            if remaining[rid] <= 0:
                d.finish(rid)
        observations.append(d.observe())
    if isinstance(d.mgr.block_pool, RustPool):
        d.mgr.block_pool.check_invariants()
        assert manager_patches.is_installed()
    return [d.log, observations]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=8)
@given(seed=st.integers(0, 10_000), events=st.booleans(), eagle=st.booleans())
def test_manager_matches_stock(layout: str, seed: int, events: bool, eagle: bool) -> None:
    # Few enough blocks that preemption and eviction happen.
    num_blocks = 40 if "mamba" not in layout else 60
    stock = run_trace(StockPool, layout, seed, num_blocks, events, eagle)
    ours = run_trace(RustPool, layout, seed, num_blocks, events, eagle)
    assert ours[0] == stock[0]
    assert ours[1] == stock[1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trace_exercises_hits_and_preemption(layout: str) -> None:
    """The workload above is not trivial: it hits the prefix cache and preempts."""
    num_blocks = 40 if "mamba" not in layout else 60
    logs = [run_trace(RustPool, layout, seed, num_blocks, False)[0] for seed in range(4)]
    entries = [e for log in logs for e in log]
    assert any(e[0] == "admit" and e[2] > 0 and e[3] for e in entries), "no prefix-cache hit"
    assert any(e[0] == "decode" and not e[2] for e in entries), "no preemption"


@pytest.mark.parametrize(
    ("layout", "expected_groups"),
    [("full+full", [[0, 1]]), ("full32+full", [[0], [1]])],
)
def test_batched_lookup_serves_multi_group_layouts(
    layout: str, expected_groups: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's batched prefix lookup (manager_patches) is what runs for two
    full-attention groups: one call for both groups of one spec, one call per group for
    two specs, the 32-token group given vLLM's 32-token view of 16-token hashes
    (hash_block_size < block_size). It finds prefix hits there, and the traces above
    match stock's on the same layouts."""
    calls: list[tuple[list[int], int, int]] = []
    native = RustPool.get_cached_prefix

    def spy(self: Any, hashes: Any, group_ids: list[int], max_blocks: int) -> Any:
        found = native(self, hashes, group_ids, max_blocks)
        scale = getattr(hashes, "scale_factor", 1)
        calls.append((list(group_ids), scale, len(found[0])))
        return found

    monkeypatch.setattr(RustPool, "get_cached_prefix", spy)
    log = run_trace(RustPool, layout, 3, 60, False)[0]
    assert sorted({tuple(g) for g, _, _ in calls}) == [tuple(g) for g in expected_groups]
    for groups, scale, _ in calls:
        # Group 0 of "full32+full" has 32-token blocks over 16-token hashes.
        assert scale == (2 if layout == "full32+full" and groups == [0] else 1)
    assert any(found for *_, found in calls), "no batched lookup found a cached block"
    assert any(e[0] == "admit" and e[2] > 0 for e in log), "no prefix hit"
