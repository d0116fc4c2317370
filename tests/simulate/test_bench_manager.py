"""The manager-level bench (``benches/bench_manager.py``) drives vLLM's ``KVCacheManager``
on every layout the way its scheduler does: every request admitted, decoded and freed, the
drop-in pool making stock's decisions, and every block back at the end."""

from __future__ import annotations

from typing import Any

import pytest

from tests.simulate.cases import load_bench

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _held_blocks(engine: Any) -> dict[str, int]:
    """Blocks not back in each pool (elastic pools: less what the budget lent away)."""
    held = {}
    for i, pool in enumerate(engine.pools()):
        lent = getattr(pool, "_held_by_budget", lambda: 0)()
        held[str(getattr(pool, "label", i))] = (
            pool.num_gpu_blocks - 1 - pool.get_num_free_blocks() - lent
        )
    return held


@pytest.mark.parametrize("mode", ["none", "align"])
def test_manager_bench_runs_every_layout(mode: str) -> None:
    from hybrid_alloc.integration.simulator import SimSettings

    bench = load_bench("bench_manager")
    settings = SimSettings(
        memory=2 * 2**30, mamba_cache_mode=mode, max_num_seqs=12, time_model="fixed"
    )
    prompts = bench.request_mix(12, 3, 1200, (16, 200), seed=1)
    seen: dict[str, list[Any]] = {}
    for name, layout in bench.LAYOUTS.items():
        engine = bench.build("qwen3.5-0.8b", settings, layout)
        manager = engine.scheduler.kv_cache_manager
        ids: list[Any] = []
        original = manager.free

        def free(
            request: Any, original: Any = original, ids: list[Any] = ids, manager: Any = manager
        ) -> None:
            ids.append(manager.get_block_ids(request.request_id))
            original(request)

        manager.free = free
        t = bench.Timings()
        # Run with the layout's own hooks installed, as the bench runs it.
        bench.run_round({name: bench.MixRun(name, engine, prompts, 40)}, 40, {name: t})
        assert len(t.prefill_s) == len(t.decode_step_s) == len(t.free_s) == 1
        assert t.blocks_per_request > 0
        if mode == "align":
            # Later requests of a prefix hit the cache (1,200 tokens: two of stock's blocks).
            assert t.prefix_hit_tokens > 0, name
        assert all(n == 0 for n in _held_blocks(engine).values()), (name, _held_blocks(engine))
        for pool in engine.pools():
            check = getattr(pool, "check_invariants", None)
            if check is not None:
                check()
        seen[name] = ids
    # The drop-in pool is vLLM's layout on the Rust pool: the same block IDs as stock's.
    assert seen["drop-in"] == seen["stock"]
    # Per-group pools hold each request in 16-token blocks: more of them than stock's.
    assert len(seen["elastic"]) == len(seen["stock"]) == len(prompts)
