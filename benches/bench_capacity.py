"""Capacity benchmark: stock vLLM 0.32 vs per-group pools vs the physical limit.

For every shipped config at 16 / 40 / 80 GiB of KV memory, prints and writes
``benches/CAPACITY.md`` (token capacity, concurrency and ratios; per-group pools at 40 GiB; a
``max_num_seqs`` sweep; align mode; sliding-window models, which no shipped config has) and
``benches/capacity.png``.

    python benches/bench_capacity.py [--out-dir benches] [--max-num-seqs 256]

Pure arithmetic over the planner (no GPU, no vLLM import); runs in about a second.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from hybrid_alloc import sizing
from hybrid_alloc.cli import format_bytes
from hybrid_alloc.model_specs import (
    AttentionLayerSpec,
    LayerSpec,
    MambaLayerSpec,
    ModelSpec,
    model_from_config,
)
from hybrid_alloc.planner import (
    ALIGN_CACHE_FACTOR,
    Plan,
    group_needs,
    load_config,
    load_model,
    plan,
    shipped_configs,
)

GiB = 1 << 30
BUDGETS_GIB = (16, 40, 80)
DETAIL_GIB = 40
MAX_LEN = 32768  # capacity is counted at min(this, the model's own context)
SWEEP_SEQS = (16, 64, 256, 1024)
WINDOW_SEQS = (32, 256)


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table, first column left-aligned, the others right-aligned."""
    rule = "|:---|" + "|".join("---:" for _ in header[1:]) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)]


def _plans(
    names: Sequence[str], seqs: int, mode: str = "none", factor: int = ALIGN_CACHE_FACTOR
) -> dict[tuple[str, int], Plan]:
    result = {}
    for name in names:
        model = load_model(name)
        max_len = min(MAX_LEN, model.max_position_embeddings)
        for gib in BUDGETS_GIB:
            result[name, gib] = plan(
                model,
                gib * GiB,
                max_num_seqs=seqs,
                mamba_cache_mode=mode,
                max_model_len=max_len,
                align_cache_factor=factor,
            )
    return result


SPEC_TOKENS = (1, 2, 3)


def _speculation(names: Sequence[str], seqs: int) -> list[str]:
    """Stock vs ours vs the physical limit with 1-3 speculative tokens (mode none)."""
    header = (
        "model",
        "spec",
        "stock tokens (vLLM)",
        f"stock @{seqs} seqs",
        "ours",
        "physical",
        "ours / stock @seqs",
        "ours / physical",
    )
    rows = []
    for name in names:
        model = load_model(name)
        max_len = min(MAX_LEN, model.max_position_embeddings)
        for spec in SPEC_TOKENS:
            p = plan(
                model,
                DETAIL_GIB * GiB,
                max_num_seqs=seqs,
                max_model_len=max_len,
                num_spec_tokens=spec,
            )
            rows.append(
                (
                    p.model.name,
                    str(spec),
                    f"{p.stock.tokens:,}",
                    f"{p.stock.tokens_at_max_num_seqs:,}",
                    _tokens(p),
                    f"{p.physical.tokens:,}",
                    _ratio(p.ours.tokens, p.stock.tokens_at_max_num_seqs)
                    if p.ours.feasible
                    else "n/a",
                    _ratio(p.ours.tokens, p.physical.tokens) if p.ours.feasible else "n/a",
                )
            )
    return _table(header, rows)


def _tokens(p: Plan) -> str:
    return f"{p.ours.tokens:,}" if p.ours.feasible else "does not fit"


