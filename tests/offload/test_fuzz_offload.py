"""A hypothesis state machine over vLLM's CPU offload index (its real `CPUOffloadingManager`,
LRU policy) next to per-group pools (vLLM's `KVCacheManager` with the per-group coordinator
over a `PoolSet`): one full-attention group and one Mamba 'align' group, each with its own
pool and pool-scoped block IDs (the pools listed in group order or reversed).

Data, not only counts: every device block (group, block ID) and every host chunk carries a
payload token. A block that holds the KV (or the Mamba state) of block hash ``h`` in group
``g`` carries ``("kv", g, h)``, the same token a CPU chunk stored under
``make_offload_key(h, g)`` must carry; torn, partial or not-yet-loaded blocks carry other
tokens.

Rules, as vLLM's scheduler and the offloading connector drive both sides:

* admit: a request (a prefix of one of two prompts + its own suffix; the device may first
  evict that prefix's cached blocks, Mamba states only or all) looks up the device prefix
  cache, then the offload index past the device hit (the hit rule below, checked against
  vLLM's real ``OffloadingConnectorScheduler`` over the same CPU manager at every lookup),
  and either starts an asynchronous load of the offload hit (``prepare_load``, blocks
  allocated with caching delayed, vLLM's load plan: every attention block of the hit, the
  Mamba block at its boundary) or computes its first step;
* compute: a step of a running request's prompt, ending at a chunk boundary (where Mamba
  'align' keeps a state) or at the prompt's end; admit and compute then offload what the
  step completed, as the connector does after every step (or not);
* store: offload a running request's final blocks (attention blocks, Mamba boundary states)
  per group under ``make_offload_key(block_hash, group)``: ``prepare_store`` (under pressure
  it evicts old keys; refused exactly when the evictable entries outside the offer cannot
  make room), the host copy, then ``complete_store`` at once or later (store_completes);
* load_finishes: the host copy into the request's freshly allocated blocks of each group's
  own pool, ``complete_load``, then the blocks are cached;
* load_fails: the copy fails in a subset of groups (a torn write there); ``complete_load``,
  then :func:`hybrid_alloc.integration.kv_transfer.offload.drop_offloaded_keys` on the
  load's keys (what the connector's failed-load hook does), and the request's blocks are
  freed uncached;
* finish: free a running request; evict_device: evict cached blocks from the pools by
  (group, IDs): one prompt's prefix in some groups, a few random ones, or all;
* restart: every request ends and the pools' ``reset_prefix_cache`` (the index is kept), or
  a new per-group manager with the index's ``reset_cache`` or with a new CPU manager.

The offload hit rule (vLLM's ``_lookup_complete_chunks`` for one full-attention group and
one Mamba group, one block per chunk; :func:`modelled_hit`): the hit is the longest
chunk-aligned prefix past the device hit whose full-attention keys are all present and whose
Mamba key at the boundary chunk is present (Mamba is a window of one chunk), capped so that
the last prompt token is computed; none -> 0. A relied-on key still being stored
(HIT_PENDING), or being loaded by another request, defers the request (None).

After every step: every key the model holds is in the index with the same chunk, readiness
and load count, and nothing else is (the index's chunk accounting: allocated chunks = index
+ free list, no chunk ID twice, evictable/pending counters, the LRU's evictable set); every
stored chunk carries the payload of its own key (so a key of group g never resolves to a
payload of group h); vLLM's offload events rebuild the set of ready keys; every pool passes
its own checks (free + held + null == total, reference counts == holders, ...); no block is
held by two requests that both allocated it (sharing is only through prefix hits); every
cached device block and every final block a request holds carries its own payload (nothing
served from the device or loaded that was not computed or stored under the same key); a
failed load's keys are out of the index unless another load in flight holds them.

Plain tests: groups that disagree (attention chunks without their Mamba states and the
reverse), pending and loading chunks, each against the model and vLLM's scheduler; and a
failed load whose keys another load in flight holds, driven through the machine by hand.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import currently_in_test_context, settings
from hypothesis import event as hypothesis_event
from hypothesis.stateful import initialize, invariant, precondition, rule
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.request import Request

from hybrid_alloc import integration
from hybrid_alloc.integration.kv_transfer import offload
from tests.helpers import (
    BLOCK,
    PER_GROUP_LAYOUTS,
    CountingMachine,
    budget,
    check_our_pool,
    new_request,
    per_group_config,
    per_group_manager,
    stepping,
)

LAYOUT = "full+mamba_align"
FA, MAMBA = 0, 1
CHUNK = BLOCK
"""One block per offload chunk; vLLM hashes every BLOCK tokens, so a chunk is one hash."""

SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
CONFIG_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"

PROMPT_LEN = 96
STORE = st.sampled_from(["now", "later", "no"])
"""After a step: no offload, an offload completed at once, or one completed later."""
PREFIXES = [[(p * 977 + i * 31) % 5000 + 3 for i in range(PROMPT_LEN)] for p in range(2)]
PREFIX_HASHES = [new_request(f"p{p}", tokens).block_hashes for p, tokens in enumerate(PREFIXES)]
"""Block hashes of each prompt's chunks (every request that starts with it shares them)."""


def truth(group: int, block_hash: bytes) -> tuple[Any, ...]:
    """The payload of a block that holds block hash ``block_hash`` of ``group``."""
    return ("kv", group, bytes(block_hash))


def key_truth(key: OffloadKey) -> tuple[Any, ...]:
    return truth(get_offload_group_idx(key), get_offload_block_hash(key))


def event(value: str) -> None:
    """A hypothesis event (statistics); a no-op when the machine is driven by hand."""
    if currently_in_test_context():
        hypothesis_event(value)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ the hit rule
