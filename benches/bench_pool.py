#!/usr/bin/env python
"""Benchmark hybrid_alloc's Rust ``BlockPool`` against vLLM's stock ``BlockPool``.

Every measurement runs the SAME operation trace against both pools in one process,
interleaved (stock, ours, stock, ours, ...), so that machine noise hits both alike. Each
ratio is the median over repeats of ``stock_i / ours_i`` for back-to-back pairs; > 1 means
ours is faster. The table is printed and written to ``benches/RESULTS.md``.

    python benches/bench_pool.py            # full run (a few minutes on 2 cores)
    python benches/bench_pool.py --quick    # smoke run (under a minute)

Sections:

1. construction of a 1M-block pool;
2. per-block cost of each bulk pool operation on a 1M-block pool;
3. bookkeeping bytes per block;
4. cost of reading block attributes (vLLM's managers read them per block);
5. vLLM's own ``KVCacheManager`` driving a prefix-sharing request workload, once on each
   pool (block IDs are asserted identical).

The cyclic GC is disabled inside timed loops (after a full collection) so that a
collection landing in one side's loop does not decide the ratio; construction and the
manager loop's setup run with the GC on.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import vllm  # noqa: E402
import vllm.v1.core.kv_cache_coordinator as kv_cache_coordinator  # noqa: E402
from vllm.v1.core.block_pool import BlockPool as StockBlockPool  # noqa: E402

from hybrid_alloc.block_pool import BlockPool as OurBlockPool  # noqa: E402

HASH_BLOCK_SIZE = 16
BLOCK_SIZE = 16
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"

perf_ns = time.perf_counter_ns


# --------------------------------------------------------------------------- helpers
@dataclass
class FakeRequest:
    """The request fields a pool reads in ``cache_full_blocks``."""

    block_hashes: list[bytes]
    all_token_ids: list[int] = field(default_factory=list)
    lora_request: Any = None
    session_id: Any = None
    mm_features: list[Any] = field(default_factory=list)
    cache_salt: Any = None
    prompt_embeds: Any = None


def make_hashes(tag: str, n: int) -> list[bytes]:
    """``n`` distinct 32-byte block hashes (sha256 of a tag and an index)."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def make_request(tag: str, n: int) -> FakeRequest:
    return FakeRequest(
        block_hashes=make_hashes(tag, n),
        all_token_ids=[i % 32000 for i in range(n * BLOCK_SIZE)],
    )


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect, then keep the cyclic GC off for the timed block."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def ids(blocks: Sequence[Any]) -> list[int]:
    return [b.block_id for b in blocks]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


@dataclass
class Row:
    section: str
    op: str
    unit: str
    stock: float | None
    ours: float | None
    ratio: float | None
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def pair(
        self,
        section: str,
        op: str,
        unit: str,
        stock: Sequence[float],
        ours: Sequence[float],
        note: str = "",
    ) -> None:
        """Add a row from paired samples (``stock[i]`` and ``ours[i]`` back to back)."""
        ratios = [s / o for s, o in zip(stock, ours) if o > 0]
        self.rows.append(
            Row(
                section,
                op,
                unit,
                median(stock),
                median(ours),
                median(ratios) if ratios else None,
                note,
            )
        )

    def single(
        self,
        section: str,
        op: str,
        unit: str,
        stock: float | None,
        ours: float | None,
        note: str = "",
    ) -> None:
        ratio = stock / ours if stock is not None and ours else None
        self.rows.append(Row(section, op, unit, stock, ours, ratio, note))

    def same(self, what: str, stock: object, ours: object) -> None:
        """Record (without stopping) a difference in observable results."""
        if stock != ours:
            msg = f"{what}: stock={_short(stock)} ours={_short(ours)}"
            self.mismatches.append(msg)
            print(f"  !! MISMATCH {msg}", flush=True)


