"""Serving benchmark: stock vLLM, the static per-group split and elastic per-group pools on
the shipped configs, through vLLM's own scheduler.

For every shipped config at 16 / 40 / 80 GiB of KV memory, Mamba 'none' and 'align' modes,
and each generated trace (chat, long documents, prefix sharing, reasoning, agentic
sessions), runs the serving
simulator (:mod:`hybrid_alloc.integration.simulator`: vLLM's real ``Scheduler``, no model,
no GPU) on the same seeded trace for each layout: the KV-cache config vLLM builds
(**stock**), the one this package builds with a static split sized up front for
``max_num_seqs`` requests (**per-group**), and per-group pools over one shared byte budget
(**elastic**). Every step is charged what it computes (``--time-model h100``, the
default: :mod:`hybrid_alloc.step_time`) or 25 ms (``--time-model fixed``). Writes
``benches/SERVING.md`` and ``benches/serving.png``.

    python benches/bench_serving.py [--out-dir benches] [--configs a,b] [--memories 16,40,80]
        [--modes none,align] [--traces chat,long,long-burst,prefix,reasoning,agentic]
        [--layouts stock,per-group,elastic] [--json FILE] [--scale X] [--time-model h100]
        [--async-scheduling]
        [--shard I/N --save-cells FILE] [--merge FILE,FILE,...]

``--shard I/N`` runs every N-th (config, memory) group of cells from the I-th on
and ``--save-cells`` keeps them (a pickle); ``--merge`` writes the report from the saved
cells of several shards, run side by side, one per core.

Where the Mamba state of 256 requests takes more than half of the KV memory in the static
split's pools (static sizing then over-subscribes its fixed pools, or refuses), the cell is
also run, every layout, at the largest ``max_num_seqs`` of :data:`FALLBACK_SEQS` whose
fixed pools take at most half: what the capacity planner's "lower --max-num-seqs" advice
leads to. Every layout is compared with stock (:func:`_verdict`). Trace sizes are chosen so
that the whole run takes about an hour on two shared CPU cores; see :data:`TRACES`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
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
TIME_MODEL = "h100"
ASYNC_SCHEDULING = False
"""vLLM's async scheduler (``--async-scheduling``, a GPU engine's default) instead of the
sync one."""
"""How steps are charged (``--time-model``): ``h100``, each step what it computes
(:mod:`hybrid_alloc.step_time`); ``fixed``, :data:`STEP_MS` each."""
MAX_NUM_BATCHED_TOKENS = 8192

BASE = "stock"
"""The layout every other one is compared with."""
LAYOUTS = ("stock", "per-group", "elastic")
"""Default ``--layouts``: stock vLLM, the static per-group split, elastic per-group pools."""
LABELS = {"stock": "stock", "per-group": "static split", "elastic": "elastic"}
SHORT = {"stock": "stock", "per-group": "static", "elastic": "elastic"}

# Verdict of a layout against stock (:func:`_verdict`). Worse: throughput (finished
# requests per simulated second) below WORSE_TPUT x stock's, mean latency above WORSE_LATENCY x, or
# prefix hits more than WORSE_HITS (a fraction of prompt tokens) below stock's. Better (and
# not worse): throughput above BETTER_TPUT x, latency below BETTER_LATENCY x, or prefix hits
# more than BETTER_HITS above.
WORSE_TPUT = 0.98
WORSE_LATENCY = 1.05
WORSE_HITS = 0.005
BETTER_TPUT = 1.03
BETTER_LATENCY = 0.97
BETTER_HITS = 0.01
VERDICTS = ("worse", "better", "same")

# trace name: (generator in hybrid_alloc.traces, requests, arrivals per second). Chat
# requests arrive faster than 256 sequences are served while they arrive (1.5 a step, ~275
# steps each); long documents at ~4 a second (up to ~30 held at once); prefix sharing at 40
# a second (conversation turns follow 5-20 s later). `long-burst` sends 96 long documents
# at once, so that KV memory, not arrivals or max_num_seqs, limits the batch for most
# models at 16 GiB: the case per-group capacity is meant for. About 20 minutes of CPU per
# layout for the whole grid on this machine.
TRACES: dict[str, tuple[str, int, float]] = {
    "chat": ("chat", 200, 60.0),
    "long": ("long", 32, 4.0),
    "long-burst": ("long", 96, 1000.0),
    "prefix": ("prefix", 200, 40.0),
    # Long heavy-tailed outputs in waves (issue 28), agent sessions re-sending their context.
    "reasoning": ("reasoning", 160, 1.0),
    "agentic": ("agentic", 240, 4.0),
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

    @property
    def name(self) -> str:
        return (
            f"{self.config} {self.memory_gib} GiB '{self.mode}' {self.trace} @{self.max_num_seqs}"
        )

    def layout(self, name: str) -> Any:  # LayoutResult
        return self.result.layouts[name]


@dataclass(frozen=True)
class Ratios:
    """One layout against another in one cell."""

    tput: float
    """Finished requests per simulated second, layout / base."""
    latency: float
    """Mean latency in simulated seconds, layout / base."""
    hits: float
    """Prefix-cache hit rate (share of prompt tokens), layout minus base."""
    cpu: float | None
    """Scheduler CPU per busy step, layout / base (None: no figure for base)."""


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
        time_model=TIME_MODEL,
        step_ms=STEP_MS,
        async_scheduling=ASYNC_SCHEDULING,
    )


def _fixed_bytes(config: str, memory_gib: int, mode: str, seqs: int, max_len: int) -> int:
    """Bytes the static split sets aside for the fixed-size (Mamba) pools, per the planner."""
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
    layouts: Sequence[str] = LAYOUTS,
    log: Any = sys.stdout,
    shard: tuple[int, int] = (0, 1),
) -> list[Cell]:
    """Every cell, or (``shard`` = (i, n)) those of every n-th (config, memory) group
    from the i-th on."""
    from hybrid_alloc.integration.simulator import simulate

    cells: list[Cell] = []
    group = -1
    for config in configs:
        max_len = min(32768, load_model(config).max_position_embeddings)
        for memory in memories:
            group += 1
            if group % shard[1] != shard[0]:
                continue
            for mode in modes:
                for kind, trace in traces.items():
                    t0 = time.perf_counter()
                    result = simulate(
                        config,
                        _settings(memory, mode, MAX_NUM_SEQS, max_len),
                        trace,
                        layouts=layouts,
                    )
                    cell = Cell(config, memory, mode, kind, MAX_NUM_SEQS, result, 0.0)
                    cell.seconds = time.perf_counter() - t0
                    cells.append(cell)
                    _log(cell, log)
                    seqs = _tuned_seqs(config, memory, mode, max_len)
                    if seqs is None:
                        continue
                    t0 = time.perf_counter()
                    again = simulate(
                        config, _settings(memory, mode, seqs, max_len), trace, layouts=layouts
                    )
                    retry = Cell(config, memory, mode, kind, seqs, again, 0.0)
                    retry.note = (
                        f"{config}, {memory} GiB: the Mamba state of {MAX_NUM_SEQS} requests "
                        f"takes over half the KV memory in the static split's pools; also run "
                        f"with max_num_seqs {seqs}, all layouts"
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
                f"{r.preemptions} preempt, hit {100 * r.prefix_hit_rate:.0f}%, "
                f"{r.cpu_us_per_step:,.0f} us/step"
            )
        else:
            parts.append(f"{name}: {r.error[:90] if r.error else '?'}")
    print(
        f"{cell.config} {cell.memory_gib}GiB {cell.mode} {cell.trace} seqs={cell.max_num_seqs} "
        f"({cell.seconds:.1f}s): " + " | ".join(parts),
        file=log,
        flush=True,
    )


# --------------------------------------------------------------------------- comparisons


def _ok(cell: Cell, *names: str) -> bool:
    """Whether every named layout ran in ``cell`` (all of the cell's layouts if none named)."""
    layouts = cell.result.layouts
    return all(n in layouts and layouts[n].ok for n in (names or tuple(layouts)))


def _ratios(cell: Cell, layout: str, base: str = BASE) -> Ratios:
    b, r = cell.layout(base), cell.layout(layout)
    lat_b = b.latency_s.get("mean", 0.0)
    return Ratios(
        tput=r.finished_per_s / b.finished_per_s if b.finished_per_s else 1.0,
        latency=r.latency_s.get("mean", 0.0) / lat_b if lat_b else 1.0,
        hits=r.prefix_hit_rate - b.prefix_hit_rate,
        cpu=r.cpu_us_per_step / b.cpu_us_per_step if b.cpu_us_per_step else None,
    )


def _verdict(cell: Cell, layout: str) -> str:
    """``layout`` against stock in one word: worse, better or same (see the thresholds at
    the top of the module); 'refused' where either did not run."""
    if not _ok(cell, BASE, layout):
        return "refused"
    r = _ratios(cell, layout)
    if r.tput < WORSE_TPUT or r.latency > WORSE_LATENCY or r.hits < -WORSE_HITS:
        return "worse"
    if r.tput > BETTER_TPUT or r.latency < BETTER_LATENCY or r.hits > BETTER_HITS:
        return "better"
    return "same"


def _marked(verdict: str) -> str:
    return f"**{verdict}**" if verdict == "better" else verdict


def _badness(cell: Cell, layout: str) -> tuple[bool, float, float]:
    """Sort key, worst first: worse cells before others, then the lower of the throughput
    ratio and the inverse latency ratio, then the prefix-hit difference."""
    r = _ratios(cell, layout)
    return (_verdict(cell, layout) != "worse", min(r.tput, _inverse(r.latency)), r.hits)


def _goodness(cell: Cell, layout: str) -> tuple[bool, float, float]:
    """Sort key, best first."""
    r = _ratios(cell, layout)
    return (_verdict(cell, layout) != "better", -max(r.tput, _inverse(r.latency)), -r.hits)


def _cpu_pairs(layouts: Sequence[str]) -> list[tuple[str, str]]:
    """(layout, base) pairs of the scheduler-CPU ratios: elastic / static, then each / stock."""
    pairs = []
    if "elastic" in layouts and "per-group" in layouts:
        pairs.append(("elastic", "per-group"))
    pairs += [(n, BASE) for n in layouts if n != BASE]
    return pairs


def _cpu_ratio(cell: Cell, layout: str, base: str) -> float | None:
    if not _ok(cell, layout, base):
        return None
    return _ratios(cell, layout, base).cpu


def _same_schedule(cell: Cell, a: str, b: str) -> bool:
    """Whether two layouts ran nearly the same schedule (steps within 1%, mean running
    within 2%): per-step scheduler cost grows with the batch, so only then is its ratio
    one of the pools alone."""
    x, y = cell.layout(a), cell.layout(b)
    if not (x.steps and y.steps and x.mean_running and y.mean_running):
        return False
    return abs(x.steps / y.steps - 1) <= 0.01 and abs(x.mean_running / y.mean_running - 1) <= 0.02


def _cells(n: int) -> str:
    return f"{n} cell" + ("" if n == 1 else "s")


def _inverse(x: float) -> float:
    return 1 / x if x else math.inf


# --------------------------------------------------------------------------- report


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.3f}" if a else "n/a"


