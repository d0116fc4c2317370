"""vLLM's own KVCacheManager driven through realistic request lifecycles, once on the stock
pool and once on ours, step by step: same prefix hits, same block IDs per group, same free
counts, same events."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration import manager_patches
from hybrid_alloc.integration.block_pool import BlockPool as RustPool
from tests.helpers import normalize_events, rust_snapshot, stock_snapshot

BLOCK = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def attn(window: int | None = None) -> Any:
    common = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    if window is None:
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(sliding_window=window, **common)


def mamba(mode: str) -> Any:
    return MambaSpec(
        block_size=BLOCK,
        shapes=((4, 64), (8, 16, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode=mode,
    )


LAYOUTS: dict[str, list[Any]] = {
    "full": [attn()],
    "full+swa": [attn(), attn(window=48)],
    "full+mamba_align": [attn(), mamba("align")],
    "full+swa+mamba_align": [attn(), attn(window=32), mamba("align")],
}


@contextmanager
def pool_class(cls: type) -> Iterator[None]:
    """Build managers with ``cls``; ours comes with the plugin's batched prefix lookup."""
    if cls is RustPool:
        integration.install(per_group_pools=False)
    else:
        integration.uninstall()
    try:
        yield
    finally:
        integration.uninstall()


def build_manager(
    cls: type, layout: str, num_blocks: int, events: bool, eagle: bool = False
) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(LAYOUTS[layout])]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    mgr = KVCacheManager(
        config,
        max_model_len=2048,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
        enable_kv_cache_events=events,
        use_eagle=eagle,
    )
    assert type(mgr.block_pool) is cls
    return mgr


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
        req = Request(
            request_id=rid,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            block_hasher=HASHER,
        )
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