def _align(names: Sequence[str], seqs: int) -> list[str]:
    """Align mode with the engine's cache factor and with factor 1 (live states only)."""
    engine = _plans(names, seqs, "align")
    live = _plans(names, seqs, "align", 1)
    header = (
        "model",
        "KV",
        "stock tokens (vLLM)",
        f"stock @{seqs} seqs",
        f"ours, factor {ALIGN_CACHE_FACTOR}",
        "ours, factor 1",
        "physical",
        f"ours {ALIGN_CACHE_FACTOR}/physical",
        "ours 1/physical",
        f"ours 1/stock@{seqs}",
    )
    rows = []
    for key, p in engine.items():
        q = live[key]
        rows.append(
            (
                key[0],
                f"{key[1]} GiB",
                f"{p.stock.tokens:,}",
                f"{p.stock.tokens_at_max_num_seqs:,}",
                _tokens(p),
                _tokens(q),
                f"{p.physical.tokens:,}",
                _ratio(p.ours.tokens, p.physical.tokens) if p.ours.feasible else "n/a",
                _ratio(q.ours.tokens, q.physical.tokens) if q.ours.feasible else "n/a",
                _ratio(q.ours.tokens, q.stock.tokens_at_max_num_seqs) if q.ours.feasible else "n/a",
            )
        )
    return _table(header, rows)


def _headline(plans: dict[tuple[str, int], Plan], seqs: int) -> list[str]:
    header = (
        "model",
        "KV",
        "max_model_len",
        "stock tokens (vLLM)",
        "stock conc.",
        f"stock @{seqs} seqs",
        "ours",
        "ours conc.",
        "physical",
        "ours/stock",
        f"ours/stock@{seqs}",
        "ours/physical",
    )
    rows = []
    for (name, gib), p in plans.items():
        ours = _tokens(p)
        rows.append(
            (
                name,
                f"{gib} GiB",
                f"{p.params.max_model_len:,}",
                f"{p.stock.tokens:,}",
                f"{p.stock.concurrency:.1f}",
                f"{p.stock.tokens_at_max_num_seqs:,}",
                ours,
                f"{p.ours.concurrency:.1f}",
                f"{p.physical.tokens:,}",
                *(
                    (
                        _ratio(p.ours.tokens, p.stock.tokens),
                        _ratio(p.ours.tokens, p.stock.tokens_at_max_num_seqs),
                        _ratio(p.ours.tokens, p.physical.tokens),
                    )
                    if p.ours.feasible
                    else ("n/a",) * 3
                ),
            )
        )
    return _table(header, rows)


def _detail(p: Plan) -> list[str]:
    """Ours' pools, each next to the stock groups holding the same layers."""
    header = (
        "kind",
        "layers",
        "stock groups",
        "stock page",
        "stock block",
        "stock blocks (shared)",
        "stock per request",
        "ours page",
        "ours block",
        "ours blocks",
        "ours bytes",
        "ours per request",
    )
    rows = []
    for group, o in zip(p.groups, p.ours.rows, strict=True):
        stock = [
            r for g, r in zip(p.stock_groups, p.stock.rows, strict=True) if g.spec == group.spec
        ]
        sizes = sorted({r.num_layers for r in stock}, reverse=True)
        split = " + ".join(f"{sum(r.num_layers == n for r in stock)} x {n}" for n in sizes)
        s = stock[0]
        rows.append(
            (
                o.kind + ("" if o.grows else " (fixed)"),
                str(o.num_layers),
                split,
                f"{s.page_bytes:,}",
                f"{s.block_size:,}",
                f"{s.num_blocks:,}",
                f"{s.blocks_per_request:,}",
                f"{o.page_bytes:,}",
                f"{o.block_size:,}",
                f"{o.num_blocks:,}",
                format_bytes(o.bytes),
                f"{o.blocks_per_request:,}",
            )
        )
    return _table(header, rows)


def _sweep(names: Sequence[str]) -> list[str]:
    header = ("model", *(f"ours/stock @ max_num_seqs {s}" for s in SWEEP_SEQS))
    rows = []
    for name in names:
        model = load_model(name)
        max_len = min(MAX_LEN, model.max_position_embeddings)
        cells = []
        for seqs in SWEEP_SEQS:
            p = plan(model, DETAIL_GIB * GiB, max_num_seqs=seqs, max_model_len=max_len)
            cell = _ratio(p.ours.tokens, p.stock.tokens) if p.ours.feasible else "does not fit"
            cells.append(f"{cell} ({p.stock.concurrency:.0f})")
        rows.append((name, *cells))
    return _table(header, rows)