def _each(cell: Cell, layouts: Sequence[str], fmt: Callable[[Any], str]) -> str:
    """``fmt`` of each layout's result, ' / ' between, '-' where a layout did not run."""
    return " / ".join(fmt(cell.layout(n)) if _ok(cell, n) else "-" for n in layouts)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    rule = "|:---|" + "|".join("---:" for _ in header[1:]) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)]


def _header(layouts: Sequence[str]) -> list[str]:
    compared = [n for n in layouts if n != BASE]
    pairs = _cpu_pairs(layouts)
    names = " / ".join(SHORT[n] for n in layouts)
    return [
        "model",
        "GiB",
        f"finished / s ({names})",
        *(f"throughput, {SHORT[n]} / stock" for n in compared),
        "mean running",
        "preemptions",
        "recomputed tokens",
        "prefix hits (tokens)",
        "TTFT, s (mean)",
        "latency, s (mean)",
        *(f"latency, {SHORT[n]} / stock" for n in compared),
        "sched. CPU us / step",
        *(
            ["sched. CPU ratios: " + "; ".join(f"{SHORT[a]} / {SHORT[b]}" for a, b in pairs)]
            if pairs
            else []
        ),
        *(f"{SHORT[n]} vs stock" for n in compared),
    ]


def _versus(cell: Cell, layout: str, metric: Callable[[Any], float]) -> str:
    """``metric`` of ``layout`` / stock's, as text."""
    if not _ok(cell, BASE, layout):
        return "n/a"
    return _ratio(metric(cell.layout(BASE)), metric(cell.layout(layout)))


