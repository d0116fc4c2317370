"""Named regression tests: counterexamples the state machines found, replayed on their own.

Each test says which machine found it and what went wrong."""

from __future__ import annotations

from typing import Any
from unittest import mock

from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.block_pool import BlockPool as StockPool
from vllm.v1.request import RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration.scheduler.block_pool import BlockPool as RustPool
from tests.helpers import (
    BLOCK,
    build_manager,
    check_stock_pool,
    holders,
    new_request,
    rust_snapshot,
    stock_snapshot,
)

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


class RecordingStockPool(StockPool):
    """vLLM's pool, recording each refused ``get_new_blocks`` and whether the refusal
    left the pool as it was."""

    def get_new_blocks(self, num_blocks: int) -> Any:
        before = stock_snapshot(self)
        try:
            return super().get_new_blocks(num_blocks)
        except ValueError as e:
            REFUSALS.append(("stock", num_blocks, str(e), stock_snapshot(self) == before))
            raise


class RecordingRustPool(RustPool):
    """Our pool, recording the same."""

    def get_new_blocks(self, num_blocks: int) -> Any:
        before = rust_snapshot(self)
        try:
            return super().get_new_blocks(num_blocks)
        except ValueError as e:
            REFUSALS.append(("ours", num_blocks, str(e), rust_snapshot(self) == before))
            raise


REFUSALS: list[tuple[str, int, str, bool]] = []


def run_claims(pool_cls: type) -> tuple[Any, tuple[int, str] | None]:
    """Replay the claims on a manager whose coordinator builds ``pool_cls``; returns the
    manager and (step, message) of the allocation that raised, if any."""
    if issubclass(pool_cls, RustPool):
        integration.install(per_group_pools=False)
    else:
        integration.uninstall()
    with mock.patch.object(kv_cache_coordinator, "BlockPool", pool_cls):
        mgr = build_manager(pool_cls, "full+mamba_align", 68, False)
    try:
        for i, (prefix_len, suffix, ext_blocks, load_async) in enumerate(
            MAMBA_ALIGN_EXTERNAL_CLAIMS
        ):
            tokens = PREFIX[:prefix_len] + [(i * 13 + k) % 5000 + 3 for k in range(suffix)]
            req = new_request(f"r{i}", tokens)
            blocks, hit, _ = mgr.get_computed_blocks(req)
            ext = max(0, min(ext_blocks * BLOCK, (req.num_tokens - 1 - hit) // BLOCK * BLOCK))
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
                return mgr, (i, str(e))
            assert got is not None
            if load_async and ext > 0:
                req.num_computed_tokens = hit + ext
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            else:
                req.num_computed_tokens = req.num_tokens
                req.status = RequestStatus.RUNNING
        return mgr, None
    finally:
        integration.uninstall()


def test_mamba_align_external_claim_overallocation() -> None:
    """Found by ManagerMachine (full attention + Mamba 'align', 68 blocks). After several
    async external loads, a synchronous external claim passes vLLM's admission check,
    then its Mamba manager asks the pool for one block more than is free. The accounting
    is vLLM's, not the pool's: the stock pool raises the same ValueError at the same
    step. Both pools must refuse that ``get_new_blocks`` without changing anything, and
    end in the same state (blocks the manager took before the refused call, prefix hits
    and other groups' blocks, stay with the request: reference counts == holders)."""
    REFUSALS.clear()
    stock, failure_s = run_claims(RecordingStockPool)
    ours, failure_o = run_claims(RecordingRustPool)
    assert failure_s is not None, "vLLM's over-allocation no longer happens"
    assert failure_o is not None
    assert failure_o[0] == failure_s[0] == len(MAMBA_ALIGN_EXTERNAL_CLAIMS) - 1
    assert "Cannot get 1 free blocks" in failure_s[1]
    # Ours names the pool and says how many blocks are free.
    assert failure_o[1] == "BlockPool: Cannot get 1 free blocks from the pool: only 0 are free"
    # One refused get_new_blocks on each pool, asking for the same count, and neither
    # refusal changed its pool.
    assert [(side, n, unchanged) for side, n, _, unchanged in REFUSALS] == [
        ("stock", 1, True),
        ("ours", 1, True),
    ]
    assert rust_snapshot(ours.block_pool) == stock_snapshot(stock.block_pool)
    ours.block_pool.check_invariants()
    managers = ours.coordinator.single_type_managers
    refs = ours.block_pool.ref_counts()
    assert {bid: c for bid, c in enumerate(refs) if c} == dict(holders(managers))
    check_stock_pool(stock.block_pool, stock.coordinator.single_type_managers)
