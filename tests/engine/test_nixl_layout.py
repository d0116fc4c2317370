"""The NIXL descriptors of per-group pools (:mod:`hybrid_alloc.integration.kv_transfer.nixl`),
checked against vLLM's own worker allocation: a transfer that copies bytes descriptor by
descriptor, from a prefill engine's KV cache into a decode engine's of another size, moves
each layer's pages of the named blocks and nothing else."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hybrid_alloc.integration.kv_transfer import nixl
from tests.planner.specs import small_engine_config
from tests.planner.test_engine_sizing import qwen_like_specs


def per_group_config(
    memory: int, elastic: bool, layout_name: str, kernel_blocks: int = 1
) -> tuple[object, object]:
    """(config, vLLM's per-layer views of its KV cache) of the Qwen-like layout (3 GDN
    layers l.0-l.2 in group 0, attention l.3 in group 1) in ``memory`` bytes; the
    runner splits each attention block into ``kernel_blocks``."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    layout = KVCacheLayout[layout_name]
    cfg = small_engine_config("none")
    cfg.cache_config.get_resolved_kv_cache_layout = lambda: layout
    specs = qwen_like_specs("none")
    groups = sizing.build_groups(specs)
    if elastic:
        config = sizing.build_elastic_config(
            cfg, groups, sizing.size_elastic_groups(cfg, groups, [memory], [specs])
        )
    else:
        config = sizing.build_config(cfg, groups, sizing.size_groups(cfg, groups, memory))
    kernel_sizes = [
        g.kv_cache_spec.block_size // (1 if i == 0 else kernel_blocks)
        for i, g in enumerate(config.kv_cache_groups)
    ]
    return config, allocate_kv_cache(config, torch.device("cpu"), layout, kernel_sizes)


def regions_of(
    config: object, caches: dict[str, torch.Tensor], kernel_blocks: int = 1
) -> list[nixl.Region]:
    base = next(iter(caches.values())).untyped_storage().data_ptr()
    layer_specs = {
        name: group.kv_cache_spec
        for group in config.kv_cache_groups  # type: ignore[attr-defined]
        for name in group.layer_names
    }
    regions = nixl.layer_regions(config, base, layer_specs, str, kernel_blocks)  # type: ignore[arg-type]
    nixl.check_region_views(regions, caches, base)
    return regions


def kernel_ids(block_ids: list[list[int]], kernel_blocks: int) -> list[list[int]]:
    """Block IDs as vLLM's NIXL worker hands them to the descriptors: each attention
    block (group 1) as its kernel blocks; state blocks (group 0) as they are."""
    attention = [b * kernel_blocks + k for b in block_ids[1] for k in range(kernel_blocks)]
    return [block_ids[0], attention]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def copy_by_descriptors(
    src: np.ndarray, src_ids: np.ndarray, dst: np.ndarray, dst_ids: np.ndarray
) -> None:
    """What one NIXL read does: descriptor ``dst_ids[i]`` gets descriptor ``src_ids[i]``'s
    bytes (same lengths)."""
    import ctypes

    assert len(src_ids) == len(dst_ids)
    for s, d in zip(src_ids, dst_ids, strict=True):
        (src_addr, src_len, _), (dst_addr, dst_len, _) = src[s], dst[d]
        assert src_len == dst_len
        ctypes.memmove(int(dst_addr), int(src_addr), int(src_len))