def _cpu_text(cell: Cell, layout: str, base: str) -> str:
    value = _cpu_ratio(cell, layout, base)
    return "n/a" if value is None else f"{value:.2f}"


def cell_rows(cells: Sequence[Cell], layouts: Sequence[str]) -> list[list[str]]:
    compared = [n for n in layouts if n != BASE]
    pairs = _cpu_pairs(layouts)
    rows = []
    for c in cells:
        name = c.config + ("" if c.max_num_seqs == MAX_NUM_SEQS else f" @{c.max_num_seqs} seqs")
        cpus = ["; ".join(_cpu_text(c, a, b) for a, b in pairs)] if pairs else []

        rows.append(
            [
                name,
                f"{c.memory_gib}",
                _each(c, layouts, lambda r: f"{r.finished_per_s:.3f}"),
                *(_versus(c, n, lambda r: r.finished_per_s) for n in compared),
                _each(c, layouts, lambda r: f"{r.mean_running:.0f}"),
                _each(c, layouts, lambda r: f"{r.preemptions}"),
                _each(c, layouts, lambda r: f"{r.recomputed_tokens:,}"),
                _each(c, layouts, lambda r: f"{100 * r.prefix_hit_rate:.1f}%"),
                _each(c, layouts, lambda r: f"{r.ttft_s.get('mean', 0):.2f}"),
                _each(c, layouts, lambda r: f"{r.latency_s.get('mean', 0):.1f}"),
                *(_versus(c, n, lambda r: r.latency_s.get("mean", 0.0)) for n in compared),
                _each(c, layouts, lambda r: f"{r.cpu_us_per_step:,.0f}"),
                *cpus,
                *(_marked(_verdict(c, n)) for n in compared),
            ]
        )
    return rows


def _modes_of(cells: Sequence[Cell]) -> str:
    """'N in 'align' mode, M in 'none' mode' for ``cells``."""
    counts = {m: sum(1 for c in cells if c.mode == m) for m in MODES}
    return ", ".join(f"{k} in '{m}' mode" for m, k in counts.items() if k)


def _describe_layout(name: str) -> str:
    return {
        "stock": (
            "the KV-cache layout vLLM builds itself for the full-size model (**stock**: one "
            "shared pool, attention block size raised and Mamba pages padded by vLLM's "
            "platform hook, sized by vLLM's `get_kv_cache_configs`)"
        ),
        "per-group": (
            "this package's per-group pools with a **static split** (layout `per-group`: one "
            "Rust pool per KV-cache group at its natural page size; the Mamba state of "
            "`max_num_seqs` requests set aside up front, the rest to attention)"
        ),
        "elastic": (
            "**elastic** per-group pools (layout `elastic`: the same per-group Rust pools "
            "over one shared byte budget, lent to a group in slabs when it needs them and "
            "returned when its blocks in a slab are free; the engine's default)"
        ),
    }.get(name, f"**{name}**")


_TITLES = {"per-group": "the static per-group split", "elastic": "elastic per-group pools"}