def _sliding_window_models() -> list[tuple[str, ModelSpec]]:
    """Models with sliding-window layers (no shipped config has any), both also checked
    against the engine's sizing in ``tests/planner/test_engine_cross_check.py``.

    * Nemotron-H-8B with transformers' ``sliding_window`` set to 4,096 (vLLM's Nemotron-H
      gives every attention layer that window; no such checkpoint is published), next to
      the same model with full attention, both over a 32K context;
    * a synthetic model with full attention, sliding-window attention (window 1,024, same
      heads) and Mamba2, the layout where the window group is bounded.
    """
    cfg = {**load_config("nemotron-h-8b"), "max_position_embeddings": MAX_LEN}
    full = model_from_config({**cfg, "_source": "nemotron-h-8b @32K (full attention)"})
    swa = model_from_config(
        {**cfg, "sliding_window": 4096, "_source": "nemotron-h-8b @32K, sliding window 4,096"}
    )
    mamba2 = MambaLayerSpec("mamba2", 32 * 64 + 256, 4, (32, 64, 128), 2, 4, True, 1)
    full_attn = AttentionLayerSpec("full", 8, 128, 2)
    window = AttentionLayerSpec("sliding", 8, 128, 2, window=1024)
    pattern: list[LayerSpec] = [mamba2, mamba2, window, mamba2, full_attn, window] * 4
    mixed = ModelSpec("synthetic full + sliding 1,024 + mamba2", "test", tuple(pattern), MAX_LEN)
    return [(full.name, full), (swa.name, swa), (mixed.name, mixed)]


def _window_as_growing(p: Plan) -> int:
    """Ours' tokens had the window groups been sized as growing ones, split by one
    max-length request (the engine's rule before the sizing model was shared, up to the
    null blocks it did not set aside first)."""
    needs = [
        replace(n, kind="growing") if n.kind == "bounded" else n
        for n in group_needs(list(p.groups), p.params)
    ]
    try:
        result = sizing.size_pools(
            needs,
            available_bytes=p.params.kv_bytes,
            max_num_seqs=p.params.max_num_seqs,
            max_model_len=p.params.max_model_len,
        )
    except sizing.SizingError:
        return 0  # does not fit
    return result.tokens


def _percent_range(values: Sequence[float]) -> str:
    low, high = f"{100 * min(values):.0f}", f"{100 * max(values):.0f}"
    return f"{low}%" if low == high else f"{low}-{high}%"


def _former(tokens: int) -> str:
    return f"{tokens:,}" if tokens else "does not fit"


