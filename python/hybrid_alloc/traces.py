"""Request traces for the serving simulation: generators, JSONL files, token IDs.

Pure Python (no vLLM): a trace is a list of :class:`TraceRequest`, each with an arrival time
in seconds, a prompt length, an output length (the request runs with ``ignore_eos``, so it
produces exactly that many tokens unless ``max_model_len`` caps it) and, optionally, a
shared-prefix id.

**Token IDs** are derived, not stored. Every request reads its tokens (prompt, then output)
from deterministic *streams*: position ``i`` of a request comes from the stream of its
``system_id`` while ``i < system_len`` (a system prompt shared across prefixes), then from
the stream of its ``prefix_id`` while ``i < prefix_len``, and from the request's own stream
after that. A
stream is a sequence of bytes seeded by ``(token_seed, stream name)``, produced in fixed
4096-token chunks so that any prefix of a stream is the same whatever length is asked for.
Two requests that share a ``prefix_id`` therefore have equal tokens (and equal block hashes)
over their common prefix. ``prefix_len`` left out (``None``) means the whole request, its
output included, reads the shared stream: that is a multi-turn conversation, where turn
``k + 1`` re-sends turn ``k``'s prompt and answer and adds a new message. The fake model of
the simulator "samples" exactly these output tokens, so the next turn's prompt really
contains the previous answer. Token IDs lie in 0..255 (the scheduler only hashes them).

**JSONL** (:func:`write_jsonl`, :func:`read_jsonl`): one JSON object per line with keys
``arrival`` (seconds, float), ``prompt_len`` and ``output_len`` (positive integers), and
optional ``id`` (string, default ``r<line number>``), ``prefix_id`` (string),
``prefix_len`` (integer >= 0), ``system_id`` (string) and ``system_len`` (integer >= 0).
A first line with the key ``_trace`` carries the generator's name and parameters and is
skipped on reading (so are blank lines).

**Generators** (all seeded; arrivals a Poisson process of ``rate`` requests per second
unless said otherwise):

* :func:`chat_trace`: independent chat turns; prompt lengths log-normal with median 256
  and sigma 1.0 (clipped to 16..4096), output lengths log-normal with median 200 and
  sigma 0.8 (clipped to 8..1024);
* :func:`long_trace`: long documents; prompts uniform in 8192..32768 tokens, outputs
  log-normal with median 256 and sigma 0.5 (clipped to 32..1024);
* :func:`prefix_trace`: prefix sharing; half the requests put a short question
  (log-normal, median 128, sigma 0.8, 8..1024) after one of 8 system prompts (log-uniform
  1024..4096 tokens, the ``prefix_len``), the other half are turns of multi-turn
  conversations (2 to 6 turns; first message median 256, later messages median 128,
  answers median 200; each turn re-sends the whole conversation so far), the next turn
  arriving 5 to 20 seconds (uniform) after the previous one. Arrivals are open-loop: if
  the simulated answer to turn ``k`` is not finished when turn ``k + 1`` arrives, that part
  of the prompt is simply not cached yet;
* :func:`reasoning_trace`: a reasoning model's traffic; requests arrive in *waves* of
  ``wave_size`` (default 32; arrivals spread uniformly over the first 2 seconds of a wave,
  a wave every ``wave_size / rate`` seconds); questions log-normal (median 384, sigma 1.0,
  16..8192 tokens); 40% of the requests put their question after one of 2 system prompts
  (log-uniform 1536..3072 tokens); outputs heavy-tailed: log-normal with median 2,400 and
  sigma 0.8, clipped to 1,024..16,384 tokens (mean about 3.3k; a few percent reach 10k);
* :func:`agentic_trace`: agent sessions that call tools; a session runs 3 to 12 turns
  (uniform); every session starts with one of 2 tool-definition system prompts
  (log-uniform 2048..6144 tokens, shared by all sessions, ``system_id``) and a task
  (median 512); each turn's answer is a short tool call or reply (log-normal, median 160,
  sigma 0.8, 16..2048), and the next turn re-sends the whole session so far plus the tool's
  result (log-normal, median 768, sigma 1.0, 16..16384), so the context grows turn by turn
  and every turn's prompt begins with the previous turn's tokens; the next turn arrives 1
  to 6 seconds (uniform) after the previous one (open-loop, as :func:`prefix_trace`);
  sessions start as a Poisson process of ``rate / mean turns`` per second.
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

TRACE_KINDS = ("chat", "long", "prefix", "reasoning", "agentic")
STREAM_CHUNK = 4096
"""Tokens per generated chunk of a stream (streams are prefix-stable across lengths)."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival: seconds after the start of the trace.
        prompt_len: prompt tokens.
        output_len: tokens the request generates (``ignore_eos``).
        request_id: unique within the trace.
        prefix_id: name of the shared token stream the request starts with (None: none).
        prefix_len: tokens read from the shared stream (None with a ``prefix_id``: the
            whole request, output included; ignored without one).
        system_id: name of a system-prompt stream read before the ``prefix_id`` stream
            (None: none); lets requests of different prefixes (agent sessions) share it.
        system_len: tokens read from the system stream (0 without a ``system_id``).
    """

    arrival: float
    prompt_len: int
    output_len: int
    request_id: str
    prefix_id: str | None = None
    prefix_len: int | None = None
    system_id: str | None = None
    system_len: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival, (int, float)) and math.isfinite(self.arrival)):
            raise ValueError(f"request {self.request_id!r}: arrival must be a finite number")
        if self.arrival < 0:
            raise ValueError(f"request {self.request_id!r}: arrival must not be negative")
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"request {self.request_id!r}: {name} must be a positive int")
        if self.prefix_len is not None and (
            not isinstance(self.prefix_len, int)
            or isinstance(self.prefix_len, bool)
            or self.prefix_len < 0
        ):
            raise ValueError(f"request {self.request_id!r}: prefix_len must be an int >= 0")
        if (
            not isinstance(self.system_len, int)
            or isinstance(self.system_len, bool)
            or self.system_len < 0
        ):
            raise ValueError(f"request {self.request_id!r}: system_len must be an int >= 0")
        if self.system_len and self.system_id is None:
            raise ValueError(f"request {self.request_id!r}: system_len needs a system_id")
        if not self.request_id:
            raise ValueError("request_id must not be empty")

    def system_tokens(self) -> int:
        """Tokens (prompt and output) read from the system stream."""
        if self.system_id is None:
            return 0
        return min(self.system_len, self.prompt_len + self.output_len)

    def shared_tokens(self) -> int:
        """Tokens (prompt and output) read from the system and shared streams."""
        total = self.prompt_len + self.output_len
        if self.prefix_id is None:
            return self.system_tokens()
        shared = total if self.prefix_len is None else min(self.prefix_len, total)
        return max(shared, self.system_tokens())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.request_id,
            "arrival": float(self.arrival),
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
        }
        if self.prefix_id is not None:
            out["prefix_id"] = self.prefix_id
            if self.prefix_len is not None:
                out["prefix_len"] = self.prefix_len
        if self.system_id is not None:
            out["system_id"] = self.system_id
            out["system_len"] = self.system_len
        return out


@dataclass(frozen=True)
class Trace:
    """A named, ordered (by arrival) list of requests."""

    name: str
    requests: tuple[TraceRequest, ...]
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            dupes = sorted({i for i in ids if ids.count(i) > 1})[:5]
            raise ValueError(f"trace {self.name!r}: duplicate request ids {dupes}")

    def __len__(self) -> int:
        return len(self.requests)

    def with_max_output(self, max_output: int) -> Trace:
        """The same requests with each output cut to at most ``max_output`` tokens
        (``1``: a P/D prefill instance's traffic, whose requests end at their first
        token; prompts, arrivals and shared prefixes stay as they are)."""
        if max_output < 1:
            raise ValueError(f"trace {self.name!r}: max_output must be at least 1")
        requests = tuple(
            replace(r, output_len=min(r.output_len, max_output)) for r in self.requests
        )
        return Trace(self.name, requests, {**self.params, "max_output": max_output})

    def describe(self) -> str:
        n = len(self.requests)
        if not n:
            return f"{self.name}: empty"
        prompt = sum(r.prompt_len for r in self.requests)
        output = sum(r.output_len for r in self.requests)
        span = max(r.arrival for r in self.requests)
        shared = sum(1 for r in self.requests if r.prefix_id is not None)
        return (
            f"{self.name}: {n} requests over {span:.1f} s, prompts {prompt:,} tokens "
            f"(mean {prompt / n:,.0f}), outputs {output:,} (mean {output / n:,.0f}), "
            f"{shared} with a shared prefix"
        )


# --------------------------------------------------------------------------- token IDs


class TokenStreams:
    """Deterministic token streams (see the module doc), with a small chunk cache."""

    def __init__(self, seed: int = 0, cache_chunks: int = 4096) -> None:
        self.seed = seed
        self._cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._limit = cache_chunks

    def _chunk(self, name: str, index: int) -> bytes:
        key = (name, index)
        chunk = self._cache.get(key)
        if chunk is None:
            # A str seed is hashed with SHA-512 by `random`: stable across processes.
            chunk = random.Random(f"{self.seed}/{name}/{index}").randbytes(STREAM_CHUNK)
            self._cache[key] = chunk
            if len(self._cache) > self._limit:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return chunk

    def tokens(self, name: str, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop`` (exclusive) of stream ``name``."""
        out: list[int] = []
        pos = start
        while pos < stop:
            index, offset = divmod(pos, STREAM_CHUNK)
            take = min(stop - pos, STREAM_CHUNK - offset)
            out.extend(self._chunk(name, index)[offset : offset + take])
            pos += take
        return out

    def request_tokens(self, request: TraceRequest) -> tuple[list[int], list[int]]:
        """(prompt token IDs, output token IDs) of ``request``."""
        total = request.prompt_len + request.output_len
        system = request.system_tokens()
        shared = request.shared_tokens()
        seq: list[int] = []
        if system:
            assert request.system_id is not None
            seq = self.tokens("system:" + request.system_id, 0, system)
        if shared > system:
            assert request.prefix_id is not None
            seq += self.tokens("prefix:" + request.prefix_id, system, shared)
        if shared < total:
            seq += self.tokens("request:" + request.request_id, shared, total)
        return seq[: request.prompt_len], seq[request.prompt_len :]