def _and_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def write_report(
    cells: Sequence[Cell],
    traces: dict[str, Trace],
    out: Path,
    elapsed: float,
    png: str,
    layouts: Sequence[str] = LAYOUTS,
    num_shards: int = 1,
    commit: str | None = None,
) -> None:
    """``commit``: the one the cells ran at (merged shards), else this checkout's."""
    from hybrid_alloc.integration import versions

    shards = f" ({num_shards} shards side by side, the longest)" if num_shards > 1 else ""

    compared = [n for n in layouts if n != BASE]
    names = " / ".join(SHORT[n] for n in layouts)
    lines = [
        "# Serving simulation: "
        + _and_list(["stock vLLM", *(_TITLES[n] for n in compared)])
        + " on the shipped configs",
        "",
        "Generated by `python benches/bench_serving.py"
        + (" --async-scheduling" if ASYNC_SCHEDULING else "")
        + "` (no GPU): vLLM's own scheduler (`"
        + (
            "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
            if ASYNC_SCHEDULING
            else "vllm.v1.core.sched.scheduler.Scheduler"
        )
        + "`, its KV-cache manager, coordinator and "
        f"pools) runs every trace {len(layouts)} times in one process, side by side (the "
        "engines take turns of a few hundred steps each, so that machine noise falls on every "
        "layout's scheduler CPU alike), on "
        + "; on ".join(_describe_layout(n) for n in layouts)
        + ". No model runs: each step a fake runner returns one token per request that is "
        "not mid-prefill. See `hybrid_alloc.integration.simulator` for what is vLLM's code "
        "and what is faked.",
        "",
        "## Setup",
        "",
        f"- vLLM {versions.installed_version()} (scheduler side; CUDA block-size rules: "
        "FlashAttention kernel blocks of 16), Python "
        f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPU cores "
        f"(shared with other jobs), commit {commit or _git_commit()}.",
        f"- Engine: `max_num_seqs` {MAX_NUM_SEQS}, `max_num_batched_tokens` "
        f"{MAX_NUM_BATCHED_TOKENS:,}, block size 16, chunked prefill, `max_model_len` "
        "min(32,768, the model's context); 'none' = no prefix caching, 'align' = prefix "
        "caching (vLLM's Mamba 'align' mode). "
        + (
            "Async scheduler (`AsyncScheduler`, two steps in flight: a GPU engine's default)."
            if ASYNC_SCHEDULING
            else "Sync scheduler."
        ),
        (
            "- Time: arrivals in simulated seconds; every step costs what it computes on "
            "one H100 (`hybrid_alloc.step_time`: a fixed part plus the larger of its FLOPs "
            "and its bytes moved: prompt chunks, recomputed tokens of preempted requests, "
            "decodes, KV context and Mamba states read). Throughput, TTFT and latency are "
            "in simulated seconds."
            if TIME_MODEL != "fixed"
            else f"- Time: arrivals in simulated seconds, {STEP_MS:g} ms per scheduler step "
            "whatever the batch (a fixed step time: the comparison is of what the pools "
            "admit, not of kernel speed)."
        ),
        "- Traces (seeded, `hybrid_alloc.traces`; token IDs derived so shared prefixes "
        "hash equal; every layout of a cell runs the same requests):",
    ]
    for kind, trace in traces.items():
        rate = TRACES[kind][2]
        lines.append(f"  - **{kind}** ({len(trace)} requests, {rate:g}/s): {trace.describe()}.")
    lines += [
        "  Requests longer than a model's context keep their output and have their prompt "
        "cut to fit (Zamba2: 4,096 tokens, Nemotron-H-8B: 8,192), counted in each table's "
        "notes.",
        f"- Total run time of the benchmark: {elapsed / 60:.1f} min{shards} "
        f"({len(cells)} cells, each on {len(layouts)} layouts: {', '.join(layouts)}).",
        "",
        f"Columns give {names}. *finished / s* is requests finished per simulated second "
        "over the whole run (all requests finish in every cell, so its ratio is the "
        "inverse makespan ratio); *recomputed tokens* are tokens preempted requests "
        "computed again; *throughput* and *latency* ratios are against stock "
        "(above 1 = more throughput; below 1 = lower latency). *... vs stock*: "
        f"**worse** where throughput is below {WORSE_TPUT:g}x stock's, mean latency above "
        f"{WORSE_LATENCY:g}x, or prefix hits more than {100 * WORSE_HITS:g} points lower; "
        f"**better** (and not worse) where throughput is above {BETTER_TPUT:g}x, latency "
        f"below {BETTER_LATENCY:g}x, or prefix hits more than {100 * BETTER_HITS:g} point "
        "higher; else same.",
        "",
    ]
    lines += _headline(cells, layouts)
    for mode in MODES:
        for kind in traces:
            sel = [c for c in cells if c.mode == mode and c.trace == kind]
            if not sel:
                continue
            lines += [f"## Trace `{kind}`, mode '{mode}'", ""]
            lines += _table(_header(layouts), cell_rows(sel, layouts))
            notes = sorted({c.note for c in sel if c.note})
            clipped = sorted(
                {
                    f"{c.config}: {c.layout(BASE).clipped} prompts cut to fit the "
                    "context with their output"
                    for c in sel
                    if c.layout(BASE).clipped
                }
            )
            for note in [*notes, *clipped]:
                lines.append(f"- {note}")
            lines.append("")
    lines += _layouts_section(cells, layouts)
    lines += _refusals(cells)
    lines += [
        "## Plot",
        "",
        f"![serving]({png})",
        "",
        "Top rows: "
        + ", ".join(f"{SHORT[n]} / stock" for n in compared)
        + " throughput (finished requests per simulated second) for every cell, one row per layout "
        "and mode, bars drawn from 1.0 (models on the x axis, one bar per memory size; "
        "the max_num_seqs 256 cell, else the re-run at fewer sequences; a missing bar is a "
        "refused cell). Bottom: running requests and KV memory held over simulated time for "
        f"{_highlight_title(cells, layouts)}.",
        "",
    ]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _primary(layouts: Sequence[str]) -> str | None:
    """The layout the headline looks at first: elastic where it ran."""
    compared = [n for n in layouts if n != BASE]
    if "elastic" in compared:
        return "elastic"
    return compared[-1] if compared else None


def _headline(cells: Sequence[Cell], layouts: Sequence[str]) -> list[str]:
    compared = [n for n in layouts if n != BASE]
    ok = [c for c in cells if _ok(c, *layouts)]
    lines = ["## Headline", ""]
    if not compared:
        return [*lines, "Only stock ran: nothing to compare.", ""]
    refused = {n: sum(1 for c in cells if not _ok(c, n)) for n in layouts}
    lines.append(
        f"{len(ok)} of {len(cells)} cells ran on all {len(layouts)} layouts; the counts "
        "below are over those cells ("
        + (
            ", ".join(f"{LABELS[n]} refused in {k}" for n, k in refused.items() if k)
            or "none refused"
        )
        + f"). Of them {sum(1 for c in ok if c.max_num_seqs == MAX_NUM_SEQS)} ran at "
        f"max_num_seqs {MAX_NUM_SEQS} and the rest at fewer sequences (the `@n` re-runs)."
    )
    for n in compared:
        kept = [c for c in ok if c.layout(n).note]
        if kept:
            lines.append(
                f"In {len(kept)} of them ({_modes_of(kept)}) the engine with {LABELS[n]} "
                "pools switched on keeps vLLM's own KV-cache layout, on the Rust pool, and "
                "the simulated engine does the same (its note: "
                f'"{kept[0].layout(n).note}"): there {LABELS[n]} makes stock\'s decisions.'
            )
    lines.append("")
    rows = []
    for n in [_primary(layouts), *(x for x in compared if x != _primary(layouts))]:
        assert n is not None
        counts = {v: [c for c in ok if _verdict(c, n) == v] for v in VERDICTS}
        at_256 = {v: sum(1 for c in counts[v] if c.max_num_seqs == MAX_NUM_SEQS) for v in counts}
        rows.append(
            [
                f"{LABELS[n]} vs stock",
                *(f"{len(counts[v])}" for v in VERDICTS),
                " / ".join(f"{at_256[v]}" for v in VERDICTS),
            ]
        )
    lines += _table(
        (
            "layout",
            "worse",
            "better",
            "same",
            f"worse / better / same, max_num_seqs {MAX_NUM_SEQS} cells only",
        ),
        rows,
    )
    lines.append("")
    primary = _primary(layouts)
    assert primary is not None
    others = [n for n in compared if n != primary]
    for n in [primary, *others]:
        lines += _better_by_reason(ok, n)
        lines += _recompute_check(ok, n)
    lines += _ranked(ok, primary, layouts, worst=True)
    lines += _ranked(ok, primary, layouts, worst=False)
    lines += _cpu_section(cells, layouts)
    if "elastic" in compared:
        lines += _fragmentation(ok)
    lines += _findings(ok, compared)
    for n in [primary, *others]:
        lines += _overview(ok, n)
    return lines


