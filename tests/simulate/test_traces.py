"""Traces: generators (seeded, documented distributions), token IDs (shared prefixes hash
equal), JSONL round trip and bad input."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_alloc.traces import (
    STREAM_CHUNK,
    TRACE_KINDS,
    TokenStreams,
    Trace,
    TraceRequest,
    agentic_trace,
    chat_trace,
    load_trace,
    long_trace,
    make_trace,
    parse_jsonl,
    prefix_trace,
    read_jsonl,
    reasoning_trace,
    write_jsonl,
)
from tests.simulate.cases import budget


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_generators_are_seeded(kind: str) -> None:
    a = make_trace(kind, num_requests=60, seed=3)
    assert a == make_trace(kind, num_requests=60, seed=3)
    assert a != make_trace(kind, num_requests=60, seed=4)
    assert len(a) == 60
    arrivals = [r.arrival for r in a.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert len({r.request_id for r in a.requests}) == 60


def test_chat_distribution() -> None:
    trace = chat_trace(num_requests=2000, rate=10.0, seed=1)
    prompts = [r.prompt_len for r in trace.requests]
    outputs = [r.output_len for r in trace.requests]
    assert min(prompts) >= 16 and max(prompts) <= 4096
    assert min(outputs) >= 8 and max(outputs) <= 1024
    # Log-normal around medians of 256 and 200 tokens.
    assert 220 <= statistics.median(prompts) <= 300
    assert 175 <= statistics.median(outputs) <= 225
    assert all(r.prefix_id is None for r in trace.requests)
    # Poisson arrivals at 10 per second.
    assert 180 <= trace.requests[-1].arrival <= 220


def test_long_distribution() -> None:
    trace = long_trace(num_requests=300, seed=2)
    assert all(8192 <= r.prompt_len <= 32768 for r in trace.requests)
    assert all(32 <= r.output_len <= 1024 for r in trace.requests)


def test_prefix_trace_shares_prefixes() -> None:
    trace = prefix_trace(num_requests=400, seed=5)
    system = [r for r in trace.requests if r.prefix_id and r.prefix_id.startswith("system-")]
    turns = [r for r in trace.requests if r.prefix_id and r.prefix_id.startswith("conversation-")]
    assert len(system) + len(turns) == 400
    assert 100 < len(system) < 300
    assert all(r.prefix_len is not None and 1024 <= r.prefix_len < r.prompt_len for r in system)
    # Each conversation turn re-sends the previous turn's prompt and answer.
    by_conv: dict[str, list[TraceRequest]] = {}
    for r in turns:
        by_conv.setdefault(str(r.prefix_id), []).append(r)
    multi = [c for c in by_conv.values() if len(c) > 1]
    assert multi
    for conv in multi:
        conv.sort(key=lambda r: int(r.request_id.rsplit("turn", 1)[1]))
        for prev, nxt in itertools.pairwise(conv):
            assert nxt.prompt_len > prev.prompt_len + prev.output_len
            assert nxt.arrival > prev.arrival


def test_reasoning_distribution() -> None:
    """Heavy-tailed outputs of 1k-16k tokens, 40% behind one of two system prompts, waves."""
    trace = reasoning_trace(num_requests=1600, rate=2.0, seed=3)
    outputs = [r.output_len for r in trace.requests]
    assert min(outputs) >= 1024 and max(outputs) <= 16384
    assert 2800 <= statistics.mean(outputs) <= 3900
    assert 2100 <= statistics.median(outputs) <= 2700
    # Heavy tail: some outputs reach 10k tokens, the longest hit the 16k cap.
    assert sum(o >= 10_000 for o in outputs) >= 16
    assert max(outputs) == 16384
    shared = [r for r in trace.requests if r.prefix_id is not None]
    assert 0.35 <= len(shared) / len(trace) <= 0.45
    systems = {r.prefix_id: r.prefix_len for r in shared}
    assert len(systems) == 2
    for r in shared:
        assert r.prefix_len == systems[r.prefix_id]
        assert r.prefix_len is not None and 1536 <= r.prefix_len < r.prompt_len
    # Waves of 32 every 16 s (32 / 2 per second), each within its first 2 seconds.
    for r in trace.requests:
        wave_start = 16.0 * (r.arrival // 16.0)
        assert r.arrival - wave_start <= 2.0
    waves = {int(r.arrival // 16.0) for r in trace.requests}
    assert len(waves) == 50
    with pytest.raises(ValueError, match="rate"):
        reasoning_trace(rate=0)


def test_agentic_sessions_grow_and_reuse_their_context() -> None:
    """Each turn re-sends the session so far (its tokens begin with the previous turn's
    prompt and answer, plus a tool result); sessions share their tool prompts' tokens."""
    trace = agentic_trace(num_requests=300, seed=4)
    assert len(trace) == 300
    streams = TokenStreams(seed=2)
    sessions: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        assert r.prefix_id is not None and r.prefix_len is None
        assert r.system_id is not None and 2048 <= r.system_len < r.prompt_len
        sessions.setdefault(r.prefix_id, []).append(r)
    assert all(1 <= len(turns) <= 12 for turns in sessions.values())
    assert sum(len(turns) >= 3 for turns in sessions.values()) >= len(sessions) - 1
    for turns in list(sessions.values())[:10]:
        turns.sort(key=lambda r: int(r.request_id.rsplit("turn", 1)[1]))
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival > prev.arrival
            assert nxt.prompt_len > prev.prompt_len + prev.output_len
            p_prev, o_prev = streams.request_tokens(prev)
            p_next, _ = streams.request_tokens(nxt)
            assert p_next[: len(p_prev) + len(o_prev)] == p_prev + o_prev
    # Two sessions behind the same tool prompt share its tokens, and only those.
    by_system: dict[str, list[TraceRequest]] = {}
    for turns in sessions.values():
        by_system.setdefault(str(turns[0].system_id), []).append(turns[0])
    a, b = next(v for v in by_system.values() if len(v) >= 2)[:2]
    pa, _ = streams.request_tokens(a)
    pb, _ = streams.request_tokens(b)
    assert pa[: a.system_len] == pb[: b.system_len]
    assert pa[a.system_len : a.system_len + 64] != pb[b.system_len : b.system_len + 64]
    with pytest.raises(ValueError, match="turns"):
        agentic_trace(turns=(0, 3))


