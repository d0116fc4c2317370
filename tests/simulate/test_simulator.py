"""The serving simulator: random traces finish on every layout without leaking blocks,
the layouts it builds are the ones the capacity planner predicts, the fake model runner
behaves as vLLM's runners do, and the ``hybrid-alloc simulate`` command."""

from __future__ import annotations

import contextlib
import gc
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from hybrid_alloc.traces import Trace, TraceRequest, chat_trace, write_jsonl
from tests.simulate.cases import (
    RANDOM_CELLS,
    SMALL_MAX_MODEL_LEN,
    budget,
    served_layouts,
    simulate_random_cell,
    tight_memory,
)

pytest.importorskip("vllm")

GiB = 1 << 30


def _sim() -> Any:
    from hybrid_alloc.integration import simulator

    return simulator


# ------------------------------------------------------------------ random traces


@settings(max_examples=budget(15), deadline=None)
@given(**RANDOM_CELLS)
def test_random_traces_finish_without_leaks(
    trace: Trace, name: str, mode: str, max_num_seqs: int, worth: float, batched: int
) -> None:
    """Every request finishes on both layouts, every block is back in its pool (null
    blocks aside) and every Rust pool's invariants hold; the layouts preempt or not, hit
    the prefix cache or not, as the trace and the memory make them."""
    sim = _sim()
    cell = (trace, name, mode, max_num_seqs, worth, batched)
    result = simulate_random_cell(*cell, layouts=sim.ALL_LAYOUTS)
    for _, r in served_layouts(result, trace):
        # Prompts and outputs fit the context: every request generates its whole output.
        assert r.clipped == 0
        if mode == "none":
            assert r.prefix_queries == r.prefix_hits == 0
            # Without prefix caching every prompt token is computed once, every output
            # token but the last is fed back once, and a preempted request computes again
            # what it had computed: the step-time model is charged all of it.
            fed = r.prompt_tokens + r.generated_tokens - r.finished
            assert r.computed_tokens == fed + r.recomputed_tokens
        if r.preemptions == 0:
            assert r.recomputed_tokens == 0
        # Simulated time covers every step and every request's latency.
        assert r.elapsed_s > 0 and r.latency_s["max"] <= r.elapsed_s
        assert r.series["time_s"] == sorted(r.series["time_s"])
    assert result.layouts["per-group"].invariants_ok is True
    assert len(result.layouts["per-group"].pools) >= 2
    # Elastic pools: the budget and every pool agree at the end (check_invariants).
    elastic = result.layouts["elastic"]
    assert elastic.invariants_ok is True or elastic.error, elastic
    # Fragmentation is sampled on the elastic budget only, as shares of it.
    if elastic.ok:
        assert elastic.mean_stranded is not None and elastic.mean_edge_waste is not None
        assert 0.0 <= elastic.mean_stranded <= (elastic.peak_stranded or 0.0) <= 1.0
        assert 0.0 <= elastic.mean_edge_waste < 1.0
    assert result.layouts["per-group"].mean_stranded is None


# ------------------------------------------------------------------ layouts vs the planner


