"""Requests from a trace, the step loop on vLLM's scheduler (charged by the step-time model),
and `simulate` / `run_layout`, the entry points."""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybrid_alloc.integration import versions
from hybrid_alloc.integration.simulator.engine import (
    SimEngine,
    build_engine,
    default_max_model_len,
    engine_heap_frozen,
    layout_installed,
    quiet_vllm,
)
from hybrid_alloc.integration.simulator.records import (
    DEFAULT_LAYOUTS,
    LayoutResult,
    SimRequest,
    SimResult,
    SimSettings,
)
from hybrid_alloc.model_specs import (
    ModelSpec,
)
from hybrid_alloc.planner import load_config
from hybrid_alloc.step_time import H100, StepCost
from hybrid_alloc.traces import TokenStreams, Trace, TraceRequest
from hybrid_alloc.vllm_specs import load_model_spec

# --------------------------------------------------------------------------- requests


def requests_from_trace(
    trace: Trace | Sequence[TraceRequest],
    step_ms: float,
    max_model_len: int,
    token_seed: int = 0,
) -> tuple[list[SimRequest], int]:
    """Token IDs and arrival steps for every request. A request longer than
    ``max_model_len`` keeps its output and has its prompt cut to ``max_model_len`` minus
    the output, but never below half of ``max_model_len`` (vLLM then caps the output).
    Returns the requests and how many prompts were cut."""
    streams = TokenStreams(token_seed)
    items = trace.requests if isinstance(trace, Trace) else tuple(trace)
    out: list[SimRequest] = []
    clipped = 0
    step_s = step_ms / 1000.0
    for r in items:
        prompt, output = streams.request_tokens(r)
        cap = max(max_model_len // 2, max_model_len - len(output))
        if len(prompt) > cap:
            prompt = prompt[:cap]
            clipped += 1
        out.append(
            SimRequest(
                request_id=r.request_id,
                arrival_step=math.floor(r.arrival / step_s + 1e-9),
                prompt_token_ids=prompt,
                output_token_ids=output,
                arrival_s=float(r.arrival),
            )
        )
    return out, clipped


def _vllm_request(engine: SimEngine, req: SimRequest, arrival_s: float) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=len(req.output_token_ids), ignore_eos=True, temperature=0.0)
    return Request(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_s,
        block_hasher=engine.block_hasher,
    )


