"""The simulation's table, its text report and its plots."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybrid_alloc.integration.simulator.records import (
    LayoutResult,
    SimResult,
)

# --------------------------------------------------------------------------- report


def _fmt_stat(d: Mapping[str, float], key: str) -> str:
    return f"{d[key]:,.0f}" if key in d else "-"


def table_rows(result: SimResult) -> list[tuple[str, ...]]:
    """(metric, value per layout..., ratio) rows of the side-by-side table."""
    names = list(result.layouts)
    res = [result.layouts[n] for n in names]

    def pools(r: LayoutResult) -> str:
        return "; ".join(f"{p.kind} {p.num_blocks:,} x {p.block_size}" for p in r.pools)

    rows: list[tuple[str, ...]] = []

    def add(label: str, fn: Callable[[LayoutResult], Any], ratio: bool = False) -> None:
        values = [fn(r) if r.ok else "-" for r in res]
        text = [
            f"{v:,.3f}" if isinstance(v, float) else (f"{v:,}" if isinstance(v, int) else str(v))
            for v in values
        ]
        extra = ""
        if ratio and len(res) == 2 and all(r.ok for r in res):
            a, b = fn(res[0]), fn(res[1])
            extra = f"{b / a:.3f}x" if a else "-"
        rows.append((label, *text, extra))

    add("pools: blocks x tokens per block", pools)
    add("attention block size (tokens)", lambda r: r.attention_block_size)
    add("KV capacity (vLLM's figure, tokens)", lambda r: r.kv_cache_size_tokens, ratio=True)
    add("requests finished", lambda r: f"{r.finished:,}/{r.requests:,}")
    add("simulated time (s)", lambda r: round(r.elapsed_s, 3), ratio=True)
    add("finished requests / s", lambda r: r.finished_per_s, ratio=True)
    add("generated tokens / s", lambda r: r.tokens_per_s, ratio=True)
    add("latency, s (mean)", lambda r: r.latency_s.get("mean", 0.0), ratio=True)
    add("latency, s (p90)", lambda r: r.latency_s.get("p90", 0.0), ratio=True)
    add("time to first token, s (mean)", lambda r: r.ttft_s.get("mean", 0.0), ratio=True)
    add("time to first token, s (p99)", lambda r: r.ttft_s.get("p99", 0.0), ratio=True)
    add("preemptions", lambda r: r.preemptions)
    add("computed tokens", lambda r: r.computed_tokens, ratio=True)
    add("recomputed tokens (after preemption)", lambda r: r.recomputed_tokens)
    add("simulated steps", lambda r: r.steps, ratio=True)
    add("finished requests / step", lambda r: r.finished_per_step, ratio=True)
    add("generated tokens / step", lambda r: r.tokens_per_step, ratio=True)
    add("running (mean)", lambda r: r.mean_running, ratio=True)
    add("running (peak)", lambda r: r.peak_running, ratio=True)
    add("waiting (mean)", lambda r: r.mean_waiting)
    add("waiting (peak)", lambda r: r.peak_waiting)
    add(
        "prefix-cache hit rate (tokens)",
        lambda r: f"{100 * r.prefix_hit_rate:.1f}% ({r.prefix_hits:,}/{r.prefix_queries:,})",
    )
    add("KV usage, attention pool (mean)", lambda r: f"{100 * r.mean_kv_usage:.1f}%")
    add("KV usage, attention pool (peak)", lambda r: f"{100 * r.peak_kv_usage:.1f}%")
    add("KV memory held, GiB (mean)", lambda r: f"{r.mean_kv_held_bytes / (1 << 30):.2f}")
    add("KV memory held, GiB (peak)", lambda r: f"{r.peak_kv_held_bytes / (1 << 30):.2f}")
    add(
        "stranded in slabs, share of budget (mean / peak)",
        lambda r: (
            "-"
            if r.mean_stranded is None
            else f"{100 * r.mean_stranded:.1f}% / {100 * (r.peak_stranded or 0.0):.1f}%"
        ),
    )
    add("time to first token, steps (mean)", lambda r: _fmt_stat(r.ttft_steps, "mean"))
    add("latency, steps (mean)", lambda r: _fmt_stat(r.latency_steps, "mean"))
    add("scheduler CPU per step (us)", lambda r: r.cpu_us_per_step, ratio=True)
    add("blocks held at the end", lambda r: sum(r.leaked_blocks.values()))
    return rows


def format_result(result: SimResult) -> str:
    """The side-by-side table (plain text) with a header naming model, settings, trace."""
    s = result.settings
    lines = [
        f"model     {result.model} (vLLM {result.vllm_version}, {s.platform} block-size rules)",
        f"settings  KV memory {s.memory / (1 << 30):.2f} GiB, "
        f"mamba_cache_mode {s.mamba_cache_mode}, "
        f"max_num_seqs {s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens:,}, "
        f"max_model_len {result.max_model_len:,}",
        f"step time {result.time_model}",
        f"trace     {result.trace_description}",
    ]
    clipped = max((r.clipped for r in result.layouts.values()), default=0)
    if clipped:
        lines.append(f"          {clipped} prompts cut to fit max_model_len with their output")
    lines.append("")
    names = list(result.layouts)
    header = ("", *names, f"{names[1]} / {names[0]}" if len(names) == 2 else "")
    rows = [header, *table_rows(result)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    for name, r in result.layouts.items():
        if r.error:
            lines.append(f"{name}: not simulated: {r.error}")
        elif r.note:
            lines.append(f"{name}: {r.note}")
    return "\n".join(lines)


def draw_series(result: SimResult, running: Any, held: Any, waiting: Any | None = None) -> None:
    """Running requests, KV memory held (GiB) and, given an axis, waiting requests over
    simulated time, one line per layout (matplotlib axes)."""
    colors = {"stock": "#616161", "per-group": "#1f77b4", "elastic": "#ff7f0e"}
    for name, r in result.layouts.items():
        if not r.ok or not r.series.get("time_s"):
            continue
        t = r.series["time_s"]
        kw = {"label": name, "color": colors.get(name), "lw": 1}
        running.plot(t, r.series["running"], **kw)
        held.plot(t, r.series["kv_held_gib"], **kw)
        if waiting is not None:
            waiting.plot(t, r.series["waiting"], **kw)
    held.axhline(result.settings.memory / (1 << 30), color="#d62728", lw=0.8, ls="--")
    running.set_ylabel("running requests")
    held.set_ylabel("KV held (GiB)")
    axes = [running, held]
    if waiting is not None:
        waiting.set_ylabel("waiting requests")
        axes.append(waiting)
    axes[-1].set_xlabel(f"simulated time (s; {result.time_model})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def plot_result(result: SimResult, path: str | Path) -> None:
    """Running requests, KV memory held and waiting requests over simulated time, both
    layouts (the dashed line is the KV memory size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    draw_series(result, ax1, ax2, ax3)
    s = result.settings
    fig.suptitle(
        f"{result.model}: {s.memory / (1 << 30):.0f} GiB KV, mode {s.mamba_cache_mode}, "
        f"trace {result.trace}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
