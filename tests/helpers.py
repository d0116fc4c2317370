"""Helpers shared by the test modules (no test module imports another).

* pool level: a minimal request, comparable snapshots of a stock pool and of ours,
  normalised KV events;
* manager level: KV-cache layouts and managers built with either pool;
* state machines: the example budget of the hypothesis profile and step counting;
* engine level: real vLLM engines (stock vs ours) started through
  ``tests/support/engine_run.py``, side by side.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from hybrid_alloc import integration
from hybrid_alloc.integration.block_pool import BlockPool as RustPool
from tests.support.engine_run import ROOT, engine_run_command

PROFILE = os.environ.get("HYBRID_ALLOC_HYPOTHESIS_PROFILE", "ci")


def budget(examples: int) -> int:
    """Examples for a test in this profile: the long profile runs 20 times as many."""
    return examples * (20 if PROFILE == "long" else 1)


@dataclass
class FakeRequest:
    """The request fields a pool reads: block hashes and what events are built from."""

    block_hashes: list[bytes]
    all_token_ids: list[int] = field(default_factory=list)
    lora_request: Any = None
    session_id: Any = None
    mm_features: list[Any] = field(default_factory=list)
    cache_salt: Any = None
    prompt_embeds: Any = None


def make_request(seed: int, num_hash_blocks: int, hash_block_size: int = 4) -> FakeRequest:
    """A request whose chained hashes share a prefix with every request of the same seed."""
    # Real-looking 32-byte hashes: vLLM's events may shorten them to their last 8 bytes.
    hashes = [hashlib.sha256(f"s{seed}-b{i}".encode()).digest() for i in range(num_hash_blocks)]
    tokens = [(seed * 131 + i) % 1000 for i in range(num_hash_blocks * hash_block_size)]
    return FakeRequest(block_hashes=hashes, all_token_ids=tokens)


def stock_snapshot(pool: Any) -> dict[str, Any]:
    """Everything observable about a stock pool, in a comparable form."""
    cache: dict[bytes, list[int]] = {}
    for key, val in pool.cached_block_hash_to_block._cache.items():
        cache[key] = [val.block_id] if hasattr(val, "block_id") else list(val.keys())
    return {
        "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "num_free": pool.get_num_free_blocks(),
        "usage": pool.get_usage(),
        "ref": [b.ref_cnt for b in pool.blocks[1:]],
        "hash": [(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks[1:]],
        "extra": {
            bid: sorted(keys) for bid, keys in pool.cached_block_hashes_by_block.items() if keys
        },
        "cache": dict(sorted(cache.items())),
    }


def rust_snapshot(pool: Any) -> dict[str, Any]:
    """The same view of one of our pools."""
    extra = {}
    for bid in range(1, pool.num_gpu_blocks):
        keys = pool._extra_block_hashes(bid)
        if keys:
            extra[bid] = sorted(keys)
    return {
        "free": pool.free_block_ids(),
        "num_free": pool.get_num_free_blocks(),
        "usage": pool.get_usage(),
        "ref": pool.ref_counts()[1:],
        "hash": [(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks[1:]],
        "extra": extra,
        "cache": dict(pool.cache_entries()),
    }


def normalize_events(events: list[Any]) -> list[Any]:
    """Events as comparable tuples. Runs of BlockRemoved are sorted: vLLM removes a block's
    extra hashes in set order, which depends on the process's hash seed."""
    out: list[Any] = []
    run: list[Any] = []
    for ev in events:
        name = type(ev).__name__
        fields = repr(ev)
        if name == "BlockRemoved":
            run.append((name, fields))
            continue
        out.extend(sorted(run))
        run = []
        out.append((name, fields))
    out.extend(sorted(run))
    return out


# Steps executed by each state machine in this run (reported at the end of the session).
MACHINE_STEPS: Counter[str] = Counter()


def count_step(machine: str) -> None:
    MACHINE_STEPS[machine] += 1


# ------------------------------------------------------------------ manager level


BLOCK = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def attn(window: int | None = None) -> Any:
    common = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    if window is None:
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(sliding_window=window, **common)


def mamba(mode: str) -> Any:
    return MambaSpec(
        block_size=BLOCK,
        shapes=((4, 64), (8, 16, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode=mode,
    )


LAYOUTS: dict[str, list[Any]] = {
    "full": [attn()],
    "full+swa": [attn(), attn(window=48)],
    "full+mamba_align": [attn(), mamba("align")],
    "full+swa+mamba_align": [attn(), attn(window=32), mamba("align")],
}


@contextmanager
def pool_class(cls: type) -> Iterator[None]:
    """Build managers with ``cls``; ours comes with the plugin's batched prefix lookup."""
    if cls is RustPool:
        integration.install(per_group_pools=False)
    else:
        integration.uninstall()
    try:
        yield
    finally:
        integration.uninstall()


def build_manager(
    cls: type, layout: str, num_blocks: int, events: bool, eagle: bool = False
) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(LAYOUTS[layout])]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    mgr = KVCacheManager(
        config,
        max_model_len=2048,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
        enable_kv_cache_events=events,
        use_eagle=eagle,
    )
    assert type(mgr.block_pool) is cls
    return mgr


def new_request(rid: str, tokens: list[int]) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        block_hasher=HASHER,
    )


