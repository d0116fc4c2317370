#!/usr/bin/env python
"""Scheduler-side KV work per step: vLLM's ``KVCacheManager`` on each layout, one request mix.

vLLM 0.32's own ``KVCacheManager`` (coordinator, single-type managers and pool) is built by
the simulator's engine builder (:func:`hybrid_alloc.integration.simulator.build_engine`, the
sizing the engine core runs) for a full-size shipped config on four layouts:

* **stock**: vLLM's shared pool, its Python ``BlockPool``;
* **drop-in**: the same layout on this package's Rust pool (``HYBRID_ALLOC_PER_GROUP_POOLS=0``);
* **static**: per-group pools, the static split (``HYBRID_ALLOC_ELASTIC_POOLS=0``);
* **elastic**: per-group pools over one byte budget (the default).

The same requests are driven through each, as vLLM's scheduler calls the manager: every
request's prefill (prefix lookup; ``allocate_slots`` for its first chunk with the
scheduler's arguments for a waiting request, whole-prompt admission gate and watermark
included, and for each later chunk as for a running request; its block IDs for the
scheduler output), then ``--decode-steps`` steps in which every request decodes one token
(``allocate_slots`` for one slot, the new blocks' IDs, the step's new block IDs for
zeroing), then every request freed. In each round (``--rounds``) the layouts are built side
by side and run interleaved, phase by phase and in turns of decode steps
(``DECODE_STEPS_PER_TURN``; the order rotating, each layout's hooks installed while it
runs), so machine noise hits all of them;
each figure is the median over rounds. The cyclic GC is off inside timed phases (vLLM's
engine freezes its long-lived objects). Decode figures are per step and per running
request; ratios are stock's time over the layout's (above 1: faster than stock), and
*mix x* is that ratio over the whole mix (prefill, every decode step, free).
``--profile`` prints where one elastic decode phase spends its time, by function.

    python benches/bench_manager.py                       # Qwen3.5-27B-shaped, 'none' mode
    python benches/bench_manager.py --config falcon-h1-7b --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

LAYOUTS = {"stock": "stock", "drop-in": "drop-in", "static": "per-group", "elastic": "elastic"}

# Decode steps a layout runs before the next layout's turn. Installing a layout's hooks
# re-patches vLLM's classes, and the steps right after run slower (CPython's attribute
# caches start over): switching at every step measured elastic's decode step at 1.76 us
# per running request on Falcon-H1-7B against 0.81 us timed alone, a cost the engine,
# which installs its hooks once, never pays. Turns of a few milliseconds still share
# machine noise between the layouts.
DECODE_STEPS_PER_TURN = 16


@dataclass
class Timings:
    prefill_s: list[float] = field(default_factory=list)
    decode_step_s: list[float] = field(default_factory=list)
    free_s: list[float] = field(default_factory=list)
    blocks_per_request: float = 0.0
    prefix_hit_tokens: int = 0


@contextmanager
def _gc_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def request_mix(
    num_requests: int, num_prefixes: int, prefix_len: int, suffix: tuple[int, int], seed: int
) -> list[list[int]]:
    """Prompts: one of ``num_prefixes`` shared prefixes, then a request's own tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        prefixes[i % num_prefixes] + [rng.randrange(1, 30_000) for _ in range(rng.randint(*suffix))]
        for i in range(num_requests)
    ]


def _requests(engine: Any, prompts: Sequence[list[int]], decode_steps: int) -> list[Any]:
    from hybrid_alloc.integration.simulator import SimRequest
    from hybrid_alloc.integration.simulator.run import _vllm_request

    out = []
    for i, prompt in enumerate(prompts):
        sim = SimRequest(
            request_id=f"r{i}",
            arrival_step=0,
            prompt_token_ids=prompt,
            output_token_ids=[7] * (decode_steps + 1),
            arrival_s=0.0,
        )
        out.append(_vllm_request(engine, sim, 0.0))
    return out