def better_reasons(cell: Cell, layout: str) -> list[str]:
    """Why ``layout`` is better than stock in ``cell`` (every reason that holds; empty
    unless the verdict is better)."""
    if _verdict(cell, layout) != "better":
        return []
    r = _ratios(cell, layout)
    reasons = []
    if r.tput > BETTER_TPUT:
        reasons.append("throughput")
    if r.latency < BETTER_LATENCY:
        reasons.append("latency")
    if r.hits > BETTER_HITS:
        reasons.append("prefix hits")
    return reasons


def _better_by_reason(ok: Sequence[Cell], layout: str) -> list[str]:
    """The better cells of ``layout`` split by what made them better."""
    better = [c for c in ok if _verdict(c, layout) == "better"]
    if not better:
        return []
    reasons = {id(c): better_reasons(c, layout) for c in better}
    counts = {
        k: sum(1 for c in better if k in reasons[id(c)])
        for k in ("throughput", "latency", "prefix hits")
    }
    only_hits = sum(1 for c in better if reasons[id(c)] == ["prefix hits"])
    return [
        f"Why {LABELS[layout]} is better in its {len(better)} better cells (a cell may count "
        f"under several): throughput in {counts['throughput']}, mean latency in "
        f"{counts['latency']}, prefix hits in {counts['prefix hits']}; prefix hits alone in "
        f"{only_hits} (16-token hits, which the static split has too).",
        "",
    ]


RECOMPUTE_LIMIT = 2.0
"""A layout that recomputes more than this many times stock's tokens after preemptions is
listed (:func:`_recompute_check`), with whether it is better in simulated time anyway."""


def _recompute_check(ok: Sequence[Cell], layout: str) -> list[str]:
    """Cells where ``layout`` recomputed more than :data:`RECOMPUTE_LIMIT` x stock's tokens
    after preemptions (any, where stock recomputed none)."""
    heavy = [
        c
        for c in ok
        if c.layout(layout).recomputed_tokens > RECOMPUTE_LIMIT * c.layout(BASE).recomputed_tokens
    ]
    lines = [
        f"Cells where {LABELS[layout]} recomputed more than {RECOMPUTE_LIMIT:g}x stock's "
        f"tokens after preemptions: {len(heavy)}" + (":" if heavy else "."),
        "",
    ]
    for c in heavy:
        r = _ratios(c, layout)
        lines.append(
            f"- {c.name}: {c.layout(BASE).recomputed_tokens:,} -> "
            f"{c.layout(layout).recomputed_tokens:,} tokens, {_verdict(c, layout)} in "
            f"simulated time (throughput {r.tput:.3f}x, latency {r.latency:.3f}x)"
        )
    if heavy:
        lines.append("")
    return lines


def _ranked(ok: Sequence[Cell], layout: str, layouts: Sequence[str], worst: bool) -> list[str]:
    """The five worst (or best) cells of ``layout`` against stock, with their ratios and
    the other layouts' beside them."""
    others = [n for n in layouts if n not in (BASE, layout)]
    if worst:
        chosen = sorted(ok, key=lambda c: _badness(c, layout))[:5]
    else:
        chosen = [c for c in sorted(ok, key=lambda c: _goodness(c, layout))[:5]]
        chosen = [c for c in chosen if _verdict(c, layout) == "better"]
    if not chosen:
        return []
    every = list(layouts)
    rows = []
    for c in chosen:
        r = _ratios(c, layout)
        base, mine = c.layout(BASE), c.layout(layout)
        rows.append(
            [
                c.config + f" @{c.max_num_seqs}",
                f"{c.memory_gib}",
                c.mode,
                c.trace,
                _marked(_verdict(c, layout)),
                f"{r.tput:.3f}",
                f"{r.latency:.3f}",
                f"{100 * base.prefix_hit_rate:.1f}% -> {100 * mine.prefix_hit_rate:.1f}% "
                f"({100 * r.hits:+.1f})",
                *(
                    f"{_ratios(c, o).tput:.3f} / {_ratios(c, o).latency:.3f} ({_verdict(c, o)})"
                    for o in others
                ),
                _each(c, every, lambda x: f"{x.mean_running:.0f}"),
                _each(c, every, lambda x: f"{x.preemptions}"),
                _each(c, every, lambda x: f"{x.peak_kv_held_bytes / GiB:.1f}"),
            ]
        )
    order = " / ".join(SHORT[n] for n in every)
    what = (
        "worst cells of {} against stock (worse cells first, then by the lower of the "
        "throughput ratio and the inverse latency ratio)"
        if worst
        else "best cells of {} against stock (better cells only)"
    )
    return [
        f"The five {what.format(LABELS[layout])}:",
        "",
        *_table(
            (
                "model",
                "GiB",
                "mode",
                "trace",
                f"{SHORT[layout]} vs stock",
                "throughput ratio",
                "latency ratio",
                "prefix hits (points)",
                *(f"{SHORT[o]}: throughput / latency ratio" for o in others),
                f"mean running ({order})",
                "preemptions",
                "peak KV held, GiB",
            ),
            rows,
        ),
        "",
    ]


