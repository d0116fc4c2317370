"""Shared helpers: a minimal request for pool-level tests and comparable snapshots of a stock
vLLM pool and of ours."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings

# Hypothesis profiles: "ci" (default) is derandomized with a fixed budget; "long" digs deeper.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = os.environ.get("HYBRID_ALLOC_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


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


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if MACHINE_STEPS:
        total = sum(MACHINE_STEPS.values())
        parts = ", ".join(f"{name}: {n}" for name, n in sorted(MACHINE_STEPS.items()))
        terminalreporter.write_line(f"state-machine steps: {total} ({parts})")
