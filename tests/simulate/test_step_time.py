"""The step-time model: a step's simulated cost grows with the tokens it computes, with
its decodes and with the context they read; MoE weights, Mamba states and sliding windows
are charged as documented; the calibration reproduces the public figures the README cites;
parameter estimates stay near the model cards."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_alloc.model_specs import AttentionLayerSpec, ModelSpec, model_from_config
from hybrid_alloc.planner import load_config, load_model
from hybrid_alloc.step_time import H100, Hardware, StepCost, estimate_params
from tests.simulate.cases import budget

# Llama-3.1-8B's shape (the model of the public H100 figures the README cites).
LLAMA_8B_CFG: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
LLAMA_8B = ModelSpec("llama-3.1-8b", "llama", (AttentionLayerSpec("full", 8, 128, 2),) * 32, 131072)


def _cost(name: str) -> StepCost:
    cfg = load_config(name)
    return StepCost.for_model(cfg, model_from_config(cfg))


@pytest.fixture(scope="module")
def qwen36() -> StepCost:
    return _cost("qwen3.6-35b-a3b")


@settings(max_examples=budget(40), deadline=None)
@given(
    name=st.sampled_from(["qwen3.6-35b-a3b", "nemotron-h-8b", "jamba-v0.1", "qwen3.5-0.8b"]),
    context=st.integers(0, 60_000),
    new=st.integers(1, 8192),
    more=st.integers(1, 4096),
    others=st.lists(st.tuples(st.integers(0, 30_000), st.integers(1, 512)), max_size=8),
)
def test_cost_grows_with_computed_tokens(
    name: str, context: int, new: int, more: int, others: list[tuple[int, int]]
) -> None:
    """More tokens computed (a longer prompt chunk, a recompute) always cost more time."""
    cost = _cost(name)
    base = cost.breakdown([*others, (context, new)])
    bigger = cost.breakdown([*others, (context, new + more)])
    assert bigger.tokens == base.tokens + more
    assert bigger.flops > base.flops and bigger.bytes > base.bytes
    assert bigger.seconds > base.seconds


@settings(max_examples=budget(40), deadline=None)
@given(
    decodes=st.integers(1, 300),
    context=st.integers(1, 60_000),
    extra=st.integers(1, 20_000),
)
def test_cost_grows_with_decodes_and_context(decodes: int, context: int, extra: int) -> None:
    cost = _cost("qwen3.6-35b-a3b")
    step = cost.seconds([(context, 1)] * decodes)
    assert cost.seconds([(context, 1)] * (decodes + 1)) > step
    # The same decodes over longer contexts read more KV (and attend to more keys).
    longer = cost.breakdown([(context + extra, 1)] * decodes)
    shorter = cost.breakdown([(context, 1)] * decodes)
    assert longer.bytes > shorter.bytes and longer.flops > shorter.flops
    assert longer.seconds > shorter.seconds


def test_what_a_step_is_charged(qwen36: StepCost) -> None:
    """The formula's parts: the fixed part, attention keys (full and windowed), Mamba
    states read and written per request, MoE experts reached by the step's tokens."""
    fixed = qwen36.hardware.fixed_ms / 1000
    one = qwen36.breakdown([(0, 1)])
    assert one.seconds == pytest.approx(fixed + max(one.compute_s, one.memory_s))
    # Keys attended: full causal, and capped by a window.
    assert StepCost._attended(0, 4, None) == 1 + 2 + 3 + 4
    assert StepCost._attended(10, 2, None) == 11 + 12
    assert StepCost._attended(0, 6, 3) == 1 + 2 + 3 + 3 + 3 + 3
    assert StepCost._attended(100, 2, 3) == 6
    # Mamba/GDN states: two state reads/writes per request.
    no_state = replace(qwen36, state_bytes=0)
    assert qwen36.state_bytes > 0
    assert qwen36.breakdown([(5, 1)] * 3).bytes - no_state.breakdown([(5, 1)] * 3).bytes == (
        pytest.approx(6 * qwen36.state_bytes)
    )
    # MoE: one token reaches 8 of 256 experts' weights, 4096 tokens nearly all of them.
    p = qwen36.params
    assert p.experts == 256 and p.experts_per_token == 8
    dense = (p.total - p.routed) * 2
    few = qwen36.breakdown([(0, 1)]).bytes - dense
    many = qwen36.breakdown([(0, 4096)]).bytes - dense
    assert few < 0.05 * p.routed * 2 < 0.99 * p.routed * 2 < many


def test_calibration_matches_public_h100_figures() -> None:
    """The README's checks: Llama-3.1-8B (bf16) on one H100. One request decoding at a
    1k context: 100-200 tokens/s (a single stream reaches ~60-80% of the HBM roofline);
    256 requests decoding at 1k: 10k-15k tokens/s (public saturated throughput ~12.5k);
    an 8k-token prefill chunk: 15k-40k prompt tokens/s."""
    cost = StepCost.for_model(LLAMA_8B_CFG, LLAMA_8B)
    assert 7.5e9 < cost.params.total < 8.5e9
    single = 1 / cost.seconds([(1024, 1)])
    assert 100 < single < 200
    batch = 256 / cost.seconds([(1024, 1)] * 256)
    assert 10_000 < batch < 15_000
    prefill = 8192 / cost.seconds([(0, 8192)])
    assert 15_000 < prefill < 40_000


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        ("qwen3.5-0.8b", 0.8, 0.8),
        ("qwen3.6-35b-a3b", 35, 3),
        ("nemotron-h-8b", 8, 8),
        ("nemotron-3-nano-30b-a3b", 31.6, 3.2),
        ("jamba-v0.1", 52, 12),
        ("falcon-h1-7b", 7.6, 7.6),
        ("zamba2-2.7b", 2.7, 2.7),
        ("qwen3.5-27b", 27, 27),
        ("granite-4.0-h-small", 32, 9),
        ("lfm2-1.2b", 1.2, 1.2),
    ],
)
def test_parameter_estimates_are_near_the_model_cards(
    name: str, total_b: float, active_b: float
) -> None:
    cfg = load_config(name)
    model = load_model(name)  # the layers as simulate reads them (vLLM's, where installed)
    p = estimate_params(cfg, model)
    assert p.source == "estimate"
    assert p.total / 1e9 == pytest.approx(total_b, rel=0.3)
    assert p.active / 1e9 == pytest.approx(active_b, rel=0.3)
    # A config's own figures win; the active share follows the estimate's.
    mine = estimate_params({**cfg, "_params_b": 2 * total_b}, model)
    assert mine.total == pytest.approx(2e9 * total_b)
    assert mine.active / mine.total == pytest.approx(p.active / p.total)
    assert mine.source == "model card"


def test_bad_hardware() -> None:
    with pytest.raises(ValueError, match="mfu"):
        Hardware("x", 1e12, 1e12, mfu=1.5)
    with pytest.raises(ValueError, match="peak_flops"):
        Hardware("x", 0, 1e12)
    with pytest.raises(ValueError, match="fixed_ms"):
        replace(H100, fixed_ms=-1)