# --------------------------------------------------------------------------- generators


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    t = 0.0
    out = []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def chat_trace(num_requests: int = 1000, rate: float = 40.0, seed: int = 0) -> Trace:
    """Independent chat turns (see the module doc for the distributions)."""
    rng = random.Random(f"chat/{seed}")
    requests = tuple(
        TraceRequest(
            arrival=t,
            prompt_len=_lognormal(rng, 256, 1.0, 16, 4096),
            output_len=_lognormal(rng, 200, 0.8, 8, 1024),
            request_id=f"chat-{i}",
        )
        for i, t in enumerate(_arrivals(rng, num_requests, rate))
    )
    return Trace("chat", requests, {"num_requests": num_requests, "rate": rate, "seed": seed})


def long_trace(num_requests: int = 64, rate: float = 2.0, seed: int = 0) -> Trace:
    """Long documents: 8k-32k-token prompts, short answers."""
    rng = random.Random(f"long/{seed}")
    requests = tuple(
        TraceRequest(
            arrival=t,
            prompt_len=rng.randint(8192, 32768),
            output_len=_lognormal(rng, 256, 0.5, 32, 1024),
            request_id=f"long-{i}",
        )
        for i, t in enumerate(_arrivals(rng, num_requests, rate))
    )
    return Trace("long", requests, {"num_requests": num_requests, "rate": rate, "seed": seed})