def test_system_streams_precede_the_prefix_stream() -> None:
    streams = TokenStreams(seed=5)
    a = TraceRequest(0.0, 900, 10, "a", prefix_id="s1", system_id="tools", system_len=500)
    b = TraceRequest(0.0, 900, 10, "b", prefix_id="s2", system_id="tools", system_len=500)
    pa, _ = streams.request_tokens(a)
    pb, _ = streams.request_tokens(b)
    assert pa[:500] == pb[:500] and pa[500:] != pb[500:]
    assert pa[:500] == streams.tokens("system:tools", 0, 500)
    assert pa[500:] == streams.tokens("prefix:s1", 500, 900)
    with pytest.raises(ValueError, match="system_id"):
        TraceRequest(0.0, 10, 1, "c", system_len=5)
    with pytest.raises(ValueError, match="system_len"):
        TraceRequest(0.0, 10, 1, "c", system_id="x", system_len=-1)


def test_shared_prefixes_have_equal_tokens() -> None:
    streams = TokenStreams(seed=7)
    a = TraceRequest(0.0, 3000, 10, "a", prefix_id="sys", prefix_len=2500)
    b = TraceRequest(1.0, 2600, 10, "b", prefix_id="sys", prefix_len=2500)
    c = TraceRequest(2.0, 2600, 10, "c")
    pa, _ = streams.request_tokens(a)
    pb, _ = streams.request_tokens(b)
    pc, _ = streams.request_tokens(c)
    assert pa[:2500] == pb[:2500]
    assert pa[2500:2600] != pb[2500:2600]
    assert pc[:2500] != pa[:2500]
    assert all(0 <= t < 256 for t in pa + pb + pc)
    # Same seed in another instance: same tokens; another seed: others.
    assert TokenStreams(seed=7).request_tokens(a) == streams.request_tokens(a)
    assert TokenStreams(seed=8).request_tokens(a) != streams.request_tokens(a)


def test_conversation_turns_contain_the_previous_answer() -> None:
    streams = TokenStreams()
    turn0 = TraceRequest(0.0, 300, 200, "t0", prefix_id="conv")
    turn1 = TraceRequest(5.0, 600, 100, "t1", prefix_id="conv")
    prompt0, answer0 = streams.request_tokens(turn0)
    prompt1, _ = streams.request_tokens(turn1)
    assert prompt1[:500] == prompt0 + answer0
    assert len(prompt0) == 300 and len(answer0) == 200 and len(prompt1) == 600


@settings(max_examples=budget(50), deadline=None)
@given(
    name=st.text("abc", min_size=1, max_size=3),
    start=st.integers(0, 3 * STREAM_CHUNK),
    length=st.integers(0, 2 * STREAM_CHUNK),
    longer=st.integers(0, STREAM_CHUNK),
)
def test_streams_are_prefix_stable(name: str, start: int, length: int, longer: int) -> None:
    """Any slice of a stream equals the same slice of a longer read, whatever the chunk
    boundaries (token IDs do not depend on how much was asked for)."""
    streams = TokenStreams(seed=1, cache_chunks=1)
    short = streams.tokens(name, start, start + length)
    full = TokenStreams(seed=1).tokens(name, 0, start + length + longer)
    assert short == full[start : start + length]
    assert len(short) == length


