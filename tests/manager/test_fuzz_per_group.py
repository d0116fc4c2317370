"""A hypothesis state machine: vLLM's own `KVCacheManager` with per-group pools (the
per-group coordinator over a `PoolSet`) against vLLM's genuine stock `KVCacheManager`,
coordinator and pool (built with the integration uninstalled), driven with the same
requests.

Layouts: full attention + Mamba 'none' (no prefix caching), full attention + Mamba
'align', full + sliding window + Mamba 'align', two full-attention groups of different
specs (two pools that grow), and two full-attention groups of one spec sharing a pool
next to Mamba 'align'; our pools may be listed in the reverse order of their groups (pool
indices are then not group indices). Mamba specs carry speculative blocks where the
example decodes with drafts. Rules follow a scheduler: admit with prefix hits
and external connector claims (loaded synchronously or asynchronously), decode one token
or spec-style steps (several tokens, lookahead slots, drafts accepted or rejected),
preempt, resume, async loads that finish or fail, finish, eviction by (group, IDs),
prefix-cache reset, new steps; KV-cache events are on.

Three sizings, drawn per example:

* ample: the stock pool and every per-group pool are large enough that nothing is ever
  evicted to make room or refused, so both layouts must make the same decisions: the
  same admissions, prefix-hit lengths, block lists (same shapes, same sharing between
  requests, same null padding: block IDs differ, they are pool-scoped), the same cache
  contents and the same KV-cache events;
* tight: the stock pool has N blocks and every per-group pool has N blocks too (the
  capacity each group has in stock's shared pool), so allocations fail, requests are
  preempted and cached blocks evicted. Ours must admit (and decode) whenever stock does;
  where only ours can, its allocation is undone (the request waits, or is preempted, in
  both);
* skewed: every per-group pool has its own small size, so any pool (a Mamba pool, the
  second growing pool) can be the one that runs out. Decisions may go either way; where
  they differ the allocation that went through is undone.

In every sizing, our admission of a request is checked against vLLM's per-group counts
(each manager's ``get_num_blocks_to_allocate``, summed per pool): admitted exactly when
every pool can hold its groups' share, and never failing inside an allocation it admitted.
Undoing an allocation that went through on one side only also undoes what vLLM's Mamba
manager noted as cached in that step (it defers hits on such states).

Outside ample sizing, prefix caches are kept equal by evicting, before every lookup and
after every rule, what one side has cached and the other has not (both through the
managers' public ``evict_blocks``), so prefix-hit lengths are compared exactly in every
sizing.

After every step: each of our pools passes its own ``check_invariants()`` and our own
cross-checks (free + held + null == total, reference counts == holders across every
manager's block lists, no handle outside its group's pool, the free queue is exactly the
unreferenced blocks, cache and blocks consistent both ways, no key of another pool's
group); vLLM's pool passes the same checks through its internals; our events, replayed on
their own, rebuild our cache contents.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import initialize, invariant, precondition, rule
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc import integration
from hybrid_alloc.integration.scheduler import coordinator as pg_coordinator
from hybrid_alloc.integration.scheduler import manager_patches
from tests.helpers import (
    BLOCK,
    MAX_LEN,
    PER_GROUP_LAYOUTS,
    SHARED_POOLS,
    CountingMachine,
    assert_block_ids_as_vllm,
    budget,
    check_our_pool,
    check_stock_pool,
    engine_hooks_installed,
    genuine_stock_manager,
    new_request,
    normalize_events,
    per_group_caching,
    per_group_config,
    per_group_manager,
    scheduler_block_size,
    state_mamba,
    stepping,
    stock_config,
)

AMPLE_STOCK_BLOCKS = 1536
AMPLE_POOL_BLOCKS = 768
"""No example allocates more than a few hundred blocks per group: nothing is evicted."""

# (prefix, prefix length, suffix length, external blocks claimed, load asynchronously,
#  full sequence must fit, decode steps)
ADMISSION = st.tuples(
    st.integers(0, 2),
    st.sampled_from([16, 32, 48, 64]),
    st.integers(0, 40),
    st.integers(0, 3),
    st.booleans(),
    st.booleans(),
    st.integers(1, 30),
)


@dataclass
class Tracked:
    """A request in both managers, as a scheduler tracks it."""

    stock: Request
    ours: Request
    state: str  # "running" | "loading" (async external load in flight) | "preempted"
    remaining: int
    ext_start: int = 0


def stock_cache(pool: Any) -> dict[bytes, list[Any]]:
    """vLLM's prefix cache: key -> blocks."""
    out = {}
    for key, val in pool.cached_block_hash_to_block._cache.items():
        out[key] = [val] if hasattr(val, "block_id") else list(val.values())
    return out