class MixRun:
    """The request mix on one layout's manager, phase by phase (each phase timed)."""

    def __init__(self, name: str, engine: Any, prompts: Sequence[list[int]], steps: int) -> None:
        self.name = name
        self.engine = engine
        self.manager = engine.scheduler.kv_cache_manager
        self.requests = _requests(engine, prompts, steps)
        self.prefix_hit_tokens = 0

    def prefill(self) -> float:
        from vllm.v1.request import RequestStatus

        manager = self.manager
        full_sequence_must_fit = self.engine.scheduler.scheduler_reserve_full_isl
        admitted = 0
        t0 = time.perf_counter()
        for req in self.requests:
            computed, num_hit = manager.get_computed_blocks(req)[:2]
            self.prefix_hit_tokens += num_hit
            while req.num_computed_tokens < req.num_tokens:
                # One prefill chunk per scheduler step (vLLM batches several requests'
                # chunks in a step; the manager's calls are the same).
                self.new_step()
                n = self.chunk(req, req.num_tokens - req.num_computed_tokens - num_hit, num_hit)
                if req.status == RequestStatus.RUNNING:
                    # A later chunk: the scheduler's call for a running request.
                    new = manager.allocate_slots(req, n, num_lookahead_tokens=0)
                else:
                    # The scheduler's call for a waiting request, with its arguments: the
                    # whole-prompt admission gate (`scheduler_reserve_full_isl`, on by
                    # default) and the watermark once other requests run.
                    new = manager.allocate_slots(
                        req,
                        n,
                        num_new_computed_tokens=num_hit,
                        new_computed_blocks=computed,
                        num_lookahead_tokens=0,
                        num_external_computed_tokens=0,
                        delay_cache_blocks=False,
                        skip_zeroing_group_ids=(),
                        num_encoder_tokens=0,
                        full_sequence_must_fit=full_sequence_must_fit,
                        reserved_blocks=0,
                        has_scheduled_reqs=admitted > 0,
                    )
                    req.status = RequestStatus.RUNNING  # admitted, as the scheduler marks it
                    admitted += 1
                if new is None:
                    raise RuntimeError(
                        f"{self.name}: request {req.request_id} not admitted: the mix does "
                        "not fit the KV memory (raise --memory-gib)"
                    )
                req.num_computed_tokens += num_hit + n
                num_hit, computed = 0, None
            manager.get_blocks(req.request_id).get_block_ids()
            req.append_output_token_ids(7)
        manager.take_new_block_ids()
        return time.perf_counter() - t0

    def new_step(self) -> None:
        """What the scheduler tells the manager as a step starts (vLLM 0.32: blocks cached
        in this step are not hits for Mamba 'align' mode until the next)."""
        starts = getattr(self.manager, "new_step_starts", None)
        if starts is not None:
            starts()

    def chunk(self, req: Any, num_new: int, num_hit: int) -> int:
        """The prefill chunk vLLM's scheduler schedules: in Mamba 'align' mode it ends
        where a state is checkpointed (its ``_mamba_block_aligned_split``)."""
        scheduler = self.engine.scheduler
        if scheduler.cache_config.mamba_cache_mode != "align":
            return num_new
        return int(scheduler._mamba_block_aligned_split(req, num_new, num_hit))

    def decode_step(self) -> float:
        manager = self.manager
        t0 = time.perf_counter()
        self.new_step()
        for req in self.requests:
            new = manager.allocate_slots(req, 1, num_lookahead_tokens=0)
            if new is None:
                raise RuntimeError(
                    f"{self.name}: request {req.request_id} would be preempted: the mix does "
                    "not fit the KV memory (raise --memory-gib)"
                )
            new.get_block_ids(allow_none=True)
        manager.take_new_block_ids()
        elapsed = time.perf_counter() - t0
        # The model's part of the step: one token computed and one sampled per request.
        for req in self.requests:
            req.num_computed_tokens += 1
            req.append_output_token_ids(7)
        return elapsed

    def blocks_per_request(self) -> float:
        return statistics.mean(
            sum(len(ids) for ids in self.manager.get_block_ids(r.request_id)) for r in self.requests
        )

    def free(self) -> float:
        t0 = time.perf_counter()
        for req in self.requests:
            self.manager.free(req)
        return time.perf_counter() - t0


def run_round(runs: dict[str, MixRun], steps: int, timings: dict[str, Timings]) -> None:
    """One pass of the mix on every layout, interleaved phase by phase and step by step
    (the order rotating), each layout's own hooks installed while it runs."""
    from hybrid_alloc.integration.simulator import layout_installed

    names = list(runs)

    def each(k: int) -> list[str]:
        return names[k % len(names) :] + names[: k % len(names)]

    with _gc_off():
        for name in each(0):
            with layout_installed(LAYOUTS[name]):
                timings[name].prefill_s.append(runs[name].prefill())
        per_step: dict[str, list[float]] = {n: [] for n in names}
        for turn, first in enumerate(range(0, steps, DECODE_STEPS_PER_TURN)):
            for name in each(turn):
                with layout_installed(LAYOUTS[name]):
                    for _ in range(min(DECODE_STEPS_PER_TURN, steps - first)):
                        per_step[name].append(runs[name].decode_step())
        for name in names:
            t = timings[name]
            t.decode_step_s.append(statistics.median(per_step[name]))
            t.blocks_per_request = runs[name].blocks_per_request()
            t.prefix_hit_tokens = runs[name].prefix_hit_tokens
        for name in each(1):
            with layout_installed(LAYOUTS[name]):
                timings[name].free_s.append(runs[name].free())


def build(config: str, settings: Any, layout: str) -> Any:
    from hybrid_alloc.integration import simulator as sim
    from hybrid_alloc.planner import load_config
    from hybrid_alloc.vllm_specs import load_model_spec

    cfg = load_config(config)
    model = load_model_spec(cfg, settings.specs, dtype=settings.dtype)
    with sim.layout_installed(layout), sim.quiet_vllm(True):
        return sim.build_engine(cfg, model, settings, layout)


