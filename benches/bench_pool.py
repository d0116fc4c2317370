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
5. vLLM's own ``KVCacheManager`` driving a prefix-sharing request workload: on the stock
   pool, on ours as the hybrid_alloc plugin installs it (pool
   + ``hybrid_alloc.integration.scheduler.manager_patches``)
   and on our pool alone, in lockstep; prefix
   hits and block IDs are asserted identical.

Live objects are frozen out of the GC after start-up (``gc.freeze()``, as vLLM's engine
does) and the cyclic GC is off inside timed loops, so that a collection landing in one
side's loop does not decide the ratio; construction runs with the GC on.
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

import vllm
import vllm.v1.core.kv_cache_coordinator as kv_cache_coordinator
from vllm.v1.core.block_pool import BlockPool as StockBlockPool
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from hybrid_alloc.integration.scheduler import manager_patches
from hybrid_alloc.integration.scheduler.block_pool import BlockPool as OurBlockPool

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


def settle() -> None:
    """Collect, then move every live object to the permanent generation (as vLLM's engine
    does after start-up with ``gc.freeze()``) so later collections stay cheap."""
    gc.collect()
    gc.freeze()


def release() -> None:
    """Unfreeze, collect (frees dropped pools, whose blocks form cycles), refreeze."""
    gc.unfreeze()
    settle()


@contextmanager
def no_gc() -> Iterator[None]:
    """Keep the cyclic GC off for the timed block."""
    was = gc.isenabled()
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
    load_start: str = ""

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
        ratios = [s / o for s, o in zip(stock, ours, strict=True) if o > 0]
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
                mgr_repeats=3,
                mgr_num_blocks=4096,
                mgr_wave=16,
                mgr_decode_steps=16,
            )
        return Config(
            quick=False,
            num_blocks=n,
            repeats=9,
            stock_builds=3,
            ours_builds_per_stock=5,
            mem_blocks_stock=n,
            op_rounds=24,
            attr_reads=400,
            mgr_requests=768,
            mgr_repeats=5,
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
        f"median of {len(stock_ns)} stock / {len(ours_ns)} ours builds (GC on)",
    )
    ours_pool = OurBlockPool(n, True, HASH_BLOCK_SIZE)
    return stock_pool, ours_pool


# ---------------------------------------------------------- 2. bulk operations
Pools = tuple[tuple[str, Any], tuple[str, Any]]