def _cpu_section(cells: Sequence[Cell], layouts: Sequence[str]) -> list[str]:
    """Median and worst scheduler-CPU-per-step ratios over the cells, over all of them and
    over those where the two layouts ran the same schedule."""

    def p90(values: Sequence[float]) -> float:
        return values[min(len(values) - 1, int(0.9 * len(values)))]

    rows = []
    for a, b in _cpu_pairs(layouts):
        values = sorted(
            ((v, c) for c in cells if (v := _cpu_ratio(c, a, b)) is not None),
            key=lambda x: x[0],
        )
        if not values:
            continue
        same = [(v, c) for v, c in values if _same_schedule(c, a, b)]
        rows.append(
            [
                f"{SHORT[a]} / {SHORT[b]}",
                f"{len(values)}",
                f"{statistics.median([v for v, _ in values]):.2f}",
                f"{p90([v for v, _ in values]):.2f}",
                f"{values[-1][0]:.2f} ({values[-1][1].name})",
                _cells(len(same)),
                f"{statistics.median([v for v, _ in same]):.2f}" if same else "-",
                f"{p90([v for v, _ in same]):.2f}" if same else "-",
                f"{same[-1][0]:.2f} ({same[-1][1].name})" if same else "-",
            ]
        )
    if not rows:
        return []
    ran = [c for c in cells if _ok(c, *layouts)]
    totals = ", ".join(
        f"{SHORT[n]} {sum(c.layout(n).scheduler_cpu_s for c in ran):,.1f} s over "
        f"{sum(c.layout(n).busy_steps for c in ran):,} steps"
        for n in layouts
    )
    return [
        "Scheduler CPU time per busy step (thread CPU time of `schedule()` + "
        "`update_from_output()`, measured by the simulator). The layouts of a cell run side "
        "by side in one process, taking turns of a few hundred steps, on a shared machine (other "
        "jobs ran beside this one), Python's cyclic garbage collected between turns, untimed, "
        "so that a collection in one layout's calls scans only what that layout allocated: "
        "noise falls on both layouts alike, but small cells "
        "stay the noisiest figures; "
        "the per-step cost also grows with the batch, so where two layouts ran different "
        "schedules the ratio mixes pool cost with batch size. The *same schedule* columns "
        "keep the cells where the two layouts ran steps within 1% and mean running within "
        "2% of each other.",
        "",
        *_table(
            (
                "ratio",
                "cells",
                "median",
                "p90",
                "worst (highest)",
                "same schedule",
                "median",
                "p90",
                "worst",
            ),
            rows,
        ),
        "",
        f"Total scheduler CPU over the cells that ran on every layout: {totals}.",
        "",
    ]


def _fragmentation(ok: Sequence[Cell]) -> list[str]:
    """The elastic budget's fragmentation as the simulator sampled it every busy step:
    free bytes stranded in slabs that also hold live blocks, and bytes of owned slabs no
    page can use (slab edges, padded Mamba/GDN blocks), as shares of the budget."""
    sampled = [
        (c, r)
        for c in ok
        if (r := c.layout("elastic")).mean_stranded is not None and r.mean_edge_waste is not None
    ]
    if not sampled:
        return []

    def spread(values: list[float]) -> str:
        values = sorted(values)
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        return (
            f"{100 * statistics.median(values):.1f}% / {100 * p90:.1f}% / {100 * values[-1]:.1f}%"
        )

    worst = sorted(sampled, key=lambda cr: -(cr[1].mean_stranded or 0.0))[:5]
    return [
        f"Fragmentation of the elastic budget, sampled every busy step of {_cells(len(sampled))}"
        " (share of the budget; median / p90 / worst cell): stranded, free bytes in slabs "
        "that also hold live blocks (only their owner can use them; cached blocks count as "
        f"free), mean over the steps {spread([r.mean_stranded or 0.0 for _, r in sampled])}, "
        f"peak {spread([r.peak_stranded or 0.0 for _, r in sampled])}; lost at slab edges and "
        "to padded Mamba/GDN blocks in owned slabs, mean "
        f"{spread([r.mean_edge_waste or 0.0 for _, r in sampled])}. Most stranded: "
        + "; ".join(
            f"{c.name} {100 * (r.mean_stranded or 0.0):.1f}% (peak "
            f"{100 * (r.peak_stranded or 0.0):.1f}%, {_verdict(c, 'elastic')})"
            for c, r in worst
        )
        + ".",
        "",
    ]


