"""The sizing model itself (:mod:`hybrid_alloc.sizing`, no vLLM): pool order, the split of
the memory left over, errors, and the per-request rules."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybrid_alloc import sizing
from hybrid_alloc.sizing import GroupNeeds, SizingError, size_pools

MiB = 1 << 20


def _groups() -> list[GroupNeeds]:
    return [
        GroupNeeds("mamba", "fixed", 100_000, 3, 2, state_factor=2),
        GroupNeeds("full", "growing", 4096, 2, 64),
        GroupNeeds("window", "bounded", 4096, 1, 9),
        GroupNeeds("narrow", "growing", 1024, 2, 64),
    ]


def test_importing_it_imports_no_vllm() -> None:
    code = "import sys, hybrid_alloc.sizing, hybrid_alloc.planner; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_fixed_then_bounded_then_growing() -> None:
    groups = _groups()
    result = size_pools(groups, available_bytes=64 * MiB, max_num_seqs=8, max_model_len=1024)
    mamba, full, window, narrow = result.pools
    assert mamba.num_blocks == 8 * 2 * 2 + 1 and not mamba.grows
    assert window.num_blocks == 8 * 9 + 1 and not window.grows
    assert full.grows and narrow.grows and result.primary_index == 1
    # Each growing pool: its null block, then the same number of max-length requests.
    assert abs(full.num_blocks - narrow.num_blocks) <= 1
    padding = sizing.REGION_ALIGNMENT * len(groups)
    left = 64 * MiB - padding - result.used_bytes
    assert 0 <= left < full.needs.block_bytes + narrow.needs.block_bytes
    assert result.concurrency == min((p.num_blocks - 1) / 64 for p in (full, narrow))
    assert result.tokens == int(result.concurrency * 1024)


def test_bounded_groups_grow_where_nothing_else_does() -> None:
    groups = [g for g in _groups() if g.kind != "growing"]
    result = size_pools(groups, available_bytes=16 * MiB, max_num_seqs=8, max_model_len=1024)
    assert [p.grows for p in result.pools] == [False, True]
    window = result.pools[1]
    assert window.num_blocks > 8 * 9 + 1  # the memory left over, not max_num_seqs caps
    assert result.concurrency == (window.num_blocks - 1) / 9
    with pytest.raises(ValueError, match="nothing to count capacity in"):
        size_pools(groups[:1], available_bytes=16 * MiB, max_num_seqs=8, max_model_len=1024)


def test_override_sets_the_primary_pool() -> None:
    result = size_pools(
        _groups(),
        available_bytes=64 * MiB,
        max_num_seqs=8,
        max_model_len=1024,
        num_blocks_override=100,
    )
    assert [p.num_blocks for p in result.pools] == [33, 100, 73, 100]
    with pytest.raises(SizingError, match="num_gpu_blocks_override") as err:
        size_pools(
            _groups(),
            available_bytes=64 * MiB,
            max_num_seqs=8,
            max_model_len=1024,
            num_blocks_override=50,
        )
    assert err.value.shortfall_bytes == 0


def test_errors_name_the_group_and_the_numbers() -> None:
    groups = _groups()
    with pytest.raises(SizingError, match="max_num_seqs=8") as fixed:
        size_pools(groups, available_bytes=MiB, max_num_seqs=8, max_model_len=1024)
    message = str(fixed.value)
    assert "mamba: 33 blocks x 300,000 B = 9,900,000 B" in message
    assert "window: 73 blocks x 4,096 B" in message
    assert [p.needs.name for p in fixed.value.fixed_pools] == ["mamba", "window"]
    # The shortfall is exact: that much more memory and it fits, a byte less and it does not.
    enough = MiB + fixed.value.shortfall_bytes
    size_pools(groups, available_bytes=enough, max_num_seqs=8, max_model_len=1024)
    with pytest.raises(SizingError, match="fewer than one 1,024-token request") as short:
        size_pools(groups, available_bytes=enough - 1, max_num_seqs=8, max_model_len=1024)
    assert short.value.shortfall_bytes == 1
    assert "lower max_model_len" in str(short.value)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(sizing.GROUP_KINDS),
            st.integers(1, 1 << 16),
            st.integers(1, 8),
            st.integers(1, 3000),
        ),
        min_size=1,
        max_size=5,
    ),
    st.integers(1, 64),
    st.integers(1, 1 << 34),
)
def test_the_shortfall_is_exact(
    specs: list[tuple[sizing.GroupKind, int, int, int]], seqs: int, memory: int
) -> None:
    groups = [GroupNeeds(f"g{i}", *spec) for i, spec in enumerate(specs)]
    if not any(g.kind != "fixed" for g in groups):
        return
    try:
        result = size_pools(groups, available_bytes=memory, max_num_seqs=seqs, max_model_len=4096)
    except SizingError as exc:
        assert exc.shortfall_bytes > 0
        more = memory + exc.shortfall_bytes
        size_pools(groups, available_bytes=more, max_num_seqs=seqs, max_model_len=4096)
        return
    padding = sizing.REGION_ALIGNMENT * len(groups)
    assert result.used_bytes + padding <= memory
    for pool in result.pools:
        assert pool.num_blocks - 1 >= (pool.needs.blocks_per_request if pool.grows else 0)


def test_per_request_rules() -> None:
    # Sliding window: window - 1 tokens plus those in flight, one block more; capped by
    # max_model_len.
    assert sizing.sliding_window_blocks(4096, 16, 2048, 32768) == 385
    assert sizing.sliding_window_blocks(4096, 16, 2048, 1000) == 64
    assert sizing.chunked_local_blocks(8192, 16, 2048, 32768) == 640
    assert sizing.mamba_blocks_per_request("none", 2) == 3
    assert sizing.mamba_blocks_per_request("align", 2, 1) == 5
    assert sizing.mamba_blocks_per_request("all", 1, max_model_len=1000, block_size=100) == 11
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        sizing.mamba_blocks_per_request("sometimes", 0)
    assert sizing.mamba_group_kind("all") == "growing"
    assert sizing.mamba_state_factor("align") == sizing.ALIGN_CACHE_FACTOR
    assert sizing.mamba_state_factor("none") == 1
    # Bounded only while the cap is below a full-attention request of max_model_len.
    assert sizing.windowed_kind(385, 16, 32768) == "bounded"
    assert sizing.windowed_kind(64, 16, 1000) == "growing"
    with pytest.raises(ValueError, match="kind"):
        GroupNeeds("x", "sometimes", 1, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page_bytes"):
        GroupNeeds("x", "fixed", 0, 1, 1)
