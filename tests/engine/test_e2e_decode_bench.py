"""vLLM's DecodeBenchConnector on per-group pools, against the stock pool.

The connector benchmarks decoding at long contexts without running their prefills: it
claims every new request's prompt but its last token as loaded from outside, and its
worker side fills the claimed blocks with dummy values, each group's blocks by that
group's block IDs in that group's layers (a state layer's whole tensor). Pool-scoped IDs
serve it, so per-group pools stay on (``engine_sizing.DECODE_BENCH_CONNECTOR``). The fill
is a constant here, so both engines see the same values and give the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import TWO_PREFIX_WAVES, check_pair, run_pair, slow_e2e

DECODE_BENCH = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}
WORKLOAD = [
    "--prefix-caching",
    *TWO_PREFIX_WAVES,
    "--engine-arg",
    f"kv_transfer_config={json.dumps(DECODE_BENCH)}",
]


@pytest.mark.e2e
@slow_e2e("DecodeBenchConnector on per-group pools; the quick set's P/D pair runs a connector")
def test_decode_bench_connector_on_per_group_pools(tmp_path: Path) -> None:
    """Qwen3-Next in 'align' mode, 12 requests through 4 slots: every prompt but its last
    token claimed by the connector in both engines, same tokens, per-group (elastic) pools
    with every block back, more token capacity."""
    from tests.support.tiny_model import write_tiny_hybrid_model

    model = write_tiny_hybrid_model(tmp_path / "model", "qwen3_next")
    pair = run_pair(model, tmp_path / "runs", WORKLOAD)
    check_pair(pair, "PerGroupHybridCoordinator")
    stock, ours = pair["stock"], pair["per_group"]
    assert "per-group KV-cache pools not used" not in ours["log_text"]
    assert "elastic per-group KV-cache pools" in ours["log_text"]
    assert "Creating v1 connector with name: DecodeBenchConnector" in ours["log_text"]
    prompts = ours["prompts"]
    assert len(prompts) > 2 * 4  # more requests than max_num_seqs, twice over
    claimed = sum(len(p) - 1 for p in prompts)
    for run in (stock, ours):
        metrics = run["metrics"]
        assert metrics["external_prefix_cache_queries"] == sum(map(len, prompts))
        assert metrics["external_prefix_cache_hits"] == claimed
        assert metrics["finished_requests"] == len(prompts)
    assert ours["capacity"]["kv_cache_size_tokens"] > stock["capacity"]["kv_cache_size_tokens"]