requests_st = st.builds(
    TraceRequest,
    arrival=st.floats(0, 1e5, allow_nan=False, allow_infinity=False),
    prompt_len=st.integers(1, 100_000),
    output_len=st.integers(1, 10_000),
    request_id=st.text("xyz0123456789-", min_size=1, max_size=8),
    prefix_id=st.one_of(st.none(), st.text("pq", min_size=1, max_size=3)),
    prefix_len=st.one_of(st.none(), st.integers(0, 100_000)),
    system_id=st.one_of(st.none(), st.text("st", min_size=1, max_size=3)),
)


@settings(max_examples=budget(50), deadline=None)
@given(st.lists(requests_st, max_size=20, unique_by=lambda r: r.request_id))
def test_jsonl_round_trip(requests: list[TraceRequest]) -> None:
    requests.sort(key=lambda r: r.arrival)
    trace = Trace("mine", tuple(requests), {"seed": 3})
    lines = [json.dumps({"_trace": {"name": "mine", "seed": 3}})]
    lines += [json.dumps(r.to_json()) for r in requests]
    back = parse_jsonl(lines)
    assert back.name == "mine" and back.params == {"seed": 3}
    assert len(back.requests) == len(requests)
    for a, b in zip(back.requests, trace.requests, strict=True):
        assert b.request_id == a.request_id
        assert a.arrival == pytest.approx(b.arrival, abs=1e-6)
        assert (a.prompt_len, a.output_len, a.prefix_id) == (
            b.prompt_len,
            b.output_len,
            b.prefix_id,
        )
        assert a.prefix_len == (b.prefix_len if b.prefix_id is not None else None)
        assert (a.system_id, a.system_len) == (b.system_id, b.system_len)


def test_outputs_cut_to_a_maximum() -> None:
    trace = prefix_trace(num_requests=40, seed=3)
    cut = trace.with_max_output(1)
    assert [r.output_len for r in cut.requests] == [1] * 40
    assert [(r.arrival, r.prompt_len, r.prefix_id, r.prefix_len) for r in cut.requests] == [
        (r.arrival, r.prompt_len, r.prefix_id, r.prefix_len) for r in trace.requests
    ]
    some = trace.with_max_output(200)
    assert [r.output_len for r in some.requests] == [min(r.output_len, 200) for r in trace.requests]
    assert any(r.output_len > 200 for r in trace.requests)
    assert some.params["max_output"] == 200
    with pytest.raises(ValueError, match="max_output"):
        trace.with_max_output(0)


def test_jsonl_files(tmp_path: Path) -> None:
    trace = prefix_trace(num_requests=50, seed=9)
    path = write_jsonl(trace, tmp_path / "t.jsonl")
    back = read_jsonl(path)
    assert back == trace
    assert load_trace(str(path)) == trace
    assert len(load_trace(str(path), num_requests=10)) == 10
    # A hand-written file: ids, prefix fields and blank lines optional, any order.
    hand = tmp_path / "hand.jsonl"
    hand.write_text(
        '{"arrival": 2.5, "prompt_len": 100, "output_len": 5}\n\n'
        '{"arrival": 0, "prompt_len": 900, "output_len": 50, "prefix_id": 7, "prefix_len": 800}\n'
    )
    mine = read_jsonl(hand)
    assert mine.name == "hand"
    assert [r.request_id for r in mine.requests] == ["r3", "r1"]
    assert mine.requests[0].prefix_id == "7" and mine.requests[0].prefix_len == 800


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 1"),
        ('{"arrival": 0, "prompt_len": 5}', "missing 'output_len'"),
        ('{"arrival": -1, "prompt_len": 5, "output_len": 5}', "negative"),
        ('{"arrival": 0, "prompt_len": 0, "output_len": 5}', "prompt_len"),
        ('{"arrival": 0, "prompt_len": 5.5, "output_len": 5}', "prompt_len"),
        ('{"arrival": 0, "prompt_len": 5, "output_len": 5, "colour": 1}', "unknown keys"),
        ('{"arrival": 0, "prompt_len": 5, "output_len": 5, "prefix_len": -2}', "prefix_len"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_bad_jsonl_lines(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_jsonl([line])


def test_duplicate_ids_and_unknown_kinds(tmp_path: Path) -> None:
    line = '{"id": "x", "arrival": 0, "prompt_len": 5, "output_len": 5}'
    with pytest.raises(ValueError, match="duplicate"):
        parse_jsonl([line, line])
    with pytest.raises(ValueError, match="unknown trace kind"):
        make_trace("bursty")
    with pytest.raises(FileNotFoundError):
        load_trace(str(tmp_path / "nope.jsonl"))
