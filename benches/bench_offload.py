#!/usr/bin/env python
"""KV offloading on CPU platforms: the host-copy transfer path against a plain ``torch`` copy
of the same bytes, and the scheduler-side cost per offloaded block.

1. **Transfers.**
   :class:`hybrid_alloc.integration.kv_transfer.offload.HostCopyOffloadingWorker` stores
   blocks of a per-group KV cache (an attention group and a Mamba/GDN-state group, each
   with its own pool and block stride) to host chunks and loads them back, through the same
   ``GPULoadStoreSpec`` / ``CPULoadStoreSpec`` objects vLLM's connector sends. The bound is a
   plain contiguous ``Tensor.copy_`` of the same number of bytes (memory bandwidth: no
   gather, no scatter); ``index_select`` of the same rows is shown too (a gather, what any
   block-scattered copy must do). Every pair runs interleaved in one process; MB/s are
   medians over repeats, ratios are ours / bound.
2. **Scheduler side.** vLLM's ``CPUOffloadingManager`` (LRU) per offloaded block: store
   (``prepare_store`` + ``complete_store``), ``lookup``, load (``prepare_load`` +
   ``complete_load``), and dropping failed entries (``offload.drop_offloaded_keys``).

    python benches/bench_offload.py            # full run (about a minute)
    python benches/bench_offload.py --quick    # smoke run

Writes ``benches/OFFLOAD.md`` and replaces its section in ``benches/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np
import torch
import vllm
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from hybrid_alloc.integration.kv_transfer.offload import (
    HostCopyOffloadingWorker,
    drop_offloaded_keys,
)

HERE = Path(__file__).resolve().parent
SECTION = "## KV offloading on CPU platforms (host-copy transfers, offload index)"


def _group(layers: int, blocks: int, page: int, stride: int) -> list[torch.Tensor]:
    """Per-layer int8 row views over one backing tensor per layer: ``blocks`` rows of
    ``page`` bytes, ``stride`` bytes apart (as the worker's per-group views are)."""
    out = []
    for _ in range(layers):
        backing = torch.randint(-128, 127, (blocks * stride,), dtype=torch.int8)
        out.append(backing.as_strided((blocks, page), (stride, 1)))
    return out


def _worker(groups: Sequence[list[torch.Tensor]], chunks: int) -> HostCopyOffloadingWorker:
    tensors, refs = [], []
    for rows in groups:
        group_refs = []
        for t in rows:
            tensors.append(CanonicalKVCacheTensor(tensor=t, page_size_bytes=t.shape[1]))
            group_refs.append(
                CanonicalKVCacheRef(tensor_idx=len(tensors) - 1, page_size_bytes=t.shape[1])
            )
        refs.append(group_refs)
    return HostCopyOffloadingWorker(CanonicalKVCaches(tensors, refs), 1, chunks)


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _transfer_row(
    label: str, gid: int, layers: int, pool: int, page: int, stride: int, n: int, repeats: int
) -> str:
    """Store ``n`` blocks of group ``gid`` to host chunks and load them back, interleaved
    with a contiguous copy and an ``index_select`` of the same bytes; one table row."""
    groups = [_group(0, 1, 1, 1), _group(0, 1, 1, 1)]
    groups[gid] = _group(layers, pool, page, stride)
    worker = _worker(groups, n)
    ids = sorted(np.random.default_rng(0).choice(pool, size=n, replace=False).tolist())
    sizes = [0, 0]
    sizes[gid] = n
    device = GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=[0, 0])
    host = CPULoadStoreSpec(list(range(n)))
    nbytes = n * layers * page
    flat_src = torch.randint(-128, 127, (nbytes,), dtype=torch.int8)
    flat_dst = torch.empty_like(flat_src)
    gather_idx = torch.tensor(ids)
    job = iter(range(1 << 30))
    columns: list[list[float]] = [[], [], [], []]
    steps: list[Callable[[], object]] = [
        lambda: worker.submit_store(next(job), device, host),
        lambda: worker.submit_load(next(job), host, device),
        lambda: flat_dst.copy_(flat_src),
        lambda: [t.index_select(0, gather_idx) for t in groups[gid]],
    ]
    for _ in range(repeats):  # interleaved: noise hits every column alike
        for column, step in zip(columns, steps, strict=True):
            column.append(_median_s(step, 1))
    worker.get_finished()
    mbps = [nbytes / statistics.median(t) / 1e6 for t in columns]
    return (
        f"| {label} | {n} | {nbytes / 1e6:.1f} | {mbps[0]:,.0f} | {mbps[1]:,.0f} | "
        f"{mbps[2]:,.0f} | {mbps[3]:,.0f} | {mbps[0] / mbps[2]:.2f} | {mbps[1] / mbps[2]:.2f} |"
    )


