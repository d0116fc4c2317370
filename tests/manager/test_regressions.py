"""Named regression tests: counterexamples the state machines found, replayed on their own.

Each test says which machine found it and what went wrong."""

from __future__ import annotations

import pytest
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.request import RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration.block_pool import BlockPool as RustPool
from tests.helpers import BLOCK, build_manager, new_request

PREFIX = [(i * 31) % 5000 + 3 for i in range(64)]
# (prefix_len, suffix_len, external blocks claimed, load asynchronously), as drawn.
MAMBA_ALIGN_EXTERNAL_CLAIMS = [
    (16, 1, 0, False),
    (32, 1, 0, False),
    (64, 1, 0, False),
    (48, 1, 1, True),
    (48, 33, 1, True),
    (64, 17, 1, True),
    (64, 33, 1, True),
    (64, 1, 0, True),
    (64, 17, 0, True),
    (32, 17, 3, False),
    (32, 1, 1, False),
]


@pytest.mark.parametrize("pool_cls", [StockPool, RustPool], ids=["stock", "rust"])
def test_mamba_align_external_claim_overallocation(pool_cls: type) -> None:
    """Found by ManagerMachine (full attention + Mamba 'align', 68 blocks). After several
    async external loads, a synchronous external claim passes vLLM 0.32's admission check,
    then its Mamba manager asks the pool for one block more than is free. The accounting is
    vLLM's, not the pool's (the stock pool raises the same ValueError); the pool must refuse
    the allocation without changing anything and stay consistent."""
    if pool_cls is RustPool:
        integration.install(per_group_pools=False)
    else:
        integration.uninstall()
    try:
        mgr = build_manager(pool_cls, "full+mamba_align", 68, False)
        failure = None
        for i, (prefix_len, suffix, ext_blocks, load_async) in enumerate(
            MAMBA_ALIGN_EXTERNAL_CLAIMS
        ):
            tokens = PREFIX[:prefix_len] + [(i * 13 + k) % 5000 + 3 for k in range(suffix)]
            req = new_request(f"r{i}", tokens)
            blocks, hit, _ = mgr.get_computed_blocks(req)
            ext = max(0, min(ext_blocks * BLOCK, (req.num_tokens - 1 - hit) // BLOCK * BLOCK))
            free_before = mgr.block_pool.get_num_free_blocks()
            try:
                got = mgr.allocate_slots(
                    req,
                    req.num_tokens - hit - ext,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=blocks,
                    num_external_computed_tokens=ext,
                    delay_cache_blocks=load_async and ext > 0,
                )
            except ValueError as e:
                failure = (i, str(e), free_before, mgr.block_pool.get_num_free_blocks())
                break
            assert got is not None
            if load_async and ext > 0:
                req.num_computed_tokens = hit + ext
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            else:
                req.num_computed_tokens = req.num_tokens
                req.status = RequestStatus.RUNNING
        assert failure is not None, "vLLM's over-allocation no longer happens"
        step, message, free_before, free_after = failure
        assert step == len(MAMBA_ALIGN_EXTERNAL_CLAIMS) - 1
        assert "Cannot get 1 free blocks" in message
        if pool_cls is RustPool:
            pool = mgr.block_pool
            pool.check_invariants()
            # The refused call took nothing from the pool itself; blocks taken before it
            # (prefix hits touched by the manager) are still held by the request.
            assert free_after <= free_before
            assert free_after == pool.get_num_free_blocks()
    finally:
        integration.uninstall()
