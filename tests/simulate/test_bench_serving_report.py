"""The serving bench's verdicts (``benches/bench_serving.py``): better cells split by what
made them better, and cells that recompute more than twice stock's tokens listed with
their verdict in simulated time."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

from tests.simulate.cases import load_bench


def _layout(tput: float, latency: float, hits: float, recomputed: int) -> Any:
    return SimpleNamespace(
        ok=True,
        finished_per_s=tput,
        latency_s={"mean": latency},
        prefix_hit_rate=hits,
        cpu_us_per_step=100.0,
        recomputed_tokens=recomputed,
    )


def _cell(bench: ModuleType, name: str, stock: Any, elastic: Any) -> Any:
    result = SimpleNamespace(layouts={"stock": stock, "elastic": elastic})
    return bench.Cell(name, 16, "none", "chat", 256, result, 1.0)


def test_better_cells_are_split_by_reason() -> None:
    bench = load_bench("bench_serving")
    base = _layout(1.0, 10.0, 0.20, 0)
    cells = [
        _cell(bench, "tput", base, _layout(1.10, 10.0, 0.20, 0)),
        _cell(bench, "both", base, _layout(1.10, 9.0, 0.20, 0)),
        _cell(bench, "hits", base, _layout(1.0, 10.0, 0.40, 0)),
        _cell(bench, "same", base, _layout(1.01, 10.0, 0.20, 0)),
        _cell(bench, "worse", base, _layout(0.90, 10.0, 0.40, 0)),
    ]
    assert [bench.better_reasons(c, "elastic") for c in cells] == [
        ["throughput"],
        ["throughput", "latency"],
        ["prefix hits"],
        [],
        [],
    ]
    (line, _) = bench._better_by_reason(cells, "elastic")
    assert "its 3 better cells" in line
    assert "throughput in 2, mean latency in 1, prefix hits in 1" in line
    assert "prefix hits alone in 1" in line


def test_heavy_recompute_is_listed_with_its_verdict() -> None:
    bench = load_bench("bench_serving")
    cells = [
        # Twice stock's recompute exactly: not listed.
        _cell(bench, "twice", _layout(1.0, 10.0, 0.0, 100), _layout(1.0, 10.0, 0.0, 200)),
        # Any recompute where stock had none, but better in time.
        _cell(bench, "fresh", _layout(1.0, 10.0, 0.0, 0), _layout(1.2, 10.0, 0.0, 50)),
        _cell(bench, "heavy", _layout(1.0, 10.0, 0.0, 10), _layout(0.9, 12.0, 0.0, 900)),
    ]
    lines = bench._recompute_check(cells, "elastic")
    assert "more than 2x stock's tokens after preemptions: 2:" in lines[0]
    listed = [x for x in lines if x.startswith("- ")]
    assert len(listed) == 2
    assert listed[0].startswith("- fresh 16 GiB 'none' chat @256: 0 -> 50 tokens, better")
    assert "heavy" in listed[1] and "worse" in listed[1]
    none = bench._recompute_check(cells[:1], "elastic")
    assert none[0].endswith(": 0.")


def test_shards_split_the_cells_and_merge_back(tmp_path: Any, monkeypatch: Any) -> None:
    """``--shard I/N`` runs every N-th (config, memory) group; the shards' saved cells,
    merged, are every cell once, and the report is written from them."""
    import hybrid_alloc.integration.simulator as simulator

    bench = load_bench("bench_serving")
    monkeypatch.setattr(bench, "_tuned_seqs", lambda *args: None)
    monkeypatch.setattr(bench, "_settings", lambda *args: args)
    monkeypatch.setattr(bench, "_log", lambda cell, log: None)
    monkeypatch.setattr(
        simulator,
        "simulate",
        lambda config, settings, trace, layouts: SimpleNamespace(
            layouts={n: _layout(1.0, 10.0, 0.0, 0) for n in layouts}
        ),
    )
    configs, memories = ["qwen3.5-0.8b", "zamba2-2.7b", "lfm2-1.2b"], [16, 40]
    traces: dict[str, Any] = {"chat": None, "long": None}
    every = {
        (c.config, c.memory_gib, c.mode, c.trace)
        for c in bench.run_cells(configs, memories, ["none", "align"], traces)
    }
    assert len(every) == 3 * 2 * 2 * 2
    shards = []
    for index in range(4):
        cells = bench.run_cells(configs, memories, ["none", "align"], traces, shard=(index, 4))
        groups = {(c.config, c.memory_gib) for c in cells}
        assert len(cells) == 4 * len(groups)  # a group's cells stay in one shard
        path = tmp_path / f"shard{index}.pkl"
        path.write_bytes(bench.pickle.dumps((cells, 10.0 + index, "abc1234")))
        shards.append(path)
    merged, elapsed, commit = bench._merge(shards)
    assert sorted((c.config, c.memory_gib, c.mode, c.trace) for c in merged) == sorted(every)
    assert elapsed == 13.0  # the shards ran side by side: the longest
    assert commit == "abc1234"