def fake_model_output(
    scheduler: Any, scheduler_output: Any, outputs: Mapping[str, list[int]]
) -> Any:
    """The ``ModelRunnerOutput`` a model runner returns for ``scheduler_output``: one
    token for every scheduled request whose computed tokens reach its end (vLLM's
    runners discard the sample of a partial prefill), the token ``outputs`` prescribes."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        partial = getattr(request, "is_prefill_chunk", None)
        if partial is None:
            partial = request.num_computed_tokens < request.num_tokens
        if partial:
            sampled.append([])
            continue
        tokens = outputs[req_id]
        # The step computes up to position ``num_computed_tokens`` (the scheduler has
        # advanced it) and samples the output token after it. Under the async scheduler
        # the previous step's token may not have reached the request yet, so its output
        # count can lag; its computed count does not.
        index = request.num_computed_tokens - request.num_prompt_tokens
        sampled.append([tokens[index] if 0 <= index < len(tokens) else 0])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


# --------------------------------------------------------------------------- run


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {
        "mean": sum(ordered) / len(ordered),
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p99": pick(0.99),
        "max": float(ordered[-1]),
    }


def run_engine(
    engine: SimEngine,
    requests: Sequence[SimRequest],
    step_ms: float,
    waves: bool = False,
    max_steps: int | None = None,
    on_step: Callable[[SimEngine, Any], None] | None = None,
    step_cost: StepCost | None = None,
) -> LayoutResult:
    """Run ``requests`` through ``engine`` until all finished.

    Every step costs ``step_cost.seconds`` of what it computes, or ``step_ms`` without a
    ``step_cost`` (see the module doc). With ``waves``, ``arrival_step`` is a wave number
    instead: a wave arrives once the scheduler has nothing left to do (as
    ``LLM.generate()`` called once per wave does). ``on_step(engine, scheduler_output)``
    runs after every step.
    """
    return _run_to_end(
        engine_steps(engine, requests, step_ms, waves, max_steps, on_step, step_cost)
    )


def _run_to_end(steps: Generator[None, None, LayoutResult]) -> LayoutResult:
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            result: LayoutResult = finished.value
            return result


def engine_steps(
    engine: SimEngine,
    requests: Sequence[SimRequest],
    step_ms: float,
    waves: bool = False,
    max_steps: int | None = None,
    on_step: Callable[[SimEngine, Any], None] | None = None,
    step_cost: StepCost | None = None,
) -> Generator[None, None, LayoutResult]:
    """:func:`run_engine` one step at a time: yields after every scheduler step and
    returns the result. Lets :func:`simulate` run its layouts' engines side by side, a
    few steps each in turn."""
    scheduler = engine.scheduler
    step_s = step_ms / 1000.0
    timed = step_cost is not None and not waves
    pending = sorted(
        requests, key=lambda r: (r.arrival_s, r.arrival_step) if timed else r.arrival_step
    )
    outputs = {r.request_id: r.output_token_ids for r in requests}
    arrival = {r.request_id: r.arrival_step for r in requests}
    arrival_s = {r.request_id: r.arrival_s for r in requests}
    live: dict[str, Any] = {}
    first_token: dict[str, int] = {}
    done: dict[str, int] = {}
    first_token_s: dict[str, float] = {}
    done_s: dict[str, float] = {}
    # The furthest position each request has computed: tokens below it are recomputed.
    reached: dict[str, int] = {}
    result = LayoutResult(layout=engine.layout, requests=len(requests))
    series: dict[str, list[float]] = {
        k: []
        for k in ("step", "time_s", "running", "waiting", "kv_usage", "kv_held_gib", "finished")
    }
    attention_pool = engine.attention_pool()
    pool_bytes = [
        (pool, info.block_bytes)
        for pool, info in zip(engine.pools(), engine.describe_pools(), strict=True)
    ]
    pool_set = scheduler.kv_cache_manager.block_pool
    elastic = getattr(pool_set, "elastic", None) is not None
    # Elastic pools: the share of the one budget in use; else the attention pool's usage.
    get_usage = pool_set.get_usage if elastic else attention_pool.get_usage
    held_sum = 0.0
    budget = pool_set.elastic if elastic else None
    budget_bytes = budget.slab_bytes * budget.num_slabs if budget is not None else 0
    # Bytes of each pool's owned slab that its pages do not use: slab edges and the padding
    # of padded Mamba/GDN blocks (the budget knows only the block stride).
    slab_loss = (
        [budget.slab_bytes - budget.pages_per_slab(g) * b for g, (_, b) in enumerate(pool_bytes)]
        if budget is not None
        else []
    )
    stranded_sum = edge_sum = 0.0
    step = 0
    now = 0.0
    wave = -1
    busy = 0
    cpu = wall = 0.0
    kv_sum = 0.0
    next_index = 0
    limit = max_steps if max_steps is not None else 10_000_000
    # vLLM's async scheduler runs under the engine core's batch queue: it schedules the
    # next step before the model has answered the last one (two steps in flight), and
    # updates from a step's output only then. Steps in flight, oldest last: the
    # scheduler's output, the model's, and the step's number and end in simulated time.
    in_flight: deque[tuple[Any, Any, int, float]] = deque()
    queue_size = 2 if _is_async(scheduler) else 1

    def update_oldest() -> Any:
        """``update_from_output`` with the oldest step in flight: its first tokens and
        finished requests are stamped with that step's number and end; returns the
        scheduler's stats, if it sent any."""
        nonlocal cpu, wall
        out, model_output, at_step, at_s = in_flight.pop()
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        engine_outputs = scheduler.update_from_output(out, model_output)
        cpu += time.thread_time() - t_cpu
        wall += time.perf_counter() - t_wall
        stats = None
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.new_token_ids and o.request_id not in first_token:
                    first_token[o.request_id] = at_step
                    first_token_s[o.request_id] = at_s
                if o.finish_reason is not None:
                    done[o.request_id] = at_step
                    done_s[o.request_id] = at_s
            stats = eco.scheduler_stats or stats
        if stats is not None:
            result.prefix_queries += stats.prefix_cache_stats.queries
            result.prefix_hits += stats.prefix_cache_stats.hits
        return stats

    while busy < limit:
        idle = not scheduler.has_requests()
        if idle and in_flight:
            # Nothing more to schedule: the engine core waits for the oldest step.
            update_oldest()
            continue
        if idle and next_index >= len(pending):
            break
        if waves:
            if idle:
                wave = pending[next_index].arrival_step
            due = wave
        elif timed:
            if idle and pending[next_index].arrival_s > now:
                now = pending[next_index].arrival_s  # nothing to do until then
        else:
            if idle and pending[next_index].arrival_step > step:
                step = pending[next_index].arrival_step  # nothing to do until then
            due = step
            now = step * step_s
        while next_index < len(pending) and (
            pending[next_index].arrival_s <= now
            if timed
            else pending[next_index].arrival_step <= due
        ):
            req = pending[next_index]
            next_index += 1
            if waves:
                arrival[req.request_id] = step
                arrival_s[req.request_id] = now
            vreq = _vllm_request(engine, req, arrival_s[req.request_id])
            live[req.request_id] = vreq
            result.prompt_tokens += len(req.prompt_token_ids)
            scheduler.add_request(vreq)
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        out = scheduler.schedule()
        cpu += time.thread_time() - t_cpu
        wall += time.perf_counter() - t_wall
        # What this step computes, per request: (context before it, new tokens); the
        # scheduler has already advanced num_computed_tokens by the scheduled tokens.
        work: list[tuple[int, int]] = []
        for req_id, new in out.num_scheduled_tokens.items():
            context = scheduler.requests[req_id].num_computed_tokens - new
            before = reached.get(req_id, 0)
            result.recomputed_tokens += max(0, min(context + new, before) - context)
            reached[req_id] = max(before, context + new)
            work.append((context, new))
            result.computed_tokens += new
        # Under the time model a step that schedules nothing (it only reports finished
        # requests) runs no forward pass in the engine core: it costs nothing.
        cost = step_s if step_cost is None else (step_cost.seconds(work) if work else 0.0)
        busy += 1
        end = now + cost
        # The model runs the step as scheduled (what it samples is fixed now). As vLLM's
        # engine core does, wait for the oldest step's output once the queue is full, or
        # when this step ran nothing and nothing else can be scheduled.
        in_flight.appendleft((out, fake_model_output(scheduler, out, outputs), step, end))
        stats = None
        if len(in_flight) == queue_size or not (work or scheduler.has_requests()):
            stats = update_oldest()
        running = len(out.num_scheduled_tokens)
        waiting = stats.num_waiting_reqs if stats is not None else len(scheduler.waiting)
        usage = get_usage()
        kv_sum += usage
        held = sum(
            (
                p.num_gpu_blocks
                - 1
                - p.get_num_free_blocks()
                - (p._held_by_budget() if elastic else 0)
            )
            * b
            for p, b in pool_bytes
        )
        held_sum += held
        if budget is not None:
            stranded = budget.stranded_bytes / budget_bytes
            stranded_sum += stranded
            edge_sum += (
                sum(budget.num_owned(g) * loss for g, loss in enumerate(slab_loss)) / budget_bytes
            )
            result.peak_stranded = max(result.peak_stranded or 0.0, stranded)
        result.peak_kv_held_bytes = max(result.peak_kv_held_bytes, held)
        series["kv_held_gib"].append(round(held / (1 << 30), 5))
        series["step"].append(step)
        series["time_s"].append(round(now, 6))
        series["running"].append(running)
        series["waiting"].append(waiting)
        series["kv_usage"].append(round(usage, 5))
        series["finished"].append(len(done))
        result.peak_running = max(result.peak_running, running)
        result.peak_waiting = max(result.peak_waiting, waiting)
        result.peak_kv_usage = max(result.peak_kv_usage, usage)
        if on_step is not None:
            on_step(engine, out)
        step += 1
        now = end
        yield
    result.steps = step
    result.elapsed_s = now
    result.busy_steps = busy
    result.finished = len(done)
    result.generated_tokens = sum(r.num_output_tokens for r in live.values())
    result.preemptions = sum(r.num_preemptions for r in live.values())
    result.scheduler_cpu_s = cpu
    result.scheduler_wall_s = wall
    if busy:
        result.mean_running = sum(series["running"]) / busy
        result.mean_waiting = sum(series["waiting"]) / busy
        result.mean_kv_usage = kv_sum / busy
        result.mean_kv_held_bytes = held_sum / busy
        if budget is not None:
            result.mean_stranded = stranded_sum / busy
            result.mean_edge_waste = edge_sum / busy
    result.ttft_s = _percentiles([first_token_s[r] - arrival_s[r] for r in first_token_s])
    result.latency_s = _percentiles([done_s[r] - arrival_s[r] for r in done_s])
    result.ttft_steps = _percentiles([first_token[r] - arrival[r] for r in first_token])
    result.latency_steps = _percentiles([done[r] - arrival[r] for r in done])
    result.series = series
    _final_checks(engine, result)
    return result