@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize(
    "name",
    [
        "qwen3.5-0.8b",
        "qwen3.6-35b-a3b",
        "nemotron-h-8b",
        "nemotron-3-nano-30b-a3b",
        "jamba-v0.1",
        "falcon-h1-7b",
        "zamba2-2.7b",
    ],
)
def test_layouts_are_the_planned_ones(
    name: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator builds what the capacity planner predicts for both layouts: stock's
    block size and shared-pool blocks (vLLM's own platform alignment and sizing), the
    per-group pools' sizes (this package's sizing; in 'align' mode per-group pools of these
    models run only with HYBRID_ALLOC_FINE_ALIGN_BLOCKS=1, what the planner's 'ours' is)."""
    from hybrid_alloc.planner import load_model, plan

    monkeypatch.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", "1")

    sim = _sim()
    model = load_model(name)
    max_len = min(32768, model.max_position_embeddings)
    memory = 160 * GiB + 12345
    config = sim.SimSettings(
        memory=memory, mamba_cache_mode=mode, max_num_seqs=32, max_model_len=max_len
    )
    result = sim.simulate(name, config, Trace("empty", ()), layouts=("stock", "per-group"))
    stock, ours = result.layouts["stock"], result.layouts["per-group"]
    assert stock.ok and ours.ok, (stock.error, ours.error)
    p = plan(model, memory, mamba_cache_mode=mode, max_model_len=max_len, max_num_seqs=32)
    assert stock.attention_block_size == p.stock.block_size
    assert [pool.num_blocks for pool in stock.pools] == [p.stock.num_blocks]
    assert ours.attention_block_size == 16
    planned = sorted((r.num_layers, r.num_blocks) for r in p.ours.rows)
    assert sorted((pool.layers, pool.num_blocks) for pool in ours.pools) == planned
    # The bytes behind the pools (what the KV memory held series counts).
    (shared,) = stock.pools
    assert memory - shared.block_bytes < shared.num_blocks * shared.block_bytes <= memory
    assert sum(pool.num_blocks * pool.block_bytes for pool in ours.pools) <= memory


@pytest.mark.parametrize(
    # Blocks raised to 1,568 and 48 tokens, and one not raised (16).
    "name",
    ["falcon-h1-7b", "zamba2-2.7b", "lfm2-1.2b"],
)
def test_decode_room_is_half_of_stocks_block(name: str) -> None:
    """Elastic pools keep each running request half of the attention block vLLM's shared
    pool would use for the model (its own platform rule, as the stock layout is built)."""
    from hybrid_alloc.planner import load_config
    from hybrid_alloc.vllm_specs import load_model_spec

    sim = _sim()
    settings = sim.SimSettings(
        memory=16 * GiB, mamba_cache_mode="none", max_num_seqs=32, max_model_len=4096
    )
    stock = sim.simulate(name, settings, Trace("empty", ()), layouts=("stock",)).layouts["stock"]
    assert stock.ok and stock.attention_block_size is not None, stock.error
    cfg = load_config(name)
    model = load_model_spec(cfg, settings.specs, dtype=settings.dtype)
    with sim.layout_installed("elastic"), sim.quiet_vllm(True):
        engine = sim.build_engine(cfg, model, settings, "elastic")
    config = engine.kv_cache_config
    assert config.elastic is not None
    assert config.decode_room_tokens == stock.attention_block_size // 2 >= 8
    assert engine.scheduler.kv_cache_manager.coordinator._decode_room_tokens == (
        config.decode_room_tokens
    )


def test_align_mode_vllms_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """'align' mode on a full-size model with HYBRID_ALLOC_FINE_ALIGN_BLOCKS=0 (and by
    default where no whole number of configured blocks halves vLLM's raised block): the
    engine keeps vLLM's layout (the worker hook, then the engine core's sizing) on the Rust
    pool, so it makes stock's decisions step for step; HYBRID_ALLOC_FINE_ALIGN_BLOCKS=1
    gives per-group pools at 16-token blocks."""
    from hybrid_alloc.traces import prefix_trace

    sim = _sim()
    monkeypatch.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", "0")
    config = sim.SimSettings(
        memory=384 << 20, mamba_cache_mode="align", max_num_seqs=16, max_model_len=8192
    )
    trace = prefix_trace(num_requests=60)
    result = sim.simulate("qwen3.5-0.8b", config, trace, layouts=("stock", "elastic"))
    stock, ours = result.layouts["stock"], result.layouts["elastic"]
    assert stock.ok and ours.ok, (stock.error, ours.error)
    assert ours.note is not None and "vLLM's shared layout on the Rust pool" in ours.note
    assert "vLLM's shared layout" in sim.format_result(result)
    assert [(p.kind, p.num_blocks, p.block_size) for p in ours.pools] == [
        (p.kind, p.num_blocks, p.block_size) for p in stock.pools
    ]
    assert ours.attention_block_size == stock.attention_block_size > 16
    for key in ("steps", "preemptions", "prefix_hits", "generated_tokens", "computed_tokens"):
        assert getattr(ours, key) == getattr(stock, key), key
    assert stock.prefix_hits > 0 and stock.preemptions > 0
    monkeypatch.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", "1")
    fine = sim.simulate("qwen3.5-0.8b", config, trace, layouts=("elastic",)).layouts["elastic"]
    assert fine.ok and fine.note is None and fine.attention_block_size == 16


@pytest.mark.parametrize("setting", [None, "divisor"])
def test_half_blocks_in_align_mode(monkeypatch: pytest.MonkeyPatch, setting: str | None) -> None:
    """'align' mode on a full-size model whose raised block is an even number of 16-token
    blocks (Qwen3.5-0.8B: 544 = 2 x 272 tokens): by default, and with
    HYBRID_ALLOC_FINE_ALIGN_BLOCKS=divisor, per-group pools at 272-token blocks, each
    running request left half of vLLM's block to decode into, as at 16-token blocks; the
    trace runs to the end with prefix hits."""
    from hybrid_alloc.planner import load_config
    from hybrid_alloc.traces import prefix_trace
    from hybrid_alloc.vllm_specs import load_model_spec

    sim = _sim()
    if setting is None:
        monkeypatch.delenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", raising=False)
    else:
        monkeypatch.setenv("HYBRID_ALLOC_FINE_ALIGN_BLOCKS", setting)
    config = sim.SimSettings(
        memory=384 << 20, mamba_cache_mode="align", max_num_seqs=16, max_model_len=8192
    )
    result = sim.simulate("qwen3.5-0.8b", config, prefix_trace(num_requests=60))
    stock, ours = result.layouts["stock"], result.layouts["elastic"]
    assert stock.ok and ours.ok, (stock.error, ours.error)
    assert ours.note is None and stock.attention_block_size == 544
    assert ours.attention_block_size == 272
    assert ours.finished == stock.finished == 60 and ours.prefix_hits > 0
    assert ours.invariants_ok and not any(ours.leaked_blocks.values())
    model = load_model_spec(load_config("qwen3.5-0.8b"), config.specs, dtype=config.dtype)
    with sim.layout_installed("elastic"), sim.quiet_vllm(True):
        engine = sim.build_engine(load_config("qwen3.5-0.8b"), model, config, "elastic")
    assert engine.kv_cache_config.decode_room_tokens == 544 // 2


def test_refusals_are_reported_not_raised() -> None:
    """A layout that cannot be built (here: 64 MiB hold no 32k-token request of
    Qwen3.6's attention on either layout) has its ``error`` set; the run goes on."""
    sim = _sim()
    config = sim.SimSettings(memory=64 << 20, max_num_seqs=8, max_model_len=32768)
    result = sim.simulate("qwen3.6-35b-a3b", config, chat_trace(num_requests=5))
    for r in result.layouts.values():
        assert r.error is not None and "memory" in r.error.lower()
        assert r.finished == 0 and r.requests == 5
    assert "not simulated" in sim.format_result(result)


# ------------------------------------------------------------------ pieces


def test_fake_runner_discards_partial_prefills() -> None:
    """A prompt longer than the token budget is prefilled in chunks: its first token
    comes with the last chunk, as vLLM's runners discard the samples of partial
    prefills; a preempted request's recompute samples nothing until it catches up."""
    sim = _sim()
    config = sim.SimSettings(
        memory=16 * GiB, max_num_seqs=4, max_num_batched_tokens=1000, max_model_len=8192
    )
    trace = Trace("one", (TraceRequest(0.0, 4500, 3, "a"),))
    result = sim.simulate("qwen3.5-0.8b", config, trace)
    for r in result.layouts.values():
        # 5 prefill chunks (the first token arrives with the fifth), 2 more decode steps.
        assert r.ttft_steps["max"] == 4
        assert r.latency_steps["max"] == 6
        assert r.generated_tokens == 3
        assert r.series["running"][:7] == [1] * 7


def test_steps_cost_what_they_compute() -> None:
    """One request alone: the simulated time is the step-time model's cost of its prefill
    step and of every decode step at its growing context, nothing else; ``fixed`` charges
    ``step_ms`` a step."""
    from hybrid_alloc.planner import load_config, load_model

    sim = _sim()
    trace = Trace("one", (TraceRequest(0.5, 3000, 40, "a"),))
    config = sim.SimSettings(memory=16 * GiB, max_num_seqs=4, max_model_len=8192)
    result = sim.simulate("qwen3.5-0.8b", config, trace)
    cost = sim.step_cost_for(load_config("qwen3.5-0.8b"), load_model("qwen3.5-0.8b"), config)
    expected = cost.seconds([(0, 3000)]) + sum(cost.seconds([(3000 + i, 1)]) for i in range(39))
    for r in result.layouts.values():
        assert r.ok, r.error
        assert r.computed_tokens == 3000 + 39 and r.recomputed_tokens == 0
        assert r.elapsed_s == pytest.approx(0.5 + expected)
        assert r.latency_s["max"] == pytest.approx(expected)
        assert r.ttft_s["max"] == pytest.approx(cost.seconds([(0, 3000)]))
    assert "H100" in result.time_model
    fixed = sim.simulate(
        "qwen3.5-0.8b", sim.SimSettings(**{**config.__dict__, "time_model": "fixed"}), trace
    )
    for r in fixed.layouts.values():
        # Arrives before step 20 of 25 ms; 40 steps compute, and one more only reports
        # the finished request (fixed steps count it, as they always did; the time model
        # charges nothing for a step that runs no forward pass).
        assert r.elapsed_s == pytest.approx(0.025 * (20 + 41))
        assert r.latency_s["max"] == pytest.approx(0.025 * 60 - 0.5)


def test_recompute_is_charged() -> None:
    """Two requests whose outputs outgrow the pool together (12 blocks of 544 tokens,
    each request also holding 3 GDN state blocks): vLLM preempts one, which computes its
    tokens again; they are counted and charged."""
    sim = _sim()
    trace = Trace("two", (TraceRequest(0.0, 500, 2500, "a"), TraceRequest(0.0, 500, 2500, "b")))
    config = sim.SimSettings(
        memory=16 * GiB, max_num_seqs=2, max_model_len=4096, num_gpu_blocks_override=12
    )
    result = sim.simulate("qwen3.5-0.8b", config, trace, layouts=("stock",))
    r = result.layouts["stock"]
    assert r.ok, r.error
    assert r.finished == 2 and r.preemptions >= 1
    assert r.recomputed_tokens >= 500
    assert r.computed_tokens == 2 * (500 + 2499) + r.recomputed_tokens


def test_prompts_are_cut_to_the_context() -> None:
    sim = _sim()
    trace = Trace(
        "long",
        (TraceRequest(0.0, 9000, 50, "a"), TraceRequest(0.1, 100, 5000, "b")),
    )
    requests, clipped = sim.requests_from_trace(trace, 25.0, 4096)
    # "a" keeps its 50 output tokens; "b"'s prompt fits alone, its output does not.
    assert clipped == 1
    assert len(requests[0].prompt_token_ids) == 4096 - 50
    assert len(requests[1].prompt_token_ids) == 100
    assert [r.arrival_step for r in requests] == [0, 4]
    config = sim.SimSettings(memory=16 * GiB, max_model_len=4096, max_num_seqs=4)
    result = sim.simulate("qwen3.5-0.8b", config, trace)
    for r in result.layouts.values():
        # vLLM caps "b"'s output at max_model_len.
        assert r.finished == 2 and r.clipped == 1
        assert r.generated_tokens == 50 + (4096 - 100)


def test_qwen35_configs_become_qwen3_next() -> None:
    from hybrid_alloc.integration.simulator import engine
    from hybrid_alloc.planner import load_config

    cfg = engine._engine_hf_config(load_config("qwen3.6-35b-a3b"))
    assert cfg["model_type"] == "qwen3_next"
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert "text_config" not in cfg and cfg["num_hidden_layers"] == 40
    plain = engine._engine_hf_config(load_config("jamba-v0.1"))
    assert plain["model_type"] == "jamba" and not any(k.startswith("_") for k in plain)


def test_layout_install_state_is_restored() -> None:
    from hybrid_alloc import integration

    sim = _sim()
    before = integration.installed()
    with sim.layout_installed("stock"):
        assert integration.installed() is None
    assert integration.installed() == before
    with sim.layout_installed("per-group"):
        assert integration.installed() == ("rust", True)
    assert integration.installed() == before
    with sim.layout_installed(sim.DROP_IN):
        assert integration.installed() == ("rust", False)
    assert integration.installed() == before
    with pytest.raises(ValueError, match="layout"), sim.layout_installed("mine"):
        pass


def test_bad_settings() -> None:
    sim = _sim()
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        sim.SimSettings(memory=GiB, mamba_cache_mode="all")
    with pytest.raises(ValueError, match="platform"):
        sim.SimSettings(memory=GiB, platform="tpu")
    with pytest.raises(ValueError, match="memory"):
        sim.SimSettings(memory=0)
    with pytest.raises(ValueError, match="time_model"):
        sim.SimSettings(memory=GiB, time_model="a100")
    with pytest.raises(ValueError, match="params_b"):
        sim.SimSettings(memory=GiB, params_b=0)


# ------------------------------------------------------------------ CLI


def test_cli_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hybrid_alloc.cli import main

    png, out, saved = tmp_path / "sim.png", tmp_path / "sim.json", tmp_path / "trace.jsonl"
    args = ["simulate", "qwen3.5-0.8b", "--memory", "8GiB", "--trace", "prefix"]
    args += ["--num-requests", "12", "--mamba-cache-mode", "align", "--max-num-seqs", "8"]
    args += ["--max-model-len", "8192", "--plot", str(png), "--json", str(out)]
    assert main([*args, "--save-trace", str(saved)]) == 0
    text = capsys.readouterr().out
    # Stock against the engine's default layout (elastic pools), in simulated time.
    assert "elastic / stock" in text and "prefix-cache hit rate" in text
    assert "recomputed tokens" in text and "finished requests / s" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert set(data["layouts"]) == {"stock", "elastic"}
    assert data["layouts"]["elastic"]["finished"] == 12
    assert "H100" in data["time_model"]
    assert len(data["layouts"]["stock"]["series"]["running"]) > 0
    # The saved trace replays to the same numbers.
    replay = ["simulate", "qwen3.5-0.8b", "--memory", "8GiB", "--trace", str(saved)]
    replay += ["--mamba-cache-mode", "align", "--max-num-seqs", "8", "--max-model-len", "8192"]
    assert main([*replay, "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    for layout in ("stock", "elastic"):
        keys = ("steps", "finished", "prefix_hits", "preemptions", "generated_tokens")
        for key in (*keys, "elapsed_s", "computed_tokens", "recomputed_tokens"):
            assert again["layouts"][layout][key] == data["layouts"][layout][key]


def test_cli_simulate_prefill_only(tmp_path: Path) -> None:
    """``--max-output-tokens 1``: every request ends at its first token, on both layouts."""
    from hybrid_alloc.cli import main

    out = tmp_path / "sim.json"
    args = ["simulate", "qwen3.5-0.8b", "--memory", "8GiB", "--trace", "chat"]
    args += ["--num-requests", "12", "--max-num-seqs", "8", "--max-model-len", "8192"]
    assert main([*args, "--max-output-tokens", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for layout in ("stock", "elastic"):
        assert data["layouts"][layout]["finished"] == 12
        assert data["layouts"][layout]["generated_tokens"] == 12
    with pytest.raises(SystemExit):  # argparse refuses it
        main([*args, "--max-output-tokens", "0"])


def test_cli_simulate_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hybrid_alloc.cli import main

    assert main(["simulate", "qwen3.5-0.8b", "--trace", str(tmp_path / "x.jsonl")]) == 1
    assert "neither a trace kind" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0}\n')
    assert main(["simulate", "qwen3.5-0.8b", "--trace", str(bad)]) == 1
    assert "line 1" in capsys.readouterr().err
    trace = write_jsonl(chat_trace(num_requests=3), tmp_path / "ok.jsonl")
    assert main(["simulate", "nope-model", "--trace", str(trace)]) == 1
    assert main(["simulate", "qwen3.5-0.8b", "--trace", str(trace), "--layouts", "x"]) == 1


def test_cli_imports_no_vllm() -> None:
    """``plan`` keeps working without vLLM: the CLI imports the simulator lazily."""
    code = "import sys, hybrid_alloc.cli, hybrid_alloc.traces; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("layout", ["elastic", "per-group"])
def test_quiet_steps_schedule_alike(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's scheduler over per-group pools makes the same schedule with quiet decode
    steps (`integration.quiet_step`) as with vLLM's whole ``allocate_slots`` on every
    call: the same preemptions, tokens, simulated time and per-step series, on memory
    tight enough to preempt."""
    from hybrid_alloc.integration.scheduler import coordinator

    sim = _sim()
    rng = random.Random(5)
    trace = Trace(
        "long outputs",
        tuple(
            TraceRequest(0.01 * i, rng.randint(100, 600), rng.randint(300, 1500), f"r{i}")
            for i in range(30)
        ),
    )
    config = sim.SimSettings(
        memory=tight_memory("qwen3.5-0.8b", "none", 6, 1.0),
        mamba_cache_mode="none",
        max_num_seqs=6,
        max_model_len=SMALL_MAX_MODEL_LEN,
    )
    runs = []
    for quiet in (False, True):
        monkeypatch.setattr(coordinator, "QUIET_STEPS", quiet)
        r = sim.simulate("qwen3.5-0.8b", config, trace, layouts=(layout,)).layouts[layout]
        assert r.ok, r.error
        runs.append(r.to_json(with_series=True))
    timings = ("scheduler_cpu_s", "scheduler_wall_s", "build_s", "cpu_us_per_step")
    slow, quick = ({k: v for k, v in run.items() if k not in timings} for run in runs)
    assert slow["preemptions"] > 0 and slow["finished"] == 30
    assert quick == slow


def test_each_turn_starts_with_the_young_generations_collected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layouts' engines share Python's cyclic garbage collector. Each turn starts with
    nothing left in its young generations (the counts `gc.get_count` reads are those of a
    collection just run), so a collection in one layout's timed calls scans only what
    that layout allocated, never what the other layout's turn left behind."""
    sim = _sim()
    from hybrid_alloc.integration.simulator import run as sim_run

    monkeypatch.setattr(sim_run, "STEPS_PER_TURN", 7)
    counts: list[tuple[int, int, int]] = []
    installed = sim_run.layout_installed

    @contextlib.contextmanager
    def counting(layout: str) -> Iterator[None]:
        counts.append(gc.get_count())
        with installed(layout):
            yield

    monkeypatch.setattr(sim_run, "layout_installed", counting)
    trace = chat_trace(40, seed=5)
    config = sim.SimSettings(
        memory=384 << 20,
        mamba_cache_mode="none",
        max_num_seqs=8,
        max_model_len=SMALL_MAX_MODEL_LEN,
    )
    layouts = ("stock", "elastic")
    result = sim.simulate("qwen3.5-0.8b", config, trace, layouts=layouts)
    assert all(r.ok for r in result.layouts.values())
    turns = counts[len(layouts) :]  # after one entry per engine built
    assert len(turns) > 10
    # A few objects made between the collection and the count, at most.
    assert max(c[0] for c in turns) < 50, turns
    assert all(c[1:] == (0, 0) for c in turns), turns


@pytest.mark.parametrize("mode", ["none", "align"])
def test_side_by_side_runs_are_the_runs_one_after_the_other(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`simulate` runs its layouts' engines in turns (so noise falls on every layout's CPU
    time alike); every figure but the timings, the per-step series included, is what each
    layout's run alone gives, on memory tight enough to preempt and with prefix caching.
    Short turns here, so that this small trace switches engines many times."""
    sim = _sim()
    from hybrid_alloc.integration.simulator import run as sim_run

    monkeypatch.setattr(sim_run, "STEPS_PER_TURN", 7)

    rng = random.Random(11)
    trace = Trace(
        "mixed",
        tuple(
            TraceRequest(
                0.01 * i,
                rng.randint(100, 900),
                rng.randint(300, 2000),
                f"r{i}",
                prefix_id="p0" if i % 3 == 0 else None,
            )
            for i in range(40)
        ),
    )
    config = sim.SimSettings(
        memory=tight_memory("qwen3.5-0.8b", mode, 6, 0.5),
        mamba_cache_mode=mode,
        max_num_seqs=12,
        max_model_len=SMALL_MAX_MODEL_LEN,
    )
    layouts = ("stock", "elastic", "drop-in")
    together = sim.simulate("qwen3.5-0.8b", config, trace, layouts=layouts)
    assert list(together.layouts) == list(layouts)
    timings = ("scheduler_cpu_s", "scheduler_wall_s", "build_s", "cpu_us_per_step")
    turns = sim_run.STEPS_PER_TURN
    for layout in layouts:
        alone = sim.simulate("qwen3.5-0.8b", config, trace, layouts=(layout,)).layouts[layout]
        run = together.layouts[layout]
        assert run.ok and alone.ok, (run.error, alone.error)
        # Several turns each, so the engines really ran interleaved.
        assert run.busy_steps > 3 * turns
        got, want = (
            {k: v for k, v in r.to_json(with_series=True).items() if k not in timings}
            for r in (run, alone)
        )
        assert got == want, layout
    assert all(r.preemptions > 0 for r in together.layouts.values())
