"""Serving benchmark: what per-group pools buy on real models, through vLLM's own scheduler.

For every shipped config at 16 / 40 / 80 GiB of KV memory, Mamba 'none' and 'align' modes,
and each generated trace (chat, long documents, prefix sharing), runs the serving
simulator (:mod:`hybrid_alloc.integration.simulator`: vLLM's real ``Scheduler`` on the
KV-cache config vLLM builds (stock) and the one this package builds (per-group), no model,
no GPU) and writes ``benches/SERVING.md`` and ``benches/serving.png``.

    python benches/bench_serving.py [--out-dir benches] [--configs a,b] [--memories 16,40,80]
        [--modes none,align] [--traces chat,long,long-burst,prefix] [--json FILE]

Where the Mamba state of 256 requests takes more than half of the KV memory in per-group
pools (per-group sizing then over-subscribes its fixed pools, or refuses), the cell is
also run, both layouts, at the largest ``max_num_seqs`` of :data:`FALLBACK_SEQS` whose
fixed pools take at most half: what the capacity planner's "lower --max-num-seqs" advice
leads to. Trace sizes are chosen so that the whole run takes
well under an hour on two CPU cores; see :data:`TRACES`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_alloc.planner import load_model, plan, shipped_configs
from hybrid_alloc.traces import Trace, make_trace

GiB = 1 << 30
MEMORIES_GIB = (16, 40, 80)
MODES = ("none", "align")
MAX_NUM_SEQS = 256
FALLBACK_SEQS = (192, 128, 96, 64, 48, 32, 24, 16, 8, 4, 2, 1)
STEP_MS = 25.0
MAX_NUM_BATCHED_TOKENS = 8192

# trace name: (generator in hybrid_alloc.traces, requests, arrivals per second). Chat
# requests arrive faster than 256 sequences are served while they arrive (1.5 a step, ~275
# steps each); long documents at ~4 a second (up to ~30 held at once); prefix sharing at 40
# a second (conversation turns follow 5-20 s later). `long-burst` sends 96 long documents
# at once, so that KV memory, not arrivals or max_num_seqs, limits the batch for most
# models at 16 GiB: the case per-group capacity is meant for. About 20 minutes of CPU for
# the whole grid on this machine.
TRACES: dict[str, tuple[str, int, float]] = {
    "chat": ("chat", 200, 60.0),
    "long": ("long", 32, 4.0),
    "long-burst": ("long", 96, 1000.0),
    "prefix": ("prefix", 200, 40.0),
}


@dataclass
class Cell:
    config: str
    memory_gib: int
    mode: str
    trace: str
    max_num_seqs: int
    result: Any  # SimResult
    seconds: float
    note: str = ""


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        return out.stdout.strip() + (" (working tree has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _settings(memory_gib: int, mode: str, seqs: int, max_len: int) -> Any:
    from hybrid_alloc.integration.simulator import SimSettings

    return SimSettings(
        memory=memory_gib * GiB,
        mamba_cache_mode=mode,
        max_num_seqs=seqs,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=max_len,
        step_ms=STEP_MS,
    )


def _fixed_bytes(config: str, memory_gib: int, mode: str, seqs: int, max_len: int) -> int:
    """Bytes per-group sizing sets aside for the fixed-size (Mamba) pools, per the planner."""
    p = plan(
        load_model(config),
        memory_gib * GiB,
        max_num_seqs=seqs,
        mamba_cache_mode=mode,
        max_model_len=max_len,
    )
    return sum(r.bytes for r in p.ours.rows if not r.grows)


def _tuned_seqs(config: str, memory_gib: int, mode: str, max_len: int) -> int | None:
    """Where the Mamba state of 256 requests takes more than half of the KV memory, the
    largest of :data:`FALLBACK_SEQS` whose fixed pools take at most half (None: the 256
    cell stands as it is, or nothing fits)."""
    half = memory_gib * GiB // 2
    if _fixed_bytes(config, memory_gib, mode, MAX_NUM_SEQS, max_len) <= half:
        return None
    for seqs in FALLBACK_SEQS:
        if _fixed_bytes(config, memory_gib, mode, seqs, max_len) <= half:
            return seqs
    return None


def run_cells(
    configs: Sequence[str],
    memories: Sequence[int],
    modes: Sequence[str],
    traces: dict[str, Trace],
    log: Any = sys.stdout,
) -> list[Cell]:
    from hybrid_alloc.integration.simulator import simulate

    cells: list[Cell] = []
    for config in configs:
        max_len = min(32768, load_model(config).max_position_embeddings)
        for memory in memories:
            for mode in modes:
                for kind, trace in traces.items():
                    t0 = time.perf_counter()
                    result = simulate(config, _settings(memory, mode, MAX_NUM_SEQS, max_len), trace)
                    cell = Cell(config, memory, mode, kind, MAX_NUM_SEQS, result, 0.0)
                    cell.seconds = time.perf_counter() - t0
                    cells.append(cell)
                    _log(cell, log)
                    seqs = _tuned_seqs(config, memory, mode, max_len)
                    if seqs is None:
                        continue
                    t0 = time.perf_counter()
                    again = simulate(config, _settings(memory, mode, seqs, max_len), trace)
                    retry = Cell(config, memory, mode, kind, seqs, again, 0.0)
                    retry.note = (
                        f"{config}, {memory} GiB: the Mamba state of {MAX_NUM_SEQS} requests "
                        f"takes over half the KV memory in per-group pools; also run with "
                        f"max_num_seqs {seqs}, both layouts"
                    )
                    retry.seconds = time.perf_counter() - t0
                    cells.append(retry)
                    _log(retry, log)
    return cells


def _log(cell: Cell, log: Any) -> None:
    parts = []
    for name, r in cell.result.layouts.items():
        if r.ok:
            parts.append(
                f"{name}: {r.steps} steps, {r.finished}/{r.requests} done, "
                f"{r.preemptions} preempt, hit {100 * r.prefix_hit_rate:.0f}%"
            )
        else:
            parts.append(f"{name}: {r.error[:90] if r.error else '?'}")
    print(
        f"{cell.config} {cell.memory_gib}GiB {cell.mode} {cell.trace} seqs={cell.max_num_seqs} "
        f"({cell.seconds:.1f}s): " + " | ".join(parts),
        file=log,
        flush=True,
    )


# --------------------------------------------------------------------------- report


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.3f}" if a else "n/a"


def _pair(cell: Cell, fmt: Any) -> tuple[str, str]:
    s, p = cell.result.layouts["stock"], cell.result.layouts["per-group"]
    return (fmt(s) if s.ok else "-", fmt(p) if p.ok else "-")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    rule = "|:---|" + "|".join("---:" for _ in header[1:]) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)]


def _both_ok(cell: Cell) -> bool:
    return all(r.ok for r in cell.result.layouts.values())


def _verdict(cell: Cell) -> str:
    """Per-group against stock in one word, from throughput and mean latency."""
    s, p = cell.result.layouts["stock"], cell.result.layouts["per-group"]
    tput = p.finished_per_step / s.finished_per_step if s.finished_per_step else 1.0
    lat_s = s.latency_steps.get("mean", 0.0)
    lat = p.latency_steps.get("mean", 0.0) / lat_s if lat_s else 1.0
    hits = p.prefix_hit_rate - s.prefix_hit_rate
    if tput > 1.01 or lat < 0.97 or hits > 0.01:
        better = tput >= 0.99 and lat <= 1.03 and hits >= -0.01
        return "**better**" if better else "mixed"
    if tput < 0.99 or lat > 1.03 or hits < -0.01:
        return "worse"
    return "same"


def cell_rows(cells: Sequence[Cell]) -> list[list[str]]:
    rows = []
    for c in cells:
        name = c.config + ("" if c.max_num_seqs == MAX_NUM_SEQS else f" @{c.max_num_seqs} seqs")
        if not _both_ok(c):
            failed = [k for k, r in c.result.layouts.items() if not r.ok]
            rows.append([name, f"{c.memory_gib}", *(["-"] * 9), f"{'/'.join(failed)} refused"])
            continue
        s, p = c.result.layouts["stock"], c.result.layouts["per-group"]
        fin = _pair(c, lambda r: f"{r.finished_per_step:.3f}")
        run = _pair(c, lambda r: f"{r.mean_running:.0f}")
        pre = _pair(c, lambda r: f"{r.preemptions}")
        hit = _pair(c, lambda r: f"{100 * r.prefix_hit_rate:.1f}%")
        lat = _pair(c, lambda r: f"{r.latency_steps.get('mean', 0):.0f}")
        ttft = _pair(c, lambda r: f"{r.ttft_steps.get('mean', 0):.0f}")
        cpu = _pair(c, lambda r: f"{r.cpu_us_per_step:,.0f}")
        rows.append(
            [
                name,
                f"{c.memory_gib}",
                f"{fin[0]} / {fin[1]}",
                _ratio(s.finished_per_step, p.finished_per_step),
                f"{run[0]} / {run[1]}",
                f"{pre[0]} / {pre[1]}",
                f"{hit[0]} / {hit[1]}",
                f"{ttft[0]} / {ttft[1]}",
                f"{lat[0]} / {lat[1]}",
                _ratio(s.latency_steps.get("mean", 0.0), p.latency_steps.get("mean", 0.0)),
                f"{cpu[0]} / {cpu[1]}",
                _verdict(c),
            ]
        )
    return rows


HEADER = (
    "model",
    "GiB",
    "finished / step (stock / per-group)",
    "ratio",
    "mean running",
    "preemptions",
    "prefix hits (tokens)",
    "TTFT, steps (mean)",
    "latency, steps (mean)",
    "latency ratio",
    "sched. CPU us / step",
    "per-group vs stock",
)


def write_report(
    cells: Sequence[Cell], traces: dict[str, Trace], out: Path, elapsed: float, png: str
) -> None:
    from hybrid_alloc.integration import versions

    lines = [
        "# Serving simulation: stock vLLM vs per-group pools on the shipped configs",
        "",
        "Generated by `python benches/bench_serving.py` (no GPU): vLLM's own scheduler "
        "(`vllm.v1.core.sched.scheduler.Scheduler`, its KV-cache manager, coordinator and "
        "pools) runs every trace twice in one process, on the KV-cache layout vLLM builds "
        "itself for the full-size model (**stock**: one shared pool, attention block size "
        "raised and Mamba pages padded by vLLM's platform hook, sized by vLLM's "
        "`get_kv_cache_configs`) and on the one this package builds (**per-group**: one "
        "Rust pool per KV-cache group at its natural page size). No model runs: each step "
        "a fake runner returns one token per request that is not mid-prefill. See "
        "`hybrid_alloc.integration.simulator` for what is vLLM's code and what is faked.",
        "",
        "## Setup",
        "",
        f"- vLLM {versions.installed_version()} (scheduler side; CUDA block-size rules: "
        "FlashAttention kernel blocks of 16), Python "
        f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPU cores "
        f"(shared with other jobs), commit {_git_commit()}.",
        f"- Engine: `max_num_seqs` {MAX_NUM_SEQS}, `max_num_batched_tokens` "
        f"{MAX_NUM_BATCHED_TOKENS:,}, block size 16, chunked prefill, `max_model_len` "
        "min(32,768, the model's context); 'none' = no prefix caching, 'align' = prefix "
        "caching (vLLM's Mamba 'align' mode). Sync scheduler.",
        f"- Time: arrivals in simulated seconds, {STEP_MS:g} ms per scheduler step "
        "whatever the batch (a fixed step time: the comparison is of what the pools "
        "admit, not of kernel speed). Latency and TTFT are in steps.",
        "- Traces (seeded, `hybrid_alloc.traces`; token IDs derived so shared prefixes "
        "hash equal):",
    ]
    for kind, trace in traces.items():
        rate = TRACES[kind][2]
        lines.append(f"  - **{kind}** ({len(trace)} requests, {rate:g}/s): {trace.describe()}.")
    lines += [
        "  Requests longer than a model's context keep their output and have their prompt "
        "cut to fit (Zamba2: 4,096 tokens, Nemotron-H-8B: 8,192), counted in each table's "
        "notes.",
        f"- Total run time of the benchmark: {elapsed / 60:.1f} min "
        f"({len(cells)} cells, each both layouts).",
        "",
        "Columns give stock / per-group. *finished / step* is requests finished per "
        "scheduler step over the whole run (all requests finish in every cell, so its "
        "ratio is the inverse makespan ratio); *ratio* and *latency ratio* are "
        "per-group / stock (above 1 = more throughput; below 1 = lower latency). "
        "*per-group vs stock*: **better** / worse / mixed / same (same: throughput and "
        "latency within 1-3% and prefix hits within 1 point).",
        "",
    ]
    lines += _headline(cells)
    for mode in MODES:
        for kind in traces:
            sel = [c for c in cells if c.mode == mode and c.trace == kind]
            if not sel:
                continue
            lines += [f"## Trace `{kind}`, mode '{mode}'", ""]
            lines += _table(HEADER, cell_rows(sel))
            notes = sorted({c.note for c in sel if c.note})
            clipped = sorted(
                {
                    f"{c.config}: {c.result.layouts['stock'].clipped} prompts cut to fit the "
                    "context with their output"
                    for c in sel
                    if c.result.layouts["stock"].clipped
                }
            )
            for note in [*notes, *clipped]:
                lines.append(f"- {note}")
            lines.append("")
    lines += _layouts(cells)
    lines += _refusals(cells)
    lines += [
        "## Plot",
        "",
        f"![serving]({png})",
        "",
        "Top: per-group / stock throughput (finished requests per step) for every cell "
        "(models on the x axis, one bar per memory size; a missing bar is a refused "
        "cell). Bottom: running requests and KV memory held over simulated time for "
        f"{_highlight_title(cells)}.",
        "",
    ]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _headline(cells: Sequence[Cell]) -> list[str]:
    ok = [c for c in cells if _both_ok(c)]
    verdicts: dict[str, list[Cell]] = {}
    for c in ok:
        verdicts.setdefault(_verdict(c).strip("*"), []).append(c)
    lines = ["## Headline", ""]
    lines.append(
        f"{len(ok)} of {len(cells)} cells ran on both layouts: "
        + ", ".join(f"{k} {len(v)}" for k, v in sorted(verdicts.items()))
        + "."
    )
    lines.append("")

    def tput(c: Cell) -> float:
        s, p = c.result.layouts["stock"], c.result.layouts["per-group"]
        return p.finished_per_step / s.finished_per_step if s.finished_per_step else 1.0

    def hits(c: Cell) -> float:
        s, p = c.result.layouts["stock"], c.result.layouts["per-group"]
        return p.prefix_hit_rate - s.prefix_hit_rate

    def latency(c: Cell) -> float:
        s, p = c.result.layouts["stock"], c.result.layouts["per-group"]
        base = s.latency_steps.get("mean", 0.0)
        return p.latency_steps.get("mean", 0.0) / base if base else 1.0

    lines += _overview(ok, tput, latency)
    lines += _findings(ok)
    better = sorted(verdicts.get("better", []), key=latency)[:6]
    worse = sorted(verdicts.get("worse", []) + verdicts.get("mixed", []), key=latency)[::-1][:6]
    align = [c for c in ok if c.mode == "align" and c.trace == "prefix"]
    by_hits = sorted(align, key=lambda c: abs(hits(c)))[::-1][:4]
    rows = []
    seen = set()
    for c in [*better, *worse, *by_hits]:
        key = (c.config, c.memory_gib, c.mode, c.trace, c.max_num_seqs)
        if key in seen:
            continue
        seen.add(key)
        s, p = c.result.layouts["stock"], c.result.layouts["per-group"]
        rows.append(
            [
                f"{c.config} @{c.max_num_seqs}",
                f"{c.memory_gib}",
                c.mode,
                c.trace,
                _verdict(c),
                f"{tput(c):.3f}",
                f"{latency(c):.3f}",
                f"{s.mean_running:.0f} / {p.mean_running:.0f}",
                f"{s.preemptions} / {p.preemptions}",
                f"{100 * s.prefix_hit_rate:.1f}% / {100 * p.prefix_hit_rate:.1f}%",
                f"{s.peak_kv_held_bytes / GiB:.1f} / {p.peak_kv_held_bytes / GiB:.1f}",
            ]
        )
    lines.append(
        "The cells where per-group pools do best, worst, and where prefix hits differ most "
        "(stock / per-group):"
    )
    lines.append("")
    lines += _table(
        (
            "model",
            "GiB",
            "mode",
            "trace",
            "verdict",
            "throughput ratio",
            "latency ratio",
            "mean running",
            "preemptions",
            "prefix hits",
            "peak KV held, GiB",
        ),
        rows,
    )
    lines.append("")
    same = verdicts.get("same", [])
    if same:
        lines.append(
            f"Where per-group pools do not help ({len(same)} cells 'same'): the two layouts "
            "ran nearly the same schedule, so memory was not what limited the batch on "
            "either (the arrival rate or `max_num_seqs` was); the tables below name the "
            "cells."
        )
        lines.append("")
    worse = verdicts.get("worse", []) + verdicts.get("mixed", [])
    if worse:
        lines.append(
            "Where per-group pools do worse or trade one metric for another: "
            + "; ".join(
                f"{c.config} {c.memory_gib} GiB {c.mode} {c.trace} @{c.max_num_seqs}"
                for c in worse[:12]
            )
            + ("; ..." if len(worse) > 12 else "")
            + "."
        )
        lines.append("")
    return lines


def _overview(ok: Sequence[Cell], tput: Any, latency: Any) -> list[str]:
    """One row per model and memory, one column per trace and mode: per-group / stock
    throughput and mean latency (a second figure for the run at fewer sequences)."""
    columns = sorted({(c.mode, c.trace) for c in ok}, key=lambda k: (MODES.index(k[0]), k[1]))
    rows = []
    for config, memory in sorted({(c.config, c.memory_gib) for c in ok}):
        row = [config, str(memory)]
        for mode, trace in columns:
            sel = [
                c
                for c in ok
                if (c.config, c.memory_gib, c.mode, c.trace) == (config, memory, mode, trace)
            ]
            texts = []
            for c in sel:
                text = f"{tput(c):.2f} / {latency(c):.2f}"
                if c.max_num_seqs != MAX_NUM_SEQS:
                    text = f"@{c.max_num_seqs}: {text}"
                texts.append(f"**{text}**" if _verdict(c) == "**better**" else text)
            row.append("; ".join(texts) or "refused")
        rows.append(row)
    header = ["model", "GiB", *(f"{trace}, '{mode}'" for mode, trace in columns)]
    return [
        "Per cell: per-group / stock throughput (finished per step) and mean latency "
        f"(max_num_seqs {MAX_NUM_SEQS}; `@n:` the run at n sequences); bold where "
        "per-group pools are better on the whole (verdict rule above):",
        "",
        *_table(header, rows),
        "",
    ]


def _findings(ok: Sequence[Cell]) -> list[str]:
    """Counts over the cells, by what drives them (computed, not written by hand)."""
    lines = ["What the numbers say (counted over the cells that ran on both layouts):", ""]

    def over(c: Cell) -> bool:
        return (
            _fixed_bytes(c.config, c.memory_gib, c.mode, c.max_num_seqs, c.result.max_model_len)
            > c.memory_gib * GiB // 2
        )

    def layouts(c: Cell) -> tuple[Any, Any]:
        return c.result.layouts["stock"], c.result.layouts["per-group"]

    flagged = [c for c in ok if over(c)]
    fitted = [c for c in ok if not over(c)]
    for label, group in (
        ("Mamba state of max_num_seqs requests over half the KV memory", flagged),
        ("at most half", fitted),
    ):
        if not group:
            continue
        verdicts: dict[str, int] = {}
        for c in group:
            key = _verdict(c).strip("*")
            verdicts[key] = verdicts.get(key, 0) + 1
        more = sum(1 for c in group if layouts(c)[1].preemptions > layouts(c)[0].preemptions)
        fewer = sum(1 for c in group if layouts(c)[1].preemptions < layouts(c)[0].preemptions)
        lines.append(
            f"- {label} ({len(group)} cells): "
            + ", ".join(f"{k} {n}" for k, n in sorted(verdicts.items()))
            + f"; per-group pools preempt more in {more}, fewer in {fewer}."
        )
    hits = [c for c in ok if c.mode == "align" and c.trace == "prefix"]
    if hits:
        diffs = [(layouts(c)[1].prefix_hit_rate - layouts(c)[0].prefix_hit_rate, c) for c in hits]
        up = [d for d in diffs if d[0] > 0.005]
        down = [d for d in diffs if d[0] < -0.005]
        best = max(diffs, key=lambda d: d[0])
        lines.append(
            f"- Prefix trace, 'align' ({len(hits)} cells): per-group pools hit more prefix "
            f"tokens in {len(up)}, fewer in {len(down)}; largest gain "
            f"{100 * best[0]:+.1f} points ({best[1].config}, {best[1].memory_gib} GiB, "
            f"@{best[1].max_num_seqs}: {100 * layouts(best[1])[0].prefix_hit_rate:.1f}% -> "
            f"{100 * layouts(best[1])[1].prefix_hit_rate:.1f}%)."
        )
    cpu = [
        layouts(c)[1].cpu_us_per_step / layouts(c)[0].cpu_us_per_step
        for c in ok
        if layouts(c)[0].cpu_us_per_step
    ]
    if cpu:
        cpu.sort()
        lines.append(
            f"- Scheduler CPU per step, per-group / stock (Rust pools against vLLM's Python "
            f"pool, same process, shared machine): median {cpu[len(cpu) // 2]:.2f}, range "
            f"{cpu[0]:.2f}-{cpu[-1]:.2f}."
        )
    lines.append("")
    return lines


def _pools(r: Any) -> str:
    if not r.ok:
        return "refused"
    parts = []
    for pool in r.pools:
        unit = "states" if pool.kind == "Mamba" else f"x {pool.block_size} tokens"
        parts.append(f"{pool.kind} {pool.num_blocks:,} {unit}")
    return "; ".join(parts)


def _layouts(cells: Sequence[Cell]) -> list[str]:
    """The pools each layout built (they depend on model, memory, mode and max_num_seqs,
    not on the trace)."""
    rows = []
    seen = set()
    for c in cells:
        key = (c.config, c.memory_gib, c.mode, c.max_num_seqs)
        if key in seen:
            continue
        seen.add(key)
        s, p = c.result.layouts["stock"], c.result.layouts["per-group"]
        rows.append(
            [
                c.config,
                str(c.memory_gib),
                c.mode,
                str(c.max_num_seqs),
                _pools(s),
                _pools(p),
                f"{s.kv_cache_size_tokens or 0:,} / {p.kv_cache_size_tokens or 0:,}"
                if s.ok and p.ok
                else "-",
            ]
        )
    return [
        "## The layouts",
        "",
        "Blocks of each pool, null block included (a Mamba block holds one request's "
        "state; in 'align' mode also cached states). Stock shares one pool between all "
        "groups: a running request takes one block per Mamba group in it, plus its "
        "attention blocks of the raised block size. Per-group pools hold the Mamba state "
        "of `max_num_seqs` requests up front ('align': with room for cached states) and "
        "give the rest to attention at 16 tokens a block. *KV capacity* is vLLM's own "
        "startup figure (tokens; for per-group pools, of the attention pool only).",
        "",
        *_table(
            ("model", "GiB", "mode", "max_num_seqs", "stock", "per-group", "KV capacity"), rows
        ),
        "",
    ]


def _refusals(cells: Sequence[Cell]) -> list[str]:
    errors = []
    for c in cells:
        for name, r in c.result.layouts.items():
            if not r.ok:
                errors.append(
                    f"- {c.config}, {c.memory_gib} GiB, '{c.mode}', {c.trace}, "
                    f"max_num_seqs {c.max_num_seqs}, **{name}**: {r.error}"
                )
    if not errors:
        return ["## Cells that could not be simulated", "", "None.", ""]
    unique = sorted(set(errors))
    return [
        "## Cells that could not be simulated",
        "",
        "The layout's own sizing refused to start an engine (the same error a real engine "
        "would stop with at startup):",
        "",
        *unique,
        "",
    ]


def _highlight(cells: Sequence[Cell]) -> Cell | None:
    ok = [c for c in cells if _both_ok(c)]
    if not ok:
        return None

    def spread(c: Cell) -> float:
        s, p = c.result.layouts["stock"], c.result.layouts["per-group"]
        return abs(p.finished_per_step / s.finished_per_step - 1) if s.finished_per_step else 0

    return max(ok, key=spread)


def _highlight_title(cells: Sequence[Cell]) -> str:
    c = _highlight(cells)
    if c is None:
        return "(no cell ran on both layouts)"
    return (
        f"the cell with the largest throughput difference ({c.config}, {c.memory_gib} GiB, "
        f"'{c.mode}', {c.trace}, max_num_seqs {c.max_num_seqs})"
    )


def plot(cells: Sequence[Cell], traces: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybrid_alloc.integration.simulator import draw_series

    configs = sorted({c.config for c in cells})
    memories = sorted({c.memory_gib for c in cells})
    fig = plt.figure(figsize=(15, 10))
    grid = fig.add_gridspec(3, len(traces), height_ratios=[1, 1, 1.1])
    colors = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
    width = 0.8 / max(1, len(memories))
    for row, mode in enumerate(MODES):
        for col, kind in enumerate(traces):
            ax = fig.add_subplot(grid[row, col])
            for i, memory in enumerate(memories):
                values = []
                for config in configs:
                    # Prefer the max_num_seqs=256 cell; else the re-run at fewer seqs.
                    sel = [
                        c
                        for c in cells
                        if (c.config, c.memory_gib, c.mode, c.trace) == (config, memory, mode, kind)
                        and _both_ok(c)
                    ]
                    if not sel:
                        values.append(0.0)
                        continue
                    s = sel[0].result.layouts["stock"]
                    p = sel[0].result.layouts["per-group"]
                    values.append(
                        p.finished_per_step / s.finished_per_step if s.finished_per_step else 0
                    )
                xs = [j + (i - (len(memories) - 1) / 2) * width for j in range(len(configs))]
                ax.bar(xs, values, width, label=f"{memory} GiB", color=colors[i % len(colors)])
            ax.axhline(1.0, color="#d62728", lw=0.8)
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels(
                [c.split("-")[0] + "-" + c.split("-")[1] for c in configs],
                rotation=30,
                ha="right",
                fontsize=7,
            )
            ax.set_title(f"{kind}, mode '{mode}'", fontsize=9)
            if col == 0:
                ax.set_ylabel("per-group / stock\nfinished per step", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    best = _highlight(cells)
    if best is not None:
        half = max(1, len(traces) // 2)
        ax1 = fig.add_subplot(grid[2, :half])
        ax2 = fig.add_subplot(grid[2, half:])
        draw_series(best.result, ax1, ax2)
        ax1.set_title(
            f"{best.config}, {best.memory_gib} GiB, '{best.mode}', {best.trace}", fontsize=9
        )
    fig.suptitle(
        "Serving simulation (vLLM's scheduler, no model): per-group pools vs stock vLLM",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--configs", default=",".join(sorted(shipped_configs())))
    parser.add_argument("--memories", default=",".join(map(str, MEMORIES_GIB)))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--json", type=Path, default=None, help="also write raw results")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="trace sizes times this (smoke runs)"
    )
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    memories = [int(m) for m in args.memories.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    kinds = [t for t in args.traces.split(",") if t]
    traces = {
        kind: make_trace(
            TRACES[kind][0],
            num_requests=max(1, round(TRACES[kind][1] * args.scale)),
            rate=TRACES[kind][2],
        )
        for kind in kinds
    }
    t0 = time.perf_counter()
    cells = run_cells(configs, memories, modes, traces)
    elapsed = time.perf_counter() - t0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / "serving.png"
    plot(cells, kinds, png)
    write_report(cells, traces, args.out_dir / "SERVING.md", elapsed, png.name)
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "config": c.config,
                        "memory_gib": c.memory_gib,
                        "mode": c.mode,
                        "trace": c.trace,
                        "max_num_seqs": c.max_num_seqs,
                        "seconds": c.seconds,
                        "result": c.result.to_json(),
                    }
                    for c in cells
                ],
                indent=1,
            )
        )
    print(f"wrote {args.out_dir / 'SERVING.md'} and {png} in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