def _is_async(scheduler: Any) -> bool:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    return isinstance(scheduler, AsyncScheduler)


def _final_checks(engine: SimEngine, result: LayoutResult) -> None:
    """Blocks still held once every request finished, per pool, and the Rust pools'
    own invariants (``check_invariants``)."""
    ok: bool | None = None
    for i, pool in enumerate(engine.pools()):
        label = str(getattr(pool, "label", "") or f"pool{i}")
        held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        # Elastic pools: blocks of memory lent to other pools are held by the budget.
        held -= getattr(pool, "_held_by_budget", lambda: 0)()
        result.leaked_blocks[label] = held
        check = getattr(pool, "check_invariants", None)
        if check is not None:
            try:
                check()
                ok = ok is not False
            except Exception as exc:
                ok = False
                result.error = f"pool {label} invariants: {exc}"
    result.invariants_ok = ok


# --------------------------------------------------------------------------- top level


def simulate(
    config: str | Path | Mapping[str, Any],
    settings: SimSettings,
    trace: Trace,
    layouts: Sequence[str] = DEFAULT_LAYOUTS,
    quiet: bool = True,
    max_steps: int | None = None,
) -> SimResult:
    """Run ``trace`` on each layout (see the module doc); a layout that cannot be built or
    run has its ``error`` set instead of numbers."""
    cfg = dict(config) if isinstance(config, Mapping) else load_config(config)
    model = load_model_spec(cfg, settings.specs, dtype=settings.dtype)
    max_len = settings.max_model_len or default_max_model_len(model)
    settings = replace(settings, max_model_len=max_len)
    requests, clipped = requests_from_trace(trace, settings.step_ms, max_len, settings.token_seed)
    step_cost = step_cost_for(cfg, model, settings)
    results = run_layouts_side_by_side(
        cfg, model, settings, layouts, requests, quiet, max_steps, step_cost
    )
    for result in results.values():
        result.clipped = clipped
    return SimResult(
        model=model.name,
        settings=settings,
        trace=trace.name,
        trace_description=trace.describe(),
        max_model_len=max_len,
        layouts=results,
        vllm_version=versions.installed_version(),
        time_model=(
            step_cost.describe()
            if step_cost is not None
            else f"fixed: {settings.step_ms:g} ms per step"
        ),
    )