def _sliding_window() -> list[str]:
    """The table of `_sliding_window_models` and what it shows, in numbers."""
    header = (
        "model",
        "KV",
        "max_num_seqs",
        "stock tokens (vLLM)",
        "stock @seqs",
        "ours",
        "ours conc.",
        "window pool blocks",
        "physical",
        "ours/physical",
        "window sized as growing",
    )
    models = _sliding_window_models()
    plans = {
        (name, seqs, gib): plan(model, gib * GiB, max_num_seqs=seqs, max_model_len=MAX_LEN)
        for name, model in models
        for seqs in WINDOW_SEQS
        for gib in BUDGETS_GIB
    }
    growing_rule = {key: _window_as_growing(p) for key, p in plans.items()}
    rows = []
    for (name, seqs, gib), p in plans.items():
        windows = [r for r in p.ours.rows if r.kind == "sliding"]
        rows.append(
            (
                name,
                f"{gib} GiB",
                str(seqs),
                f"{p.stock.tokens:,}",
                f"{p.stock.tokens_at_max_num_seqs:,}",
                _tokens(p),
                f"{p.ours.concurrency:.1f}",
                ", ".join(
                    f"{r.num_blocks:,}" + (" (grows)" if r.grows else " (bounded)") for r in windows
                )
                or "-",
                f"{p.physical.tokens:,}",
                _ratio(p.ours.tokens, p.physical.tokens) if p.ours.feasible else "n/a",
                _former(growing_rule[name, seqs, gib]) if windows else "-",
            )
        )
    (full, _), (swa, _), (mixed, _) = models
    feasible = [k for k in plans if k[0] == swa and plans[k].ours.feasible]
    window = next(r for r in plans[feasible[0]].ours.rows if r.kind == "sliding")
    to_physical = [plans[k].ours.tokens / plans[k].physical.tokens for k in feasible]
    more = [plans[k].ours.concurrency / plans[(full, *k[1:])].ours.concurrency for k in feasible]

    def change(seqs: int, gib: int) -> str:
        """Ours against the former rule for the full + sliding-window model."""
        ours, former = plans[mixed, seqs, gib].ours, growing_rule[mixed, seqs, gib]
        if not ours.feasible:
            return f"{gib} GiB: does not fit (the former rule: {_former(former)} tokens)"
        if not former:
            return f"{gib} GiB: fits, the former rule does not"
        return f"{gib} GiB: {100 * (ours.tokens / former - 1):+.0f}%"

    changes = {seqs: ", ".join(change(seqs, gib) for gib in BUDGETS_GIB) for seqs in WINDOW_SEQS}
    return [
        *_table(header, rows),
        "",
        f"* The all-sliding Nemotron-H: vLLM's per-request cap is window - 1 + 2,048 tokens in "
        f"flight + one block = {window.blocks_per_request} blocks "
        f"({window.blocks_per_request * window.block_size:,} tokens), so ours reaches "
        f"{_percent_range(to_physical)} of the physical column, "
        "which counts the 4,096 window tokens only. Against full attention at 32K it holds "
        f"{min(more):.1f}x as many requests at the same memory.",
        "* Full + sliding window: bounding the window group reserves its cap for every one of "
        "max_num_seqs requests. Ours against the former engine rule (which sized the window "
        "pool for as many max-length requests as the full-attention pool holds, so short "
        "requests beyond that count waited on the window pool): "
        + "; ".join(f"{seqs} sequences: {text}" for seqs, text in changes.items())
        + ". Ours is ahead where max_num_seqs is at or below the max-length requests the "
        "full-attention pool holds (the ours conc. column) and behind where it is far above "
        "them: the reserve then holds windows for requests the full-attention pool cannot "
        "hold at full length. The former rule's figure can exceed the physical column, which "
        "also reserves the window for all max_num_seqs requests.",
    ]