def our_cache(pools: Any) -> dict[bytes, list[Any]]:
    """Every pool's prefix cache: key -> blocks (keys carry their group: no collisions)."""
    out = {}
    for pool in pools:
        for key, ids in pool.cache_entries():
            assert key not in out
            out[key] = [pool.blocks[i] for i in ids]
    return out


@contextmanager
def side_installed(side: str) -> Iterator[None]:
    """vLLM's classes as one side runs them: stock with the integration uninstalled,
    ours with it installed and the per-group coordinator's hooks (as the engine installs
    them: its running-requests table answers decode steps and hears of evictions)."""
    if side == "stock":
        pg_coordinator.uninstall()
        integration.uninstall()
        yield
    else:
        with engine_hooks_installed():
            yield


def has(state: str) -> Any:
    """Precondition: some request is in ``state`` (rules run only where they apply)."""
    return lambda self: any(t.state == state for t in self.tracked.values())


def outcome(result: Any, error: BaseException | None, external_mamba_claim: bool) -> bool:
    """Whether ``allocate_slots`` allocated. It may raise only where vLLM's own
    accounting can count fewer Mamba 'align' blocks than it then allocates: an external
    claim (see test_regressions.py); the pool must then refuse cleanly."""
    if error is not None:
        assert external_mamba_claim, error
        assert isinstance(error, ValueError) and "Cannot get" in str(error), error
        event("admission: vLLM over-allocation refused by the pool")
        return False
    return result is not None