def step_cost_for(
    cfg: Mapping[str, Any], model: ModelSpec, settings: SimSettings
) -> StepCost | None:
    """The step-time model ``settings`` ask for (None: fixed steps of ``step_ms``)."""
    if settings.time_model == "fixed":
        return None
    cfg = dict(cfg)
    if settings.params_b is not None:
        cfg["_params_b"] = settings.params_b
        cfg.pop("_active_params_b", None)
    if settings.active_params_b is not None:
        cfg["_active_params_b"] = settings.active_params_b
    # Weights in the model dtype: bfloat16 unless a float32 model is asked for.
    weight_bytes = 4 if settings.dtype in ("float32", "float") else 2
    return StepCost.for_model(cfg, model, H100, weight_bytes_per_param=weight_bytes)


def run_layout(
    cfg: Mapping[str, Any],
    model: ModelSpec,
    settings: SimSettings,
    layout: str,
    requests: Sequence[SimRequest],
    quiet: bool = True,
    max_steps: int | None = None,
    waves: bool = False,
    on_step: Callable[[SimEngine, Any], None] | None = None,
    step_cost: StepCost | None = None,
) -> LayoutResult:
    """Build ``layout``'s engine and run ``requests`` on it (errors reported, not raised,
    for layouts vLLM or this package's sizing refuses); steps cost ``step_cost`` (None:
    ``settings.step_ms`` each)."""
    with layout_installed(layout), quiet_vllm(quiet):
        built = _build_layout(cfg, model, settings, layout, len(requests))
        if isinstance(built, LayoutResult):
            return built
        engine, build_s = built
        with engine_heap_frozen():
            result = run_engine(
                engine, requests, settings.step_ms, waves, max_steps, on_step, step_cost
            )
        return _described(result, engine, build_s)


