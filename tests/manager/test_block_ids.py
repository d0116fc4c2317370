"""The scheduler output's block IDs (`manager_patches.get_block_ids`, installed as vLLM's
``KVCacheBlocks.get_block_ids``, and the native `block_ids` it calls per group) give what
vLLM's own method gives: for this package's handles, vLLM's own blocks and groups that
mix them; for lists, tuples and iterators; for empty groups with and without
``allow_none``; and for any selection of groups. Bad input raises what vLLM's method
raises. The managers' differential machines (`test_fuzz_manager.py`,
`test_fuzz_per_group.py`) compare the two on every tracked request after every step."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock as VllmBlock

from hybrid_alloc import integration
from hybrid_alloc._native import NativeBlockPool, block_ids
from hybrid_alloc.integration.scheduler import manager_patches
from tests.helpers import assert_block_ids_as_vllm

_POOL = NativeBlockPool(64, True, 16, label="block-ids")
_HANDLES = _POOL.get_new_blocks(63)
_VLLM_BLOCKS = [VllmBlock(i) for i in range(40)]

# One block: a handle of this package or one of vLLM's own blocks, picked by index.
_block = st.one_of(
    st.integers(0, len(_HANDLES) - 1).map(lambda i: _HANDLES[i]),
    st.integers(0, len(_VLLM_BLOCKS) - 1).map(lambda i: _VLLM_BLOCKS[i]),
)
_group = st.lists(_block, max_size=12)


@settings(max_examples=200, deadline=None)
@given(group=_group, kind=st.sampled_from(["list", "tuple", "iterator", "reversed"]))
def test_block_ids_reads_every_block_as_vllm_does(group: list[Any], kind: str) -> None:
    made: Any = {
        "list": lambda: list(group),
        "tuple": lambda: tuple(group),
        "iterator": lambda: iter(group),
        "reversed": lambda: reversed(group),
    }[kind]
    expected = [blk.block_id for blk in made()]
    got = block_ids(made())
    assert got == expected
    assert type(got) is list and all(type(i) is int for i in got)


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(_group, min_size=1, max_size=4), data=st.data())
def test_get_block_ids_answers_as_vllm(groups: list[list[Any]], data: Any) -> None:
    blocks = KVCacheBlocks(tuple(groups))
    assert_block_ids_as_vllm(blocks, "random groups")
    # Any selection of groups (repeats allowed), as vLLM's connectors pass them.
    group_ids = data.draw(st.lists(st.integers(0, len(groups) - 1), max_size=5))
    allow_none = data.draw(st.booleans())
    assert manager_patches.get_block_ids(
        blocks, allow_none, group_ids=group_ids
    ) == manager_patches.vllm_get_block_ids(blocks, allow_none, group_ids=group_ids)


def test_empty_groups() -> None:
    empty = KVCacheBlocks(([], ()))
    assert manager_patches.get_block_ids(empty, allow_none=True) is None
    assert manager_patches.get_block_ids(empty) == ([], [])
    one = KVCacheBlocks(([], [_HANDLES[3]]))
    assert manager_patches.get_block_ids(one, allow_none=True) == ([], [_HANDLES[3].block_id])
    assert manager_patches.get_block_ids(one, allow_none=True, group_ids=[0]) is None


def test_bad_input_raises_as_vllm_does() -> None:
    with pytest.raises(TypeError):
        block_ids(5)
    with pytest.raises(AttributeError, match="block_id"):
        block_ids([_HANDLES[0], object()])
    bad = KVCacheBlocks(([_HANDLES[0]],))
    for method in (manager_patches.get_block_ids, manager_patches.vllm_get_block_ids):
        with pytest.raises(IndexError):
            method(bad, group_ids=[1])


def test_installed_with_the_pool_and_put_back() -> None:
    before = integration.installed()
    integration.install(per_group_pools=False)
    try:
        assert KVCacheBlocks.get_block_ids is manager_patches.get_block_ids
    finally:
        integration.uninstall()
        restored = KVCacheBlocks.get_block_ids
        if before is not None:
            integration.install(per_group_pools=before[1])
    assert restored is manager_patches.vllm_get_block_ids