def bench_transfers(quick: bool) -> list[str]:
    repeats = 3 if quick else 9
    scale = 4 if quick else 1
    # Qwen3-Next-like shapes: attention page of 16 tokens x 2 (K, V) x 2 KV heads x 256 dims
    # x 2 B = 32 KiB per layer; GDN state of ~1 MiB per layer; block strides padded to 64 KiB
    # and 1 MiB + 4 KiB (region alignment).
    attn_page, state_page = 32 << 10, (1 << 20) - (64 << 10)
    cases = [
        (
            "attention blocks (8 layers x 32 KiB)",
            0,
            8,
            4096 // scale,
            attn_page,
            64 << 10,
            1024 // scale,
        ),
        (
            "GDN states (24 layers x 960 KiB)",
            1,
            24,
            64 // scale,
            state_page,
            (1 << 20) + (4 << 10),
            32 // scale,
        ),
    ]
    rows = [
        "| what | blocks per job | MB per job | store MB/s | load MB/s | plain copy MB/s | "
        "int8 index_select MB/s | store / copy | load / copy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        rows.append(_transfer_row(*case, repeats=repeats))
    return rows


def bench_index(quick: bool) -> list[str]:
    n = 2_000 if quick else 20_000
    repeats = 3 if quick else 7
    keys = [make_offload_key(i.to_bytes(16, "big"), i % 2) for i in range(n)]
    ctx = ReqContext(req_id="bench")
    results: dict[str, list[float]] = {"store": [], "lookup": [], "load": [], "drop": []}
    for _ in range(repeats):
        manager = CPUOffloadingManager(num_chunks=n)
        t = time.perf_counter()
        for i in range(0, n, 16):  # a request stores 16 blocks at a time
            batch = keys[i : i + 16]
            out = manager.prepare_store(batch, ctx)
            assert out is not None
            manager.complete_store(out.keys_to_store, ctx)
        results["store"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for key in keys:
            manager.lookup(key, ctx)
        results["lookup"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(0, n, 16):
            batch = keys[i : i + 16]
            manager.prepare_load(batch, ctx)
            manager.complete_load(batch, ctx)
        results["load"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(0, n, 16):
            drop_offloaded_keys(manager, keys[i : i + 16])
        results["drop"].append(time.perf_counter() - t)
        assert manager._get_num_free_chunks() == n
    rows = ["| operation (vLLM's CPUOffloadingManager, LRU) | us per block |", "|---|---:|"]
    labels = {
        "store": "store (prepare_store + complete_store, 16 blocks per call)",
        "lookup": "lookup",
        "load": "load (prepare_load + complete_load, 16 blocks per call)",
        "drop": "drop after a failed load (`offload.drop_offloaded_keys`)",
    }
    for name, times in results.items():
        rows.append(f"| {labels[name]} | {statistics.median(times) / n * 1e6:.2f} |")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "OFFLOAD.md")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        SECTION,
        "",
        f"Generated by `python benches/bench_offload.py{' --quick' if args.quick else ''}` on "
        f"{_dt.date.today()}: vLLM {vllm.__version__}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPU cores "
        "(one torch thread). MB = 10^6 bytes.",
        "",
        "Transfers (`HostCopyOffloadingWorker`, what `--kv-offloading-size` uses on CPU "
        "platforms): blocks scattered over the pool, host chunks consecutive; the bound is a "
        "contiguous copy of the same bytes.",
        "",
        *bench_transfers(args.quick),
        "",
        "Offload index, per block (scheduler side):",
        "",
        *bench_index(args.quick),
        "",
    ]
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)
    if args.results.exists():
        old = args.results.read_text()
        start = old.find(SECTION)
        if start >= 0:
            end = old.find("\n## ", start + len(SECTION))
            old = old[:start] + (old[end + 1 :] if end >= 0 else "")
        args.results.write_text(old.rstrip("\n") + "\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