# Steps a layout runs before the next layout's turn in :func:`run_layouts_side_by_side`:
# a fraction of a second of scheduler work, shorter than the bursts of machine noise the
# turns share out. A switch costs more than installing the hooks (about 70 us, untimed):
# re-patching vLLM's classes slows the next steps (CPython's attribute caches start
# over), the faster layout's by the larger share, a cost an engine, which installs its
# hooks once, never pays. Measured on one cell (Nemotron-H-8B 80 GiB 'none' prefix, quiet
# machine): elastic / stock 0.37-0.39x in turns of 16 steps, 0.32-0.36x in turns of 256,
# 0.27-0.35x one after the other; elastic alone, hooks flipped every 16 steps, 3-4%
# slower than never flipped, stock unchanged.
STEPS_PER_TURN = 256


def _between_turns() -> None:
    """Untimed, after each layout's turn: collect every generation the cyclic garbage
    collector keeps, so that the next turn starts with its young generations empty.

    The layouts' engines share one collector. Without this, a collection falls in the
    timed calls of whichever layout's allocation crosses its threshold and scans every
    object the other layout's turn left young: one collection of the middle generation
    (26 ms on Falcon-H1-7B 40 GiB 'none' agentic, prompts only) was charged to the layout
    that ran second in each round, both ways round, and elastic / stock read 1.96x with stock's
    turn first against 0.89x with elastic's first. Collected here, a turn's collections
    scan what that layout allocated, as in an engine that runs one layout: the same cell
    reads 1.60-1.63x and 1.66x (each layout alone in its own process: 1.49-1.57x). Steps
    full of decodes did not depend on the order (Qwen3.5-27B 40 GiB 'none' chat, 0.375x
    and 0.381x before, 0.382x and 0.380x after)."""
    gc.collect()


def run_layouts_side_by_side(
    cfg: Mapping[str, Any],
    model: ModelSpec,
    settings: SimSettings,
    layouts: Sequence[str],
    requests: Sequence[SimRequest],
    quiet: bool = True,
    max_steps: int | None = None,
    step_cost: StepCost | None = None,
) -> dict[str, LayoutResult]:
    """:func:`run_layout` for every layout, the engines built first and then run in
    turns of :data:`STEPS_PER_TURN` steps (each with its layout's hooks installed), so
    that noise on a shared machine falls on every layout's scheduler CPU alike. Each
    engine is its own scheduler on its own requests: the schedules and every figure but
    the CPU and build times are those of one run after the other."""
    results: dict[str, LayoutResult] = {}
    running: dict[str, tuple[SimEngine, float, Generator[None, None, LayoutResult]]] = {}
    with quiet_vllm(quiet):
        for layout in dict.fromkeys(layouts):
            with layout_installed(layout):
                built = _build_layout(cfg, model, settings, layout, len(requests))
            if isinstance(built, LayoutResult):
                results[layout] = built
                continue
            engine, build_s = built
            steps = engine_steps(
                engine, requests, settings.step_ms, max_steps=max_steps, step_cost=step_cost
            )
            running[layout] = (engine, build_s, steps)
        with engine_heap_frozen():
            while running:
                for layout in list(running):
                    engine, build_s, steps = running[layout]
                    with layout_installed(layout):
                        for _ in range(STEPS_PER_TURN):
                            try:
                                next(steps)
                            except StopIteration as finished:
                                results[layout] = _described(finished.value, engine, build_s)
                                del running[layout]
                                break
                    _between_turns()
    return {layout: results[layout] for layout in layouts}


def _build_layout(
    cfg: Mapping[str, Any],
    model: ModelSpec,
    settings: SimSettings,
    layout: str,
    num_requests: int,
) -> tuple[SimEngine, float] | LayoutResult:
    """The layout's engine and the seconds it took to build, or a result carrying the
    error for a layout vLLM or this package's sizing refuses."""
    t0 = time.perf_counter()
    try:
        engine = build_engine(cfg, model, settings, layout)
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        return LayoutResult(layout=layout, requests=num_requests, error=_one_line(exc))
    return engine, time.perf_counter() - t0


def _described(result: LayoutResult, engine: SimEngine, build_s: float) -> LayoutResult:
    """``result`` with what the engine was: its pools, notes and vLLM's sizing."""
    result.build_s = build_s
    result.note = engine.note
    result.pools = engine.describe_pools()
    cache = engine.vllm_config.cache_config
    result.kv_cache_size_tokens = getattr(cache, "kv_cache_size_tokens", None)
    result.max_concurrency = getattr(cache, "kv_cache_max_concurrency", None)
    result.attention_block_size = cache.block_size
    result.hash_block_size = engine.hash_block_size
    return result


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"