def modelled_hit(
    status: Callable[[OffloadKey], str],
    block_hashes: Sequence[bytes],
    start: int,
    num_tokens: int,
    being_loaded: frozenset[OffloadKey] | set[OffloadKey] = frozenset(),
) -> int | None:
    """Tokens past ``start`` (the device hit, chunk-aligned) that the offload index can
    serve to a request of ``num_tokens`` tokens, as vLLM's offloading scheduler finds them
    for a full-attention group and a Mamba group; None: the request is deferred.
    ``status(key)`` is "hit", "pending" (stored, not yet readable) or "miss".

    The hit ends at the largest chunk boundary ``b`` such that every full-attention key
    before ``b`` is present and the Mamba key of the chunk ending at ``b`` is present;
    ``b`` stays below the last prompt token (that token is computed). No such ``b``: 0.
    A relied-on key that is pending, or that another request is loading, defers.
    One quirk of vLLM's loop is kept: a full-attention prefix that defers does not bound
    the Mamba scan, so a Mamba key present past that prefix defers the request as well."""
    first = start // CHUNK
    cap = min((num_tokens - 1) // CHUNK, len(block_hashes))
    if cap <= first:
        return 0
    fa = [status(make_offload_key(h, FA)) for h in block_hashes[:cap]]
    mamba = [status(make_offload_key(h, MAMBA)) for h in block_hashes[:cap]]
    end = first
    while end < cap and fa[end] != "miss":
        end += 1
    if end == first:
        return 0
    present = [j for j in range(first, cap) if mamba[j] != "miss"]
    if not present:
        return 0
    if "pending" in fa[first:end] and present[-1] >= end:
        return None
    within = [j for j in present if j < end]
    if not within:
        return 0
    boundary = within[-1] + 1
    relied = [make_offload_key(h, FA) for h in block_hashes[first:boundary]]
    relied.append(make_offload_key(block_hashes[boundary - 1], MAMBA))
    if any(status(k) == "pending" or k in being_loaded for k in relied):
        return None
    return (boundary - first) * CHUNK


def real_scheduler(config: Any, manager: Any) -> Any:
    """vLLM's ``OffloadingConnectorScheduler`` for ``config`` over ``manager``, built from a
    stand-in spec and vllm_config holding the fields it reads (one block per chunk, one
    hash per block, prefix caching on, one worker)."""
    sched_mod = importlib.import_module(SCHEDULER_MODULE)
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    windowed = "sliding_window_size_in_chunks" in {
        f.name for f in dataclasses.fields(OffloadingGroupConfig)
    }
    groups = []
    for gid, group in enumerate(config.kv_cache_groups):
        extra = {}
        if windowed:  # vLLM 0.33: the group config carries the window, as vLLM builds it
            window = importlib.import_module(CONFIG_MODULE).get_sliding_window_size_in_chunks
            extra["sliding_window_size_in_chunks"] = window(group.kv_cache_spec, CHUNK)
        groups.append(
            OffloadingGroupConfig(
                tokens_per_block=CHUNK,
                layer_names=tuple(group.layer_names),
                group_id=gid,
                **extra,
            )
        )
    spec = SimpleNamespace(
        config=SimpleNamespace(groups=tuple(groups)),
        blocks_per_chunk=1,
        tokens_per_hash=CHUNK,
        tokens_per_block=tuple(g.tokens_per_block for g in groups),
        offload_prompt_only=True,
        extra_config={},
        kv_events_config=OffloadingKVEventsConfig(
            enable_kv_cache_events=False, self_describing_kv_events=False
        ),
        get_manager=lambda: manager,
    )
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            prefix_cache_retention_interval=None, enable_prefix_caching=True
        ),
        speculative_config=None,
        parallel_config=SimpleNamespace(world_size=1, decode_context_parallel_size=1),
    )
    sched = sched_mod.OffloadingConnectorScheduler(spec, vllm_config, config)
    assert sched.manager is manager
    return sched


def real_hit(
    sched: Any, request: Request, start: int, being_loaded: set[OffloadKey] | None
) -> int | None:
    """vLLM's own answer: ``get_num_new_matched_tokens`` for a request it has not seen
    (``being_loaded`` None: a scheduler that does not track chunks being loaded, as vLLM
    without GPU prefix caching). Leaves the scheduler as it found it."""
    sched._chunks_being_loaded = None if being_loaded is None else set(being_loaded)
    sched.on_new_request(request)
    try:
        hit, is_async = sched.get_num_new_matched_tokens(request, start)
    finally:
        sched._req_status.pop(request.request_id, None)
        release = getattr(sched, "_release_step", None)  # vLLM 0.33: the manager's lock
        if release is not None:
            release()
    assert is_async == bool(hit)
    return hit


STATUS = {LookupResult.HIT: "hit", LookupResult.HIT_PENDING: "pending", LookupResult.MISS: "miss"}


def manager_status(manager: Any) -> Callable[[OffloadKey], str]:
    ctx = ReqContext(req_id="status")
    return lambda key: STATUS[manager.lookup(key, ctx)]


# ------------------------------------------------------------------ the machine
@dataclass
class Entry:
    """The model of one index entry."""

    chunk: int
    ready: bool
    loads: int = 0


@dataclass
class Load:
    keys: list[OffloadKey]
    chunks: list[int]
    dsts: list[tuple[int, int, int]]  # (group, position, block ID), in key order


@dataclass
class Tracked:
    request: Request
    ctx: ReqContext
    state: str  # "running" | "loading"
    hit_end: int  # positions below it came from the device prefix cache
    final: dict[int, set[int]] = field(default_factory=lambda: {FA: set(), MAMBA: set()})
    load: Load | None = None