def prefix_trace(
    num_requests: int = 1000,
    rate: float = 40.0,
    seed: int = 0,
    num_system_prompts: int = 8,
    think_time: tuple[float, float] = (5.0, 20.0),
) -> Trace:
    """System prompts shared by many requests, and multi-turn conversations that re-send
    their history (see the module doc). About half the requests are of each kind; a
    conversation's next turn arrives ``think_time`` (uniform, seconds) after the last."""
    rng = random.Random(f"prefix/{seed}")
    systems = [
        round(math.exp(rng.uniform(math.log(1024), math.log(4096))))
        for _ in range(num_system_prompts)
    ]
    out: list[TraceRequest] = []
    starts = _arrivals(rng, num_requests, rate)
    conv = 0
    i = 0
    budget = num_requests
    while budget > 0:
        start = starts[i] if i < len(starts) else starts[-1]
        i += 1
        # A conversation has 4 turns on average: 4 system requests to 1 conversation
        # makes about half the requests of each kind.
        if rng.random() < 0.8:
            k = rng.randrange(num_system_prompts)
            question = _lognormal(rng, 128, 0.8, 8, 1024)
            out.append(
                TraceRequest(
                    arrival=start,
                    prompt_len=systems[k] + question,
                    output_len=_lognormal(rng, 200, 0.8, 8, 1024),
                    request_id=f"sys{k}-{len(out)}",
                    prefix_id=f"system-{k}",
                    prefix_len=systems[k],
                )
            )
            budget -= 1
            continue
        turns = min(budget, rng.randint(2, 6))
        history = 0
        t = start
        for turn in range(turns):
            message = _lognormal(rng, 256 if turn == 0 else 128, 0.8, 8, 2048)
            answer = _lognormal(rng, 200, 0.8, 8, 1024)
            out.append(
                TraceRequest(
                    arrival=t,
                    prompt_len=history + message,
                    output_len=answer,
                    request_id=f"conv{conv}-turn{turn}",
                    prefix_id=f"conversation-{conv}",
                )
            )
            history += message + answer
            t += rng.uniform(*think_time)
        conv += 1
        budget -= turns
    out.sort(key=lambda r: r.arrival)
    params = {
        "num_requests": num_requests,
        "rate": rate,
        "seed": seed,
        "num_system_prompts": num_system_prompts,
        "think_time": list(think_time),
    }
    return Trace("prefix", tuple(out), params)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def reasoning_trace(
    num_requests: int = 160,
    rate: float = 1.0,
    seed: int = 0,
    wave_size: int = 32,
    num_system_prompts: int = 2,
    shared_fraction: float = 0.4,
) -> Trace:
    """A reasoning model's traffic (see the module doc): long heavy-tailed outputs, shared
    system prompts, requests arriving in waves of ``wave_size``, ``rate`` per second on
    average."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if wave_size < 1:
        raise ValueError(f"wave_size must be positive, got {wave_size}")
    rng = random.Random(f"reasoning/{seed}")
    systems = [_log_uniform(rng, 1536, 3072) for _ in range(num_system_prompts)]
    period = wave_size / rate
    out: list[TraceRequest] = []
    for i in range(num_requests):
        wave, slot = divmod(i, wave_size)
        # The wave's first request opens it; the others follow within 2 seconds.
        arrival = wave * period + (0.0 if slot == 0 else rng.uniform(0.0, min(2.0, period)))
        question = _lognormal(rng, 384, 1.0, 16, 8192)
        output = _lognormal(rng, 2400, 0.8, 1024, 16384)
        if rng.random() < shared_fraction:
            k = rng.randrange(num_system_prompts)
            request = TraceRequest(
                arrival=arrival,
                prompt_len=systems[k] + question,
                output_len=output,
                request_id=f"reason-{i}",
                prefix_id=f"system-{k}",
                prefix_len=systems[k],
            )
        else:
            request = TraceRequest(arrival, question, output, f"reason-{i}")
        out.append(request)
    out.sort(key=lambda r: r.arrival)
    params = {
        "num_requests": num_requests,
        "rate": rate,
        "seed": seed,
        "wave_size": wave_size,
        "num_system_prompts": num_system_prompts,
        "shared_fraction": shared_fraction,
    }
    return Trace("reasoning", tuple(out), params)


def agentic_trace(
    num_requests: int = 240,
    rate: float = 4.0,
    seed: int = 0,
    num_system_prompts: int = 2,
    turns: tuple[int, int] = (3, 12),
    tool_time: tuple[float, float] = (1.0, 6.0),
) -> Trace:
    """Agent sessions whose context grows turn by turn and is re-sent as the next turn's
    prefix (see the module doc); ``rate`` requests (turns) per second on average."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    low, high = turns
    if not 1 <= low <= high:
        raise ValueError(f"turns must be 1 <= low <= high, got {turns}")
    rng = random.Random(f"agentic/{seed}")
    systems = [_log_uniform(rng, 2048, 6144) for _ in range(num_system_prompts)]
    session_rate = rate / ((low + high) / 2)
    out: list[TraceRequest] = []
    budget = num_requests
    session = 0
    start = 0.0
    while budget > 0:
        k = rng.randrange(num_system_prompts)
        count = min(budget, rng.randint(low, high))
        context = systems[k] + _lognormal(rng, 512, 0.8, 16, 4096)
        t = start
        for turn in range(count):
            answer = _lognormal(rng, 160, 0.8, 16, 2048)
            out.append(
                TraceRequest(
                    arrival=t,
                    prompt_len=context,
                    output_len=answer,
                    request_id=f"agent{session}-turn{turn}",
                    prefix_id=f"session-{session}",
                    system_id=f"tools-{k}",
                    system_len=systems[k],
                )
            )
            # The next turn re-sends everything so far plus the tool's result.
            context += answer + _lognormal(rng, 768, 1.0, 16, 16384)
            t += rng.uniform(*tool_time)
        session += 1
        budget -= count
        start += rng.expovariate(session_rate)
    out.sort(key=lambda r: r.arrival)
    params = {
        "num_requests": num_requests,
        "rate": rate,
        "seed": seed,
        "num_system_prompts": num_system_prompts,
        "turns": list(turns),
        "tool_time": list(tool_time),
    }
    return Trace("agentic", tuple(out), params)