# ------------------------------------------------------------------- engine level

TIMEOUT_S = 400
STOCK_POOL = "vllm.v1.core.block_pool.BlockPool"
POOL_SET = "hybrid_alloc.integration.pool_set.PoolSet"


def run_engines(
    model: Path, workdir: Path, runs: dict[str, tuple[str, bool, list[str]]]
) -> dict[str, dict[str, Any]]:
    """Start one engine per entry of ``runs`` ({name: (backend, per-group pools on,
    engine_run arguments)}) at once, one CPU core each when there are two; wait for all of
    them, then check that each exited cleanly without vLLM ERROR lines. Returns {name:
    engine_run's JSON result, plus ``log_text``}."""
    workdir.mkdir(parents=True, exist_ok=True)
    two_cores = (os.cpu_count() or 1) >= 2
    procs = {}
    for core, (name, (backend, per_group, extra)) in enumerate(runs.items()):
        cmd = engine_run_command(
            model,
            backend,
            workdir / f"{name}.json",
            extra,
            timeout=TIMEOUT_S,
            cpu_bind=core if two_cores else None,
            per_group=per_group,
        )
        procs[name] = subprocess.Popen(cmd, cwd=ROOT)
    codes = {}
    for name, proc in procs.items():  # wait for all before judging any
        try:
            codes[name] = proc.wait(timeout=TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[name] = proc.wait()
    results = {}
    for name, rc in codes.items():
        out = workdir / f"{name}.json"
        log = workdir / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        assert rc == 0 and out.exists(), f"{name} engine run failed (exit {rc}):\n{text[-6000:]}"
        result = json.loads(out.read_text())
        assert not result["error_lines"], f"{name}: vLLM logged errors:\n" + "\n".join(
            result["error_lines"]
        )
        result["log_text"] = text
        results[name] = result
    return results


def run_pair(
    model: Path,
    workdir: Path,
    extra: list[str],
    own: dict[str, list[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run the stock and the per-group engine on the same workload; ``own`` adds
    arguments for one of them (``"stock"`` or ``"per_group"``, e.g. its pool size)."""
    own = own or {}
    return run_engines(
        model,
        workdir,
        {
            "stock": ("vllm", False, [*extra, *own.get("stock", [])]),
            "per_group": ("rust", True, [*extra, *own.get("per_group", [])]),
        },
    )


def check_pair(pair: dict[str, dict[str, Any]], coordinator: str, preempted: bool = False) -> None:
    """Same greedy tokens (and enough distinct outputs for that to mean something); the
    per-group engine really ran ``coordinator`` over a pool set, kept natural page and
    block sizes, and got every block back. Without preemption the two runs also hit the
    prefix cache equally; with ``preempted`` both must have preempted."""
    stock, ours = pair["stock"], pair["per_group"]
    assert ours["outputs"] == stock["outputs"]
    assert len({tuple(o) for o in ours["outputs"]}) > len(ours["outputs"]) // 2
    if preempted:
        assert stock["metrics"]["preemptions"] > 0
        assert ours["metrics"]["preemptions"] > 0
    else:
        assert stock["metrics"]["preemptions"] == ours["metrics"]["preemptions"] == 0
        assert ours["metrics"]["prefix_cache_hits"] == stock["metrics"]["prefix_cache_hits"]
    assert stock["probe"]["init"]["block_pool"] == STOCK_POOL
    probe = ours["probe"]["init"]
    assert probe["coordinator"] == f"hybrid_alloc.integration.coordinator.{coordinator}"
    assert probe["block_pool"] == POOL_SET
    log = ours["log_text"]
    assert "hybrid_alloc: per-group KV-cache pools: group" in log
    assert "Padding mamba page size" not in log
    assert "Setting attention block size" not in log
    assert ours["reset_prefix_cache_ok"] is True
    for event in ("before_reset", "after_reset"):
        state = ours["probe"][event]
        assert state["pool_free_blocks"] == state["pool_num_gpu_blocks"] - 1, event


# ----------------------------------------------------------- per-group layouts
MAX_LEN = 1024
"""max_model_len of the per-group layouts: vLLM sizes a 'none'-mode Mamba block to it."""


def state_mamba(mode: str) -> Any:
    """A Mamba spec as vLLM builds it for a hybrid model: 'none'-mode blocks hold one
    request's whole state (block size = max_model_len), 'align'-mode blocks are as long as
    attention blocks."""
    return MambaSpec(
        block_size=BLOCK if mode == "align" else MAX_LEN,
        shapes=((4, 64), (8, 16, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode=mode,
    )


def fake_vllm_config(
    mode: str = "none",
    max_num_seqs: int = 16,
    override: int | None = None,
    caching: bool = False,
) -> Any:
    """The fields of VllmConfig that per-group sizing reads."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_layout import KVCacheLayout

    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, disable_hybrid_kv_cache_manager=False
        ),
        cache_config=SimpleNamespace(
            num_gpu_blocks_override=override,
            mamba_cache_mode=mode,
            enable_prefix_caching=caching,
            prefix_match_unit=None,
            prefix_cache_retention_interval=0,
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
        ),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, original_max_model_len=MAX_LEN),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            tensor_parallel_size=1,
        ),
        kv_transfer_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        max_in_flight_tokens=256,
    )