def _short(x: object, limit: int = 160) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "..."


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(rows: Sequence[Row]) -> str:
    head = "| # | operation | unit | stock | ours | stock/ours | note |"
    sep = "|---|---|---|---:|---:|---:|---|"
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r.section} | {r.op} | {r.unit} | {fmt(r.stock)} | {fmt(r.ours)} "
            f"| {fmt_ratio(r.ratio)} | {r.note} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class Config:
    quick: bool
    num_blocks: int
    repeats: int
    stock_builds: int
    ours_builds_per_stock: int
    mem_blocks_stock: int
    op_rounds: int
    attr_reads: int
    mgr_requests: int
    mgr_repeats: int
    mgr_num_blocks: int
    mgr_wave: int
    mgr_decode_steps: int
    seed: int = 0

    @staticmethod
    def make(quick: bool, num_blocks: int | None) -> Config:
        n = num_blocks or 1_000_000
        if quick:
            return Config(
                quick=True,
                num_blocks=n,
                repeats=3,
                stock_builds=1,
                ours_builds_per_stock=5,
                mem_blocks_stock=min(n, 100_000),
                op_rounds=4,
                attr_reads=20,
                mgr_requests=96,
                mgr_repeats=1,
                mgr_num_blocks=4096,
                mgr_wave=16,
                mgr_decode_steps=16,
            )
        return Config(
            quick=False,
            num_blocks=n,
            repeats=7,
            stock_builds=3,
            ours_builds_per_stock=5,
            mem_blocks_stock=n,
            op_rounds=12,
            attr_reads=200,
            mgr_requests=768,
            mgr_repeats=3,
            mgr_num_blocks=16_384,
            mgr_wave=16,
            mgr_decode_steps=32,
        )


# -------------------------------------------------------------- 1. construction
def bench_construction(cfg: Config, rep: Report) -> tuple[Any, Any]:
    """Time building a pool of ``num_blocks`` (GC on, as in vLLM). Returns the two pools
    used by the later sections."""
    n = cfg.num_blocks
    stock_ns: list[float] = []
    ours_ns: list[float] = []
    stock_pool: Any = None
    for i in range(cfg.stock_builds):
        stock_pool = None
        gc.collect()
        t0 = perf_ns()
        stock_pool = StockBlockPool(n, True, HASH_BLOCK_SIZE)
        stock_ns.append(perf_ns() - t0)
        for _ in range(cfg.ours_builds_per_stock):
            gc.collect()
            t0 = perf_ns()
            p = OurBlockPool(n, True, HASH_BLOCK_SIZE)
            ours_ns.append(perf_ns() - t0)
            del p
        print(
            f"  build {i + 1}/{cfg.stock_builds}: stock {stock_ns[-1] / 1e6:.0f} ms, "
            f"ours {min(ours_ns[-cfg.ours_builds_per_stock :]) / 1e6:.1f} ms",
            flush=True,
        )
    rep.single(
        "1",
        f"construct {n:,}-block pool",
        "ms",
        median(stock_ns) / 1e6,
        median(ours_ns) / 1e6,
        f"median of {len(stock_ns)} stock / {len(ours_ns)} ours builds",
    )
    ours_pool = OurBlockPool(n, True, HASH_BLOCK_SIZE)
    return stock_pool, ours_pool


# ---------------------------------------------------------- 2. bulk operations
Pools = tuple[tuple[str, Any], tuple[str, Any]]