class OffloadMachine(CountingMachine):
    MACHINE = "offload"

    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[str, Tracked] = {}
        self.next_id = 0
        self.device: dict[tuple[int, int], Any] = {}
        self.rows: dict[int, Any] = {}  # host chunk ID -> payload
        self.stored: dict[OffloadKey, Any] = {}  # key -> payload it was stored with
        self.index: dict[OffloadKey, Entry] = {}
        self.stores: list[tuple[ReqContext, list[OffloadKey]]] = []
        self.announced: set[OffloadKey] = set()

    @initialize(
        reverse=st.booleans(),
        attn_blocks=st.integers(6, 32),
        mamba_blocks=st.integers(3, 8),
        num_chunks=st.integers(2, 14),
    )
    def build(self, reverse: bool, attn_blocks: int, mamba_blocks: int, num_chunks: int) -> None:
        specs = PER_GROUP_LAYOUTS[LAYOUT]
        pools: list[tuple[int, ...]] = [(FA,), (MAMBA,)]
        sizes = [attn_blocks, mamba_blocks]
        if reverse:
            pools, sizes = pools[::-1], sizes[::-1]
        self.config = per_group_config(specs, sizes, pools)
        self.num_chunks = num_chunks
        self.new_device()
        self.cpu = CPUOffloadingManager(num_chunks, cache_policy="lru", enable_events=True)
        self.sched = real_scheduler(self.config, self.cpu)
        event(f"pools reversed={reverse}")
        self.after_rule()

    def teardown(self) -> None:
        integration.uninstall()

    # ---------------------------------------------------------------- helpers
    def new_device(self) -> None:
        self.mgr = per_group_manager(self.config)
        # The plugin's batched prefix lookup, as the engine runs it.
        integration.install(per_group_pools=False)
        self.pools = self.mgr.block_pool
        self.managers = self.mgr.coordinator.single_type_managers
        self.device.clear()

    def blocks(self, rid: str, group: int) -> list[Any]:
        return self.managers[group].req_to_blocks.get(rid, [])

    def status(self, key: OffloadKey) -> str:
        entry = self.index.get(key)
        if entry is None:
            return "miss"
        return "hit" if entry.ready else "pending"

    def being_loaded(self) -> set[OffloadKey]:
        return {k for t in self.tracked.values() if t.load for k in t.load.keys}

    def lookup(self, request: Request, start: int, tracks_loads: bool) -> int | None:
        """The modelled offload hit past ``start``, checked against vLLM's scheduler."""
        loading = self.being_loaded() if tracks_loads else set()
        hit = modelled_hit(
            self.status, request.block_hashes, start, request.num_tokens, frozenset(loading)
        )
        real = real_hit(self.sched, request, start, loading if tracks_loads else None)
        assert real == hit, (real, hit)
        event(f"offload lookup: {'deferred' if hit is None else 'hit' if hit else 'miss'}")
        return hit

    def pick(self, data: st.DataObject, state: str) -> str | None:
        rids = sorted(r for r, t in self.tracked.items() if t.state == state)
        return data.draw(st.sampled_from(rids)) if rids else None

    def drop_request(self, rid: str) -> None:
        t = self.tracked.pop(rid)
        self.mgr.free(t.request)
        self.cpu.on_request_finished(t.ctx)

    def write_computed(self, t: Tracked, start: int, end: int) -> None:
        """A step computed tokens [start, end): each block it wrote now holds its KV
        (full blocks) or the Mamba state at its boundary; partial ones hold partial data."""
        rid = t.request.request_id
        hashes = t.request.block_hashes
        for g in (FA, MAMBA):
            for p, b in enumerate(self.blocks(rid, g)):
                if p < start // CHUNK or p >= cdiv(end, CHUNK) or b.is_null:
                    continue
                assert p >= t.hit_end, "a step writes a block the request got from the cache"
                if (p + 1) * CHUNK <= end:
                    self.device[(g, b.block_id)] = truth(g, hashes[p])
                    t.final[g].add(p)
                else:
                    self.device[(g, b.block_id)] = ("partial", rid, end)

    def new_tracked(self, prefix: int, prefix_len: int, suffix: int) -> Tracked:
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = PREFIXES[prefix][:prefix_len] + [
            (self.next_id * 13 + i) % 5000 + 3 for i in range(suffix)
        ]
        ctx = ReqContext(req_id=rid)
        return Tracked(new_request(rid, tokens), ctx, "running", 0)

    # ------------------------------------------------------------------ rules
    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.sampled_from([64, 48, 96, 32, 80]),
        suffix=st.integers(0, 20),
        compute_instead=st.sampled_from([False, False, False, True]),
        untracked=st.booleans(),
        step_chunks=st.integers(1, 3),
        store=STORE,
        evict_first=st.sampled_from([(MAMBA,), (), (FA, MAMBA)]),
    )
    @stepping
    def admit(
        self,
        prefix: int,
        prefix_len: int,
        suffix: int,
        compute_instead: bool,
        untracked: bool,
        step_chunks: int,
        store: str,
        evict_first: tuple[int, ...],
    ) -> None:
        """A new request: device prefix hit, then the offload hit past it; it loads the
        offload hit (unless ``compute_instead``) or computes its first step (and offloads
        what the step completed, as the connector does after every step, unless ``store``
        is "no"). ``untracked``: a scheduler that does not defer on chunks other requests
        are loading (vLLM without GPU prefix caching), so loads in flight may share keys.
        ``evict_first``: the groups whose cached blocks of this prompt's prefix the device
        evicted before the request arrived (as ``evict_device`` does)."""
        self.admit_request(
            prefix, prefix_len, suffix, compute_instead, untracked, step_chunks, store, evict_first
        )

    def admit_request(
        self,
        prefix: int,
        prefix_len: int,
        suffix: int,
        compute_instead: bool,
        untracked: bool,
        step_chunks: int,
        store: str,
        evict_first: tuple[int, ...],
    ) -> str | None:
        """``admit``; returns the request's ID if it now runs or loads."""
        self.mgr.new_step_starts()
        if evict_first:
            self.evict_prefix(prefix, evict_first)
        t = self.new_tracked(prefix, prefix_len, suffix)
        req, rid = t.request, t.request.request_id
        blocks, hit, _ = self.mgr.get_computed_blocks(req)
        assert hit % CHUNK == 0
        # What the device serves is what was computed (or loaded) for those positions.
        for g, group_blocks in enumerate(blocks.blocks):
            for p, b in enumerate(group_blocks):
                if not b.is_null:
                    assert self.device.get((g, b.block_id)) == truth(g, req.block_hashes[p])
                    t.final[g].add(p)
        t.hit_end = hit // CHUNK
        ext = self.lookup(req, hit, not untracked)
        self.cpu.on_new_request(t.ctx)
        if ext and not compute_instead:
            self.begin_load(t, blocks, hit, ext)
            return rid if rid in self.tracked else None
        end = min(req.num_tokens, (t.hit_end + step_chunks) * CHUNK)
        if (
            self.mgr.allocate_slots(
                req, end - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
            )
            is None
        ):
            event("admit: pools full")
            return None
        req.num_computed_tokens = end
        self.tracked[rid] = t
        self.write_computed(t, hit, end)
        if store != "no":
            self.offload(t, (FA, MAMBA), t.hit_end, PROMPT_LEN, store == "now")
        return rid

    def begin_load(self, t: Tracked, blocks: Any, hit: int, ext: int) -> None:
        req, rid = t.request, t.request.request_id
        try:
            res = self.mgr.allocate_slots(
                req,
                0,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
                num_external_computed_tokens=ext,
                delay_cache_blocks=True,
            )
        except ValueError as e:
            # vLLM can count fewer Mamba 'align' blocks than it then allocates for an
            # external claim (see tests/manager/test_regressions.py): the pool refuses.
            assert "Cannot get" in str(e), e
            self.mgr.free(req)
            event("load: vLLM over-allocation refused by the pool")
            return
        if res is None:
            event("load: pools full")
            return
        end = hit + ext
        req.num_computed_tokens = end
        # vLLM's load plan: per group, from the first fresh (non-null, unhashed) block at
        # or past the device hit, up to the block holding the hit's last token.
        keys: list[OffloadKey] = []
        dsts: list[tuple[int, int, int]] = []
        for g in (FA, MAMBA):
            group_blocks = self.blocks(rid, g)
            num = cdiv(end, CHUNK)
            first = next(
                (
                    i
                    for i in range(hit // CHUNK, num)
                    if not group_blocks[i].is_null and group_blocks[i].block_hash is None
                ),
                num,
            )
            positions = list(range(first, num))
            # Full attention loads every chunk of the hit; Mamba only its boundary state.
            assert positions == (list(range(hit // CHUNK, num)) if g == FA else [num - 1]), (
                g,
                positions,
            )
            for p in positions:
                keys.append(make_offload_key(req.block_hashes[p], g))
                dsts.append((g, p, group_blocks[p].block_id))
        for key in keys:
            assert self.status(key) == "hit", "a load of a key that is not readable"
        if set(keys) & self.being_loaded():
            event("load: shares keys with a load in flight")
        spec = self.cpu.prepare_load(keys, t.ctx)
        chunks = [int(c) for c in spec.block_ids]
        assert chunks == [self.index[k].chunk for k in keys]
        for key in keys:
            self.index[key].loads += 1
        for g, _, bid in dsts:
            self.device[(g, bid)] = ("unloaded", rid)
        t.state = "loading"
        t.load = Load(keys, chunks, dsts)
        self.tracked[rid] = t
        event(f"load: {len(keys)} chunks")

    @precondition(lambda self: any(t.state == "running" for t in self.tracked.values()))
    @rule(data=st.data(), step_chunks=st.integers(1, 3), to_end=st.booleans(), store=STORE)
    @stepping
    def compute(self, data: st.DataObject, step_chunks: int, to_end: bool, store: str) -> None:
        """A step of a running request's prompt, then (``store``) the offload of what it
        completed."""
        self.mgr.new_step_starts()
        rid = self.pick(data, "running")
        if rid is None:
            return
        t = self.tracked[rid]
        req = t.request
        start = req.num_computed_tokens
        if start >= req.num_tokens:
            return
        end = (
            req.num_tokens
            if to_end
            else min(req.num_tokens, (start // CHUNK + step_chunks) * CHUNK)
        )
        if self.mgr.allocate_slots(req, end - start) is None:
            event("compute: pools full, preempted")
            self.drop_request(rid)
            return
        req.num_computed_tokens = end
        self.write_computed(t, start, end)
        if store != "no":
            self.offload(t, (FA, MAMBA), start // CHUNK, PROMPT_LEN, store == "now")

    @precondition(lambda self: any(t.state == "running" for t in self.tracked.values()))
    @rule(
        data=st.data(),
        groups=st.sampled_from([(FA,), (MAMBA,), (FA, MAMBA)]),
        limit=st.integers(1, 8),
        complete=st.booleans(),
    )
    @stepping
    def store(
        self, data: st.DataObject, groups: tuple[int, ...], limit: int, complete: bool
    ) -> None:
        """Offload a running request's final blocks of ``groups`` (at most ``limit``)."""
        rid = self.pick(data, "running")
        if rid is not None:
            self.offload(self.tracked[rid], groups, 0, limit, complete)

    def offload(
        self, t: Tracked, groups: Sequence[int], first: int, limit: int, complete: bool
    ) -> None:
        """Offer the request's final blocks of ``groups`` at positions ``first`` onwards
        (at most ``limit``) to the index; the host copy follows at once, ``complete_store``
        too or later."""
        rid = t.request.request_id
        hashes = t.request.block_hashes
        offer: list[tuple[OffloadKey, int, int]] = []
        for g in groups:
            for p, b in enumerate(self.blocks(rid, g)):
                if p >= first and not b.is_null and p in t.final[g]:
                    offer.append((make_offload_key(hashes[p], g), g, b.block_id))
        offer = offer[:limit]
        if not offer:
            return
        keys = [k for k, _, _ in offer]
        new = [k for k in keys if k not in self.index]
        free = self.cpu._get_num_free_chunks()
        evictable = {k for k, e in self.index.items() if e.ready and e.loads == 0 and k not in keys}
        out = self.cpu.prepare_store(keys, t.ctx)
        # Refused exactly when the evictable entries outside the offer cannot make room.
        assert (out is not None) == (len(new) - free <= len(evictable)), (len(new), free)
        if out is None:
            event("store: refused (index full of entries in use)")
            return
        assert list(out.keys_to_store) == new
        evicted = list(out.evicted_keys)
        assert len(evicted) == max(0, len(new) - free)
        assert set(evicted) <= evictable, "evicted an entry in use, pending or offered"
        for key in evicted:
            del self.index[key]
            del self.stored[key]
        chunks = [int(c) for c in out.store_spec.block_ids]
        assert len(chunks) == len(new)
        source = {k: (g, bid) for k, g, bid in offer}
        for key, chunk in zip(new, chunks, strict=True):
            payload = self.device[source[key]]
            assert payload == key_truth(key), "a block offloaded under another key"
            self.rows[chunk] = payload
            self.stored[key] = payload
            self.index[key] = Entry(chunk, ready=False)
        event(f"store: {'some' if new else 'no'} new, {'some' if evicted else 'none'} evicted")
        if complete:
            self.finish_store(t.ctx, new)
        elif new:
            self.stores.append((t.ctx, new))

    def finish_store(self, ctx: ReqContext, keys: list[OffloadKey]) -> None:
        self.cpu.complete_store(keys, ctx)
        for key in keys:
            self.index[key].ready = True

    @precondition(lambda self: self.stores)
    @rule(data=st.data())
    @stepping
    def store_completes(self, data: st.DataObject) -> None:
        idx = data.draw(st.integers(0, len(self.stores) - 1))
        ctx, keys = self.stores.pop(idx)
        self.finish_store(ctx, keys)

    @precondition(lambda self: any(t.state == "loading" for t in self.tracked.values()))
    @rule(data=st.data())
    @stepping
    def load_finishes(self, data: st.DataObject) -> None:
        # Loads that share no key with another load first (leaving shared ones to fail).
        rids = self.loads_by_sharing()
        if rids:
            self.finish_load(data.draw(st.sampled_from(rids[::-1])))

    def loads_by_sharing(self) -> list[str]:
        """The loading requests, those whose load shares keys with another load first."""
        shared = Counter(k for t in self.tracked.values() if t.load for k in set(t.load.keys))

        def alone(rid: str) -> bool:
            load = self.tracked[rid].load
            return load is not None and all(shared[k] == 1 for k in load.keys)

        return sorted((r for r, t in self.tracked.items() if t.load), key=lambda r: (alone(r), r))

    def finish_load(self, rid: str) -> None:
        self.mgr.new_step_starts()
        t = self.tracked[rid]
        assert t.load is not None
        for key, chunk, (g, p, bid) in zip(t.load.keys, t.load.chunks, t.load.dsts, strict=True):
            payload = self.rows[chunk]
            # Served only what was stored under this very key, for this group and position.
            assert payload == self.stored[key] == truth(g, t.request.block_hashes[p])
            self.device[(g, bid)] = payload
            t.final[g].add(p)
        self.cpu.complete_load(t.load.keys, t.ctx)
        for key in t.load.keys:
            self.index[key].loads -= 1
        self.mgr.cache_blocks(t.request, t.request.num_computed_tokens)
        t.load = None
        t.state = "running"
        event("load: finished")

    @precondition(lambda self: any(t.state == "loading" for t in self.tracked.values()))
    @rule(data=st.data())
    @stepping
    def load_fails(self, data: st.DataObject) -> None:
        """The copy fails in some groups (half of each such group's blocks written, the
        rest torn); the load completes, its keys leave the index unless another load in
        flight holds them, and the request's blocks are freed uncached. Loads that share
        keys with another load in flight are drawn first."""
        rids = self.loads_by_sharing()
        if rids:
            rid = data.draw(st.sampled_from(rids))
            self.fail_load(rid, data.draw(st.sampled_from([(FA,), (MAMBA,), (FA, MAMBA)])))

    def fail_load(self, rid: str, failed: tuple[int, ...]) -> list[OffloadKey]:
        """``load_fails`` for ``rid``; returns the keys dropped from the index."""
        self.mgr.new_step_starts()
        t = self.tracked[rid]
        load = t.load
        assert load is not None
        for g in (FA, MAMBA):
            mine = [(c, d[2]) for c, d in zip(load.chunks, load.dsts, strict=True) if d[0] == g]
            written = len(mine) // 2 if g in failed else len(mine)
            for i, (chunk, bid) in enumerate(mine):
                self.device[(g, bid)] = self.rows[chunk] if i < written else ("torn", rid)
        self.cpu.complete_load(load.keys, t.ctx)
        for key in load.keys:
            self.index[key].loads -= 1
        removed = offload.drop_offloaded_keys(self.cpu, load.keys)
        expected = [k for k in load.keys if self.index[k].loads == 0]
        assert removed == expected, "dropped keys another load holds, or kept a free one"
        status = manager_status(self.cpu)
        for key in load.keys:
            assert status(key) == ("hit" if self.index[key].loads else "miss")
        for key in removed:
            del self.index[key]
            del self.stored[key]
        t.load = None
        self.drop_request(rid)
        kept = "none" if len(removed) == len(load.keys) else "all" if not removed else "some"
        event(f"load: failed in groups {failed}, {kept} of its keys kept")
        return removed

    @precondition(lambda self: any(t.state == "running" for t in self.tracked.values()))
    @rule(data=st.data())
    @stepping
    def finish(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is not None:
            self.drop_request(rid)

    @precondition(lambda self: any(p.cache_entries() for p in self.pools))
    @rule(
        data=st.data(),
        which=st.sampled_from(["prefix", "random", "everything"]),
        prefix=st.integers(0, len(PREFIXES) - 1),
        groups=st.sampled_from([(MAMBA,), (FA, MAMBA), (FA,)]),
    )
    @stepping
    def evict_device(
        self, data: st.DataObject, which: str, prefix: int, groups: tuple[int, ...]
    ) -> None:
        """A connector evicts cached blocks from the pools by (group, IDs): those of one
        prompt's prefix in ``groups`` (Mamba alone: the attention blocks stay, the states
        go), a few random ones, or all."""
        cached = {key: ids for pool in self.pools for key, ids in pool.cache_entries()}
        if which == "everything":
            keys = sorted(cached)
        elif which == "random":
            keys = sorted(
                data.draw(st.sets(st.sampled_from(sorted(cached)), min_size=1, max_size=4))
            )
        else:
            self.evict_prefix(prefix, groups)
            return
        self.evict_keys(cached, keys)

    def evict_prefix(self, prefix: int, groups: tuple[int, ...]) -> None:
        cached = {key: ids for pool in self.pools for key, ids in pool.cache_entries()}
        mine = {(bytes(h), g) for h in PREFIX_HASHES[prefix] for g in groups}
        keys = [k for k in cached if (bytes(get_block_hash(k)), get_group_id(k)) in mine]
        self.evict_keys(cached, sorted(keys))

    def evict_keys(self, cached: dict[Any, list[int]], keys: list[Any]) -> None:
        if not keys:
            return
        by_group: dict[int, list[int]] = {}
        for key in keys:
            by_group.setdefault(get_group_id(key), []).extend(cached[key])
        self.mgr.evict_blocks(by_group)  # type: ignore[arg-type]
        remaining = {key for pool in self.pools for key, _ in pool.cache_entries()}
        assert not remaining & set(keys)

    @precondition(
        lambda self: self.index and all(t.state == "loading" for t in self.tracked.values())
    )
    @rule(mode=st.sampled_from(["prefix_reset", "connector_reset", "new_engine"]))
    @stepping
    def restart(self, mode: str) -> None:
        """The device forgets everything (when no request runs; loads may be in flight):

        * prefix_reset: every request ends (a load in flight completes first), then the
          pools' ``reset_prefix_cache``; the offload index is kept (vLLM's
          ``reset_prefix_cache`` without ``reset_connector``);
        * connector_reset: a new per-group manager, and the index's ``reset_cache``;
        * new_engine: a new per-group manager and a new CPU manager.

        In the last two, everything in flight is abandoned (vLLM never completes a job
        from before a connector reset)."""
        if mode == "prefix_reset":
            for rid, t in sorted(self.tracked.items()):
                if t.load is not None:
                    self.cpu.complete_load(t.load.keys, t.ctx)
                    for key in t.load.keys:
                        self.index[key].loads -= 1
                self.drop_request(rid)
            assert self.mgr.reset_prefix_cache()
            self.check_pools_empty()
            return
        known = list(self.index)
        self.tracked.clear()
        self.stores.clear()
        self.index.clear()
        self.stored.clear()
        self.rows.clear()
        self.announced.clear()
        if mode == "new_engine":
            self.cpu = CPUOffloadingManager(self.num_chunks, cache_policy="lru", enable_events=True)
            self.sched.manager = self.cpu
        else:
            self.cpu.reset_cache()
        self.new_device()
        self.check_pools_empty()
        status = manager_status(self.cpu)
        assert all(status(k) == "miss" for k in known)

    def check_pools_empty(self) -> None:
        """The device keeps nothing from before: every block free, nothing cached."""
        for pool in self.pools:
            assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
            assert not pool.cache_entries()

    # ------------------------------------------------------------- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cpu"):
            return
        self.check_device()
        self.check_index()
        self.account(
            (
                tuple(
                    (r, t.state, t.request.num_computed_tokens)
                    for r, t in sorted(self.tracked.items())
                ),
                self.pools.free_counts(),
                tuple(sorted(k for p in self.pools for k, _ in p.cache_entries())),
                tuple(sorted((k, e.chunk, e.ready, e.loads) for k, e in self.index.items())),
                len(self.stores),
            )
        )

    def check_device(self) -> None:
        for idx, pool in enumerate(self.pools):
            groups = {g for g in (FA, MAMBA) if self.pools.pool_index_of_group(g) == idx}
            check_our_pool(pool, [self.managers[g] for g in sorted(groups)], groups)
        for g in (FA, MAMBA):
            # A block is shared only through prefix hits: at most one holder allocated it.
            allocated: Counter[int] = Counter()
            for rid, t in self.tracked.items():
                for p, b in enumerate(self.blocks(rid, g)):
                    if not b.is_null and p >= t.hit_end:
                        allocated[b.block_id] += 1
                    if not b.is_null and p in t.final[g]:
                        assert self.device.get((g, b.block_id)) == truth(
                            g, t.request.block_hashes[p]
                        ), (rid, g, p)
            assert not [bid for bid, n in allocated.items() if n > 1], (g, allocated)
        for t in self.tracked.values():
            if t.load is not None:  # blocks being loaded are the loading request's alone
                for g, _, bid in t.load.dsts:
                    holders = [
                        r for r in self.tracked if bid in {b.block_id for b in self.blocks(r, g)}
                    ]
                    assert holders == [t.request.request_id], (g, bid, holders)
        # Every cached block holds what its key names (nothing torn or partial is cached).
        for pool in self.pools:
            for key, ids in pool.cache_entries():
                g = get_group_id(key)
                for bid in ids:
                    assert self.device.get((g, bid)) == truth(g, get_block_hash(key)), (g, bid)

    def check_index(self) -> None:
        cpu = self.cpu
        chunks = dict(cpu._policy.chunks)
        ids = [c.chunk_id for c in chunks.values()] + list(cpu._free_list)
        assert len(ids) == len(set(ids)), "a chunk ID held twice"
        assert len(ids) == cpu._num_allocated_chunks <= self.num_chunks
        assert all(0 <= i < cpu._num_allocated_chunks for i in ids)
        assert cpu._num_evictable_cache_chunks == sum(c.ref_cnt == 0 for c in chunks.values())
        assert cpu._num_write_pending_chunks == sum(c.ref_cnt == -1 for c in chunks.values())
        assert cpu._policy._evictable == {k for k, c in chunks.items() if c.ref_cnt == 0}
        assert chunks.keys() == self.index.keys()
        status = manager_status(cpu)
        for key, entry in self.index.items():
            chunk = chunks[key]
            assert chunk.chunk_id == entry.chunk
            assert chunk.ref_cnt == (entry.loads if entry.ready else -1)
            assert status(key) == self.status(key)
            # A key resolves to its own payload: its group's, its hash's.
            assert self.rows[entry.chunk] == self.stored[key] == key_truth(key)
            g = get_offload_group_idx(key)
            sibling = make_offload_key(get_offload_block_hash(key), 1 - g)
            assert sibling != key
            if sibling in self.index:
                assert self.index[sibling].chunk != entry.chunk
                assert self.rows[self.index[sibling].chunk][1] == 1 - g
        for ev in cpu.take_events():
            if ev.removed:
                self.announced.difference_update(ev.keys)
            else:
                self.announced.update(ev.keys)
        assert self.announced == {k for k, e in self.index.items() if e.ready}


OffloadMachine.TestCase.settings = settings(max_examples=budget(150), stateful_step_count=60)
test_offload_machine = OffloadMachine.TestCase


# ------------------------------------------------------------- groups that disagree
# (full-attention chunks present, Mamba chunks present, device hit, prompt tokens, hit)
DISAGREE = [
    ({0, 1, 2, 3}, {1}, 0, 70, 32),
    ({0, 1, 2, 3}, set(), 0, 70, 0),
    ({0, 1, 2, 3}, {3}, 0, 70, 64),
    ({0, 1, 2, 3}, {0, 2}, 0, 70, 48),
    ({0, 1}, {3}, 0, 70, 0),
    ({0, 1}, {1, 2}, 0, 70, 32),
    ({0, 1, 3}, {0, 3}, 0, 70, 16),
    (set(), {0, 1, 2, 3}, 0, 70, 0),
    ({0, 1, 2, 3}, {1, 2}, 32, 70, 16),
    ({0, 1, 2, 3}, {1}, 32, 70, 0),
    # The last prompt token is computed: 64 tokens cap the hit at 48.
    ({0, 1, 2, 3}, {3}, 0, 64, 0),
    ({0, 1, 2, 3}, {2, 3}, 0, 64, 48),
]


def disagreeing_index(
    fa: set[int],
    mamba: set[int],
    hashes: Sequence[bytes],
    pending: frozenset[OffloadKey] | set[OffloadKey] = frozenset(),
) -> CPUOffloadingManager:
    """A CPU index holding the full-attention keys of chunks ``fa`` and the Mamba keys of
    chunks ``mamba`` of ``hashes``, all ready except ``pending`` (stored, not completed)."""
    manager = CPUOffloadingManager(16, cache_policy="lru")
    ctx = ReqContext(req_id="writer")
    keys = [make_offload_key(hashes[j], FA) for j in sorted(fa)]
    keys += [make_offload_key(hashes[j], MAMBA) for j in sorted(mamba)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    manager.complete_store([k for k in keys if k not in pending], ctx)
    return manager


@pytest.mark.parametrize(("fa", "mamba", "start", "num_tokens", "want"), DISAGREE)
def test_groups_that_disagree(
    fa: set[int], mamba: set[int], start: int, num_tokens: int, want: int
) -> None:
    """Attention chunks in the index whose Mamba states are missing (or the reverse): the
    hit is the longest chunk-aligned prefix present in every group (for Mamba: the state
    at the boundary), 0 when no boundary has both; vLLM's scheduler finds the same."""
    request = new_request("q", PREFIXES[0][:num_tokens])
    manager = disagreeing_index(fa, mamba, request.block_hashes)
    assert modelled_hit(manager_status(manager), request.block_hashes, start, num_tokens) == want
    config = per_group_config(PER_GROUP_LAYOUTS[LAYOUT], [8, 4])
    assert real_hit(real_scheduler(config, manager), request, start, set()) == want


@pytest.mark.parametrize(("fa", "mamba", "start", "num_tokens", "want"), DISAGREE)
def test_disagreeing_groups_logged_at_debug(
    fa: set[int], mamba: set[int], start: int, num_tokens: int, want: int
) -> None:
    """With the plugin's hooks, vLLM's lookup says at debug level when the groups hold
    offloaded prefixes of different lengths beyond what is served (one line naming each
    group's extent), and stays silent when they agree; the hit is vLLM's either way."""
    request = new_request("q", PREFIXES[0][:num_tokens])
    manager = disagreeing_index(fa, mamba, request.block_hashes)
    sched = real_scheduler(per_group_config(PER_GROUP_LAYOUTS[LAYOUT], [8, 4]), manager)
    lines: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("vllm.hybrid_alloc")
    level, was_installed = log.level, offload.is_installed()
    log.addHandler(handler)
    try:
        offload.install()
        log.setLevel(logging.INFO)
        assert real_hit(sched, request, start, set()) == want
        assert not lines  # nothing computed or logged above debug level
        log.setLevel(logging.DEBUG)
        assert real_hit(sched, request, start, set()) == want
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        if not was_installed:
            offload.uninstall()
    fa_tokens = (max(fa) + 1) * CHUNK if fa else 0
    mamba_tokens = (max(mamba) + 1) * CHUNK if mamba else 0
    differ = fa_tokens != mamba_tokens and max(fa_tokens, mamba_tokens) > start + want
    assert lines == (
        [
            f"hybrid_alloc: request q: offloaded prefixes differ across KV-cache groups "
            f"(group {FA}: {fa_tokens} tokens, group {MAMBA}: {mamba_tokens} tokens); loading "
            f"{want} tokens, the longest prefix every group holds ({start} computed locally)"
        ]
        if differ
        else []
    )


# (full attention present, Mamba present, full attention pending, Mamba pending, hit)
PENDING = [
    ({0, 1, 2}, {2}, {1}, set(), None),  # a relied-on attention chunk is still stored
    ({0, 1, 2}, {1}, set(), {1}, None),  # the boundary state is still stored
    ({0, 1, 2}, {0}, {2}, set(), 16),  # pending past the boundary: not relied on
    ({0, 1, 2}, {0, 1}, set(), {1}, None),  # the last present state decides, pending
    ({0, 1}, {3}, {1}, set(), None),  # vLLM's quirk: the deferred prefix does not bound Mamba
    ({0, 1}, {0, 3}, set(), set(), 16),  # the same without anything pending
]


@pytest.mark.parametrize(("fa", "mamba", "fa_pending", "mamba_pending", "want"), PENDING)
def test_pending_chunks_defer(
    fa: set[int], mamba: set[int], fa_pending: set[int], mamba_pending: set[int], want: Any
) -> None:
    request = new_request("q", PREFIXES[1][:70])
    hashes = request.block_hashes
    pending = {make_offload_key(hashes[j], FA) for j in fa_pending}
    pending |= {make_offload_key(hashes[j], MAMBA) for j in mamba_pending}
    manager = disagreeing_index(fa, mamba, hashes, pending)
    assert modelled_hit(manager_status(manager), hashes, 0, 70) == want
    config = per_group_config(PER_GROUP_LAYOUTS[LAYOUT], [8, 4])
    assert real_hit(real_scheduler(config, manager), request, 0, set()) == want


def test_chunks_being_loaded_defer() -> None:
    """A relied-on key another request is loading defers the request (vLLM with GPU
    prefix caching); a scheduler that does not track loads serves it."""
    request = new_request("q", PREFIXES[0][:70])
    hashes = request.block_hashes
    manager = disagreeing_index({0, 1, 2, 3}, {1, 3}, hashes)
    sched = real_scheduler(per_group_config(PER_GROUP_LAYOUTS[LAYOUT], [8, 4]), manager)
    status = manager_status(manager)
    for loading, want in [
        ({make_offload_key(hashes[3], MAMBA)}, None),
        ({make_offload_key(hashes[1], MAMBA)}, 64),  # not relied on: the boundary is 64
        ({make_offload_key(hashes[0], FA)}, None),
        (set(), 64),
    ]:
        assert modelled_hit(status, hashes, 0, 70, frozenset(loading)) == want
        assert real_hit(sched, request, 0, loading) == want
    assert real_hit(sched, request, 0, None) == 64


def test_failed_load_keeps_keys_another_load_holds() -> None:
    """Two loads of the same chunks in flight (a scheduler that does not track loads):
    one fails in the Mamba group; its keys stay for the other load, which then serves
    them; a load that fails alone takes its keys out of the index."""
    machine = OffloadMachine()
    machine.build(reverse=True, attn_blocks=24, mamba_blocks=8, num_chunks=12)
    try:
        writer = machine.admit_request(0, 64, 5, True, True, 3, "now", ())
        assert writer is not None
        machine.restart("prefix_reset")
        first = machine.admit_request(0, 64, 7, False, True, 1, "now", ())
        second = machine.admit_request(0, 64, 9, False, True, 1, "now", ())
        assert first is not None and second is not None
        load_1, load_2 = machine.tracked[first].load, machine.tracked[second].load
        assert load_1 is not None and load_2 is not None
        assert load_1.keys == load_2.keys and len(load_1.keys) == 4  # 3 attention, 1 state
        machine.consistent()
        assert machine.fail_load(first, (MAMBA,)) == []
        status = manager_status(machine.cpu)
        assert all(status(k) == "hit" for k in load_2.keys)
        machine.consistent()
        machine.finish_load(second)
        machine.consistent()
        third = machine.admit_request(0, 64, 11, False, True, 1, "now", (MAMBA,))
        assert third is not None
        load_3 = machine.tracked[third].load
        assert load_3 is not None and load_3.keys == load_1.keys
        assert machine.fail_load(third, (FA,)) == load_3.keys
        assert all(status(k) == "miss" for k in load_3.keys)
        machine.consistent()
    finally:
        machine.teardown()
