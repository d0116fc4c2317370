"""Preemption after output on vLLM's own pool: why bf16 GDN runs that preempt are held to a
replay, not to the uninterrupted run (issue 18).

A request preempted after generating ``k`` tokens resumes by recomputing its prompt and
those tokens as a prefill; an uninterrupted run fed the same tokens to one-token decode
steps. On the tiny Qwen3-Next (bf16 GDN) the two round differently enough to flip greedy
choices. This module shows that on stock's pool alone, so that the per-group and drop-in
runs in ``test_e2e_offload.py`` can be checked with
:func:`tests.helpers.check_recompute_replay` knowing the oracle is vLLM's own behaviour:

* stock's pool, with a device pool too small for two requests' decode growth, preempts
  requests after output, and their later tokens differ from stock's uninterrupted run;
* every one of those tokens is exactly what stock's pool generates for the prompt plus the
  tokens generated before the preemption.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import check_recompute_replay, replay_prompts, run_engines, slow_e2e

pytestmark = [
    pytest.mark.e2e,
    slow_e2e("the premise of the recompute replay, on stock's pool alone"),
]

# Two requests at a time with distinct 640-token prefixes, 200 tokens each: with 22 shared
# blocks of 128 tokens both prefill, and the second's decode growth preempts the first.
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
    "--max-tokens",
    "200",
]


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from tests.support.tiny_model import write_tiny_hybrid_model

    workdir = tmp_path_factory.mktemp("recompute")
    model = write_tiny_hybrid_model(workdir / "model", "qwen3_next")
    runs: dict[str, tuple[str, bool, list[str]]] = {
        "uninterrupted": ("vllm", False, WORKLOAD),
        "preempting": ("vllm", False, [*WORKLOAD, "--num-gpu-blocks", "22"]),
    }
    results = run_engines(model, workdir, runs)
    prompts: Path = workdir / "replay_prompts.json"
    prompts.write_text(json.dumps([replay_prompts(results["preempting"])]))
    replay = {"replay": ("vllm", False, [*WORKLOAD, "--prompts", str(prompts)])}
    results.update(run_engines(model, workdir, replay))
    return results


def test_stock_pool_diverges_after_preemption_with_output(
    stock_runs: dict[str, dict[str, Any]],
) -> None:
    """Stock's pool preempting after output changes its own tokens, exactly as the replay
    says, and only for the requests that resumed with outputs."""
    uninterrupted, preempting = stock_runs["uninterrupted"], stock_runs["preempting"]
    resumed = preempting["probe"]["before_reset"]["resumed"]
    with_outputs = {int(r) for r, resumes in resumed.items() if any(k for k, _ in resumes)}
    assert with_outputs, resumed
    pairs = zip(uninterrupted["outputs"], preempting["outputs"], strict=True)
    changed = {i for i, (a, b) in enumerate(pairs) if a != b}
    # vLLM's own recompute moves tokens: the reason the replay, not stock's run, is the oracle.
    assert changed and changed <= with_outputs, (changed, resumed)
    recomputed = check_recompute_replay(uninterrupted, preempting, stock_runs["replay"])
    assert recomputed == len(with_outputs)