def run_paired(
    pools: Pools,
    repeats: int,
    trace: Callable[[Any, int], dict[str, tuple[list[int], int]]],
) -> dict[str, tuple[list[float], list[float]]]:
    """Run ``trace(pool, rep)`` on both pools ``repeats`` times, alternating which pool
    goes first. ``trace`` returns ``{op: (ns of each round, units per round)}``; a sample
    is the median round's ns per unit (a round preempted by another process does not
    count). The result maps each op to the samples ``(stock, ours)``."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    (_, stock), (_, ours) = pools
    for r in range(-1, repeats):  # r == -1: warm-up, not recorded
        order = [(0, stock), (1, ours)] if r % 2 == 0 else [(1, ours), (0, stock)]
        for side, pool in order:
            with no_gc():
                res = trace(pool, r)
            if r < 0:
                continue
            for op, (rounds, units) in res.items():
                out.setdefault(op, ([], []))[side].append(median(rounds) / units)
    return out


def hand_out_all(pool: Any) -> tuple[int, int, list[int]]:
    """Hand out every free block (batches of 256), then free them all, as requests would
    (last batch first, each batch reversed). Returns the ns of each half and sampled IDs."""
    n = pool.get_num_free_blocks()
    with no_gc():
        t0 = perf_ns()
        lists = [pool.get_new_blocks(min(256, n - i)) for i in range(0, n, 256)]
        t1 = perf_ns()
        for blocks in reversed(lists):
            pool.free_blocks(reversed(blocks))
        t2 = perf_ns()
    return t1 - t0, t2 - t1, [lst[0].block_id for lst in lists[:: max(1, len(lists) // 64)]]


def bench_first_handout(cfg: Config, pools: Pools, rep: Report) -> None:
    """Hand out every block once, then free them all. On a fresh pool of ours this creates
    every block handle; stock's blocks exist since construction. Trial 0 runs on the two
    main pools; later trials time a fresh pool of ours (and replay the trace, untimed, on
    our main pool so that both main pools stay in the same state)."""
    (_, stock), (_, ours) = pools
    n = stock.get_num_free_blocks()
    alloc: tuple[list[float], list[float]] = ([], [])
    free: tuple[list[float], list[float]] = ([], [])
    for trial in range(2 if cfg.quick else 5):
        sides: list[tuple[int, Any]] = [(0, stock)]
        fresh = ours if trial == 0 else OurBlockPool(cfg.num_blocks, True, HASH_BLOCK_SIZE)
        sides.append((1, fresh))
        if trial % 2:
            sides.reverse()
        got: dict[int, list[int]] = {}
        for side, pool in sides:
            ta, tf, got[side] = hand_out_all(pool)
            alloc[side].append(ta / n)
            free[side].append(tf / n)
        if fresh is ours:
            rep.same("first hand-out block IDs", got[0], got[1])
        else:
            _, _, main_ids = hand_out_all(ours)
            rep.same(f"hand-out replay block IDs (trial {trial})", got[0], main_ids)
            del fresh
            gc.collect()
    rep.pair(
        "2",
        "get_new_blocks, first hand-out of all blocks (x256)",
        "ns/block",
        *alloc,
        "ours creates each block's handle here",
    )
    rep.pair("2", "free_blocks after the first hand-out (x256)", "ns/block", *free)


def bench_alloc_free(cfg: Config, pools: Pools, rep: Report) -> None:
    for batch in (16, 64, 256):
        nbatch = max(8, 16384 // batch)
        seen: dict[int, list[int]] = {}

        def trace(
            pool: Any, r: int, batch: int = batch, nbatch: int = nbatch, seen: Any = seen
        ) -> dict[str, tuple[list[int], int]]:
            ta: list[int] = []
            tf: list[int] = []
            for _ in range(cfg.op_rounds):
                t0 = perf_ns()
                lists = [pool.get_new_blocks(batch) for _ in range(nbatch)]
                t1 = perf_ns()
                for blocks in reversed(lists):
                    pool.free_blocks(reversed(blocks))
                t2 = perf_ns()
                ta.append(t1 - t0)
                tf.append(t2 - t1)
            if r == 0:
                seen.setdefault(id(pool), ids(lists[-1]))
            units = nbatch * batch
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
        ) -> dict[str, tuple[list[int], int]]:
            blocks = held[id(pool)]
            tt: list[int] = []
            tf: list[int] = []
            for _ in range(cfg.op_rounds):
                a = b = 0
                for _ in range(16):
                    t0 = perf_ns()
                    pool.touch(blocks)
                    t1 = perf_ns()
                    pool.free_blocks(reversed(blocks))
                    t2 = perf_ns()
                    a += t1 - t0
                    b += t2 - t1
                tt.append(a)
                tf.append(b)
            return {"touch": (tt, 16 * n), "free": (tf, 16 * n)}

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
    names = {id(p): name for name, p in pools}
    for n in (64, 256):
        total = (cfg.repeats + 1) * cfg.op_rounds * 4
        reqs = [make_request(f"cfb{n}/{i}", n) for i in range(total)]
        cursor = {"stock": 0, "ours": 0}

        def trace(
            pool: Any, r: int, reqs: Any = reqs, cursor: Any = cursor, n: int = n
        ) -> dict[str, tuple[list[int], int]]:
            name = names[id(pool)]
            tc: list[int] = []
            te: list[int] = []
            for _ in range(cfg.op_rounds * 4):
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
                tc.append(t1 - t0)
                te.append(t2 - t1)
            return {"cache": (tc, n), "evict": (te, n)}

        res = run_paired(pools, cfg.repeats, trace)
        rep.pair("2", f"cache_full_blocks(request of {n} blocks)", "ns/block", *res["cache"])
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
    rounds = cfg.op_rounds
    loops = 8  # passes over the 256 hashes per round
    found: dict[str, list[int]] = {}
    names = {id(p): name for name, p in pools}

    def trace_hit(pool: Any, r: int) -> dict[str, tuple[list[int], int]]:
        get = pool.get_cached_block
        th: list[int] = []
        tm: list[int] = []
        for _ in range(rounds):
            t0 = perf_ns()
            for _ in range(loops):
                for h in hashes:
                    get(h, group_ids)
            t1 = perf_ns()
            for _ in range(loops):
                for h in misses:
                    get(h, group_ids)
            t2 = perf_ns()
            th.append(t1 - t0)
            tm.append(t2 - t1)
        return {"hit": (th, loops * n), "miss": (tm, loops * n)}

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
            for lst, blk in zip(computed, cached, strict=True):
                lst.append(blk)
        return computed[0]

    def trace_prefix(pool: Any, r: int) -> dict[str, tuple[list[int], int]]:
        name = names[id(pool)]
        tp: list[int] = []
        tl: list[int] = []
        for _ in range(rounds):
            t0 = perf_ns()
            for _ in range(loops):
                if name == "ours":
                    got = pool.get_cached_prefix(hashes, group_ids, n)[0]
                else:
                    got = manager_loop(pool)
            t1 = perf_ns()
            for _ in range(loops):
                manager_loop(pool)
            t2 = perf_ns()
            tp.append(t1 - t0)
            tl.append(t2 - t1)
        if r == 0:
            found[name] = ids(got)
        return {"prefix": (tp, loops * n), "loop": (tl, loops * n)}

    res = run_paired(pools, cfg.repeats, trace_prefix)
    rep.pair(
        "2",
        f"prefix lookup, {n} hits: stock loop of get_cached_block vs ours get_cached_prefix",
        "ns/block",
        *res["prefix"],
    )
    rep.same("prefix lookup block IDs", found.get("stock"), found.get("ours"))
    # Ours also through vLLM's per-block Python loop: batching vs per-call speed.
    rep.pair(
        "2",
        f"prefix lookup, {n} hits: vLLM-style loop of get_cached_block on both",
        "ns/block",
        *res["loop"],
    )

    def trace_free_count(pool: Any, r: int) -> dict[str, tuple[list[int], int]]:
        f = pool.get_num_free_blocks
        calls = 4096
        out: list[int] = []
        for _ in range(rounds):
            t0 = perf_ns()
            for _ in range(calls):
                f()
            out.append(perf_ns() - t0)
        return {"x": (out, calls)}

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
    held uncached blocks; the bare loop's cost is subtracted. Each sample is the best of 5
    chunks; the row shows the median sample."""
    uncached = {id(p): p.get_new_blocks(256) for _, p in pools}
    reads = cfg.attr_reads

    def timed(fn: Callable[[list[Any]], None], blocks: list[Any]) -> float:
        # Best of 5 chunks (timeit-style), so a preempted chunk does not count.
        best = None
        for _ in range(5):
            t0 = perf_ns()
            for _ in range(reads // 5):
                fn(blocks)
            dt = perf_ns() - t0
            best = dt if best is None else min(best, dt)
        assert best is not None
        return best / ((reads // 5) * len(blocks))

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

    cases: list[tuple[str, str, Callable[[list[Any]], None], dict[int, list[Any]]]] = [
        ("blk.block_id", "ns/read", block_id, held),
        ("blk.ref_cnt", "ns/read", ref_cnt, held),
        ("blk.is_null", "ns/read", is_null, held),
        ("blk.block_hash (cached block: bytes)", "ns/read", block_hash, held),
        ("blk.block_hash (uncached block: None)", "ns/read", block_hash, uncached),
        ("blk.ref_cnt += 1; blk.ref_cnt -= 1", "ns/pair", ref_inc_dec, held),
    ]
    (_, stock), (_, ours) = pools
    for label, unit, fn, src in cases:
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
        rep.pair("4", label, unit, s_ns, o_ns)
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
    for i, (p, s) in enumerate(zip(w.prefix_of, w.suffix_len, strict=True)):
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


#: The three ways section 5 runs: vLLM's stock pool; ours as the hybrid_alloc plugin
#: installs it (our pool plus ``hybrid_alloc.integration.scheduler.manager_patches``, the batched
#: full-attention prefix lookup); and our pool alone with vLLM's per-block lookup.
SIDES = ("stock", "ours", "ours, pool only")
PHASES = (
    "get_computed_blocks",
    "allocate_slots (prefill)",
    "get_blocks().get_block_ids() (new request)",
    DECODE := "decode step: allocate_slots + get_block_ids",
    "free",
)


class ManagerRun:
    """One KVCacheManager and its own Request objects, driven wave by wave. Only the
    manager calls are timed (not token appends and hashing, which are the engine's)."""

    def __init__(self, cfg: Config, reqs: list[Any], side: str) -> None:
        saved = kv_cache_coordinator.BlockPool
        if side != "stock":
            kv_cache_coordinator.BlockPool = OurBlockPool  # type: ignore[misc,assignment]
        try:
            t0 = perf_ns()
            self.mgr = make_manager(cfg.mgr_num_blocks, 8192)
            self.ns_build = perf_ns() - t0
        finally:
            kv_cache_coordinator.BlockPool = saved  # type: ignore[misc]
        pool_type = StockBlockPool if side == "stock" else OurBlockPool
        assert type(self.mgr.block_pool) is pool_type, type(self.mgr.block_pool)
        assert isinstance(self.mgr.coordinator.single_type_managers[0], FullAttentionManager)
        #: Whether vLLM runs with hybrid_alloc's patches while this manager works.
        self.patched = side == "ours"
        self.reqs = reqs
        #: Duration of every timed manager call, in order, per phase.
        self.calls: dict[str, list[int]] = {p: [] for p in PHASES}
        self.trace: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self._prefill_ids: dict[str, tuple[int, ...]] = {}
        self._hits: dict[str, int] = {}
        self._token = 7

    def _append(self, req: Any) -> None:
        self._token = (self._token * 1103515245 + 12345) % 32000
        req.append_output_token_ids(self._token)

    def prefill(self, wave: Sequence[int]) -> None:
        from vllm.v1.request import RequestStatus

        mgr = self.mgr
        for i in wave:
            req = self.reqs[i]
            t0 = perf_ns()
            blocks, num_hit, _ = mgr.get_computed_blocks(req)
            t1 = perf_ns()
            new = mgr.allocate_slots(
                req,
                req.num_tokens - num_hit,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=blocks,
            )
            t2 = perf_ns()
            assert new is not None, "pool too small for the workload"
            # What the scheduler does for a newly scheduled request.
            block_ids = mgr.get_blocks(req.request_id).get_block_ids()
            t3 = perf_ns()
            self.calls["get_computed_blocks"].append(t1 - t0)
            self.calls["allocate_slots (prefill)"].append(t2 - t1)
            self.calls["get_blocks().get_block_ids() (new request)"].append(t3 - t2)
            self._prefill_ids[req.request_id] = tuple(block_ids[0])
            self._hits[req.request_id] = num_hit
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_tokens
            self._append(req)

    def decode_step(self, wave: Sequence[int]) -> None:
        mgr = self.mgr
        for i in wave:
            req = self.reqs[i]
            t0 = perf_ns()
            new = mgr.allocate_slots(req, 1)
            # What the scheduler does with a running request's new blocks.
            new.get_block_ids(allow_none=True)
            self.calls[DECODE].append(perf_ns() - t0)
            assert new is not None, "pool too small for the workload"
            req.num_computed_tokens += 1
            self._append(req)

    def finish(self, wave: Sequence[int]) -> None:
        mgr = self.mgr
        for i in wave:
            req = self.reqs[i]
            rid = req.request_id
            final = tuple(mgr.get_block_ids(rid)[0])
            self.trace.append((self._hits[rid], self._prefill_ids[rid], final))
            t0 = perf_ns()
            mgr.free(req)
            self.calls["free"].append(perf_ns() - t0)


def bench_manager(cfg: Config, rep: Report) -> None:
    """The three managers run in lockstep, one wave phase at a time (all prefills of a
    wave, one decode step of a wave, the frees of a wave), rotating which goes first, so
    that noise from other processes lands on all of them alike."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(HASH_BLOCK_SIZE, sha256)
    w = make_workload(cfg)
    n = len(w.prefix_of)
    waves = [range(s, min(s + w.wave, n)) for s in range(0, n, w.wave)]
    # calls[side][phase][repeat] = per-call durations (ns), in trace order.
    calls: dict[str, dict[str, list[list[int]]]] = {s: {p: [] for p in PHASES} for s in SIDES}
    build: dict[str, list[float]] = {s: [] for s in SIDES}
    ref: list[tuple[int, tuple[int, ...], tuple[int, ...]]] | None = None
    for r in range(-1, cfg.mgr_repeats):  # r == -1: warm-up
        runs = {side: ManagerRun(cfg, build_requests(w, hasher, 0), side) for side in SIDES}
        order = list(SIDES)
        gc.collect()
        with no_gc():
            for wave in waves:
                # (step, whether it looks up the prefix cache)
                steps: list[tuple[Callable[[ManagerRun], None], bool]] = [
                    (lambda m, wave=wave: m.prefill(wave), True),
                    *[(lambda m, wave=wave: m.decode_step(wave), False)] * w.decode,
                    (lambda m, wave=wave: m.finish(wave), False),
                ]
                for step, lookup in steps:
                    order.append(order.pop(0))
                    for side in order:
                        run = runs[side]
                        if not (run.patched and lookup):
                            step(run)
                            continue
                        # Installed as the plugin does (class-level), only while ours
                        # runs a step that looks up the prefix cache.
                        manager_patches.install()
                        try:
                            step(run)
                        finally:
                            manager_patches.uninstall()
        for side, run in runs.items():
            # Apples to apples: the same hits and block IDs for every request.
            if ref is None:
                ref = run.trace
            assert len(run.trace) == len(ref) == n
            for i, (a, b) in enumerate(zip(ref, run.trace, strict=True)):
                assert a == b, (
                    f"{side}, request {i}: prefix hit or block IDs differ from stock "
                    f"(hit tokens, IDs after prefill, IDs after decode):\n{a}\n{b}"
                )
        free_counts = {s: m.mgr.block_pool.get_num_free_blocks() for s, m in runs.items()}
        assert len(set(free_counts.values())) == 1, free_counts
        line = []
        for side, run in runs.items():
            us = sum(sum(v) for v in run.calls.values()) / n / 1e3
            line.append(f"{side} {us:.1f}")
            if r < 0:
                continue
            build[side].append(run.ns_build / 1e6)
            for p in PHASES:
                calls[side][p].append(run.calls[p])
        tag = "warm-up" if r < 0 else f"repeat {r + 1}/{cfg.mgr_repeats}"
        print(f"  manager {tag}: " + ", ".join(line) + " us/request", flush=True)
        del runs
    assert ref is not None

    def robust(side: str, p: str) -> float:
        """Sum over calls of each call's median over repeats (ns). The repeats replay the
        same trace, so this drops a call that another process preempted in one repeat."""
        return sum(statistics.median(c) for c in zip(*calls[side][p], strict=True))

    phase = {(s, p): robust(s, p) for s in SIDES for p in PHASES}
    total = {s: sum(phase[(s, p)] for p in PHASES) / n / 1e3 for s in SIDES}

    def per(side: str, p: str) -> float:
        k = n * w.decode if p == DECODE else n
        return phase[(side, p)] / k / 1e3

    hit_tokens = sum(t[0] for t in ref)
    prompt_tokens = sum(
        len(w.prefixes[p]) + s for p, s in zip(w.prefix_of, w.suffix_len, strict=True)
    )
    blocks_per_req = sum(len(t[2]) for t in ref) / n
    desc = (
        f"{n} requests, prompts of {min(len(p) for p in w.prefixes) + 32}-"
        f"{max(len(p) for p in w.prefixes) + 512} tokens ({len(w.prefixes)} shared "
        f"prefixes, {hit_tokens / prompt_tokens:.0%} of prompt tokens hit), "
        f"{w.decode} decode steps each, waves of {w.wave}, {cfg.mgr_num_blocks:,}-block "
        f"pool, {blocks_per_req:.0f} blocks/request; {cfg.mgr_repeats} repeats"
    )
    rep.single(
        "5",
        "KVCacheManager request loop, total (ours = pool + manager_patches, as the "
        "plugin installs it)",
        "us/request",
        total["stock"],
        total["ours"],
        desc,
    )
    for p in PHASES:
        unit = "us/step" if p == DECODE else "us/request"
        rep.single("5", f"- {p}", unit, per("stock", p), per("ours", p))
    # Decode steps cost the same on both pools (the manager's Python dominates them), so
    # the end-to-end ratio falls with the number of output tokens; derived from the phases.
    for d in (0, 128, 1024):
        fixed = {
            side: sum(per(side, p) for p in PHASES if p != DECODE) + d * per(side, DECODE)
            for side in ("stock", "ours")
        }
        rep.single(
            "5",
            f"- derived: total with {d} decode steps per request",
            "us/request",
            fixed["stock"],
            fixed["ours"],
            "from the phase rows above",
        )
    rep.single(
        "5",
        "KVCacheManager request loop, total, ours = pool only (no manager_patches)",
        "us/request",
        total["stock"],
        total["ours, pool only"],
        "our pool under vLLM's own per-block prefix lookup",
    )
    rep.single(
        "5",
        "- get_computed_blocks, ours = pool only",
        "us/request",
        per("stock", "get_computed_blocks"),
        per("ours, pool only", "get_computed_blocks"),
    )
    rep.pair(
        "5",
        f"KVCacheManager construction ({cfg.mgr_num_blocks:,} blocks)",
        "ms",
        build["stock"],
        build["ours"],
    )
    rep.notes.append(
        "Section 5 asserted identical prefix hits and block IDs (after prefill and after "
        f"the last decode step) for all {n} requests in every run (stock, ours, ours pool "
        "only), and the same free-block count at the end. The three managers "
        "run in lockstep, one wave phase at a time, rotating which goes first. Only the "
        "manager calls are timed (not the request's token appends and hashing); every "
        "call is timed, each call's median over the repeats is taken (the repeats replay "
        "the same trace), and those are summed, so a call preempted by another process "
        "in one repeat does not count."
    )


# ------------------------------------------------ native build against an earlier one
@dataclass(frozen=True)
class NativeRow:
    op: str
    n: int
    before_ns: float
    after_ns: float
    speedup: float


def load_native(path: Path, name: str) -> Any:
    """Load a build of the extension from ``path`` as module ``name`` (an earlier build can
    then run in the same process as the installed one)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}._native", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load an extension from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_native_builds(cfg: Config, before_so: Path) -> list[NativeRow]:
    """The native pool of an earlier build against the installed one, interleaved in one
    process on the same operation traces (the native classes only: the Python layer of the
    earlier build is not loaded). Each sample is the best of 3 timed calls; values are
    medians over repeats, `speedup` the median of per-repeat before/after time quotients."""
    import hybrid_alloc._native as after_native

    builds = {"before": load_native(before_so, "hybrid_alloc_before"), "after": after_native}
    num_blocks = min(cfg.num_blocks, 200_000)
    pools = {k: m.NativeBlockPool(num_blocks, True, HASH_BLOCK_SIZE) for k, m in builds.items()}
    hashes = make_hashes("native", 256)

    def cached(p: Any, n: int) -> list[Any]:
        blocks = p.get_new_blocks(n)
        p._cache_full_blocks(blocks, hashes, 0, n, HASH_BLOCK_SIZE, 0)
        return blocks

    def drop(p: Any, blocks: list[Any]) -> None:
        p.free_blocks(reversed(blocks))
        p.evict_blocks([b.block_id for b in blocks])

    def get_new_blocks(p: Any, n: int) -> int:
        t0 = perf_ns()
        blocks = p.get_new_blocks(n)
        t1 = perf_ns()
        p.free_blocks(blocks)
        return t1 - t0

    def free_uncached(p: Any, n: int) -> int:
        blocks = p.get_new_blocks(n)
        t0 = perf_ns()
        p.free_blocks(reversed(blocks))
        return perf_ns() - t0

    def free_cached(p: Any, n: int) -> int:
        blocks = cached(p, n)
        t0 = perf_ns()
        p.free_blocks(reversed(blocks))
        t1 = perf_ns()
        p.evict_blocks([b.block_id for b in blocks])
        return t1 - t0

    def touch(p: Any, n: int) -> int:
        blocks = cached(p, n)
        p.free_blocks(reversed(blocks))
        t0 = perf_ns()
        p.touch(blocks)
        t1 = perf_ns()
        drop(p, blocks)
        return t1 - t0

    def cache_full_blocks(p: Any, n: int) -> int:
        blocks = p.get_new_blocks(n)
        t0 = perf_ns()
        p._cache_full_blocks(blocks, hashes, 0, n, HASH_BLOCK_SIZE, 0)
        t1 = perf_ns()
        drop(p, blocks)
        return t1 - t0

    def evict_blocks(p: Any, n: int) -> int:
        blocks = cached(p, n)
        ids = [b.block_id for b in blocks]
        t0 = perf_ns()
        p.evict_blocks(ids)
        t1 = perf_ns()
        p.free_blocks(reversed(blocks))
        return t1 - t0

    def get_cached_prefix(p: Any, n: int) -> int:
        blocks = cached(p, n)
        t0 = perf_ns()
        p.get_cached_prefix(hashes, [0], n)
        t1 = perf_ns()
        drop(p, blocks)
        return t1 - t0

    def get_cached_block(p: Any, n: int) -> int:
        blocks = cached(p, n)
        group = [0]
        t0 = perf_ns()
        for h in hashes[:n]:
            p.get_cached_block(h, group)
        t1 = perf_ns()
        drop(p, blocks)
        return t1 - t0

    cases: list[tuple[str, Callable[[Any, int], int]]] = [
        ("get_new_blocks(n)", get_new_blocks),
        ("free_blocks(reversed(<n uncached>))", free_uncached),
        ("free_blocks(reversed(<n cached>))", free_cached),
        ("touch(<n cached free blocks>)", touch),
        ("_cache_full_blocks(<n blocks>)", cache_full_blocks),
        ("evict_blocks(<n cached IDs>)", evict_blocks),
        ("get_cached_prefix(<n hits>)", get_cached_prefix),
        ("get_cached_block(hash, [0]) x n, hits", get_cached_block),
    ]
    repeats = 9 if cfg.quick else 41
    out: list[NativeRow] = []
    with no_gc():
        for name, fn in cases:
            for n in (64, 256):
                times: dict[str, list[float]] = {"before": [], "after": []}
                quotients: list[float] = []
                for r in range(repeats + 1):  # r == 0: warm-up
                    order = ("before", "after") if r % 2 else ("after", "before")
                    t = {side: min(fn(pools[side], n) for _ in range(3)) for side in order}
                    if r:
                        times["before"].append(t["before"] / n)
                        times["after"].append(t["after"] / n)
                        quotients.append(t["before"] / t["after"])
                out.append(
                    NativeRow(
                        name,
                        n,
                        median(times["before"]),
                        median(times["after"]),
                        median(quotients),
                    )
                )
    return out


# -------------------------------------------------------------------- reporting
BULK_OPS = ("get_new_blocks(n=", "free_blocks(reversed", "touch(", "cache_full_blocks(")
BULK_OPS += ("evict_blocks(", "prefix lookup, 256 hits: stock loop")


def targets(rows: Sequence[Row]) -> list[str]:
    """The project's targets, checked against the rows."""
    out: list[str] = []

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    for r in rows:
        if r.ours is None:
            continue
        if r.op.startswith("construct "):
            out.append(f"{r.op}: ours <= 20 ms -> {fmt(r.ours)} ms, {mark(r.ours <= 20)}")
        elif r.section == "3":
            out.append(f"{r.op}: ours <= 32 B -> {fmt(r.ours)} B, {mark(r.ours <= 32)}")
        elif r.section == "5" and r.op.startswith("KVCacheManager request loop, total ("):
            ok = r.ratio is not None and r.ratio >= 2
            out.append(f"KVCacheManager loop >= 2x -> {fmt_ratio(r.ratio)}, {mark(ok)}")
    bulk = [r for r in rows if r.section == "2" and r.op.startswith(BULK_OPS)]
    if bulk:
        met = [r for r in bulk if r.ratio is not None and r.ratio >= 20]
        missed = ", ".join(f"{r.op} {fmt_ratio(r.ratio)}" for r in bulk if r not in met)
        out.append(
            f"bulk operations >= 20x -> {len(met)} of {len(bulk)} rows met"
            + (f"; below: {missed}" if missed else "")
        )
    return out


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def machine() -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import subprocess

    import torch

    import hybrid_alloc

    try:
        head = subprocess.run(
            ["git", "-C", str(RESULTS.parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        head = ""
    native = Path(hybrid_alloc._native.__file__)
    built = _dt.datetime.fromtimestamp(native.stat().st_mtime).isoformat(timespec="seconds")
    return [
        f"CPU: {cpu}, {os.cpu_count()} cores ({platform.machine()})",
        f"OS: {platform.system()} {platform.release()}",
        f"Python: {platform.python_implementation()} {platform.python_version()}",
        f"vLLM: {vllm.__version__}; torch {torch.__version__}; "
        f"hybrid_alloc {hybrid_alloc.__version__}",
        f"Date: {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"Tree: git {head or 'unknown'}; extension {native.name} "
        f"({native.stat().st_size // 1024} KiB, built {built})",
    ]


@dataclass
class Comparison:
    """Earlier runs to compare this one with: ``before`` (RESULTS files written by this script
    on an earlier build) and ``after`` (other runs of the current build, pooled with this
    one), under ``title``; ``native``: an earlier build's native pool timed against this
    one in the same process (``--native-before``)."""

    title: str
    before: tuple[Path, ...]
    after: tuple[Path, ...]
    native_before: Path | None = None
    native: list[NativeRow] = field(default_factory=list)


def read_ratios(path: Path) -> dict[tuple[str, str], float]:
    """The `stock/ours` column of a RESULTS file written by this script, by (section, op)."""
    out: dict[tuple[str, str], float] = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not cells[5].endswith("x"):
            continue
        try:
            out[(cells[0], cells[1])] = float(cells[5][:-1].replace(",", ""))
        except ValueError:
            continue
    return out


def comparison_section(cmp: Comparison, rows: Sequence[Row]) -> list[str]:
    """A table of each row's stock/ours ratio before and after, each the median over the
    runs that have the row: both ratios come from interleaved same-process runs against
    the same stock pool, so their quotient compares the two builds of ours."""
    before = [read_ratios(p) for p in cmp.before]
    after = [read_ratios(p) for p in cmp.after]
    lines = [
        f"## {cmp.title}",
        "",
        f"`stock/ours` of each row, before: median over {len(before)} run(s) of the earlier "
        f"build; after: median over {len(after) + 1} run(s) of this build (this run "
        "included). Sections 2 and 4 ran in every run, 1, 3 and 5 only in full runs. "
        "`after/before` > 1: the ratio improved. On a shared machine single ratios move by "
        "10-20% between runs; read the medians.",
        "",
        "| # | operation | runs before / after | stock/ours before | stock/ours after "
        "| after/before |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.ratio is None:
            continue
        key = (r.section, r.op)
        b = [d[key] for d in before if key in d]
        a = [r.ratio, *(d[key] for d in after if key in d)]
        if not b:
            continue
        mb, ma = median(b), median(a)
        lines.append(
            f"| {r.section} | {r.op} | {len(b)} / {len(a)} | {fmt_ratio(mb)} | {fmt_ratio(ma)} "
            f"| {ma / mb:.2f} |"
        )
    if cmp.native:
        lines += [
            "",
            f"The native pool of the earlier build (`{cmp.native_before}`) against this one, "
            "interleaved in one process on the same traces (native classes only; "
            "`_cache_full_blocks` is the native half of `cache_full_blocks`). "
            "`before/after` is the median of per-repeat time quotients (> 1: this build is "
            "faster); this is the comparison least affected by other jobs on the machine.",
            "",
            "| operation | n | before ns/block | after ns/block | before/after |",
            "|---|---:|---:|---:|---:|",
        ]
        for nr in cmp.native:
            lines.append(
                f"| {nr.op} | {nr.n} | {fmt(nr.before_ns)} | {fmt(nr.after_ns)} "
                f"| {nr.speedup:.2f} |"
            )
    return [*lines, ""]


def write_results(
    cfg: Config, rep: Report, elapsed: float, path: Path, cmp: Comparison | None = None
) -> None:
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
        "discarded). In section 2 each sample is the median of several timed rounds, in "
        "section 4 the best of 5 chunks. The cyclic GC is off inside timed loops. The "
        "machine was shared with other jobs (load average "
        f"{rep.load_start} at the start, {load_average()} at the end), so single numbers "
        "are noisy; ratios are the figures to read.",
        "",
        table(rep.rows),
        "",
        "Targets:",
        "",
        *[f"- {t}" for t in targets(rep.rows)],
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
    if cmp is not None:
        lines += comparison_section(cmp, rep.rows)
    lines += capacity_section(path.parent)
    lines += offload_section(path.parent)
    path.write_text("\n".join(lines))


def offload_section(bench_dir: Path) -> list[str]:
    """``OFFLOAD.md`` (written by ``bench_offload.py``) as it stands, so that rewriting
    RESULTS.md keeps the offloading results."""
    source = bench_dir / "OFFLOAD.md"
    if not source.exists():
        return []
    return [source.read_text().strip(), ""]


CAPACITY_TABLE_HEADING = "## Token capacity (mamba_cache_mode none)"


def capacity_section(bench_dir: Path) -> list[str]:
    """The capacity summary of ``CAPACITY.md`` (written by ``bench_capacity.py``), so that
    RESULTS.md holds both speed and capacity."""
    source = bench_dir / "CAPACITY.md"
    if not source.exists():
        return []
    text = source.read_text()
    start = text.find(CAPACITY_TABLE_HEADING)
    if start < 0:
        return []
    body = text[start + len(CAPACITY_TABLE_HEADING) :].split("\n## ", 1)[0].strip()
    return [
        "## Capacity: stock shared pool vs per-group pools vs physical limit",
        "",
        "From `benches/CAPACITY.md` (`python benches/bench_capacity.py`, where the columns "
        "and the method are explained).",
        "",
        body,
        "",
        "![capacity](capacity.png)",
        "",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run (< 1 min)")
    ap.add_argument("--blocks", type=int, default=None, help="pool size (default 1M)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to write RESULTS.md")
    ap.add_argument(
        "--only",
        default="12345",
        help="sections to run, e.g. 35 (default all; 2 and 4 run together, after 1)",
    )
    ap.add_argument(
        "--before",
        type=Path,
        nargs="+",
        default=(),
        help="RESULTS files of an earlier build: adds a before/after section",
    )
    ap.add_argument(
        "--after",
        type=Path,
        nargs="+",
        default=(),
        help="RESULTS files of other runs of this build, pooled with this run in that section",
    )
    ap.add_argument(
        "--native-before",
        type=Path,
        default=None,
        help="an earlier build's _native*.so, timed against this one in the same process",
    )
    ap.add_argument(
        "--compare-title",
        default="Before/after the core refactor",
        help="heading of the before/after section",
    )
    args = ap.parse_args(argv)
    cmp = (
        Comparison(args.compare_title, tuple(args.before), tuple(args.after), args.native_before)
        if args.before or args.native_before
        else None
    )
    cfg = Config.make(args.quick, args.blocks)
    rep = Report(load_start=load_average())
    t_start = time.perf_counter()

    def section(title: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {title}", flush=True)

    settle()
    if "1" in args.only or "2" in args.only or "4" in args.only:
        section("1. construction")
        stock, ours = bench_construction(cfg, rep)
        pools: Pools = (("stock", stock), ("ours", ours))
        settle()
        if "2" in args.only or "4" in args.only:
            section("2. bulk operations")
            bench_first_handout(cfg, pools, rep)
            bench_alloc_free(cfg, pools, rep)
            bench_touch(cfg, pools, rep)
            bench_cache_and_evict(cfg, pools, rep)
            held = bench_lookup(cfg, pools, rep)
            section("4. attribute reads")
            bench_attrs(cfg, pools, held, rep)
            rep.same(
                "free-queue order at the end of sections 2 and 4",
                ids(stock.free_block_queue.get_all_free_blocks()),
                ours.free_block_ids(),
            )
        del pools, stock, ours
        release()
    if "3" in args.only:
        section("3. memory")
        bench_memory(cfg, rep)
        release()
    if "5" in args.only:
        section("5. KVCacheManager loop")
        bench_manager(cfg, rep)
    if cmp is not None and cmp.native_before is not None:
        section("native pool: earlier build against this one")
        cmp.native = bench_native_builds(cfg, cmp.native_before)
        release()

    rows = sorted(rep.rows, key=lambda r: r.section)
    rep.rows = rows
    elapsed = time.perf_counter() - t_start
    print()
    print(table(rows))
    print()
    for t in targets(rows):
        print(f"target: {t}")
    if rep.mismatches:
        print("\nDIFFERENCES between stock and ours:")
        for m in rep.mismatches:
            print(f"  - {m}")
    write_results(cfg, rep, elapsed, args.out, cmp)
    print(f"\nwrote {args.out} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