def _plot(plans: dict[tuple[str, int], Plan], names: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: tuple[tuple[str, Callable[[Plan], int], str], ...] = (
        ("stock (vLLM's figure)", lambda p: p.stock.tokens, "#bdbdbd"),
        ("stock @max_num_seqs", lambda p: p.stock.tokens_at_max_num_seqs, "#616161"),
        ("ours", lambda p: p.ours.tokens, "#1f77b4"),
        ("physical limit", lambda p: p.physical.tokens, "#2ca02c"),
    )
    fig, axes = plt.subplots(2, len(BUDGETS_GIB), figsize=(16, 9), sharex=True)
    width = 0.2
    for col, gib in enumerate(BUDGETS_GIB):
        top, bottom = axes[0][col], axes[1][col]
        for i, (label, value, color) in enumerate(series):
            xs = [j + (i - 1.5) * width for j in range(len(names))]
            tokens = [value(plans[name, gib]) for name in names]
            phys = [plans[name, gib].physical.tokens for name in names]
            top.bar(xs, [t / 1e6 for t in tokens], width, label=label, color=color)
            # Relative to the physical limit; a model whose state does not fit has no bar.
            bottom.bar(
                xs,
                [t / f if f else 0 for t, f in zip(tokens, phys, strict=True)],
                width,
                color=color,
            )
        top.set_title(f"{gib} GiB KV", fontsize=10)
        bottom.axhline(1.0, color="black", linewidth=0.8)
        bottom.axhline(0.99, color="black", linewidth=0.8, linestyle=":")
        bottom.set_ylim(0, 2)
        bottom.set_xticks(range(len(names)))
        bottom.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        for ax in (top, bottom):
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("KV token capacity (millions)")
    axes[1][0].set_ylabel("relative to the physical limit (dotted: 0.99)")
    axes[0][0].legend(fontsize=8)
    seqs = next(iter(plans.values())).params.max_num_seqs
    fig.suptitle(
        f"Token capacity, mamba_cache_mode none, max_num_seqs {seqs}, "
        f"max_model_len min({MAX_LEN}, model's)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_report(seqs: int) -> tuple[str, dict[tuple[str, int], Plan], list[str]]:
    names = sorted(shipped_configs())
    plans = _plans(names, seqs)
    lines = [
        "# KV-cache capacity: stock vLLM 0.32 vs per-group pools",
        "",
        "Generated by `python benches/bench_capacity.py` from the planner "
        "(`hybrid_alloc.planner`, also `hybrid-alloc plan CONFIG`). Pure arithmetic, checked in "
        "`tests/planner/test_planner.py` against vLLM 0.32's and 0.33's own sizing "
        "(`_align_hybrid_block_size`, `get_kv_cache_groups`, `get_kv_cache_config_from_groups`, "
        "`get_max_concurrency_for_kv_cache_config`, each model's "
        "`get_mamba_state_shape_from_config`). Ours is `hybrid_alloc.sizing`, the sizing model "
        "the engine core runs at startup; `tests/planner/test_engine_cross_check.py` checks that "
        "the engine builds exactly these pools from vLLM's own layer specs.",
        "",
        "Settings: bfloat16 weights and KV, the model's default SSM dtype (float32 for "
        f"Qwen3.5/3.6 and Nemotron), max_num_seqs {seqs}, no speculative tokens, block size "
        "16, tensor parallel 1, CUDA attention backend (kernel block 16). Capacity is counted at "
        f"max_model_len = min({MAX_LEN:,}, the model's max_position_embeddings).",
        "",
        "Columns:",
        "",
        "* **stock tokens (vLLM)**: what vLLM logs as `GPU KV cache size`: concurrency x "
        "max_model_len, where concurrency = num_blocks / (blocks one max_model_len request takes "
        "in every group, Mamba groups included).",
        f"* **stock @{seqs} seqs**: attention tokens left in the shared pool once {seqs} running "
        "requests hold their Mamba blocks: stock at the load ours is sized for.",
        "* **ours**: one pool per distinct layer spec at its natural page size (what "
        f"`hybrid_alloc.sizing` builds); Mamba pools hold {seqs} x (1 + spec) + 1 blocks; the "
        "rest goes to attention; only growing groups count; null blocks excluded. *does not "
        f"fit*: the memory does not hold the Mamba state of {seqs} requests plus one "
        "max_model_len request in attention (the engine then sizes the Mamba pools for as many "
        "requests as fit and says so in one warning; it stops only if not even one fits).",
        f"* **physical**: (KV bytes - Mamba state of {seqs} requests) / attention bytes per token.",
        "",
        "## Token capacity (mamba_cache_mode none)",
        "",
        *_headline(plans, seqs),
        "",
        "## Reading the numbers",
        "",
        "* **ours vs the physical limit**: ours misses it only by its null blocks (a Mamba "
        "pool's null block is one request's whole state, plus one attention block) and the "
        "4 KiB region padding, so it is at 99% or better wherever the Mamba state of "
        "max_num_seqs requests leaves room for attention. Below that only where the state eats "
        "almost the whole budget (Nemotron-3-Nano at 16 GiB: 98.9%).",
        "* **ours vs stock at the same load**: once max_num_seqs requests hold Mamba state, the "
        "shared pool has fewer attention tokens than ours: stock pads every Mamba page up to an "
        "attention page (Zamba2: 0.66 MiB -> 0.94 MiB, +43%) and pads short groups "
        "(Nemotron-3-Nano: 23 Mamba layers dealt into 4 groups of 6). Where the padding is small "
        "(Qwen, Jamba, Falcon-H1) the two are within a percent. Nemotron-H-8B comes out 0.3% "
        "below: its padding is 0.1%, while our Mamba null block is a whole request's state "
        "(24 x 4.06 MiB = 97 MiB) against stock's one 4-layer block.",
        "* **ours vs vLLM's figure**: vLLM's figure is the capacity at its own concurrency, "
        "which is below max_num_seqs whenever requests are long, so it pays Mamba state for "
        "those few requests only; a compact pool reserves state for all max_num_seqs up front. "
        "With long contexts and a large max_num_seqs the figure is therefore *higher* than ours "
        "(and than the physical limit at max_num_seqs). This is not an error in vLLM 0.32: its "
        "capacity formula already counts per-group blocks, so the understatement described in "
        "vllm#40384 (the pool divided by the number of groups) is gone there. Where stock's "
        "concurrency reaches max_num_seqs, ours is at or above it (sweep below; "
        "`test_ours_beats_stock_when_stock_admits_max_num_seqs`).",
        "* **does not fit**: the Mamba state of max_num_seqs requests alone exceeds the budget "
        "(Falcon-H1-7B: 44 x 1.52 MiB = 67 MiB a request; Nemotron-H-8B: 24 x 4.06 MiB = "
        "97 MiB), or leaves less than one max_model_len request for attention (Qwen3.6-35B-A3B "
        "at 16 GiB: 256 x 61 MiB = 15.4 GiB of state leaves 0.59 GiB, 38 MiB short of one "
        "32,768-token request; this report showed 30,832 tokens there before the planner and "
        "the engine shared one sizing model, a layout the engine refused). Stock still starts "
        "because its shared pool admits fewer requests; with per-group pools, max_num_seqs "
        "must match what the memory can hold.",
        "* What the capacity column cannot show: stock's attention block is 48 to 2,096 tokens "
        "instead of 16, so every request wastes half such a block on average and prefix-cache "
        "hits are rounded down to its multiples; ours keeps 16-token blocks.",
        "",
        f"## ours / stock (vLLM's figure) by max_num_seqs, {DETAIL_GIB} GiB",
        "",
        "In parentheses: stock's own concurrency at max_model_len. Ours overtakes vLLM's figure "
        "once max_num_seqs is at or below the concurrency stock computes (earlier where stock "
        "pads heavily, as for Zamba2).",
        "",
        *_sweep(names),
        "",
        f"## Speculative decoding ({DETAIL_GIB} GiB, mamba_cache_mode none)",
        "",
        "With `num_speculative_tokens` = spec a running request holds 1 + spec Mamba states "
        "(one scratch state per draft token; Mamba2 convolution states also grow by spec "
        "rows), as vLLM's `MambaSpec` reserves; ours sizes the Mamba pools for max_num_seqs x "
        "(1 + spec) + 1 blocks (checked against the engine sizing in "
        "`tests/planner/test_engine_cross_check.py`). Draft layers of an MTP/EAGLE drafter "
        "are not counted here (the planner reads the target's config only).",
        "",
        *_speculation(names, seqs),
        "",
        "## Prefix caching (mamba_cache_mode align)",
        "",
        "A running request holds 2 + spec states (+1 prefill checkpoint for Mamba2 mixers), the "
        "count vLLM's `MambaSpec.max_memory_usage_bytes` reserves; that is the physical "
        "column. The engine (`hybrid_alloc.sizing.ALIGN_CACHE_FACTOR`) sizes align pools at "
        f"{ALIGN_CACHE_FACTOR}x the live states, keeping as many again for cached prefix states; "
        "factor 1 keeps only the live ones (cached states then survive only in slots idle "
        "requests leave). For models whose state dominates, the factor decides everything: at "
        "80 GiB Qwen3.6-35B-A3B keeps 38% of the physical limit with factor 2 and 99.9% with "
        "factor 1.",
        "",
        *_align(names, seqs),
        "",
        "## Sliding-window layers",
        "",
        "No shipped config has sliding-window (or chunked-local) layers, so the rule that "
        "bounds them changed no number above. Before the planner and the engine shared one "
        "sizing model, they disagreed on such layers: the planner sized a window group as a "
        "bounded pool of max_num_seqs capped requests, the engine as a growing pool split "
        "with full attention by one max-length request; the planner also read Nemotron-H's "
        "`sliding_window` as full attention, and refused a model with no full attention. Now "
        "both bound window groups next to full attention and let them take the memory left "
        "over where nothing else grows. The models below are not shipped: Nemotron-H-8B with "
        "transformers' `sliding_window` set to 4,096 (vLLM gives every attention layer that "
        "window; no such checkpoint is published) next to the same model with full attention, "
        "and a synthetic full + sliding-window (1,024) + Mamba2 model. `window sized as "
        "growing`: ours had the window group been sized as the engine used to size it.",
        "",
        *_sliding_window(),
        "",
        f"## Per-group pools at {DETAIL_GIB} GiB",
        "",
        "Stock: the groups vLLM deals the layers into (`stock groups`: count x layers) all alias "
        "one pool of `stock blocks` blocks, each as large as the largest group's pages. Ours: "
        "one pool per layer spec, `ours blocks` blocks (null block included) of `layers x ours "
        "page` bytes. `per request`: the blocks a request at max_model_len takes (Mamba: the "
        "states it holds while running).",
        "",
    ]
    for name in names:
        p = plans[name, DETAIL_GIB]
        lines += [
            f"### {p.model.name}: {p.model.describe()}",
            "",
            f"Stock: attention block {p.stock.block_size} tokens, "
            f"{p.stock.num_blocks:,} shared blocks of {format_bytes(p.stock.bytes_per_block)}; "
            "ours: "
            + (
                f"{format_bytes(p.ours.total_bytes)} used, "
                f"{format_bytes(p.ours_unused_bytes)} left over."
                if p.ours.feasible
                else f"does not fit ({format_bytes(p.ours.shortfall_bytes)} short)."
            ),
            "",
            *_detail(p),
            "",
        ]
    lines += [
        "## Sizing rules (ours)",
        "",
        "* One pool per distinct layer spec (no equal-size split), each at its natural page "
        "size; no page unification or padding between pools.",
        "* Mamba/GDN, mode `none`: max_num_seqs x (1 + spec) + 1 blocks, so admission never "
        "waits on Mamba state.",
        "* Mode `align`: max_num_seqs x (2 + spec + checkpoint) x factor + 1. A partial prefix "
        "hit needs one copy-on-write block for one step; if none is free the request waits a "
        "step (it cannot deadlock: running requests keep their count, finishing ones return "
        "theirs).",
        "* Mode `all` (planner only; vLLM 0.32 and the engine accept none/align): Mamba keeps a "
        "state every `mamba_block_size` tokens (default: stock's block, so both checkpoint at "
        "the same interval), so it grows with the sequence and shares the leftover memory with "
        "attention.",
        "* Sliding-window / chunked-local attention (none in the shipped configs): bounded by "
        "the window: max_num_seqs x vLLM's per-request admission cap + 1 (window - 1 plus the "
        "max_num_batched_tokens in flight, one block more). A cap that reaches a full "
        "max_model_len request makes the group a growing one; where no group grows, the "
        "window groups share the memory left over as growing ones would.",
        "* Memory left after the fixed and bounded pools (and 4 KiB of region padding per "
        "pool) goes to the growing groups: each its null block, the rest in proportion to one "
        "max_model_len request, so all hold the same number of such requests. Capacity and "
        "concurrency count growing groups only. The memory must hold at least one "
        "max_model_len request in every growing pool.",
        "* These rules are `hybrid_alloc.sizing`, which both the engine core and this planner "
        "call; neither has a copy of its own.",
        "",
        "![capacity](capacity.png)",
        "",
    ]
    return "\n".join(lines), plans, names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args(argv)
    text, plans, names = build_report(args.max_num_seqs)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "CAPACITY.md").write_text(text, encoding="utf-8")
    _plot(plans, names, args.out_dir / "capacity.png")
    print(text)
    print(f"wrote {args.out_dir / 'CAPACITY.md'} and {args.out_dir / 'capacity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
