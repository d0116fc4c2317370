"""The driver of the quiet-step differentials (`test_quiet_steps`, `test_quiet_steps_caching`):
two of vLLM's `KVCacheManager`, the running requests' table's steps off on the first and on
on the second, given the same scheduler-like calls. Each call must answer the same on both;
after every step each test's ``check`` compares their state."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import Request, RequestStatus

from hybrid_alloc._native import STEP_CACHE_BLOCKS, STEP_REMOVE_SKIPPED, NativeRunningRequests
from tests.helpers import allocate_slots_installed, new_request


class Counted:
    """The coordinator's table, counting the answers of its decode steps."""

    def __init__(self, check: NativeRunningRequests) -> None:
        self.check = check
        self.quiet = 0
        self.grown = 0
        self.removed = 0
        self.cached = 0
        self.not_quiet = 0

    def decode_step(self, request_id: str, *counts: int) -> tuple[int, ...] | int | None:
        answer = self.check.decode_step(request_id, *counts)
        if answer == ():
            self.quiet += 1
        else:
            self.not_quiet += 1
            if isinstance(answer, int):
                self.removed += bool(answer & STEP_REMOVE_SKIPPED)
                self.cached += bool(answer & STEP_CACHE_BLOCKS)
            else:
                self.grown += answer is not None
        return answer


def ids(result: Any) -> Any:
    """None if refused, else the new block IDs (None where there are none)."""
    return None if result is None else ("allocated", result.get_block_ids(allow_none=True))