def _overview(ok: Sequence[Cell], layout: str) -> list[str]:
    """One row per model and memory, one column per trace and mode: ``layout`` / stock
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
                r = _ratios(c, layout)
                text = f"{r.tput:.2f} / {r.latency:.2f}"
                if c.max_num_seqs != MAX_NUM_SEQS:
                    text = f"@{c.max_num_seqs}: {text}"
                verdict = _verdict(c, layout)
                if verdict == "better":
                    text = f"**{text}**"
                elif verdict == "worse":
                    text = f"*{text}*"
                texts.append(text)
            row.append("; ".join(texts) or "refused")
        rows.append(row)
    header = ["model", "GiB", *(f"{trace}, '{mode}'" for mode, trace in columns)]
    return [
        f"Per cell, **{LABELS[layout]}**: {SHORT[layout]} / stock throughput (finished per "
        f"step) and mean latency (max_num_seqs {MAX_NUM_SEQS}; `@n:` the run at n "
        "sequences); bold where better, italic where worse (verdict rule above):",
        "",
        *_table(header, rows),
        "",
    ]


def _findings(ok: Sequence[Cell], compared: Sequence[str]) -> list[str]:
    """Counts over the cells, by what drives them (computed, not written by hand)."""
    lines = [
        "What the numbers say (counted over the cells that ran on every layout):",
        "",
    ]

    def over(c: Cell) -> bool:
        return (
            _fixed_bytes(c.config, c.memory_gib, c.mode, c.max_num_seqs, c.result.max_model_len)
            > c.memory_gib * GiB // 2
        )

    flags = {id(c): over(c) for c in ok}
    for layout in compared:
        for label, group in (
            (
                "where the static split's Mamba state of max_num_seqs requests takes over half "
                "the KV memory",
                [c for c in ok if flags[id(c)]],
            ),
            ("where it takes at most half", [c for c in ok if not flags[id(c)]]),
        ):
            if not group:
                continue
            verdicts = {v: sum(1 for c in group if _verdict(c, layout) == v) for v in VERDICTS}
            base = [c.layout(BASE).preemptions for c in group]
            mine = [c.layout(layout).preemptions for c in group]
            more = sum(1 for a, b in zip(base, mine, strict=True) if b > a)
            fewer = sum(1 for a, b in zip(base, mine, strict=True) if b < a)
            lines.append(
                f"- {LABELS[layout]}, {label} ({_cells(len(group))}): "
                + ", ".join(f"{k} {n}" for k, n in verdicts.items())
                + f"; preempts more than stock in {more}, fewer in {fewer}."
            )
        hits = [c for c in ok if c.mode == "align" and c.trace == "prefix"]
        if hits:
            diffs = [(_ratios(c, layout).hits, c) for c in hits]
            up = [d for d in diffs if d[0] > 0.005]
            down = [d for d in diffs if d[0] < -0.005]
            best = max(diffs, key=lambda d: d[0])
            low = min(diffs, key=lambda d: d[0])
            lines.append(
                f"- {LABELS[layout]}, prefix trace, 'align' ({_cells(len(hits))}): hits more "
                f"prefix tokens than stock in {len(up)}, fewer in {len(down)}; largest gain "
                f"{100 * best[0]:+.1f} points ({best[1].config}, {best[1].memory_gib} GiB, "
                f"@{best[1].max_num_seqs}: "
                f"{100 * best[1].layout(BASE).prefix_hit_rate:.1f}% -> "
                f"{100 * best[1].layout(layout).prefix_hit_rate:.1f}%), lowest "
                f"{100 * low[0]:+.1f} ({low[1].config}, {low[1].memory_gib} GiB, "
                f"@{low[1].max_num_seqs})."
            )
    lines.append("")
    return lines


def _pools(r: Any, elastic: bool = False) -> str:
    if not r.ok:
        return "refused"
    parts = []
    for pool in r.pools:
        unit = "states" if pool.kind == "Mamba" else f"x {pool.block_size} tokens"
        parts.append(f"{pool.kind} {pool.num_blocks:,} {unit}")
    return "; ".join(parts) + (" (each over the whole budget)" if elastic else "")


def _layouts_section(cells: Sequence[Cell], layouts: Sequence[str]) -> list[str]:
    """The pools each layout built (they depend on model, memory, mode and max_num_seqs,
    not on the trace)."""
    rows = []
    seen = set()
    for c in cells:
        key = (c.config, c.memory_gib, c.mode, c.max_num_seqs)
        if key in seen:
            continue
        seen.add(key)
        rows.append(
            [
                c.config,
                str(c.memory_gib),
                c.mode,
                str(c.max_num_seqs),
                *(_pools(c.layout(n), n == "elastic") for n in layouts),
                _each(c, layouts, lambda r: f"{r.kv_cache_size_tokens or 0:,}"),
            ]
        )
    text = [
        "## The layouts",
        "",
        "Blocks of each pool, null block included (a Mamba block holds one request's "
        "state; in 'align' mode also cached states). Stock shares one pool between all "
        "groups: a running request takes one block per Mamba group in it, plus its "
        "attention blocks of the raised block size. The static split holds the Mamba state "
        "of `max_num_seqs` requests up front ('align': with room for cached states) and "
        "gives the rest to attention at 16 tokens a block.",
    ]
    if "elastic" in layouts:
        text.append(
            "Each elastic pool spans every page of the one shared budget at its own page "
            "size (the pages of slabs it does not own are held by the budget), so its block "
            "count is the most it could hold, not memory set aside."
        )
    text += [
        "*KV capacity* is vLLM's own startup figure (tokens; for per-group pools, of the "
        "attention pool only).",
        "",
        *_table(
            (
                "model",
                "GiB",
                "mode",
                "max_num_seqs",
                *(LABELS[n] for n in layouts),
                f"KV capacity ({' / '.join(SHORT[n] for n in layouts)})",
            ),
            rows,
        ),
        "",
    ]
    return text


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
        "would stop with at startup), or the run failed:",
        "",
        *unique,
        "",
    ]


def _highlight(cells: Sequence[Cell], layouts: Sequence[str]) -> Cell | None:
    """The cell with the largest throughput difference of the primary layout."""
    primary = _primary(layouts)
    if primary is None:
        return None
    ok = [c for c in cells if _ok(c, *layouts)]
    if not ok:
        return None
    return max(ok, key=lambda c: abs(_ratios(c, primary).tput - 1))


def _highlight_title(cells: Sequence[Cell], layouts: Sequence[str]) -> str:
    c = _highlight(cells, layouts)
    primary = _primary(layouts)
    if c is None or primary is None:
        return "(no cell ran on every layout)"
    return (
        f"the cell with the largest {LABELS[primary]} / stock throughput difference "
        f"({c.config}, {c.memory_gib} GiB, '{c.mode}', {c.trace}, max_num_seqs "
        f"{c.max_num_seqs}: {_ratios(c, primary).tput:.3f}x)"
    )


COLORS = {"stock": "#616161", "per-group": "#1f77b4", "elastic": "#2ca02c"}


def plot(cells: Sequence[Cell], traces: Sequence[str], path: Path, layouts: Sequence[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybrid_alloc.integration.simulator import draw_series

    compared = [n for n in layouts if n != BASE]
    primary = _primary(layouts)
    ordered = [n for n in [primary, *compared] if n is not None]
    compared = list(dict.fromkeys(ordered))
    configs = sorted({c.config for c in cells})
    memories = sorted({c.memory_gib for c in cells})
    modes = [m for m in MODES if any(c.mode == m for c in cells)]
    panels = [(layout, mode) for layout in compared for mode in modes]
    fig = plt.figure(figsize=(15, 3.2 * (len(panels) + 1)))
    grid = fig.add_gridspec(len(panels) + 1, len(traces), height_ratios=[1] * len(panels) + [1.1])
    shades = ["#c7e9c0", "#74c476", "#238b45", "#00441b"]
    blues = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
    width = 0.8 / max(1, len(memories))
    for row, (layout, mode) in enumerate(panels):
        colors = shades if layout == "elastic" else blues
        for col, kind in enumerate(traces):
            ax = fig.add_subplot(grid[row, col])
            for i, memory in enumerate(memories):
                xs, values = [], []
                for j, config in enumerate(configs):
                    # Prefer the max_num_seqs=256 cell; else the re-run at fewer seqs.
                    sel = [
                        c
                        for c in cells
                        if (c.config, c.memory_gib, c.mode, c.trace) == (config, memory, mode, kind)
                        and _ok(c, BASE, layout)
                    ]
                    if not sel:
                        continue
                    xs.append(j + (i - (len(memories) - 1) / 2) * width)
                    values.append(_ratios(sel[0], layout).tput - 1)
                ax.bar(
                    xs,
                    values,
                    width,
                    bottom=1.0,
                    label=f"{memory} GiB",
                    color=colors[i % len(colors)],
                )
            ax.axhline(1.0, color="#d62728", lw=0.8)
            for threshold in (WORSE_TPUT, BETTER_TPUT):
                ax.axhline(threshold, color="#999999", lw=0.6, ls=":")
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels(
                [c.split("-")[0] + "-" + c.split("-")[1] for c in configs],
                rotation=30,
                ha="right",
                fontsize=7,
            )
            ax.set_title(f"{LABELS[layout]}: {kind}, mode '{mode}'", fontsize=9)
            if col == 0:
                ax.set_ylabel(f"{SHORT[layout]} / stock\nfinished per s", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            if col == 0 and mode == modes[0]:
                ax.legend(fontsize=7)
    best = _highlight(cells, layouts)
    if best is not None:
        bottom = grid[len(panels), :].subgridspec(1, 2)
        ax1 = fig.add_subplot(bottom[0, 0])
        ax2 = fig.add_subplot(bottom[0, 1])
        draw_series(best.result, ax1, ax2)
        for ax in (ax1, ax2):
            for line in ax.get_lines():
                label = str(line.get_label())
                if label in COLORS:
                    line.set_color(COLORS[label])
                    line.set_label(LABELS[label])
            ax.legend(fontsize=7)
        ax1.set_title(
            f"{best.config}, {best.memory_gib} GiB, '{best.mode}', {best.trace}, "
            f"max_num_seqs {best.max_num_seqs}",
            fontsize=9,
        )
    fig.suptitle(
        "Serving simulation (vLLM's scheduler, no model): "
        + ", ".join(LABELS[n] for n in compared)
        + " vs stock vLLM",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--configs", default=",".join(sorted(shipped_configs())))
    parser.add_argument("--memories", default=",".join(map(str, MEMORIES_GIB)))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="layouts to run, stock first as the baseline (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write raw results")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="trace sizes times this (smoke runs)"
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's async scheduler, two steps in flight (a GPU engine's default); "
        "default: the sync scheduler",
    )
    parser.add_argument(
        "--time-model",
        choices=("h100", "fixed"),
        default="h100",
        help="h100: each step costs what it computes; fixed: 25 ms a step (default h100)",
    )
    parser.add_argument(
        "--shard", default="0/1", help="I/N: run every N-th group of cells from the I-th on"
    )
    parser.add_argument(
        "--save-cells", type=Path, default=None, help="keep this run's cells (a pickle)"
    )
    parser.add_argument(
        "--merge",
        default="",
        help="FILE,FILE,...: no run; write the report from the cells these shards saved",
    )
    args = parser.parse_args(argv)
    global TIME_MODEL, ASYNC_SCHEDULING
    TIME_MODEL = args.time_model
    ASYNC_SCHEDULING = args.async_scheduling
    configs = [c for c in args.configs.split(",") if c]
    memories = [int(m) for m in args.memories.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    kinds = [t for t in args.traces.split(",") if t]
    layouts = list(dict.fromkeys(n for n in args.layouts.split(",") if n))
    from hybrid_alloc.integration.simulator import ALL_LAYOUTS

    unknown = [n for n in layouts if n not in ALL_LAYOUTS or n not in LABELS]
    if unknown:
        parser.error(f"unknown layouts {', '.join(unknown)} (known: {', '.join(ALL_LAYOUTS)})")
    if BASE not in layouts:
        parser.error(f"--layouts must include {BASE} (every layout is compared with it)")
    layouts = [BASE, *(n for n in layouts if n != BASE)]
    bad = [m for m in modes if m not in MODES] + [t for t in kinds if t not in TRACES]
    if bad:
        parser.error(f"unknown modes or traces: {', '.join(bad)}")
    traces = {
        kind: make_trace(
            TRACES[kind][0],
            num_requests=max(1, round(TRACES[kind][1] * args.scale)),
            rate=TRACES[kind][2],
        )
        for kind in kinds
    }
    try:
        index, count = (int(x) for x in args.shard.split("/"))
    except ValueError:
        parser.error(f"--shard {args.shard!r}: expected I/N, e.g. 0/2")
    if not 0 <= index < count:
        parser.error(f"--shard {args.shard!r}: I must be in 0..N-1")
    if count > 1 and not args.save_cells:
        parser.error("--shard I/N with N > 1 needs --save-cells (a shard writes no report)")
    merged = [Path(f) for f in args.merge.split(",") if f]
    commit = None
    if merged:
        cells, elapsed, commit = _merge(merged)
        # Back in the order one run makes them (the shards ran with these same arguments).
        cells.sort(
            key=lambda c: (
                configs.index(c.config),
                memories.index(c.memory_gib),
                modes.index(c.mode),
                kinds.index(c.trace),
                -c.max_num_seqs,
            )
        )
    else:
        t0 = time.perf_counter()
        cells = run_cells(configs, memories, modes, traces, layouts, shard=(index, count))
        elapsed = time.perf_counter() - t0
        if args.save_cells:
            args.save_cells.write_bytes(pickle.dumps((cells, elapsed, _git_commit())))
        if count > 1:
            print(f"shard {index}/{count}: {len(cells)} cells in {elapsed / 60:.1f} min")
            return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / "serving.png"
    plot(cells, kinds, png, layouts)
    write_report(
        cells,
        traces,
        args.out_dir / "SERVING.md",
        elapsed,
        png.name,
        layouts,
        max(1, len(merged)),
        commit,
    )
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
                        "verdicts": {n: _verdict(c, n) for n in c.result.layouts if n != BASE},
                        "result": c.result.to_json(),
                    }
                    for c in cells
                ],
                indent=1,
            )
        )
    print(f"wrote {args.out_dir / 'SERVING.md'} and {png} in {elapsed / 60:.1f} min")
    return 0


def _merge(paths: Sequence[Path]) -> tuple[list[Cell], float, str]:
    """The cells several ``--shard`` runs saved, in one list, the longest run's time (the
    shards ran side by side) and the commit(s) they ran at."""
    cells: list[Cell] = []
    elapsed = 0.0
    commits: list[str] = []
    for path in paths:
        # Our own files, written by --save-cells of this script.
        shard_cells, shard_elapsed, commit = pickle.loads(path.read_bytes())
        cells.extend(shard_cells)
        elapsed = max(elapsed, shard_elapsed)
        if commit not in commits:
            commits.append(commit)
    return cells, elapsed, " and ".join(commits)


if __name__ == "__main__":
    sys.exit(main())