@pytest.mark.parametrize(
    ("layout_name", "kernel_blocks"),
    [("LBHNC", 1), ("LBNHC", 1), ("BLHNC", 1), ("BLNHC", 1), ("LBHNC", 2)],
)
@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "static"])
def test_descriptors_move_each_groups_pages(
    layout_name: str, kernel_blocks: int, elastic: bool
) -> None:
    """``kernel_blocks`` 2: the static split's attention blocks viewed as two kernel
    blocks each (the runners never split elastic pools' blocks), block IDs expanded as
    vLLM's NIXL worker expands them."""
    if elastic and kernel_blocks > 1:
        pytest.skip("the runners never split block-outermost (elastic) blocks")
    prefill, p_caches = per_group_config(4 << 20, elastic, layout_name, kernel_blocks)
    decode, d_caches = per_group_config(6 << 20, elastic, layout_name, kernel_blocks)
    p_regions = regions_of(prefill, p_caches, kernel_blocks)
    d_regions = regions_of(decode, d_caches, kernel_blocks)
    assert [r.layer for r in p_regions] == ["l.0", "l.1", "l.2", "l.3"]
    assert [r.group for r in p_regions] == [0, 0, 0, 1]
    # The two engines share pages and layers, not block counts (their budgets differ).
    assert nixl.layout_fingerprint(p_regions, 16) == nixl.layout_fingerprint(d_regions, 16)
    assert [r.num_blocks for r in p_regions] != [r.num_blocks for r in d_regions]

    generator = torch.Generator().manual_seed(0)
    for caches in (p_caches, d_caches):
        for cache in caches.values():
            raw = cache.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    storage = next(iter(d_caches.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    before = raw.clone()
    p_last = [p_regions[0].num_blocks - 1, p_regions[3].num_blocks // kernel_blocks - 1]
    remote = [[p_last[0]], [3, 1, p_last[1]]]  # one state, three attention blocks
    local = [[d_regions[0].num_blocks - 1], [2, 7, 5]]
    src = nixl.region_descriptors(p_regions, 0)
    dst = nixl.region_descriptors(d_regions, 0)
    groups = [r.group for r in p_regions]
    src_ids = nixl.descriptor_ids(
        kernel_ids(remote, kernel_blocks), groups, [r.num_blocks for r in p_regions]
    )
    dst_ids = nixl.descriptor_ids(
        kernel_ids(local, kernel_blocks), groups, [r.num_blocks for r in d_regions]
    )
    # The decode side's pages are disjoint (as its pools hand them out), one per layer.
    written = sorted((int(a) - storage.data_ptr(), int(n)) for a, n, _ in dst[dst_ids])
    assert len(written) == 3 * 1 + 1 * 3 * kernel_blocks
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(written))
    copy_by_descriptors(src, src_ids, dst, dst_ids)

    for group, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
        for region in (r for r in d_regions if r.group == group):
            split = kernel_blocks if group == 1 else 1
            for d_block, p_block in zip(mine, theirs, strict=True):
                rows = slice(d_block * split, (d_block + 1) * split)
                got = d_caches[region.layer][rows]
                want = p_caches[region.layer][p_block * split : (p_block + 1) * split]
                # Bytes, not values: random bytes make NaNs, which equal nothing.
                assert torch.equal(as_bytes(got), as_bytes(want)), (region.layer, d_block)
    # Every other byte of the decode side's KV cache is as it was.
    untouched = torch.ones(raw.numel(), dtype=torch.bool)
    for offset, length in written:
        untouched[offset : offset + length] = False
    assert torch.equal(raw[untouched], before[untouched])


def test_descriptor_ids_per_group() -> None:
    # Regions of groups 1, 0, 0, 1 holding 10, 5, 5, 10 blocks.
    ids = nixl.descriptor_ids([[2], [3, 4]], [1, 0, 0, 1], [10, 5, 5, 10])
    assert ids.tolist() == [12, 17, 3, 4, 23, 24]
    assert nixl.descriptor_ids([[], []], [1, 0], [4, 4]).tolist() == []
    with pytest.raises(ValueError, match="block 5 of transfer group 0 is outside its pool of 5"):
        nixl.descriptor_ids([[5], []], [1, 0, 0, 1], [10, 5, 5, 10])
    with pytest.raises(ValueError, match="block -1 of transfer group 1"):
        nixl.descriptor_ids([[], [-1]], [1, 0], [4, 4])
    with pytest.raises(ValueError, match="transfer group 2, which has no region"):
        nixl.descriptor_ids([[], [], [1]], [1, 0], [4, 4])


def test_views_that_spread_a_block_are_refused() -> None:
    """Heads outside blocks (LHBNC): a block of an attention layer is not one byte range,
    so one descriptor per layer and block would move the wrong bytes."""
    config, caches = per_group_config(4 << 20, False, "LHBNC")
    with pytest.raises(RuntimeError, match=r"layer l.3('s page of \d+ B does not fit| spreads)"):
        regions_of(config, caches)


def test_peer_with_another_layout_is_refused() -> None:
    from types import SimpleNamespace

    worker = SimpleNamespace(
        _physical_blocks_per_logical_kv_block=1,
        transfer_tp_size=1,
        block_size=16,
        region_names=["l.0", "l.3"],
        region_group_ids=[0, 1],
        block_len_per_layer=[4096, 2048],
        _hybrid_alloc_layout="hybrid_alloc per-group pools abc",
    )
    peer = SimpleNamespace(
        engine_id="P",
        block_size=16,
        physical_blocks_per_logical_kv_block=1,
        region_names=["l.0", "l.3"],
        region_group_ids=[0, 1],
        block_lens=[4096, 2048],
    )
    nixl.check_peer_layout(worker, peer, 1)
    with pytest.raises(RuntimeError, match="tensor parallel size 2 there, 1 here"):
        nixl.check_peer_layout(worker, peer, 2)
    peer.block_lens = [4096, 4096]
    with pytest.raises(RuntimeError, match=r"NIXL peer P .*2 regions there \(l.0: group 0"):
        nixl.check_peer_layout(worker, peer, 1)
    peer.block_lens, peer.block_size = [4096, 2048], 544
    with pytest.raises(RuntimeError, match="block size 544 there, 16 here"):
        nixl.check_peer_layout(worker, peer, 1)
    peer.block_size, peer.physical_blocks_per_logical_kv_block = 16, 2
    with pytest.raises(RuntimeError, match="2 kernel blocks a block there, 1 here"):
        nixl.check_peer_layout(worker, peer, 1)


def test_pd_timing_failures_are_told_from_refusals() -> None:
    """The P/D harness runs a pair again only for NIXL timing failures (a handshake with
    no answer, a read after the lease, a push-mode wave never written), never for a
    refused handshake or a clean run."""
    from tests.helpers import nixl_timing_failure

    def pair(prefill: str, decode: str) -> dict[str, dict[str, str]]:
        return {"prefill": {"log_text": prefill}, "decode": {"log_text": decode}}

    timed_out = (
        "ERROR NIXL transfer failure: handshake_setup_failed | Context: ...\n"
        "zmq.error.Again: Resource temporarily unavailable\n"
    )
    refused = (
        "ERROR NIXL transfer failure: handshake_setup_failed | Context: ...\n"
        "RuntimeError: NIXL compatibility hash mismatch. Local: a, Remote: b\n"
    )
    late = (
        "ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request "
        "0-92449c23 were retrieved by a decode worker. They may have expired.\n"
    )
    assert nixl_timing_failure(pair("", timed_out)) == "the NIXL handshake got no answer in time"
    assert "lease" in (nixl_timing_failure(pair(late, "")) or "")
    assert nixl_timing_failure(pair("", refused)) is None
    assert nixl_timing_failure(pair("INFO all fine", "INFO all fine")) is None
    # Push mode: a wave whose writes never reached the decode side; not a refusal.
    push = "INFO Creating v1 connector with name: NixlPushConnector and engine_id: x\n"
    stalled = "TimeoutError: engine_run: exchange/wave1.done did not appear in 300 s\n"
    assert "push-mode wave" in (nixl_timing_failure(pair(push + stalled, "")) or "")
    assert nixl_timing_failure(pair(push + stalled, refused)) is None
    assert nixl_timing_failure(pair(push, "INFO all fine")) is None
    assert nixl_timing_failure(pair(stalled, "")) is None  # pull mode: not this one


def test_pd_timeline_names_the_events_of_a_late_read() -> None:
    """A pair run again says, from vLLM's log timestamps, when the decode side's handshake
    finished, when the prefill side's lease ran out and when the late read was reported."""
    from tests.helpers import nixl_timeline

    decode = (
        "(Worker pid=7) INFO 11-29 11:39:52 [base_worker.py:1093] NIXL compatibility check "
        "passed (hash: d8)\n"
    )
    prefill = (
        "(Worker pid=9) WARNING 11-29 11:40:21 [base_worker.py:3031] Releasing expired KV "
        "blocks for request 0-b0 which were retrieved by 0 remote worker(s) before lease "
        "expired.\n"
        "(Worker pid=9) ERROR 11-29 11:40:29 [pull_worker.py:667] Potentially invalid KV "
        "blocks for unrecognized request 0-b0 were retrieved by a decode worker. They may "
        "have expired.\n"
    )
    pair = {"prefill": {"log_text": prefill}, "decode": {"log_text": decode}}
    assert nixl_timeline(pair) == (
        "decode handshake done 11-29 11:39:52; prefill lease ran out 11-29 11:40:21; "
        "late read reported 11-29 11:40:29"
    )
    empty = {"prefill": {"log_text": ""}, "decode": {"log_text": "INFO all fine"}}
    assert nixl_timeline(empty) == "no NIXL event logged"
