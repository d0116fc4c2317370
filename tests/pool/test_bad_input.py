"""Bad input gets a Python exception naming the problem, and the pool is exactly as before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from hybrid_alloc.integration.block_pool import BlockPool
from tests.helpers import make_request, rust_snapshot

ALLOWED = (
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    RuntimeError,
    OverflowError,
    AttributeError,
)


def full_snapshot(pool: BlockPool) -> Any:
    return (rust_snapshot(pool), list(pool.kv_event_queue), pool.num_handles() >= 0)


def busy_pool(label: str = "pool-a") -> tuple[BlockPool, list[Any]]:
    """A pool with held, cached-free and plain free blocks."""
    pool = BlockPool(12, True, 4, enable_kv_cache_events=True, label=label)
    req = make_request(7, 6)
    held = pool.get_new_blocks(6)
    pool.cache_full_blocks(req, held, 0, 4, 4, 0)
    pool.free_blocks(reversed(held[3:]))
    pool.take_events()
    return pool, held[:3]


def assert_refused(
    pool: BlockPool, call: Callable[[], Any], exc: type[BaseException], *words: str
) -> None:
    before = full_snapshot(pool)
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert full_snapshot(pool) == before
    pool.check_invariants()


def test_double_free_names_the_block() -> None:
    pool, held = busy_pool()
    pool.free_blocks([held[2]])
    assert_refused(pool, lambda: pool.free_blocks([held[1], held[2]]), ValueError, "block 3")


def test_free_twice_in_one_call_is_refused_whole() -> None:
    pool, held = busy_pool()
    assert_refused(pool, lambda: pool.free_blocks([held[0], held[1], held[0]]), ValueError, "1")


def test_more_blocks_than_free() -> None:
    pool, _ = busy_pool()
    free = pool.get_num_free_blocks()
    assert_refused(pool, lambda: pool.get_new_blocks(free + 1), ValueError, "Cannot get")
    assert_refused(pool, lambda: pool.get_new_blocks(-1), ValueError, "negative")


def test_foreign_blocks_are_refused() -> None:
    pool, held = busy_pool("pool-a")
    other = BlockPool(12, True, 4, label="pool-b")
    foreign = other.get_new_blocks(2)
    assert_refused(pool, lambda: pool.touch(foreign), ValueError, "pool-a", "another pool")
    assert_refused(pool, lambda: pool.is_block_writable(foreign[0]), ValueError, "another pool")
    assert_refused(
        pool, lambda: pool.move_block_hashes(held[0], foreign[0]), ValueError, "another pool"
    )
    assert_refused(
        pool,
        lambda: pool.unpin_blocks(foreign, lambda b: None),
        ValueError,
        "another pool",
    )


def test_free_routes_other_pools_blocks_to_their_owner() -> None:
    pool, held = busy_pool("pool-a")
    other = BlockPool(12, True, 4, label="pool-b")
    foreign = other.get_new_blocks(2)
    pool.free_blocks([held[0], *foreign])
    assert other.get_num_free_blocks() == 11
    assert held[0].ref_cnt == 0
    pool.check_invariants()
    other.check_invariants()


def test_out_of_range_ids() -> None:
    pool, _ = busy_pool()
    assert_refused(pool, lambda: pool.evict_blocks({3, 12}), ValueError, "block 12", "out of range")
    assert_refused(pool, lambda: pool.evict_blocks({-1}), ValueError, "-1")
    assert_refused(pool, lambda: pool.blocks[12], IndexError, "12")
    assert_refused(pool, lambda: pool._block(99), ValueError, "99")


def test_wrong_types() -> None:
    pool, held = busy_pool()
    assert_refused(pool, lambda: pool.free_blocks([held[0], "x"]), TypeError, "str")
    assert_refused(pool, lambda: pool.touch([object()]), TypeError, "object")
    assert_refused(pool, lambda: pool.free_blocks(5), TypeError)
    assert_refused(pool, lambda: pool.get_new_blocks("3"), TypeError)
    assert_refused(pool, lambda: pool.evict_blocks(["a"]), TypeError, "int")
    assert_refused(pool, lambda: pool.get_cached_block("abc", [0]), TypeError)


def test_null_block_cannot_be_changed() -> None:
    pool, held = busy_pool()
    null = pool.null_block

    def bump() -> None:
        null.ref_cnt += 1

    assert_refused(pool, bump, ValueError, "null block")
    assert_refused(pool, lambda: pool.unpin_blocks([null], lambda b: None), ValueError, "null")
    assert_refused(pool, lambda: pool.move_block_hashes(held[0], null), ValueError, "null")
    assert_refused(pool, lambda: pool._insert_block_hash(b"k" * 36, null, 4), ValueError, "null")
    # vLLM's managers pass the null block along in lists they free and touch: a no-op.
    before = full_snapshot(pool)
    pool.touch([null, null])
    pool.free_blocks([null])
    assert full_snapshot(pool) == before
    assert pool.cache_partial_block(make_request(7, 6), null, 4, 0, 4) is None


def test_ref_cnt_writes_only_on_held_blocks() -> None:
    pool, held = busy_pool()
    free_block = pool.blocks[pool.free_block_ids()[0]]

    def set_free() -> None:
        free_block.ref_cnt = 1

    def set_zero() -> None:
        held[0].ref_cnt = 0

    assert_refused(pool, set_free, ValueError, "is free")
    assert_refused(pool, set_zero, ValueError, "free_blocks")


def test_recaching_a_full_block_is_refused() -> None:
    pool, held = busy_pool()
    req = make_request(8, 6)
    assert_refused(
        pool,
        lambda: pool.cache_full_blocks(req, held, 0, 2, 4, 0),
        ValueError,
        "already cached",
    )
    assert_refused(
        pool,
        lambda: pool.cache_full_blocks(req, held, 0, 2, 4, 0, [True]),
        ValueError,
        "block_mask",
    )


def test_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks must be positive"):
        BlockPool(0, True, 16)
    with pytest.raises(TypeError, match="num_gpu_blocks must be an int"):
        BlockPool(2.5, True, 16)
    with pytest.raises(ValueError, match="hash_block_size"):
        BlockPool(4, True, 0)


METHOD_ARGS = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),
    st.text(max_size=3),
    st.binary(max_size=40),
    st.lists(st.integers(-3, 20), max_size=4),
    st.sets(st.integers(-3, 20), max_size=4),
    st.floats(allow_nan=True),
)

METHODS = [
    "get_new_blocks",
    "free_blocks",
    "touch",
    "is_block_writable",
    "get_cached_block",
    "get_cached_prefix",
    "move_block_hashes",
    "evict_blocks",
    "unpin_blocks",
    "_insert_block_hash",
    "_maybe_evict_cached_block",
    "_remove_cached_block_hashes",
    "_block",
    "_hash_maps_to",
    "_extra_block_hashes",
    "_cache_full_blocks",
    "cache_full_blocks",
    "cache_partial_block",
]


@settings(max_examples=400)
@given(
    method=st.sampled_from(METHODS),
    args=st.lists(METHOD_ARGS, max_size=7),
    use_blocks=st.lists(st.integers(0, 11), max_size=3),
)
def test_fuzzed_arguments_never_panic_or_corrupt(
    method: str, args: list[Any], use_blocks: list[int]
) -> None:
    """Junk arguments (and real blocks in odd places) raise ordinary exceptions; a call
    that raises leaves the pool as it was. A Rust panic would surface as
    pyo3's PanicException, a BaseException, and fail this test."""
    pool, _ = busy_pool()
    args = [*args, *(pool.blocks[i] for i in use_blocks)]
    before = full_snapshot(pool)
    try:
        getattr(pool, method)(*args)
    except ALLOWED:
        assert full_snapshot(pool) == before
    pool.check_invariants()