def run_paired(
    pools: Pools,
    repeats: int,
    trace: Callable[[Any, int], dict[str, tuple[float, float]]],
) -> dict[str, tuple[list[float], list[float]]]:
    """Run ``trace(pool, rep)`` on both pools ``repeats`` times, alternating which pool
    goes first. ``trace`` returns ``{op: (ns_total, units)}``; the result maps each op to
    per-unit samples ``(stock, ours)``."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    (_, stock), (_, ours) = pools
    for r in range(-1, repeats):  # r == -1: warm-up, not recorded
        order = [(0, stock), (1, ours)] if r % 2 == 0 else [(1, ours), (0, stock)]
        for side, pool in order:
            with no_gc():
                res = trace(pool, r)
            if r < 0:
                continue
            for op, (ns, units) in res.items():
                out.setdefault(op, ([], []))[side].append(ns / units)
    return out


def bench_first_handout(pools: Pools, rep: Report) -> None:
    """Hand out every block once (batches of 256), then free them all. On a fresh pool of
    ours this creates every block handle; stock's blocks exist since construction."""
    results: dict[str, list[int]] = {}
    times: dict[str, tuple[float, float]] = {}
    for name, pool in pools:
        n = pool.get_num_free_blocks()
        with no_gc():
            t0 = perf_ns()
            lists = []
            left = n
            while left:
                k = min(256, left)
                lists.append(pool.get_new_blocks(k))
                left -= k
            t1 = perf_ns()
            for blocks in reversed(lists):
                pool.free_blocks(reversed(blocks))
            t2 = perf_ns()
        results[name] = [lst[0].block_id for lst in lists[:: max(1, len(lists) // 64)]]
        times[name] = ((t1 - t0) / n, (t2 - t1) / n)
        del lists
    rep.same("first hand-out block IDs", results["stock"], results["ours"])
    rep.single(
        "2",
        "get_new_blocks, first hand-out of all blocks (x256)",
        "ns/block",
        times["stock"][0],
        times["ours"][0],
        "ours creates each handle here; single run",
    )
    rep.single(
        "2",
        "free_blocks after first hand-out (x256)",
        "ns/block",
        times["stock"][1],
        times["ours"][1],
        "single run",
    )


def bench_alloc_free(cfg: Config, pools: Pools, rep: Report) -> None:
    for batch in (16, 64, 256):
        nbatch = max(8, 16384 // batch)
        seen: dict[int, list[int]] = {}

        def trace(
            pool: Any, r: int, batch: int = batch, nbatch: int = nbatch, seen: Any = seen
        ) -> dict[str, tuple[float, float]]:
            rounds = cfg.op_rounds
            ta = tf = 0
            for _ in range(rounds):
                t0 = perf_ns()
                lists = [pool.get_new_blocks(batch) for _ in range(nbatch)]
                t1 = perf_ns()
                for blocks in reversed(lists):
                    pool.free_blocks(reversed(blocks))
                t2 = perf_ns()
                ta += t1 - t0
                tf += t2 - t1
            if r == 0:
                seen.setdefault(id(pool), ids(lists[-1]))
            units = rounds * nbatch * batch
            return {"get_new_blocks": (ta, units), "free_blocks": (tf, units)}

        res = run_paired(pools, cfg.repeats, trace)
        got = list(seen.values())
        if len(got) == 2:
            rep.same(f"alloc x{batch} block IDs", got[0], got[1])
        rep.pair("2", f"get_new_blocks(n={batch})", "ns/block", *res["get_new_blocks"])
        rep.pair(
            "2",
            f"free_blocks(reversed(<{batch} uncached>))",
            "ns/block",
            *res["free_blocks"],
        )


def bench_touch(cfg: Config, pools: Pools, rep: Report) -> None:
    """Prefix-cache hits on cached *free* blocks: touch (leaves the free queue), then free
    again (back to the tail, cached)."""
    for n in (64, 256):
        req = make_request(f"touch{n}", n)
        held: dict[int, list[Any]] = {}
        for _, pool in pools:
            blocks = pool.get_new_blocks(n)
            pool.cache_full_blocks(req, blocks, 0, n, BLOCK_SIZE, 0)
            pool.free_blocks(reversed(blocks))
            held[id(pool)] = blocks

        def trace(
            pool: Any, r: int, held: Any = held, n: int = n
        ) -> dict[str, tuple[float, float]]:
            blocks = held[id(pool)]
            tt = tf = 0
            cycles = cfg.op_rounds * 16
            for _ in range(cycles):
                t0 = perf_ns()
                pool.touch(blocks)
                t1 = perf_ns()
                pool.free_blocks(reversed(blocks))
                t2 = perf_ns()
                tt += t1 - t0
                tf += t2 - t1
            return {"touch": (tt, cycles * n), "free": (tf, cycles * n)}

        res = run_paired(pools, cfg.repeats, trace)
        rep.pair("2", f"touch(<{n} cached free blocks>)", "ns/block", *res["touch"])
        rep.pair("2", f"free_blocks(reversed(<{n} cached>))", "ns/block", *res["free"])
        (_, sp), (_, op) = pools
        rep.same(
            f"touch{n} free-count after",
            sp.get_num_free_blocks(),
            op.get_num_free_blocks(),
        )
        for _, pool in pools:
            pool.evict_blocks({b.block_id for b in held[id(pool)]})


def bench_cache_and_evict(cfg: Config, pools: Pools, rep: Report) -> None:
    """cache_full_blocks for a fresh request of n blocks (blocks allocated untimed), then
    evict_blocks of those IDs, then free (untimed)."""
    for n in (64, 256):
        total = (cfg.repeats + 1) * cfg.op_rounds * 4
        reqs = [make_request(f"cfb{n}/{i}", n) for i in range(total)]
        cursor = {"stock": 0, "ours": 0}
        names = {id(p): name for name, p in pools}

        def trace(
            pool: Any, r: int, reqs: Any = reqs, cursor: Any = cursor, n: int = n
        ) -> dict[str, tuple[float, float]]:
            name = names[id(pool)]
            tc = te = 0
            rounds = cfg.op_rounds * 4
            for _ in range(rounds):
                req = reqs[cursor[name]]
                cursor[name] += 1
                blocks = pool.get_new_blocks(n)
                block_ids = {b.block_id for b in blocks}
                t0 = perf_ns()
                pool.cache_full_blocks(req, blocks, 0, n, BLOCK_SIZE, 0)
                t1 = perf_ns()
                pool.evict_blocks(block_ids)
                t2 = perf_ns()
                pool.free_blocks(reversed(blocks))
                tc += t1 - t0
                te += t2 - t1
            return {"cache": (tc, rounds * n), "evict": (te, rounds * n)}

        res = run_paired(pools, cfg.repeats, trace)
        rep.pair(
            "2", f"cache_full_blocks(request of {n} blocks)", "ns/block", *res["cache"]
        )
        rep.pair("2", f"evict_blocks(<{n} cached, held IDs>)", "ns/block", *res["evict"])


def bench_lookup(cfg: Config, pools: Pools, rep: Report) -> dict[int, list[Any]]:
    """get_cached_block per hash (hits and misses) and a whole-prefix lookup. Returns the
    256 cached, held blocks of each pool (by ``id(pool)``) for the attribute benchmark."""
    n = 256
    req = make_request("lookup", n)
    misses = make_hashes("lookup-miss", n)
    held: dict[int, list[Any]] = {}
    for _, pool in pools:
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(req, blocks, 0, n, BLOCK_SIZE, 0)
        held[id(pool)] = blocks
    group_ids = [0]
    hashes = req.block_hashes
    loops = cfg.op_rounds * 8
    found: dict[str, list[int]] = {}
    names = {id(p): name for name, p in pools}

    def trace_hit(pool: Any, r: int) -> dict[str, tuple[float, float]]:
        get = pool.get_cached_block
        t0 = perf_ns()
        for _ in range(loops):
            for h in hashes:
                get(h, group_ids)
        t1 = perf_ns()
        for _ in range(loops):
            for h in misses:
                get(h, group_ids)
        t2 = perf_ns()
        return {"hit": (t1 - t0, loops * n), "miss": (t2 - t1, loops * n)}

    res = run_paired(pools, cfg.repeats, trace_hit)
    rep.pair("2", "get_cached_block(hash, [0]) hit", "ns/call", *res["hit"])
    rep.pair("2", "get_cached_block(hash, [0]) miss", "ns/call", *res["miss"])

    def manager_loop(pool: Any) -> list[Any]:
        # What vLLM's FullAttentionManager.find_longest_cache_hit does per block.
        computed: tuple[list[Any], ...] = ([],)
        for h in hashes:
            cached = pool.get_cached_block(h, group_ids)
            if not cached:
                break
            for lst, blk in zip(computed, cached):
                lst.append(blk)
        return computed[0]

    def trace_prefix(pool: Any, r: int) -> dict[str, tuple[float, float]]:
        name = names[id(pool)]
        t0 = perf_ns()
        for _ in range(loops):
            if name == "ours":
                got = pool.get_cached_prefix(hashes, group_ids, n)[0]
            else:
                got = manager_loop(pool)
        t1 = perf_ns()
        if r == 0:
            found[name] = ids(got)
        return {"prefix": (t1 - t0, loops * n)}

    res = run_paired(pools, cfg.repeats, trace_prefix)
    rep.pair(
        "2",
        f"prefix lookup, {n} hits: stock loop of get_cached_block vs ours get_cached_prefix",
        "ns/block",
        *res["prefix"],
    )
    rep.same("prefix lookup block IDs", found.get("stock"), found.get("ours"))

    # Ours also through the same Python loop, to separate batching from per-call speed.
    (_, stock), (_, ours) = pools
    s_ns: list[float] = []
    o_ns: list[float] = []
    for _ in range(cfg.repeats):
        for pool, sink in ((stock, s_ns), (ours, o_ns)):
            with no_gc():
                t0 = perf_ns()
                for _ in range(loops):
                    manager_loop(pool)
                sink.append((perf_ns() - t0) / (loops * n))
    rep.pair(
        "2",
        f"prefix lookup, {n} hits: manager-style loop on both",
        "ns/block",
        s_ns,
        o_ns,
    )

    def trace_free_count(pool: Any, r: int) -> dict[str, tuple[float, float]]:
        f = pool.get_num_free_blocks
        calls = loops * 64
        t0 = perf_ns()
        for _ in range(calls):
            f()
        return {"x": (perf_ns() - t0, calls)}

    res = run_paired(pools, cfg.repeats, trace_free_count)
    rep.pair("2", "get_num_free_blocks()", "ns/call", *res["x"])
    return held


# ------------------------------------------------------------------ 3. memory
def bench_memory(cfg: Config, rep: Report) -> None:
    n_stock = cfg.mem_blocks_stock
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    stock = StockBlockPool(n_stock, True, HASH_BLOCK_SIZE)
    stock_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del stock
    gc.collect()

    n = cfg.num_blocks
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ours = OurBlockPool(n, True, HASH_BLOCK_SIZE)
    ours_py_build = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    native_build = ours.bookkeeping_bytes()

    # Hand every block to Python once: each gets a handle object kept by the pool.
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    lists = [ours.get_new_blocks(min(256, n - 1 - i)) for i in range(0, n - 1, 256)]
    for blocks in reversed(lists):
        ours.free_blocks(reversed(blocks))
    del lists, blocks
    gc.collect()
    handle_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    native_after = ours.bookkeeping_bytes()
    num_handles = ours.num_handles()
    del ours
    gc.collect()

    stock_pb = stock_bytes / n_stock
    rep.single(
        "3",
        "bytes/block at construction",
        "B/block",
        stock_pb,
        (native_build + ours_py_build) / n,
        f"stock: tracemalloc over a {n_stock:,}-block build; ours: bookkeeping_bytes() "
        f"{native_build / n:.1f} + Python {ours_py_build / n:.2f}",
    )
    rep.single(
        "3",
        "bytes/block after every block was handed to Python",
        "B/block",
        stock_pb,
        (native_after + handle_bytes) / n,
        f"ours: bookkeeping_bytes() {native_after / n:.1f} + {num_handles:,} handles "
        f"{handle_bytes / n:.1f} (tracemalloc)",
    )


# ------------------------------------------------------------- 4. attribute reads
def bench_attrs(cfg: Config, pools: Pools, held: dict[int, list[Any]], rep: Report) -> None:
    """ns per attribute read on 256 held blocks (cached: block_hash is bytes) and on 256
    held uncached blocks; the bare loop's cost is subtracted."""
    uncached = {id(p): p.get_new_blocks(256) for _, p in pools}
    reads = cfg.attr_reads

    def timed(fn: Callable[[list[Any]], None], blocks: list[Any]) -> float:
        t0 = perf_ns()
        for _ in range(reads):
            fn(blocks)
        return (perf_ns() - t0) / (reads * len(blocks))

    def bare(bs: list[Any]) -> None:
        for _b in bs:
            pass

    def block_id(bs: list[Any]) -> None:
        for b in bs:
            b.block_id  # noqa: B018

    def ref_cnt(bs: list[Any]) -> None:
        for b in bs:
            b.ref_cnt  # noqa: B018

    def is_null(bs: list[Any]) -> None:
        for b in bs:
            b.is_null  # noqa: B018

    def block_hash(bs: list[Any]) -> None:
        for b in bs:
            b.block_hash  # noqa: B018

    def ref_inc_dec(bs: list[Any]) -> None:
        for b in bs:
            b.ref_cnt += 1
            b.ref_cnt -= 1

    cases: list[tuple[str, Callable[[list[Any]], None], dict[int, list[Any]]]] = [
        ("blk.block_id", block_id, held),
        ("blk.ref_cnt", ref_cnt, held),
        ("blk.is_null", is_null, held),
        ("blk.block_hash (cached block: bytes)", block_hash, held),
        ("blk.block_hash (uncached block: None)", block_hash, uncached),
        ("blk.ref_cnt += 1; blk.ref_cnt -= 1 (2 reads + 2 writes)", ref_inc_dec, held),
    ]
    (_, stock), (_, ours) = pools
    for label, fn, src in cases:
        s_ns: list[float] = []
        o_ns: list[float] = []
        for r in range(cfg.repeats):
            order = [(stock, s_ns), (ours, o_ns)]
            if r % 2:
                order.reverse()
            for pool, sink in order:
                blocks = src[id(pool)]
                with no_gc():
                    base = timed(bare, blocks)
                    sink.append(max(timed(fn, blocks) - base, 0.1))
        rep.pair("4", label, "ns/read", s_ns, o_ns)
    s_h = [b.block_hash for b in held[id(stock)]]
    o_h = [b.block_hash for b in held[id(ours)]]
    rep.same("block_hash values of cached blocks", s_h, o_h)
    rep.same(
        "ref_cnt of held blocks",
        [b.ref_cnt for b in held[id(stock)]],
        [b.ref_cnt for b in held[id(ours)]],
    )
    for _, pool in pools:
        pool.free_blocks(reversed(uncached[id(pool)]))
        pool.free_blocks(reversed(held[id(pool)]))


# ---------------------------------------------------------- 5. KVCacheManager loop
@dataclass(frozen=True)
class Workload:
    """Request ``i`` = shared prefix ``prefix_of[i]`` + a unique suffix of
    ``suffix_len[i]`` tokens; ``decode`` decode steps each."""

    prefixes: list[list[int]]
    prefix_of: list[int]
    suffix_len: list[int]
    decode: int
    wave: int


def make_workload(cfg: Config) -> Workload:
    rng = random.Random(cfg.seed)
    num_prefixes = 8
    prefixes = [
        [rng.randrange(32000) for _ in range(rng.randrange(1024, 4097))]
        for _ in range(num_prefixes)
    ]
    # Zipf-ish popularity: a few system prompts dominate.
    weights = [1.0 / (k + 1) for k in range(num_prefixes)]
    prefix_of = rng.choices(range(num_prefixes), weights, k=cfg.mgr_requests)
    suffix_len = [rng.randrange(32, 513) for _ in range(cfg.mgr_requests)]
    return Workload(prefixes, prefix_of, suffix_len, cfg.mgr_decode_steps, cfg.mgr_wave)


def build_requests(w: Workload, hasher: Callable[[Any], list[Any]], salt: int) -> list[Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(1234)
    reqs = []
    for i, (p, s) in enumerate(zip(w.prefix_of, w.suffix_len)):
        tokens = w.prefixes[p] + [rng.randrange(32000) for _ in range(s)]
        reqs.append(
            Request(
                request_id=f"req-{salt}-{i}",
                prompt_token_ids=tokens,
                sampling_params=SamplingParams(max_tokens=w.decode + 1),
                pooling_params=None,
                block_hasher=hasher,
            )
        )
    return reqs


def make_manager(num_blocks: int, max_model_len: int) -> Any:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=HASH_BLOCK_SIZE,
        enable_caching=True,
    )


@dataclass
class MgrRun:
    ns_manager: int
    ns_build: int
    trace: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    free_after: int


def run_manager(cfg: Config, w: Workload, reqs: list[Any], ours: bool) -> MgrRun:
    """Drive one KVCacheManager over the workload; time only the manager calls."""
    from vllm.v1.request import RequestStatus

    saved = kv_cache_coordinator.BlockPool
    if ours:
        kv_cache_coordinator.BlockPool = OurBlockPool  # type: ignore[misc,assignment]
    try:
        t0 = perf_ns()
        mgr = make_manager(cfg.mgr_num_blocks, 8192)
        ns_build = perf_ns() - t0
    finally:
        kv_cache_coordinator.BlockPool = saved  # type: ignore[misc]
    assert isinstance(mgr.block_pool, OurBlockPool if ours else StockBlockPool)

    trace: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    ns = 0
    next_token = 7
    with no_gc():
        for start in range(0, len(reqs), w.wave):
            wave = reqs[start : start + w.wave]
            prefill: dict[str, tuple[int, ...]] = {}
            hits: dict[str, int] = {}
            for req in wave:
                t0 = perf_ns()
                blocks, num_hit, _ = mgr.get_computed_blocks(req)
                new = mgr.allocate_slots(
                    req,
                    req.num_tokens - num_hit,
                    num_new_computed_tokens=num_hit,
                    new_computed_blocks=blocks,
                )
                ns += perf_ns() - t0
                assert new is not None, "pool too small for the workload"
                prefill[req.request_id] = tuple(mgr.get_block_ids(req.request_id)[0])
                hits[req.request_id] = num_hit
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = req.num_tokens
                req.append_output_token_ids(next_token)
            for _step in range(w.decode):
                for req in wave:
                    t0 = perf_ns()
                    new = mgr.allocate_slots(req, 1)
                    ns += perf_ns() - t0
                    assert new is not None, "pool too small for the workload"
                    req.num_computed_tokens += 1
                    next_token = (next_token * 1103515245 + 12345) % 32000
                    req.append_output_token_ids(next_token)
            for req in wave:
                final = tuple(mgr.get_block_ids(req.request_id)[0])
                trace.append((hits[req.request_id], prefill[req.request_id], final))
                t0 = perf_ns()
                mgr.free(req)
                ns += perf_ns() - t0
    return MgrRun(ns, ns_build, trace, mgr.block_pool.get_num_free_blocks())


def bench_manager(cfg: Config, rep: Report) -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(HASH_BLOCK_SIZE, sha256)
    w = make_workload(cfg)
    n = len(w.prefix_of)
    s_ns: list[float] = []
    o_ns: list[float] = []
    s_build: list[float] = []
    o_build: list[float] = []
    ref: MgrRun | None = None
    for r in range(-1, cfg.mgr_repeats):  # r == -1: warm-up
        sides = [False, True] if r % 2 == 0 else [True, False]
        for use_ours in sides:
            reqs = build_requests(w, hasher, salt=0)
            run = run_manager(cfg, w, reqs, use_ours)
            if ref is None:
                ref = run
            else:
                # Apples to apples: the same hits and block IDs for every request.
                for i, (a, b) in enumerate(zip(ref.trace, run.trace)):
                    assert a == b, (
                        f"request {i}: block IDs differ between runs "
                        f"(hit tokens, prefill IDs, final IDs):\n{a}\n{b}"
                    )
                assert len(ref.trace) == len(run.trace)
                assert ref.free_after == run.free_after
            if r >= 0:
                (o_ns if use_ours else s_ns).append(run.ns_manager / n)
                (o_build if use_ours else s_build).append(run.ns_build / 1e6)
            print(
                f"  manager run {'ours ' if use_ours else 'stock'}: "
                f"{run.ns_manager / n / 1e3:.1f} us/request",
                flush=True,
            )
    assert ref is not None
    hit_tokens = sum(t[0] for t in ref.trace)
    prompt_tokens = sum(len(w.prefixes[p]) + s for p, s in zip(w.prefix_of, w.suffix_len))
    blocks_per_req = sum(len(t[2]) for t in ref.trace) / n
    desc = (
        f"{n} requests, prompt 1-4.5k tokens ({len(w.prefixes)} shared prefixes, "
        f"{hit_tokens / prompt_tokens:.0%} tokens hit), {w.decode} decode steps, "
        f"waves of {w.wave}, {cfg.mgr_num_blocks:,}-block pool, "
        f"{blocks_per_req:.0f} blocks/request"
    )
    rep.pair("5", "KVCacheManager request loop", "us/request", *_scale(s_ns, o_ns, 1e-3), desc)
    rep.pair(
        "5",
        f"KVCacheManager construction ({cfg.mgr_num_blocks:,} blocks)",
        "ms",
        s_build,
        o_build,
    )
    rep.notes.append(
        "Section 5 asserted identical prefix hits and block IDs (after prefill and after "
        f"the last decode step) for all {n} requests in every run, stock and ours."
    )


def _scale(a: list[float], b: list[float], k: float) -> tuple[list[float], list[float]]:
    return [x * k for x in a], [x * k for x in b]


# -------------------------------------------------------------------- reporting
def machine() -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    import hybrid_alloc

    return [
        f"CPU: {cpu}, {os.cpu_count()} cores ({platform.machine()})",
        f"OS: {platform.system()} {platform.release()}",
        f"Python: {platform.python_implementation()} {platform.python_version()}",
        f"vLLM: {vllm.__version__}; torch {torch.__version__}; "
        f"hybrid_alloc {hybrid_alloc.__version__}",
        f"Date: {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
    ]


def write_results(cfg: Config, rep: Report, elapsed: float, path: Path) -> None:
    argv = " ".join(["python", "benches/bench_pool.py", *sys.argv[1:]])
    lines = [
        "# hybrid_alloc BlockPool vs vLLM's stock BlockPool",
        "",
        "Generated by `benches/bench_pool.py`; do not edit by hand.",
        "",
        f"Command: `{argv}` ({'quick' if cfg.quick else 'full'} run, {elapsed:.0f} s)",
        "",
        *[f"- {m}" for m in machine()],
        "",
        "Every row runs the same operation trace on both pools in one process, "
        "interleaved. Values are medians over repeats; `stock/ours` is the median of "
        "per-repeat ratios of back-to-back pairs (> 1: ours is faster). Pools are built "
        f"with `enable_caching=True`, `hash_block_size={HASH_BLOCK_SIZE}`, "
        f"{cfg.num_blocks:,} blocks unless stated; {cfg.repeats} repeats (1 warm-up "
        "discarded). The cyclic GC is off inside timed loops. The machine was shared with "
        "other jobs, so single numbers are noisy; ratios are the figures to read.",
        "",
        table(rep.rows),
        "",
    ]
    if rep.notes:
        lines += ["Notes:", "", *[f"- {n}" for n in rep.notes], ""]
    if rep.mismatches:
        lines += ["Differences between stock and ours:", ""]
        lines += [f"- {m}" for m in rep.mismatches]
    else:
        lines.append(
            "No observable difference between stock and ours was found (block IDs, "
            "hashes, reference counts and free counts compared along the traces)."
        )
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run (< 1 min)")
    ap.add_argument("--blocks", type=int, default=None, help="pool size (default 1M)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to write RESULTS.md")
    ap.add_argument(
        "--only", default="12345", help="sections to run, e.g. 25 (default all)"
    )
    args = ap.parse_args(argv)
    cfg = Config.make(args.quick, args.blocks)
    rep = Report()
    t_start = time.perf_counter()

    def section(title: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {title}", flush=True)

    if "1" in args.only or "2" in args.only or "4" in args.only:
        section("1. construction")
        stock, ours = bench_construction(cfg, rep)
        pools: Pools = (("stock", stock), ("ours", ours))
        if "2" in args.only or "4" in args.only:
            section("2. bulk operations")
            bench_first_handout(pools, rep)
            bench_alloc_free(cfg, pools, rep)
            bench_touch(cfg, pools, rep)
            bench_cache_and_evict(cfg, pools, rep)
            held = bench_lookup(cfg, pools, rep)
            section("4. attribute reads")
            bench_attrs(cfg, pools, held, rep)
            rep.same(
                "free blocks at the end of sections 2 and 4",
                stock.get_num_free_blocks(),
                ours.get_num_free_blocks(),
            )
        del pools, stock, ours
        gc.collect()
    if "3" in args.only:
        section("3. memory")
        bench_memory(cfg, rep)
    if "5" in args.only:
        section("5. KVCacheManager loop")
        bench_manager(cfg, rep)

    rows = sorted(rep.rows, key=lambda r: r.section)
    rep.rows = rows
    elapsed = time.perf_counter() - t_start
    print()
    print(table(rows))
    if rep.mismatches:
        print("\nDIFFERENCES between stock and ours:")
        for m in rep.mismatches:
            print(f"  - {m}")
    write_results(cfg, rep, elapsed, args.out)
    print(f"\nwrote {args.out} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