class TwinManagers:
    """The same requests on both managers, each call made on both and compared."""

    def __init__(self, off: Any, on: Any) -> None:
        self.mgrs = [off, on]
        self.counted = Counted(on.coordinator._quiet_check)
        on.coordinator._quiet_check = self.counted
        self.reqs: dict[str, list[Request]] = {}
        self.outputs: dict[str, int] = {}
        self.calls = 0
        self.preempted = 0
        self.hits = 0
        self.evicted = 0
        # Per request, the length its decode room is counted from after its last call.
        self.lengths: dict[str, int] = {}

    def allocate(
        self, rid: str, *args: Any, each: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> bool:
        req = self.reqs[rid][0]
        self.lengths[rid] = max(
            req.num_prompt_tokens, req.num_tokens - 1, req.num_computed_tokens + args[0]
        )
        got = []
        with allocate_slots_installed():
            for i, (m, r) in enumerate(zip(self.mgrs, self.reqs[rid], strict=True)):
                extra = each[i] if each else {}
                got.append(ids(m.allocate_slots(r, *args, **kwargs, **extra)))
        self.calls += 1
        assert got[0] == got[1], f"call {self.calls} for {rid} {args} {kwargs}: {got}"
        return got[0] is not None

    def lookup(self, rid: str) -> tuple[list[dict[str, Any]], int]:
        """Both managers' prefix-cache hits for a waiting request (they must agree), as
        the arguments each one's admission takes."""
        found = [
            m.get_computed_blocks(r)[:2] for m, r in zip(self.mgrs, self.reqs[rid], strict=True)
        ]
        (blocks_a, hit_a), (blocks_b, hit_b) = found
        assert hit_a == hit_b, (rid, hit_a, hit_b)
        assert blocks_a.get_block_ids() == blocks_b.get_block_ids(), rid
        self.hits += hit_a > 0
        return [
            {"num_new_computed_tokens": hit, "new_computed_blocks": blocks} for blocks, hit in found
        ], hit_a

    def evict_cached(self, rng: random.Random) -> int:
        """A connector evicts cached blocks (vLLM's ``evict_blocks`` after a failed load),
        about a third of each pool's, the same IDs on both managers (their caches are
        equal), with the coordinator's hooks installed as the engine runs them. Returns
        the blocks evicted."""
        pool = self.mgrs[0].block_pool
        if hasattr(pool, "pool_for_group"):  # per-group pools: IDs by group
            chosen: Any = {}
            for g in range(pool.num_groups):
                cached = sorted(
                    {i for _, ids in pool.pool_for_group(g).cache_entries() for i in ids}
                )
                if cached:
                    chosen[g] = rng.sample(cached, max(1, len(cached) // 3))
            count = sum(map(len, chosen.values()))
        else:
            cached = sorted({i for _, ids in pool.cache_entries() for i in ids})
            chosen = set(rng.sample(cached, max(1, len(cached) // 3))) if cached else set()
            count = len(chosen)
        if count:
            with allocate_slots_installed():
                for m in self.mgrs:
                    m.evict_blocks(chosen)
        return count

    def each(self, rid: str, fn: Any) -> None:
        for r in self.reqs[rid]:
            fn(r)

    def free(self, rid: str) -> None:
        for m, r in zip(self.mgrs, self.reqs[rid], strict=True):
            m.free(r)

    def check(self) -> None:
        """After every step: what the test compares (its subclass says)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Traffic:
    """What the driver draws from (each seed draws the same sequence of steps)."""

    drafts: tuple[int, ...]
    """Draft tokens a decode step carries, one drawn per step (then 0..drafts accepted)."""
    in_flight: tuple[int, ...]
    """Tokens of the last step still in flight (async scheduling), one drawn per step."""
    finish_at: int
    """Output tokens after which a request finishes."""
    shared_prompts: bool
    """Prompts start with one of three shared prompts and admissions look up the prefix
    cache (sampled tokens are random); otherwise every prompt is its own, sampled tokens
    are all 7, and no lookups."""
    evict: float = 0.0
    """Per step, the chance that a connector evicts cached blocks (`evict_cached`)."""


def drive(twins: TwinManagers, seed: int, steps: int, traffic: Traffic) -> None:
    rng = random.Random(seed)
    prompts = (
        [[rng.randrange(1, 5000) for _ in range(rng.randint(40, 260))] for _ in range(3)]
        if traffic.shared_prompts
        else []
    )
    waiting: list[str] = []
    n = 0
    for _ in range(steps):
        scheduled = False
        for rid in [r for r, (req, _) in twins.reqs.items() if req.status == RequestStatus.RUNNING]:
            req = twins.reqs[rid][0]
            if req.num_computed_tokens < req.num_tokens - 1:
                # A prefill chunk of a running request: the scheduler's call shape.
                chunk = min(rng.choice([16, 40, 128]), req.num_tokens - req.num_computed_tokens)
                ok = twins.allocate(rid, chunk, num_lookahead_tokens=0)
                # The chunk that ends the prompt samples a token.
                advance, out = chunk, int(req.num_computed_tokens + chunk == req.num_tokens)
            else:
                drafts = rng.choice(traffic.drafts)
                # Async scheduling: tokens of the last step not yet processed (kept out of
                # what `remove_skipped_blocks` may free).
                in_flight = min(rng.choice(traffic.in_flight), req.num_computed_tokens)
                twins.each(rid, lambda r, k=in_flight: setattr(r, "num_in_flight_tokens", k))
                ok = twins.allocate(rid, 1 + drafts, num_lookahead_tokens=rng.choice([0, 0, 2]))
                twins.each(rid, lambda r: setattr(r, "num_in_flight_tokens", 0))
                accepted = rng.randint(0, drafts)
                advance, out = 1 + accepted, 1 + accepted
            if not ok:
                twins.preempted += 1
                twins.free(rid)
                twins.each(
                    rid,
                    lambda r: (
                        setattr(r, "status", RequestStatus.PREEMPTED),
                        setattr(r, "num_computed_tokens", 0),
                    ),
                )
                waiting.append(rid)
                continue
            scheduled = True
            sampled = (
                [rng.randrange(1, 5000) for _ in range(out)]
                if traffic.shared_prompts
                else [7] * out
            )

            def step(r: Request, advance: int = advance, sampled: list[int] = sampled) -> None:
                r.num_computed_tokens += advance
                for token in sampled:
                    r.append_output_token_ids(token)

            twins.each(rid, step)
            twins.outputs[rid] += out
            if twins.outputs[rid] >= traffic.finish_at:
                twins.free(rid)
                twins.each(rid, lambda r: setattr(r, "status", RequestStatus.FINISHED_STOPPED))
        if rng.random() < 0.35:
            n += 1
            rid = f"s{seed}-r{n}"
            if traffic.shared_prompts:
                tokens = rng.choice(prompts) + [
                    rng.randrange(1, 5000) for _ in range(rng.randint(0, 90))
                ]
            else:
                tokens = [rng.randrange(1, 5000) for _ in range(rng.randint(8, 300))]
            twins.reqs[rid] = [new_request(rid, tokens, 200), new_request(rid, tokens, 200)]
            twins.outputs[rid] = 0
            waiting.append(rid)
        if waiting and rng.random() < 0.6:
            rid = waiting[0]
            req = twins.reqs[rid][0]
            each, hit = twins.lookup(rid) if traffic.shared_prompts else (None, 0)
            # The first chunk of an admission (or a resumption, which recomputes).
            total = req.num_tokens - 1 if req.num_output_tokens else req.num_tokens
            first = min(rng.choice([32, 64, 512]), max(total - hit, 1))
            if twins.allocate(
                rid, first, each=each, full_sequence_must_fit=True, has_scheduled_reqs=scheduled
            ):
                waiting.pop(0)

                def admitted(r: Request, first: int = first, hit: int = hit) -> None:
                    r.status = RequestStatus.RUNNING
                    r.num_computed_tokens = hit + first
                    if r.num_computed_tokens == r.num_tokens:
                        r.append_output_token_ids(7)

                twins.each(rid, admitted)
                if hit + first == req.num_tokens:
                    twins.outputs[rid] += 1
        if traffic.evict and rng.random() < traffic.evict:
            twins.evicted += twins.evict_cached(rng)
        twins.check()