def make_trace(
    kind: str, num_requests: int | None = None, rate: float | None = None, seed: int = 0
) -> Trace:
    """One of :data:`TRACE_KINDS` with its defaults unless ``num_requests`` / ``rate`` are
    given."""
    generators = {
        "chat": chat_trace,
        "long": long_trace,
        "prefix": prefix_trace,
        "reasoning": reasoning_trace,
        "agentic": agentic_trace,
    }
    if kind not in generators:
        raise ValueError(f"unknown trace kind {kind!r}; known: {', '.join(TRACE_KINDS)}")
    kwargs: dict[str, Any] = {"seed": seed}
    if num_requests is not None:
        kwargs["num_requests"] = num_requests
    if rate is not None:
        kwargs["rate"] = rate
    return generators[kind](**kwargs)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- JSONL


def write_jsonl(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as JSONL (a ``_trace`` header line, then one request a line)."""
    path = Path(path)
    lines = [json.dumps({"_trace": {"name": trace.name, **trace.params}}, sort_keys=True)]
    lines += [json.dumps(r.to_json(), sort_keys=True) for r in trace.requests]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _request_from_json(obj: Any, index: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    known = {"id", "arrival", "prompt_len", "output_len", "prefix_id", "prefix_len"}
    unknown = set(obj) - known - {"system_id", "system_len"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    for key in ("arrival", "prompt_len", "output_len"):
        if key not in obj:
            raise ValueError(f"missing {key!r}")
    prefix_id = obj.get("prefix_id")
    if prefix_id is not None and not isinstance(prefix_id, str):
        prefix_id = str(prefix_id)
    system_id = obj.get("system_id")
    if system_id is not None and not isinstance(system_id, str):
        system_id = str(system_id)
    return TraceRequest(
        arrival=float(obj["arrival"]),
        prompt_len=obj["prompt_len"],
        output_len=obj["output_len"],
        request_id=str(obj.get("id", f"r{index}")),
        prefix_id=prefix_id,
        prefix_len=obj.get("prefix_len"),
        system_id=system_id,
        system_len=obj.get("system_len", 0),
    )


def parse_jsonl(lines: Iterable[str], name: str = "file") -> Trace:
    """Parse JSONL lines (see the module doc). Requests are ordered by arrival (stable).

    Raises:
        ValueError: a line is not valid JSON or not a valid request (names the line).
    """
    requests: list[TraceRequest] = []
    params: dict[str, Any] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, dict) and "_trace" in obj:
                meta = obj["_trace"]
                if isinstance(meta, dict):
                    params = dict(meta)
                continue
            requests.append(_request_from_json(obj, lineno))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{name}, line {lineno}: {exc}") from exc
    requests.sort(key=lambda r: r.arrival)
    trace_name = str(params.pop("name", name))
    return Trace(trace_name, tuple(requests), params)


def read_jsonl(path: str | Path) -> Trace:
    """Read a trace written by :func:`write_jsonl` or by hand."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        return parse_jsonl(f, name=path.stem)


def load_trace(
    spec: str, num_requests: int | None = None, rate: float | None = None, seed: int = 0
) -> Trace:
    """A generator's name (:data:`TRACE_KINDS`) or a JSONL file's path."""
    if spec in TRACE_KINDS:
        return make_trace(spec, num_requests=num_requests, rate=rate, seed=seed)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"{spec!r} is neither a trace kind ({', '.join(TRACE_KINDS)}) nor a JSONL file"
        )
    trace = read_jsonl(path)
    if num_requests is not None:
        trace = Trace(trace.name, trace.requests[:num_requests], trace.params)
    return trace


def summary(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Counts and means of a list of requests (for reports)."""
    n = len(requests)
    return {
        "requests": n,
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "mean_prompt": sum(r.prompt_len for r in requests) / n if n else 0.0,
        "mean_output": sum(r.output_len for r in requests) / n if n else 0.0,
        "span_s": max((r.arrival for r in requests), default=0.0),
    }