def profile_decode(engine: Any, prompts: Sequence[list[int]], steps: int, top: int) -> str:
    """Where one decode phase spends its time: the ``top`` functions by own time."""
    import io

    profiler = cProfile.Profile()
    manager = engine.scheduler.kv_cache_manager

    def profiled(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        # Looked up per call: the class's method is what the layout's hooks installed.
        allocate: Callable[..., Any] = type(manager).allocate_slots
        if num_new_tokens != 1:  # a prefill chunk (this driver decodes one token a step)
            return allocate(manager, request, num_new_tokens, *args, **kwargs)
        profiler.enable()
        try:
            return allocate(manager, request, num_new_tokens, *args, **kwargs)
        finally:
            profiler.disable()

    manager.allocate_slots = profiled
    run = MixRun("elastic", engine, prompts, steps)
    try:
        run_round({"elastic": run}, steps, {"elastic": Timings()})
    finally:
        del manager.allocate_slots
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="qwen3.5-27b", help="shipped config name or path")
    ap.add_argument("--memory-gib", type=float, default=80.0)
    ap.add_argument("--mamba-cache-mode", choices=("none", "align"), default="none")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prefixes", type=int, default=16, help="shared prefixes")
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix", default="256,1024", help="own tokens per request: MIN,MAX")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--profile", action="store_true", help="profile one elastic decode phase")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from hybrid_alloc.integration.simulator import SimSettings

    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown} (known: {', '.join(LAYOUTS)})")
    low, high = (int(x) for x in args.suffix.split(","))
    settings = SimSettings(
        memory=int(args.memory_gib * 2**30),
        mamba_cache_mode=args.mamba_cache_mode,
        max_num_seqs=args.requests,
        time_model="fixed",
    )
    prompts = request_mix(args.requests, args.prefixes, args.prefix_len, (low, high), args.seed)
    timings = {n: Timings() for n in names}
    notes: dict[str, str] = {}
    for _ in range(args.rounds):
        runs = {}
        for name in names:
            engine = build(args.config, settings, LAYOUTS[name])
            if engine.note:
                notes[name] = engine.note
            runs[name] = MixRun(name, engine, prompts, args.decode_steps)
        run_round(runs, args.decode_steps, timings)
        del runs
        gc.collect()

    tokens = sum(map(len, prompts))
    print(
        f"{args.config}, {args.memory_gib:g} GiB, mamba_cache_mode {args.mamba_cache_mode}: "
        f"{args.requests} requests ({tokens:,} prompt tokens, {args.prefixes} shared "
        f"{args.prefix_len}-token prefixes), {args.decode_steps} decode steps at "
        f"{args.requests} running; median of {args.rounds} rounds, layouts interleaved"
    )
    header = (
        f"{'layout':<9} {'blocks/req':>10} {'hit tokens':>10} {'prefill ms':>10} "
        f"{'decode ms/step':>14} {'us/req/step':>11} {'free ms':>8} "
        f"{'prefill x':>9} {'decode x':>8} {'free x':>7} {'mix x':>6}"
    )
    print(header)
    base = timings.get("stock")

    def medians(t: Timings) -> tuple[float, float, float]:
        pre, dec, fre = (statistics.median(v) for v in (t.prefill_s, t.decode_step_s, t.free_s))
        return pre, dec, fre

    def whole_mix(pre: float, dec: float, fre: float) -> float:
        """The mix's KV work: prefill, every decode step (at the median step), free."""
        return pre + args.decode_steps * dec + fre

    base_mix = whole_mix(*medians(base)) if base else None
    for name in names:
        t = timings[name]
        pre, dec, fre = medians(t)
        mix = f"{base_mix / whole_mix(pre, dec, fre):.2f}x" if base_mix else "-"

        def ratio(stock_values: list[float] | None, ours: float) -> str:
            return f"{statistics.median(stock_values) / ours:.2f}x" if stock_values else "-"

        print(
            f"{name:<9} {t.blocks_per_request:>10.1f} {t.prefix_hit_tokens:>10,} "
            f"{pre * 1e3:>10.1f} {dec * 1e3:>14.3f} {dec / args.requests * 1e6:>11.2f} "
            f"{fre * 1e3:>8.2f} {ratio(base.prefill_s if base else None, pre):>9} "
            f"{ratio(base.decode_step_s if base else None, dec):>8} "
            f"{ratio(base.free_s if base else None, fre):>7} {mix:>6}"
        )
    for name, note in notes.items():
        print(f"  {name}: {note}")
    if args.profile:
        engine = build(args.config, settings, LAYOUTS["elastic"])
        print("\nProfile of one elastic decode phase (allocate_slots calls only):")
        print(profile_decode(engine, prompts, args.decode_steps, 25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
