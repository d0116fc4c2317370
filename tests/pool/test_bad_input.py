"""Bad input gets a Python exception naming the problem, and the pool is exactly as before.

Unit tests for each kind of bad input the README lists, a fuzzer of well-typed but wrong
values (IDs out of range, blocks of another pool, freed blocks, negative counts, wrong
masks) whose refusals must come from the pool itself, with one of the documented
exception types, a message naming the pool and the block, and nothing changed; and
named regression tests for inputs that still get an undocumented exception.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import event, given, settings
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from hybrid_alloc.integration.scheduler.block_pool import BlockPool
from tests.helpers import budget, make_request, rust_snapshot

DOCUMENTED = (ValueError, TypeError, IndexError, KeyError)
"""The exception types the README documents for bad input."""


def full_snapshot(pool: BlockPool) -> Any:
    """Everything a refused call must leave as it was: the pool's state, its pending
    events, and how many block handles it has handed out."""
    return (rust_snapshot(pool), list(pool.kv_event_queue), pool.num_handles())


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


@dataclass
class World:
    """Two pools: ``a`` (held, cached-free and plain free blocks, one block held twice)
    and ``b``, whose blocks are foreign to ``a``."""

    a: BlockPool
    b: BlockPool

    def handle(self, pick: tuple[str, int]) -> Any:
        pool = self.a if pick[0] == "a" else self.b
        return pool.blocks[pick[1]]

    def snapshot(self) -> Any:
        return full_snapshot(self.a), full_snapshot(self.b)


def build_world() -> World:
    a, held = busy_pool("pool-a")
    held[0].ref_cnt += 1  # held twice (a manager's extra reference)
    b = BlockPool(8, True, 4, enable_kv_cache_events=True, label="pool-b")
    b_held = b.get_new_blocks(4)
    b.free_blocks([b_held[3]])
    b.take_events()
    return World(a, b)


A_BLOCKS = st.tuples(st.just("a"), st.integers(0, 11))
B_BLOCKS = st.tuples(st.just("b"), st.integers(0, 7))
ANY_BLOCK = st.one_of(A_BLOCKS, A_BLOCKS, B_BLOCKS)
BLOCK_LISTS = st.lists(ANY_BLOCK, max_size=5)


def owner(block: Any) -> str:
    return block.pool.label


def refusal(*alternatives: tuple[type[BaseException], str]) -> list[Any]:
    """Acceptable refusals: (exception type, regular expression the message matches)."""
    return list(alternatives)


def named(pool_label: str, block_id: int) -> str:
    return rf"{re.escape(pool_label)}\b.*\bblock {block_id}\b"


def over_released(blocks: list[Any]) -> list[tuple[str, int]]:
    """Blocks released more times than they are referenced (the null block excepted)."""
    counts = Counter((owner(b), b.block_id) for b in blocks if not b.is_null)
    by_key = {(owner(b), b.block_id): b for b in blocks}
    return [key for key, n in counts.items() if n > by_key[key].ref_cnt]


@st.composite
def bad_calls(draw: Any) -> tuple[str, Any, Any]:
    """(description, call on a World, the refusals it may get, or None if it is valid)."""
    kind = draw(
        st.sampled_from(
            [
                "get_new_blocks",
                "get_new_blocks_with_ids",
                "free_blocks",
                "touch",
                "unpin_blocks",
                "count_evictable",
                "max_block_hash_num_tokens",
                "is_block_writable",
                "evict_blocks",
                "move_block_hashes",
                "ref_cnt",
                "blocks[]",
                "_block",
                "cache_full_blocks",
                "cache_partial_block",
                "_insert_block_hash",
                "_remove_cached_block_hashes",
                "lookups",
            ]
        )
    )
    if kind in ("get_new_blocks", "get_new_blocks_with_ids"):
        n = draw(st.integers(-40, 40))

        def call(w: World) -> Any:
            return getattr(w.a, kind)(n)

        def expect(w: World) -> Any:
            if 0 <= n <= w.a.get_num_free_blocks():
                return None
            return refusal((ValueError, rf"pool-a\b.*{n}\b"))

        return f"{kind}({n})", call, expect
    if kind in (
        "free_blocks",
        "touch",
        "unpin_blocks",
        "count_evictable",
        "max_block_hash_num_tokens",
    ):
        picks = draw(BLOCK_LISTS)

        def call(w: World) -> Any:
            blocks = [w.handle(p) for p in picks]
            if kind == "unpin_blocks":
                return w.a.unpin_blocks(blocks, lambda block: None)
            return getattr(w.a, kind)(blocks)

        def expect(w: World) -> Any:
            blocks = [w.handle(p) for p in picks]
            foreign = [b.block_id for b in blocks if owner(b) == "pool-b"]
            if kind == "free_blocks":
                # Other pools' blocks go back to their own pool.
                bad = over_released(blocks)
                return refusal(*((ValueError, named(lab, i)) for lab, i in bad)) or None
            alternatives = [(ValueError, rf"pool-a\b.*block {i}\b.*another pool") for i in foreign]
            if kind == "unpin_blocks":
                if any(b.is_null for b in blocks):
                    alternatives.append((ValueError, r"pool-a\b.*null block"))
                own = [b for b in blocks if owner(b) == "pool-a"]
                alternatives += [(ValueError, named(lab, i)) for lab, i in over_released(own)]
            return alternatives or None

        return f"{kind}({picks})", call, expect
    if kind == "is_block_writable":
        pick = draw(ANY_BLOCK)

        def call(w: World) -> Any:
            return w.a.is_block_writable(w.handle(pick))

        def expect(w: World) -> Any:
            if pick[0] == "a":
                return None
            return refusal((ValueError, rf"pool-a\b.*block {pick[1]}\b.*another pool"))

        return f"is_block_writable({pick})", call, expect
    if kind == "evict_blocks":
        ids = draw(st.sets(st.integers(-20, 30), max_size=4))

        def call(w: World) -> Any:
            return w.a.evict_blocks(ids)

        def expect(w: World) -> Any:
            bad = [i for i in ids if not 0 <= i < 12]
            return refusal(*((ValueError, named("pool-a", i)) for i in bad)) or None

        return f"evict_blocks({ids})", call, expect
    if kind == "move_block_hashes":
        src, dst = draw(ANY_BLOCK), draw(ANY_BLOCK)

        def call(w: World) -> Any:
            return w.a.move_block_hashes(w.handle(src), w.handle(dst))

        def expect(w: World) -> Any:
            alternatives = []
            for pick in (src, dst):
                block = w.handle(pick)
                if pick[0] == "b":
                    alternatives.append((ValueError, rf"pool-a\b.*block {pick[1]}\b.*another"))
                elif block.is_null:
                    alternatives.append((ValueError, r"pool-a\b.*null block"))
            target = w.handle(dst)
            if (
                dst[0] == "a"
                and not target.is_null
                and (target.block_hash is not None or w.a._extra_block_hashes(dst[1]))
            ):
                alternatives.append((ValueError, named("pool-a", dst[1])))
            return alternatives or None

        return f"move_block_hashes({src}, {dst})", call, expect
    if kind == "ref_cnt":
        pick, value = draw(ANY_BLOCK), draw(st.integers(-3, 4))

        def call(w: World) -> Any:
            w.handle(pick).ref_cnt = value

        def expect(w: World) -> Any:
            block = w.handle(pick)
            label = owner(block)
            if block.is_null:
                return refusal((ValueError, rf"{label}\b.*null block"))
            if block.ref_cnt == 0 or value < 1:
                return refusal((ValueError, named(label, pick[1])))
            return None

        return f"ref_cnt({pick} = {value})", call, expect
    if kind == "blocks[]":
        index = draw(st.integers(-30, 30))

        def call(w: World) -> Any:
            return w.a.blocks[index]

        def expect(w: World) -> Any:
            return None if -12 <= index < 12 else refusal((IndexError, rf"{index}\b"))

        return f"blocks[]({index})", call, expect
    if kind == "_block":
        index = draw(st.integers(-20, 30))

        def call(w: World) -> Any:
            return w.a._block(index)

        def expect(w: World) -> Any:
            return None if 0 <= index < 12 else refusal((ValueError, named("pool-a", index)))

        return f"_block({index})", call, expect
    if kind == "cache_full_blocks":
        picks = draw(st.lists(ANY_BLOCK, min_size=1, max_size=4, unique=True))
        num_full = draw(st.integers(0, len(picks)))
        num_cached = draw(st.integers(0, num_full))
        width = num_full - num_cached
        mask = draw(
            st.none() | st.lists(st.booleans(), min_size=max(0, width - 1), max_size=width + 1)
        )
        seed = draw(st.integers(10, 12))

        def call(w: World) -> Any:
            req = make_request(seed, 6)
            blocks = [w.handle(p) for p in picks]
            return w.a.cache_full_blocks(req, blocks, num_cached, num_full, 4, 0, mask)

        def expect(w: World) -> Any:
            if num_cached >= num_full:
                return None  # nothing to cache
            if mask is not None and len(mask) != width:
                return refusal((ValueError, r"pool-a\b.*block_mask"))
            alternatives = []
            for pos in range(num_cached, num_full):
                block = w.handle(picks[pos])
                if picks[pos][0] == "b":
                    # Another pool's block in the range is refused, masked out or not.
                    alternatives.append(
                        (ValueError, rf"pool-a\b.*block {block.block_id}\b.*another pool")
                    )
                elif mask is not None and not mask[pos - num_cached]:
                    continue
                elif (
                    not block.is_null
                    and block.block_hash is not None
                    and block.block_hash_num_tokens >= (pos + 1) * 4
                ):
                    # Only a partial entry may be promoted to a full block.
                    alternatives.append((ValueError, named("pool-a", block.block_id)))
            return alternatives or None

        return f"cache_full_blocks({picks}, {num_cached}, {num_full}, {mask})", call, expect
    if kind == "cache_partial_block":
        pick, num_tokens = draw(ANY_BLOCK), draw(st.integers(-8, 32))

        def call(w: World) -> Any:
            return w.a.cache_partial_block(make_request(11, 6), w.handle(pick), num_tokens, 0, 8)

        def expect(w: World) -> Any:
            block = w.handle(pick)
            if pick[0] == "b":
                return refusal((ValueError, rf"pool-a\b.*block {pick[1]}\b.*another pool"))
            if block.is_null:
                return None  # vLLM's managers pass the null block: nothing to cache
            if num_tokens <= 0 or num_tokens % 4:
                return refusal((ValueError, r"pool-a\b.*multiples of hash_block_size"))
            if num_tokens // 4 > 6:
                return refusal((ValueError, named("pool-a", pick[1])))
            return None

        return f"cache_partial_block({pick}, {num_tokens})", call, expect
    if kind == "_insert_block_hash":
        pick, num_tokens = draw(ANY_BLOCK), draw(st.integers(1, 24))
        key = make_block_hash_with_group_id(make_request(13, 1).block_hashes[0], 0)

        def call(w: World) -> Any:
            return w.a._insert_block_hash(key, w.handle(pick), num_tokens)

        def expect(w: World) -> Any:
            if pick[0] == "b":
                return refusal((ValueError, rf"pool-a\b.*block {pick[1]}\b.*another pool"))
            if w.handle(pick).is_null:
                return refusal((ValueError, r"pool-a\b.*null block"))
            return None

        return f"_insert_block_hash({pick}, {num_tokens})", call, expect
    if kind == "_remove_cached_block_hashes":
        pick = draw(ANY_BLOCK)
        method = draw(st.sampled_from(["_remove_cached_block_hashes", "_maybe_evict_cached_block"]))

        def call(w: World) -> Any:
            return getattr(w.a, method)(w.handle(pick))

        def expect(w: World) -> Any:
            if pick[0] == "b":
                return refusal((ValueError, rf"pool-a\b.*block {pick[1]}\b.*another pool"))
            return None

        return f"{method}({pick})", call, expect
    # lookups: any hash, any groups, any non-negative length: never refused
    seed, groups, max_blocks = (
        draw(st.integers(0, 12)),
        draw(st.sampled_from([[0], [1], [0, 1], [1, 0], []])),
        draw(st.integers(0, 8)),
    )

    def call(w: World) -> Any:
        hashes = make_request(seed, 6).block_hashes
        w.a.get_cached_block(hashes[0], groups)
        return w.a.get_cached_prefix(hashes, groups, max_blocks)

    return f"lookups({seed}, {groups}, {max_blocks})", call, lambda w: None


@settings(max_examples=budget(600))
@given(case=bad_calls())
def test_wrong_values_are_refused_by_the_pool(case: tuple[str, Any, Any]) -> None:
    """Well-typed calls with wrong values (IDs out of range, blocks of another pool,
    freed blocks, negative counts, wrong masks) and valid ones, against a model of which
    are wrong: a wrong call gets one of the documented exception types with a message
    naming the pool (and the block), and changes nothing in either pool; a valid call
    goes through. A Rust panic would surface as pyo3's PanicException (a BaseException)
    and fail the test."""
    description, call, expect = case
    world = build_world()
    expected = expect(world)
    before = world.snapshot()
    event(f"{description.split('(')[0]}: {'refused' if expected else 'valid'}")
    try:
        call(world)
    except DOCUMENTED as e:
        assert expected is not None, f"{description}: refused a valid call: {e!r}"
        message = str(e)
        assert any(type(e) is exc and re.search(pattern, message) for exc, pattern in expected), (
            f"{description}: {e!r} is not one of {expected}"
        )
        assert world.snapshot() == before, f"{description}: a refused call changed a pool"
    else:
        assert expected is None, f"{description}: accepted, expected one of {expected}"
    world.a.check_invariants()
    world.b.check_invariants()


# ---------------------------------------------------------------------- regressions
# Found by the wrong-values fuzzer with values past the ranges it draws from above: each
# got an exception type the README does not document for bad input (OverflowError from
# argument conversion, TypeError 'expected ints, got int', vLLM's AssertionError).


def test_regression_get_new_blocks_past_a_c_long_is_a_value_error() -> None:
    """``get_new_blocks(2**63)``: more blocks than free, like any other count (README:
    ValueError); the binding raises OverflowError before the pool sees it."""
    pool, _ = busy_pool()
    assert_refused(pool, lambda: pool.get_new_blocks(2**63), ValueError, "pool-a")


def test_regression_evict_blocks_past_a_c_long_is_out_of_range() -> None:
    """``evict_blocks([2**63])``: an ID out of range (README: ValueError naming the
    block); the binding raises TypeError 'expected block IDs as ints, got int'."""
    pool, _ = busy_pool()
    assert_refused(pool, lambda: pool.evict_blocks([2**63]), ValueError, "pool-a", "out of range")


def test_regression_block_table_index_past_a_c_long_is_an_index_error() -> None:
    """``pool.blocks[2**63]``: out-of-range indexing (README: IndexError, as a Python
    list gives); the binding raises OverflowError."""
    pool, _ = busy_pool()
    assert_refused(pool, lambda: pool.blocks[2**63], IndexError)


def test_regression_get_cached_prefix_negative_length_is_a_value_error() -> None:
    """``get_cached_prefix(hashes, [0], -1)``: a negative count (README: ValueError);
    the binding raises OverflowError."""
    pool, _ = busy_pool()
    hashes = make_request(7, 6).block_hashes
    assert_refused(pool, lambda: pool.get_cached_prefix(hashes, [0], -1), ValueError, "pool-a")


def test_regression_negative_group_id_is_a_value_error() -> None:
    """A group ID out of range (-1) in ``get_cached_block`` and ``cache_full_blocks``
    (README: ValueError); the binding raises OverflowError. vLLM's stock pool raises
    OverflowError here too (``int.to_bytes``), but our contract is the README's."""
    pool, held = busy_pool()
    req = make_request(7, 6)
    assert_refused(
        pool, lambda: pool.get_cached_block(req.block_hashes[0], [-1]), ValueError, "pool-a"
    )
    assert_refused(
        pool, lambda: pool.cache_full_blocks(req, [held[2]], 0, 1, 4, -1), ValueError, "pool-a"
    )


def test_regression_block_size_not_a_multiple_of_hash_block_size_is_a_value_error() -> None:
    """``cache_full_blocks`` with ``block_size=6`` on a pool hashing every 4 tokens:
    ``block_pool.py`` hands it to vLLM's ``resolve_block_hashes``, whose ``assert``
    fires (AssertionError, not a documented type)."""
    pool, held = busy_pool()
    req = make_request(7, 6)
    assert_refused(
        pool, lambda: pool.cache_full_blocks(req, held, 4, 5, 6, 0), ValueError, "pool-a"
    )


def test_regression_make_handles_limits_past_a_c_long() -> None:
    """``make_handles(-1)`` / ``make_handles(2**63)``: a negative limit is a ValueError
    naming the pool (not the binding's OverflowError), a huge one means every block."""
    pool, _ = busy_pool()
    assert_refused(pool, lambda: pool.make_handles(-1), ValueError, "pool-a")
    assert_refused(pool, lambda: pool.make_handles(-(2**63) - 1), ValueError, "pool-a")
    assert pool.make_handles(2**63) == pool.num_gpu_blocks == pool.num_handles()