class PerGroupMachine(CountingMachine):
    MACHINE = "per_group"

    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[str, Tracked] = {}
        self.next_id = 0
        self.token = 29
        self.replayed: Counter[tuple[Any, int]] = Counter()

    @initialize(
        layout=st.sampled_from(sorted(PER_GROUP_LAYOUTS)),
        sizing=st.sampled_from(["ample", "tight", "skewed"]),
        tight_blocks=st.integers(12, 40),
        skew=st.lists(st.integers(4, 40), min_size=3, max_size=3),
        spec=st.sampled_from([0, 2]),
        reverse=st.booleans(),
        first=st.lists(ADMISSION, min_size=1, max_size=3),
    )
    def build(
        self,
        layout: str,
        sizing: str,
        tight_blocks: int,
        skew: list[int],
        spec: int,
        reverse: bool,
        first: list[Any],
    ) -> None:
        """Both managers (with ``reverse``, our pools are listed in the reverse order of
        their groups: pool indices are not group indices), then a few requests admitted
        (every example starts with state)."""
        specs = [
            state_mamba(s.mamba_cache_mode, spec) if isinstance(s, MambaSpec) else s
            for s in PER_GROUP_LAYOUTS[layout]
        ]
        self.layout = layout
        self.sizing = sizing
        self.ample = sizing == "ample"
        self.spec = spec
        self.caching = per_group_caching(specs)
        self.align = scheduler_block_size(specs) if self.caching else BLOCK
        pools = SHARED_POOLS.get(layout, [(g,) for g in range(len(specs))])
        if reverse:
            pools = pools[::-1]
        if self.ample:
            stock_blocks, sizes = AMPLE_STOCK_BLOCKS, [AMPLE_POOL_BLOCKS] * len(pools)
        elif sizing == "tight":
            stock_blocks, sizes = tight_blocks, [tight_blocks] * len(pools)
        else:
            stock_blocks, sizes = tight_blocks, skew[: len(pools)]
        self.stock = genuine_stock_manager(stock_config(specs, stock_blocks), events=True)
        self.ours = per_group_manager(per_group_config(specs, sizes, pools), events=True)
        self.pools = self.ours.block_pool
        self.stock_managers = self.stock.coordinator.single_type_managers
        self.our_managers = self.ours.coordinator.single_type_managers
        self.prefixes = [[(p * 977 + i * 31) % 5000 + 3 for i in range(64)] for p in range(3)]
        event(f"layout={layout} sizing={sizing} spec={spec} reverse={reverse}")
        for params in first:
            self.admit_new(*params)
        self.after_rule()

    def teardown(self) -> None:
        integration.uninstall()

    # ---------------------------------------------------------------- helpers
    def run(self, side: str, fn: str, rid: str, *args: Any, **kwargs: Any) -> Any:
        """``fn(request, ...)`` on one side's manager: vLLM's with the integration
        uninstalled, ours with it installed (the batched lookup, our ``allocate_slots``);
        returns (result, error)."""
        t = self.tracked[rid]
        mgr, req = (self.stock, t.stock) if side == "stock" else (self.ours, t.ours)
        with side_installed(side):
            try:
                return getattr(mgr, fn)(req, *args, **kwargs), None
            except ValueError as e:
                return None, e

    def both(self, fn: str, rid: str, *args: Any, **kwargs: Any) -> None:
        for side in ("stock", "ours"):
            _, error = self.run(side, fn, rid, *args, **kwargs)
            assert error is None, error

    def step_marks(self) -> tuple[list[set[bytes]], list[set[bytes]]]:
        """What vLLM's Mamba managers cached in this step, on each side."""
        return tuple(  # type: ignore[return-value]
            [set(getattr(m, "cached_blocks_this_step", ())) for m in managers]
            for managers in (self.stock_managers, self.our_managers)
        )

    def undo_marks(self, side: str, marks: Any) -> None:
        """An allocation that went through on one side only is undone (the request is
        freed): so is what vLLM's Mamba manager noted as cached in this step for it,
        which would otherwise defer the other side's later hits on those states."""
        managers = self.stock_managers if side == "stock" else self.our_managers
        saved = marks[0] if side == "stock" else marks[1]
        for manager, keys in zip(managers, saved, strict=True):
            if hasattr(manager, "cached_blocks_this_step"):
                manager.cached_blocks_this_step.clear()
                manager.cached_blocks_this_step.update(keys)

    def allocate(self, rid: str, *args: Any, **kwargs: Any) -> tuple[bool, bool]:
        """``allocate_slots`` on both; ample pools decide alike, tight per-group pools
        admit whenever stock does. Returns (stock allocated, ours allocated); where only
        one side allocated, the caller undoes it (it preempts the request on both)."""
        marks = self.step_marks()
        res_s, err_s = self.run("stock", "allocate_slots", rid, *args, **kwargs)
        res_o, err_o = self.run("ours", "allocate_slots", rid, *args, **kwargs)
        ok_s, ok_o = outcome(res_s, err_s, False), outcome(res_o, err_o, False)
        if ok_s != ok_o:
            self.undo_marks("stock" if ok_s else "ours", marks)
        if self.ample:
            assert ok_s == ok_o
            if ok_s:
                shape_s = [[b.is_null for b in g] for g in res_s.blocks]
                assert shape_s == [[b.is_null for b in g] for g in res_o.blocks]
        elif self.sizing == "tight":
            assert ok_o or not ok_s, "stock allocated, the per-group pools refused"
        event(f"allocate: stock={ok_s} ours={ok_o}")
        return ok_s, ok_o

    def on_both(self, rid: str, action: Any) -> None:
        t = self.tracked[rid]
        action(t.stock)
        action(t.ours)

    def pick(self, data: st.DataObject, state: str) -> str | None:
        rids = sorted(r for r, t in self.tracked.items() if t.state == state)
        return data.draw(st.sampled_from(rids)) if rids else None

    def next_token(self) -> int:
        self.token = (self.token * 31 + 7) % 5000 + 3
        return self.token

    def advance(self, rid: str, num_tokens: int) -> None:
        """A step computed the request's pending token and ``num_tokens - 1`` accepted
        drafts: they become computed, and as many new tokens are sampled."""
        new = [self.next_token() for _ in range(num_tokens)]

        def step(req: Request) -> None:
            req.num_computed_tokens = req.num_tokens - 1 + num_tokens
            req.spec_token_ids = []
            req.append_output_token_ids(list(new))
            req.status = RequestStatus.RUNNING

        self.on_both(rid, step)

    def free_both(self, rid: str) -> None:
        self.both("free", rid)

    def preempt_request(self, rid: str) -> None:
        self.free_both(rid)

        def reset(req: Request) -> None:
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.spec_token_ids = []
            req.num_preemptions += 1

        self.on_both(rid, reset)
        self.tracked[rid].state = "preempted"

    def lookup(self, rid: str) -> tuple[Any, Any, int]:
        if not self.ample:
            self.equalize_caches()
        (blocks_s, hit_s, _), err = self.run("stock", "get_computed_blocks", rid)
        assert err is None
        (blocks_o, hit_o, _), err = self.run("ours", "get_computed_blocks", rid)
        assert err is None
        # Prefix caches are equal here (ample pools, or kept equal): so are the hits.
        assert hit_s == hit_o, (hit_s, hit_o)
        assert [len(g) for g in blocks_s.blocks] == [len(g) for g in blocks_o.blocks]
        event(f"lookup: hit={hit_s > 0}")
        return blocks_s, blocks_o, hit_s

    def fits(
        self,
        rid: str,
        blocks: Any,
        hit: int,
        ext: int,
        new: int,
        lookahead: int,
        must_fit: bool,
    ) -> bool:
        """Whether every one of our pools can hold what its groups need for this
        admission (the request holds no block yet): vLLM's per-group counts (each
        manager's ``get_num_blocks_to_allocate``, called with the arguments
        ``allocate_slots`` passes), summed per pool, against each pool's free count;
        with ``full_sequence_must_fit`` the whole sequence must fit first."""
        req = self.tracked[rid].ours
        max_len = self.ours.max_model_len
        local = req.num_computed_tokens + hit
        total = min(local + ext, max_len)
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if self.ours.coordinator.retention_interval != 0:
            prefill_end = 0
        free = self.pools.free_counts()

        def pool_needs(num_tokens: int, main: int, cap: bool) -> list[int]:
            need = [0] * len(free)
            for gid, manager in enumerate(self.our_managers):
                need[self.pools.pool_index_of_group(gid)] += manager.get_num_blocks_to_allocate(
                    rid,
                    num_tokens,
                    blocks.blocks[gid],
                    total if cap else local + ext,
                    local,
                    main,
                    apply_admission_cap=cap,
                    prefill_end=prefill_end,
                )
            return need

        if must_fit:
            full = min(req.num_tokens, max_len)
            if any(n > f for n, f in zip(pool_needs(full, full, True), free, strict=True)):
                return False
        main = total + new
        need = pool_needs(min(main + lookahead, max_len), main, False)
        return all(n <= f for n, f in zip(need, free, strict=True))

    def admit_tracked(self, rid: str, ext_blocks: int, load_async: bool, must_fit: bool) -> bool:
        """Prefix lookup, a connector claim of ``ext_blocks`` more aligned blocks, then
        the allocation; True if the request now runs (or loads) in both."""
        t = self.tracked[rid]
        blocks_s, blocks_o, hit = self.lookup(rid)
        num_tokens = t.stock.num_tokens
        ext = max(
            0, min(ext_blocks * self.align, (num_tokens - 1 - hit) // self.align * self.align)
        )
        new = num_tokens - hit - ext
        lookahead = self.spec if self.spec and not load_async else 0
        delay = load_async and ext > 0
        kwargs = {
            "num_new_computed_tokens": hit,
            "num_lookahead_tokens": lookahead,
            "num_external_computed_tokens": ext,
            "delay_cache_blocks": delay,
            "full_sequence_must_fit": must_fit,
        }
        expected = self.fits(rid, blocks_o, hit, ext, new, lookahead, must_fit)
        marks = self.step_marks()
        res_s, err_s = self.run(
            "stock", "allocate_slots", rid, new, new_computed_blocks=blocks_s, **kwargs
        )
        res_o, err_o = self.run(
            "ours", "allocate_slots", rid, new, new_computed_blocks=blocks_o, **kwargs
        )
        mamba_claim = ext > 0 and any(
            isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.mamba_cache_mode == "align"
            for g in self.stock.kv_cache_config.kv_cache_groups
        )
        ok_s = outcome(res_s, err_s, mamba_claim)
        ok_o = outcome(res_o, err_o, mamba_claim)
        event(f"admission: hit={hit > 0} external={ext > 0} stock={ok_s} ours={ok_o}")
        # Per-pool admission is exact: admitted iff every pool holds its groups' share.
        assert ok_o == expected or err_o is not None, (ok_o, expected)
        if self.ample:
            assert (err_s is None) == (err_o is None), (err_s, err_o)
            assert ok_s == ok_o
        elif self.sizing == "tight":
            assert ok_o or not ok_s, "stock admitted, the per-group pools refused"
        if not (ok_s and ok_o):
            # Not admitted (where only one side could, undo it): the request waits.
            # A refused allocation may have taken blocks part-way: give them back.
            if err_s is not None or ok_s:
                self.run("stock", "free", rid)
                self.undo_marks("stock", marks)
            if err_o is not None or ok_o:
                self.run("ours", "free", rid)
                self.undo_marks("ours", marks)
            return False
        if delay:
            # The scheduler records what the load will provide and parks the request.
            def park(req: Request) -> None:
                req.num_computed_tokens = hit + ext
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS

            self.on_both(rid, park)
            t.state = "loading"
            t.ext_start = hit
        else:
            self.advance(rid, 1)
            t.state = "running"
        return True

    def admit_new(
        self,
        prefix: int,
        prefix_len: int,
        suffix: int,
        ext_blocks: int,
        load_async: bool,
        must_fit: bool,
        decode: int,
    ) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = self.prefixes[prefix][:prefix_len] + [
            (self.next_id * 13 + i) % 5000 + 3 for i in range(suffix)
        ]
        self.tracked[rid] = Tracked(new_request(rid, tokens), new_request(rid, tokens), "", decode)
        if not self.admit_tracked(rid, ext_blocks, load_async, must_fit):
            del self.tracked[rid]  # not admitted: the scheduler keeps it waiting

    def continue_after_load(self, rid: str) -> None:
        t = self.tracked[rid]

        def wake(req: Request) -> None:
            req.status = RequestStatus.WAITING

        self.on_both(rid, wake)
        remaining = t.stock.num_tokens - t.stock.num_computed_tokens
        ok_s, ok_o = self.allocate(rid, remaining)
        if ok_s and ok_o:
            self.advance(rid, 1)
            t.state = "running"
        else:
            self.preempt_request(rid)

    # ------------------------------------------------------------------ rules
    @rule(params=ADMISSION)
    @stepping
    def admit(self, params: Any) -> None:
        self.admit_new(*params)

    @precondition(has("running"))
    @rule(data=st.data(), drafts=st.integers(0, 2), accepted=st.integers(0, 2), ahead=st.booleans())
    @stepping
    def decode(self, data: st.DataObject, drafts: int, accepted: int, ahead: bool) -> None:
        """One step: the pending token plus ``drafts`` draft tokens (spec decoding), with
        lookahead slots; ``accepted`` drafts survive verification, the rest roll back."""
        rid = self.pick(data, "running")
        if rid is None:
            return
        t = self.tracked[rid]
        drafts = min(drafts, self.spec)
        accepted = min(accepted, drafts)
        draft_tokens = [self.next_token() for _ in range(drafts)]

        def propose(req: Request) -> None:
            req.spec_token_ids = list(draft_tokens)

        self.on_both(rid, propose)
        ok_s, ok_o = self.allocate(rid, 1 + drafts, num_lookahead_tokens=self.spec if ahead else 0)
        if not (ok_s and ok_o):
            event("decode: preempted (pool full)")
            self.preempt_request(rid)
            return
        event(f"decode: drafts={drafts} rejected={drafts - accepted}")
        self.advance(rid, 1 + accepted)
        t.remaining -= 1 + accepted
        if t.remaining <= 0 or t.stock.num_tokens + 8 > MAX_LEN:
            self.free_both(rid)
            del self.tracked[rid]

    @precondition(has("running"))
    @rule(data=st.data())
    @stepping
    def preempt(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is not None:
            # Blocks are in use: a prefix-cache reset is refused by both, changing nothing.
            assert not self.stock.reset_prefix_cache()
            assert not self.ours.reset_prefix_cache()
            self.preempt_request(rid)

    @precondition(has("preempted"))
    @rule(data=st.data(), ext_blocks=st.integers(0, 2), must_fit=st.booleans())
    @stepping
    def resume(self, data: st.DataObject, ext_blocks: int, must_fit: bool) -> None:
        rid = self.pick(data, "preempted")
        if rid is not None:
            self.admit_tracked(rid, ext_blocks, load_async=False, must_fit=must_fit)

    @precondition(has("loading"))
    @rule(data=st.data())
    @stepping
    def load_finishes(self, data: st.DataObject) -> None:
        """An async external load completes: cache what it brought, then schedule the rest."""
        rid = self.pick(data, "loading")
        if rid is None:
            return
        self.both("cache_blocks", rid, self.tracked[rid].stock.num_computed_tokens)
        self.continue_after_load(rid)

    @precondition(has("loading"))
    @rule(data=st.data())
    @stepping
    def load_fails(self, data: st.DataObject) -> None:
        """An async load fails. Block IDs are pool-scoped, so with several groups vLLM
        recomputes the request from scratch: it gives its blocks back and waits."""
        rid = self.pick(data, "loading")
        if rid is not None:
            self.preempt_request(rid)

    @precondition(has("running"))
    @rule(data=st.data())
    @stepping
    def finish(self, data: st.DataObject) -> None:
        rid = self.pick(data, "running")
        if rid is not None:
            self.free_both(rid)
            del self.tracked[rid]

    @precondition(lambda self: stock_cache(self.stock.block_pool))
    @rule(data=st.data())
    @stepping
    def evict(self, data: st.DataObject) -> None:
        """A connector evicts cached blocks: stock by block ID, ours by (group, IDs)."""
        cached = stock_cache(self.stock.block_pool)
        if not cached:
            return
        keys = data.draw(st.sets(st.sampled_from(sorted(cached)), min_size=1, max_size=3))
        ours = our_cache(self.pools)
        by_group: dict[int, list[int]] = {}
        for key in keys:
            by_group.setdefault(get_group_id(key), []).extend(b.block_id for b in ours[key])
        self.stock.evict_blocks({b.block_id for key in keys for b in cached[key]})
        with side_installed("ours"):
            self.ours.evict_blocks(by_group)  # type: ignore[arg-type]
        for key in keys:
            event(f"evict: group {get_group_id(key)}")

    @precondition(
        lambda self: (
            not (has("running")(self) or has("loading")(self))
            and stock_cache(self.stock.block_pool)
        )
    )
    @rule()
    @stepping
    def reset(self) -> None:
        """No request holds a block (in either layout): both reset their whole cache (a
        reset with blocks in use is refused by both: see ``preempt``)."""
        assert self.stock.reset_prefix_cache()
        assert self.ours.reset_prefix_cache()
        assert not stock_cache(self.stock.block_pool)
        assert not our_cache(self.pools)

    @precondition(
        lambda self: any(getattr(m, "cached_blocks_this_step", None) for m in self.our_managers)
    )
    @rule()
    @stepping
    def new_step(self) -> None:
        """A scheduler step starts: Mamba states cached in the last step become usable."""
        self.stock.new_step_starts()
        self.ours.new_step_starts()

    def after_rule(self) -> None:
        if not self.ample:
            self.equalize_caches()

    def equalize_caches(self) -> None:
        """Tight pools evict different blocks to make room: evict, on each side, what
        only that side has cached, until both caches hold the same keys."""
        for _ in range(8):
            ours = our_cache(self.pools)
            stock = stock_cache(self.stock.block_pool)
            only_ours = ours.keys() - stock.keys()
            only_stock = stock.keys() - ours.keys()
            if not only_ours and not only_stock:
                return
            if only_ours:
                by_group: dict[int, list[int]] = {}
                for key in only_ours:
                    by_group.setdefault(get_group_id(key), []).extend(b.block_id for b in ours[key])
                with side_installed("ours"):
                    self.ours.evict_blocks(by_group)  # type: ignore[arg-type]
            if only_stock:
                self.stock.evict_blocks({b.block_id for k in only_stock for b in stock[k]})
        raise AssertionError("caches do not converge")

    # ------------------------------------------------------------- invariants
    def layout_of(self, side: str) -> tuple[list[Any], dict[tuple[int, int], Any]]:
        """Every request's block list per group, as positions: a block is named by the
        first (group, request, index) that holds it (None for the null block)."""
        managers = self.stock_managers if side == "stock" else self.our_managers
        first: dict[tuple[int, int], Any] = {}
        rows = []
        for gid, manager in enumerate(managers):
            pool = 0 if side == "stock" else self.pools.pool_index_of_group(gid)
            for rid in sorted(r for r, bl in manager.req_to_blocks.items() if bl):
                row = []
                for i, b in enumerate(manager.req_to_blocks[rid]):
                    row.append(
                        None if b.is_null else first.setdefault((pool, b.block_id), (gid, rid, i))
                    )
                rows.append((gid, rid, tuple(row)))
        return rows, first

    def named_cache(self, cache: dict[bytes, list[Any]], first: Any, side: str) -> Any:
        out = {}
        for key, blocks in cache.items():
            pool = 0 if side == "stock" else self.pools.pool_index_of_group(get_group_id(key))
            out[key] = sorted(str(first.get((pool, b.block_id), "free")) for b in blocks)
        return out

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "ours"):
            return
        check_stock_pool(self.stock.block_pool, self.stock_managers)
        for idx, pool in enumerate(self.pools):
            groups = {
                g for g in range(self.pools.num_groups) if self.pools.pool_index_of_group(g) == idx
            }
            check_our_pool(pool, [self.our_managers[g] for g in sorted(groups)], groups)
        # The prefill statistics' cached-token estimate: ours (one pool call per group)
        # against vLLM's own loop over the same handles.
        for rid, t in sorted(self.tracked.items()):
            assert manager_patches.estimate_cached_tokens(
                self.ours, t.ours
            ) == manager_patches.vllm_estimate_cached_tokens(self.ours, t.ours), rid
            # The scheduler output's IDs: the plugin's method against vLLM's own.
            assert_block_ids_as_vllm(self.ours.get_blocks(rid), rid)
        rows_s, first_s = self.layout_of("stock")
        rows_o, first_o = self.layout_of("ours")
        # The same requests hold the same block lists (shapes, null padding).
        assert [(g, r, [p is None for p in row]) for g, r, row in rows_s] == [
            (g, r, [p is None for p in row]) for g, r, row in rows_o
        ]
        cache_o = our_cache(self.pools)
        cache_s = stock_cache(self.stock.block_pool)
        assert cache_o.keys() == cache_s.keys()
        events_o = self.ours.take_events()
        events_s = self.stock.take_events()
        if self.ample:
            # The same sharing between requests and the same blocks behind every key.
            assert rows_s == rows_o
            assert self.named_cache(cache_s, first_s, "stock") == self.named_cache(
                cache_o, first_o, "ours"
            )
            assert normalize_events(events_o) == normalize_events(events_s)
        # Our events, replayed on their own, rebuild our cache contents.
        for ev in events_o:
            if isinstance(ev, AllBlocksCleared):
                self.replayed.clear()
                continue
            sign = 1 if isinstance(ev, BlockStored) else -1
            for h in ev.block_hashes:
                self.replayed[(h, ev.group_idx)] += sign
        rebuilt = Counter(
            {
                (maybe_convert_block_hash(get_block_hash(k)), get_group_id(k)): len(v)
                for k, v in cache_o.items()
            }
        )
        assert +self.replayed == rebuilt, "our events do not rebuild our caches"
        self.account(
            (
                tuple(rows_o),
                tuple(sorted(cache_o)),
                tuple(p.get_num_free_blocks() for p in self.pools),
                self.stock.block_pool.get_num_free_blocks(),
                # vLLM's Mamba managers defer hits on states cached in this step.
                tuple(len(getattr(m, "cached_blocks_this_step", ())) for m in self.our_managers),
                tuple(
                    (r, t.state, t.stock.num_computed_tokens, t.stock.num_tokens)
                    for r, t in sorted(self.tracked.items())
                ),
            )
        )


PerGroupMachine.TestCase.settings = settings(max_examples=budget(100), stateful_step_count=40)
test_per_group_machine = PerGroupMachine.TestCase
