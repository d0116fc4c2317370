"""The one sizing model of per-group KV-cache pools.

The engine core (:mod:`hybrid_alloc.integration.scheduler.engine_sizing`, which
translates vLLM's layer specs) and the capacity planner (:mod:`hybrid_alloc.planner`, which
translates a ``config.json``) both describe each KV-cache group with a :class:`GroupNeeds` and call
:func:`size_pools`; neither has rules of its own. Pure Python: no vLLM, no torch.

A group is one of three kinds:

* ``fixed``: Mamba/GDN state, a fixed number of blocks per running request whatever its
  length. Its pool holds ``max_num_seqs`` requests' states, times ``state_factor`` ('align'
  mode keeps as many cached states again for prefix hits, see `ALIGN_CACHE_FACTOR`).
* ``bounded``: sliding-window or chunked-local attention whose per-request cap (window plus
  the tokens in flight, vLLM's admission cap) is below what a full-attention request of
  ``max_model_len`` takes. It does not grow with the sequence either, so its pool holds
  ``max_num_seqs`` capped requests.
* ``growing``: attention whose KV grows with the sequence. The memory left after the fixed
  and bounded pools is split between these in proportion to what one ``max_model_len``
  request costs in each, so all hold the same number of such requests. Capacity and
  concurrency count these pools only.

A model with windowed attention but no growing group (every attention layer sliding) has its
bounded groups sized as growing ones: something must take the memory left over, and the
window-bounded pool is what limits how many requests run.

Every pool has one null block on top of what it holds (vLLM's block pools reserve block 0),
and its own region of the backing allocation, aligned to `REGION_ALIGNMENT`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

GroupKind = Literal["growing", "bounded", "fixed"]
GROUP_KINDS: tuple[GroupKind, ...] = ("growing", "bounded", "fixed")

ALIGN_CACHE_FACTOR = 2
"""An 'align'-mode Mamba pool holds this many times what the running requests need: the
rest keeps cached states for prefix hits (a policy choice; 'none' mode caches nothing)."""

REGION_ALIGNMENT = 4096
"""Byte alignment of each group's region in the backing allocation (dtype views of a
region must start on an aligned address). One alignment per pool is set aside for the
padding between regions."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------- per-request blocks
# vLLM's own per-request figures (``KVCacheSpec.max_memory_usage_bytes`` over the page size),
# for callers that have no vLLM spec to ask: the planner. The engine asks vLLM's specs; the
# planner's cross-check tests hold the two to the same numbers.


def full_attention_blocks(max_model_len: int, block_size: int) -> int:
    """Blocks a full-attention request of ``max_model_len`` tokens holds."""
    return cdiv(max_model_len, block_size)


def sliding_window_blocks(
    window: int,
    block_size: int,
    in_flight_tokens: int,
    max_model_len: int,
    extra_retained_tokens: int = 0,
) -> int:
    """vLLM's per-request admission cap of a sliding-window layer: the last ``window - 1``
    computed tokens (plus any retained for multi-module speculation) and the tokens in
    flight, never more than ``max_model_len``, plus one block because the window need not
    start on a block boundary."""
    tokens = min(window - 1 + extra_retained_tokens + in_flight_tokens, max_model_len)
    return cdiv(tokens, block_size) + 1


def chunked_local_blocks(
    chunk: int, block_size: int, in_flight_tokens: int, max_model_len: int
) -> int:
    """vLLM's per-request admission cap of a chunked-local-attention layer: one chunk plus
    the tokens in flight, never more than ``max_model_len``."""
    return cdiv(min(chunk + in_flight_tokens, max_model_len), block_size)


def mamba_blocks_per_request(
    mode: str,
    num_speculative_blocks: int,
    prefill_checkpoint_blocks: int = 0,
    *,
    max_model_len: int = 0,
    block_size: int = 0,
) -> int:
    """Blocks a running request holds in a Mamba/GDN group.

    'none': its running state plus one scratch state per speculative token. 'align' (prefix
    caching): also the previous step's state (the copy source) and, for Mamba2 mixers, one
    prefill checkpoint; vLLM's ``MambaSpec.max_memory_usage_bytes`` reserves exactly these.
    'all': one state per ``block_size`` tokens of a ``max_model_len`` request plus the
    scratch states (it grows with the sequence; vLLM's engine accepts only none / align).
    """
    if mode == "none":
        return 1 + num_speculative_blocks
    if mode == "align":
        return 2 + num_speculative_blocks + prefill_checkpoint_blocks
    if mode == "all":
        return cdiv(max_model_len, block_size) + num_speculative_blocks
    raise ValueError(f"unknown mamba_cache_mode {mode!r}; known: none, align, all")


def mamba_group_kind(mode: str) -> GroupKind:
    """'all' keeps a state per block of tokens, so it grows; the others are fixed."""
    return "growing" if mode == "all" else "fixed"


def mamba_state_factor(mode: str, align_cache_factor: int = ALIGN_CACHE_FACTOR) -> int:
    """Blocks a fixed Mamba pool keeps per live state: ``align_cache_factor`` in 'align'
    mode (room for cached states), else 1 ('none' mode caches no state)."""
    return align_cache_factor if mode == "align" else 1


def windowed_kind(blocks_per_request: int, block_size: int, max_model_len: int) -> GroupKind:
    """A windowed group is bounded only if its per-request cap is below what a
    full-attention request of ``max_model_len`` takes; a window (plus tokens in flight) that
    covers the context needs as much as a growing group, so it is sized as one."""
    if blocks_per_request < full_attention_blocks(max_model_len, block_size):
        return "bounded"
    return "growing"


# ----------------------------------------------------------------- inputs and results


@dataclass(frozen=True)
class GroupNeeds:
    """What the sizing needs to know about one KV-cache group.

    Attributes:
        name: names the group in error messages.
        kind: ``growing``, ``bounded`` or ``fixed`` (see the module doc).
        page_bytes: one layer's page, rounded up to the block stride alignment.
        num_layers: layers in the group (one block spans all of them).
        blocks_per_request: blocks one request at ``max_model_len`` takes (bounded groups:
            their per-request cap; fixed groups: the states a running request holds).
        state_factor: fixed groups keep this many blocks per live state (cached states).
    """

    name: str
    kind: GroupKind
    page_bytes: int
    num_layers: int
    blocks_per_request: int
    state_factor: int = 1

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"{self.name}: kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        for field in ("page_bytes", "num_layers", "blocks_per_request", "state_factor"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be positive")

    @property
    def block_bytes(self) -> int:
        """Bytes one block costs over all the group's layers."""
        return self.page_bytes * self.num_layers


@dataclass(frozen=True)
class PoolSize:
    """One group's pool."""

    needs: GroupNeeds
    num_blocks: int
    """Blocks in the pool, null block included."""
    grows: bool
    """Sized from the memory left over and counted in capacity (growing groups, and bounded
    ones where no group grows). The first such pool is the primary pool."""

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.needs.block_bytes


@dataclass(frozen=True)
class Sizing:
    """The pools of one model at one budget, in group order."""

    pools: tuple[PoolSize, ...]
    available_bytes: int
    max_model_len: int

    @property
    def used_bytes(self) -> int:
        """Bytes the pools take (region padding excluded)."""
        return sum(p.bytes for p in self.pools)

    @property
    def primary_index(self) -> int:
        return next(i for i, p in enumerate(self.pools) if p.grows)

    @property
    def concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens the growing pools hold at once (usable
        blocks: the null block excluded)."""
        return max_concurrency(
            ((p.num_blocks, p.needs.blocks_per_request) for p in self.pools if p.grows),
            count_null_block=False,
        )

    @property
    def tokens(self) -> int:
        """Token capacity: concurrency times ``max_model_len``."""
        return int(self.concurrency * self.max_model_len)


class SizingError(ValueError):
    """The memory does not hold the fixed and bounded pools, or not one ``max_model_len``
    request in a growing pool.

    Attributes:
        shortfall_bytes: memory missing for the smallest working layout (0 where an
            explicit block count, not the memory, is what falls short).
        fixed_pools: the fixed and bounded pools as sized before the failure.
    """

    def __init__(
        self, message: str, shortfall_bytes: int, fixed_pools: tuple[PoolSize, ...]
    ) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes
        self.fixed_pools = fixed_pools


def max_concurrency(pools: Iterable[tuple[int, int]], *, count_null_block: bool) -> float:
    """Requests of ``max_model_len`` tokens that ``(num_blocks, blocks_per_request)`` pools
    hold at once: the smallest pool-by-pool ratio. ``count_null_block=True`` counts every
    block as vLLM's capacity report does; False counts usable blocks only."""
    null = 0 if count_null_block else 1
    limits = [(n - null) / per_request for n, per_request in pools]
    return min(limits) if limits else float("inf")


def counted_in_capacity(kinds: Sequence[GroupKind]) -> list[bool]:
    """Which groups are sized from the memory left over and counted in capacity: the
    growing ones, or the bounded ones where none grows."""
    if "growing" in kinds:
        return [kind == "growing" for kind in kinds]
    return [kind == "bounded" for kind in kinds]


def fixed_pool_blocks(needs: GroupNeeds, max_num_seqs: int) -> int:
    """Blocks of a fixed or bounded pool, null block included: ``max_num_seqs`` requests
    each holding its share (times the state factor), so admission never waits on it."""
    return max_num_seqs * needs.blocks_per_request * needs.state_factor + 1


# ----------------------------------------------------------------- the sizing


def size_pools(
    groups: Sequence[GroupNeeds],
    *,
    available_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    num_blocks_override: int | None = None,
    region_alignment: int = REGION_ALIGNMENT,
) -> Sizing:
    """Blocks of every group's pool: fixed pools first, then bounded pools for
    ``max_num_seqs`` requests, then the rest of ``available_bytes`` to the growing pools:
    each its null block, and what is left in proportion to one ``max_model_len`` request.

    Args:
        groups: the groups, in the order their pools are laid out.
        available_bytes: memory for the KV cache.
        max_num_seqs: most requests running at once (fixed and bounded pools hold them).
        max_model_len: the request length the growing pools are split by and capacity is
            counted at.
        num_blocks_override: blocks of the primary (first growing) pool, as vLLM's
            ``num_gpu_blocks_override``; other growing pools keep their proportion to it.
        region_alignment: alignment of each pool's region (one is set aside per pool).

    Raises:
        ValueError: no group grows or is bounded (nothing to count capacity in), or bad
            arguments.
        SizingError: the memory does not hold the fixed and bounded pools, or a growing
            pool gets fewer blocks than one ``max_model_len`` request takes.
    """
    if not groups:
        raise ValueError("per-group KV-cache pools: no KV-cache group to size")
    for name, value in (
        ("available_bytes", available_bytes),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
    ):
        if value < 1:
            raise ValueError(f"per-group KV-cache pools: {name} must be positive, got {value}")
    counted = counted_in_capacity([g.kind for g in groups])
    if not any(counted):
        raise ValueError(
            "per-group KV-cache pools: no KV-cache group grows with the sequence or is "
            "bounded by a window ("
            + ", ".join(f"{g.name}: {g.kind}" for g in groups)
            + "); nothing to count capacity in"
        )
    sizes = [
        0 if grows else fixed_pool_blocks(g, max_num_seqs)
        for g, grows in zip(groups, counted, strict=True)
    ]
    fixed = tuple(
        PoolSize(g, n, False)
        for g, n, grows in zip(groups, sizes, counted, strict=True)
        if not grows
    )
    padding = region_alignment * len(groups)
    fixed_bytes = sum(p.bytes for p in fixed)
    budget = available_bytes - padding - fixed_bytes
    shortfall = _min_budget(groups, counted, fixed_bytes, padding) - available_bytes
    growing = [i for i, grows in enumerate(counted) if grows]
    if budget <= 0:
        detail = "; ".join(
            f"{p.needs.name}: {p.num_blocks:,} blocks x {p.needs.block_bytes:,} B = {p.bytes:,} B"
            for p in fixed
        )
        raise SizingError(
            f"per-group KV-cache pools: {available_bytes:,} bytes of KV-cache memory do not "
            f"hold the fixed-size pools for max_num_seqs={max_num_seqs} requests ({detail}; "
            f"{padding:,} B region padding); {shortfall:,} bytes short: lower max_num_seqs "
            "or give the KV cache more memory",
            shortfall,
            fixed,
        )
    # Each growing pool's null block first; the rest split so that every growing pool
    # holds the same number of max_model_len requests.
    shared = max(0, budget - sum(groups[i].block_bytes for i in growing))
    weights = {i: groups[i].blocks_per_request * groups[i].block_bytes for i in growing}
    total_weight = sum(weights.values())
    first = groups[growing[0]]
    for i in growing:
        g = groups[i]
        if num_blocks_override is not None:
            sizes[i] = max(
                1, num_blocks_override * g.blocks_per_request // first.blocks_per_request
            )
        else:
            sizes[i] = 1 + shared * weights[i] // total_weight // g.block_bytes
    for i in growing:
        g = groups[i]
        if sizes[i] - 1 < g.blocks_per_request:
            # With an explicit block count the memory is not what falls short.
            short = max(shortfall, 0) if num_blocks_override is None else 0
            source = "num_gpu_blocks_override" if num_blocks_override is not None else "memory"
            raise SizingError(
                f"per-group KV-cache pools: {g.name} gets {sizes[i] - 1:,} usable blocks "
                f"from the {source} left after the fixed-size pools ({max(budget, 0):,} B), "
                f"fewer than one {max_model_len:,}-token request needs "
                f"({g.blocks_per_request:,} blocks x {g.block_bytes:,} B)"
                + (f"; {short:,} bytes short" if short > 0 else "")
                + ": lower max_model_len or give the KV cache more memory",
                short,
                fixed,
            )
    pools = tuple(PoolSize(g, n, grows) for g, n, grows in zip(groups, sizes, counted, strict=True))
    return Sizing(pools, available_bytes, max_model_len)


def _min_budget(
    groups: Sequence[GroupNeeds], counted: Sequence[bool], fixed_bytes: int, padding: int
) -> int:
    """The least memory with which every growing pool holds one ``max_model_len`` request
    plus its null block under the split of :func:`size_pools`: pool i gets
    ``1 + shared * w_i // W // b_i`` blocks (``w_i = p_i * b_i``, ``W`` the sum of the
    weights), at least ``p_i + 1`` exactly when ``shared >= W``."""
    growing = [g for g, grows in zip(groups, counted, strict=True) if grows]
    nulls = sum(g.block_bytes for g in growing)
    total_weight = sum(g.blocks_per_request * g.block_bytes for g in growing)
    return fixed_bytes + padding + nulls + total_weight


# ----------------------------------------------------------------- pipeline stages


def size_stages(
    stages: Sequence[Sequence[GroupNeeds | None]],
    available_bytes: Sequence[int],
    *,
    max_num_seqs: int,
    max_model_len: int,
    num_blocks_override: int | None = None,
    region_alignment: int = REGION_ALIGNMENT,
) -> Sizing:
    """Pools whose block counts hold on every worker that holds layers of the groups.

    With pipeline parallelism each stage (worker) holds some of every group's layers, and
    the scheduler's one pool per group hands the same block IDs to every stage: a pool has
    one block count everywhere, and each stage's memory must hold its own layers' share.
    ``stages[s][i]`` is group ``i`` as stage ``s`` holds it (its ``num_layers`` are that
    stage's; None: the stage holds none of it). Each stage is sized by :func:`size_pools`
    on its own groups; fixed and bounded pools come out the same on every stage, growing
    pools take the fewest blocks any stage affords (fewer blocks never need more memory).
    A stage that holds no group counted in capacity only has to hold its fixed pools.

    Returns the sizing with each group's needs over all stages (``num_layers`` summed) and
    ``available_bytes`` summed; with one stage it is :func:`size_pools`'s own result.

    Raises:
        ValueError / SizingError: as :func:`size_pools`, for the first stage that fails.
    """
    if len(stages) != len(available_bytes) or not stages:
        raise ValueError("per-group KV-cache pools: one memory figure per stage needed")
    width = len(stages[0])
    if any(len(stage) != width for stage in stages):
        raise ValueError("per-group KV-cache pools: every stage lists every group")
    merged: list[GroupNeeds] = []
    for i in range(width):
        present = [g for stage in stages if (g := stage[i]) is not None]
        if not present:
            raise ValueError(f"per-group KV-cache pools: group {i} has no layer on any stage")
        first = present[0]
        for other in present[1:]:
            if (other.kind, other.page_bytes, other.blocks_per_request, other.state_factor) != (
                first.kind,
                first.page_bytes,
                first.blocks_per_request,
                first.state_factor,
            ):
                raise ValueError(f"per-group KV-cache pools: {first.name} differs between stages")
        merged.append(replace(first, num_layers=sum(g.num_layers for g in present)))
    counted = counted_in_capacity([g.kind for g in merged])
    if len(stages) == 1 and all(g is not None for g in stages[0]):
        return size_pools(
            [g for g in stages[0] if g is not None],
            available_bytes=available_bytes[0],
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_blocks_override=num_blocks_override,
            region_alignment=region_alignment,
        )
    sizes: list[int | None] = [
        None if c else fixed_pool_blocks(g, max_num_seqs)
        for g, c in zip(merged, counted, strict=True)
    ]
    for stage, memory in zip(stages, available_bytes, strict=True):
        index = [i for i, g in enumerate(stage) if g is not None]
        own = [g for g in stage if g is not None]
        if not any(counted[i] for i in index):
            fixed = tuple(PoolSize(g, fixed_pool_blocks(g, max_num_seqs), False) for g in own)
            need = sum(p.bytes for p in fixed) + region_alignment * len(own)
            if need > memory:
                raise SizingError(
                    f"per-group KV-cache pools: {memory:,} bytes of KV-cache memory of a "
                    f"pipeline stage do not hold its fixed-size pools for max_num_seqs="
                    f"{max_num_seqs} requests ({need:,} B); {need - memory:,} bytes short: "
                    "lower max_num_seqs or give the KV cache more memory",
                    need - memory,
                    fixed,
                )
            continue
        result = size_pools(
            own,
            available_bytes=memory,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_blocks_override=num_blocks_override,
            region_alignment=region_alignment,
        )
        for i, pool in zip(index, result.pools, strict=True):
            if counted[i]:
                current = sizes[i]
                sizes[i] = pool.num_blocks if current is None else min(current, pool.num_blocks)
    # Every counted group is on some stage, which sized it.
    pools = tuple(PoolSize(g, n or 0, c) for g, n, c in zip(merged, sizes, counted, strict=True))
    return Sizing(pools, sum(available_bytes), max_model_len)


def largest_fitting_num_seqs(
    stages: Sequence[Sequence[GroupNeeds | None]],
    available_bytes: Sequence[int],
    *,
    max_num_seqs: int,
    max_model_len: int,
    num_blocks_override: int | None = None,
    region_alignment: int = REGION_ALIGNMENT,
) -> int:
    """The largest request count up to ``max_num_seqs`` whose fixed and bounded pools fit
    next to growing pools that hold one ``max_model_len`` request (:func:`size_stages`
    succeeds), or 0 where not even one request fits. Fitting is monotone in the count:
    fewer requests never need more memory."""

    def fits(n: int) -> bool:
        try:
            size_stages(
                stages,
                available_bytes,
                max_num_seqs=n,
                max_model_len=max_model_len,
                num_blocks_override=num_blocks_override,
                region_alignment=region_alignment,
            )
        except SizingError:
            return False
        return True

    if fits(max_num_seqs):
        return max_num_seqs
    low, high = 0, max_num_seqs  # fits(low) or low == 0; not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


# ----------------------------------------------------------------- elastic pools

ELASTIC_PAGES_PER_SLAB = 8
"""Pages of the largest pool in one slab of elastic pools, at most. Within that bound
:func:`choose_slab_bytes` weighs what a slab loses at its edges (pages of a pool that do
not divide it) against what coarse slabs cost (slab 0, memory stranded in partly used
slabs): fine slabs strand the least, but where other pools' pages do not divide them they
lose pages at every edge (measured over the simulated matrix: 8 pages per slab everywhere
left six cells 0.95-0.99x of stock's throughput, one page everywhere ten others)."""

ELASTIC_MIN_SLABS = 32
"""Slabs the budget is cut into at least (fewer pages per slab on small memory), so that
one slab is a small share of it."""


STRIDE_ALIGNMENT = 256
"""Bytes a padded block stride is a multiple of (or the block's own power-of-two
alignment, where that is less): a padded page starts at least as aligned as vLLM's
kernels need and as the unpadded page would."""


def pages_per_slab(slab_bytes: int, page_bytes: int) -> int:
    """Pages of ``page_bytes`` that fit whole in any slab of ``slab_bytes`` laid end to end
    (the Rust ``ByteBudget``'s rule: a slab starts at most ``page - gcd`` bytes past a page
    boundary, and a page straddling two slabs is never used)."""
    return (slab_bytes - page_bytes + math.gcd(slab_bytes, page_bytes)) // page_bytes


def padded_stride(slab_bytes: int, block_bytes: int) -> int:
    """The block stride of a pool whose blocks may be padded: ``slab_bytes / k`` for the
    most pages ``k`` of ``block_bytes`` that divide the slab evenly (aligned to
    `STRIDE_ALIGNMENT`), where that fits more pages a slab than the unpadded page does at
    slab edges; else ``block_bytes``. A stride that divides the slab puts every page at the
    same place in every slab, so none straddles two.

    Only Mamba/GDN state pools are padded (stock vLLM pads their pages too, and their
    kernels take any block stride); attention pages stay dense, as kernels that split a
    block into smaller kernel blocks need."""
    if block_bytes > slab_bytes:
        return block_bytes
    align = min(block_bytes & -block_bytes, STRIDE_ALIGNMENT)
    unpadded = pages_per_slab(slab_bytes, block_bytes)
    for k in range(slab_bytes // block_bytes, unpadded, -1):
        if slab_bytes % k == 0 and (slab_bytes // k) % align == 0:
            return slab_bytes // k
    return block_bytes


def block_strides(
    slab_bytes: int, block_bytes: Sequence[int], paddable: Sequence[bool]
) -> tuple[int, ...]:
    """Each pool's page in a budget of ``slab_bytes`` slabs: its block stride, padded
    (:func:`padded_stride`) where ``paddable``."""
    return tuple(
        padded_stride(slab_bytes, b) if pad else b
        for b, pad in zip(block_bytes, paddable, strict=True)
    )


def slab_edge_loss(
    slab_bytes: int, page_bytes: Sequence[int], strides: Sequence[int] | None = None
) -> float:
    """The largest share of a slab that a pool of one of ``page_bytes`` loses at its edges
    or to padding (``strides``: each pool's block stride, by default its page)."""
    strides = page_bytes if strides is None else strides
    return (
        max(
            slab_bytes - pages_per_slab(slab_bytes, s) * p
            for p, s in zip(page_bytes, strides, strict=True)
        )
        / slab_bytes
    )


def elastic_concurrency(slab_bytes: int, num_slabs: int, pools: Iterable[tuple[int, int]]) -> float:
    """Requests of ``max_model_len`` tokens a budget of ``num_slabs`` slabs holds at once
    when all of it goes to such requests: ``pools`` gives each pool's ``(block stride,
    blocks_per_request)``; each pool's share of a request is counted in slabs at that
    pool's pages per slab, slab 0 (the null blocks) excluded."""
    per_request = sum(n / pages_per_slab(slab_bytes, page) for page, n in pools)
    return (num_slabs - 1) / per_request if per_request else float("inf")


def choose_slab_bytes(
    page_bytes: Sequence[int],
    available_bytes: int,
    *,
    blocks_per_request: Sequence[int] | None = None,
    paddable: Sequence[bool] | None = None,
    max_pages_per_slab: int = ELASTIC_PAGES_PER_SLAB,
    min_slabs: int = ELASTIC_MIN_SLABS,
) -> int:
    """The slab of elastic pools whose blocks take ``page_bytes`` (``paddable``: the pools
    whose block stride may be padded, :func:`padded_stride`; by default none).

    Candidates: whole multiples of any pool's page from the largest page up to
    ``max_pages_per_slab`` pages of the largest pool (fewer where that would leave under
    ``min_slabs`` slabs, never fewer than two), and whole multiples of every page where one
    is at most twice that. With ``blocks_per_request`` (each pool's blocks for one
    ``max_model_len`` request) the slab is the one that holds the most such requests
    (:func:`elastic_concurrency`: slab 0 and the pages lost at slab edges counted), less
    half a slab per pool stranded in partly used slabs; a budget that cannot hold one
    request in whole slabs counts as holding none. Without them: the least lost at slab
    edges. The finest slab among equals."""
    pad = [False] * len(page_bytes) if paddable is None else list(paddable)
    largest = max(page_bytes)
    most = max(2, min(max_pages_per_slab, available_bytes // (min_slabs * largest)))
    limit = most * largest
    common = math.lcm(*page_bytes)
    candidates: set[int] = set()
    for p in set(page_bytes):
        first, last = cdiv(largest, p), limit // p
        # Pages far smaller than the largest: a few hundred multiples spread over the range.
        candidates.update(range(first * p, last * p + 1, p * max(1, (last - first) // 512)))
    if common <= limit * 2:
        candidates.update(common * m for m in range(1, max(1, limit // common) + 1))
    strides = {b: block_strides(b, page_bytes, pad) for b in candidates}
    valid = {b: s for b, s in strides.items() if all(pages_per_slab(b, x) >= 1 for x in s)}

    def loss(slab: int) -> float:
        return slab_edge_loss(slab, page_bytes, valid[slab])

    if blocks_per_request is None:
        return min(valid, key=lambda b: (loss(b), b))

    def requests_held(slab: int) -> float:
        pools = list(zip(valid[slab], blocks_per_request, strict=True))
        slabs = available_bytes // slab
        if slabs < 1 + sum(cdiv(n, pages_per_slab(slab, s)) for s, n in pools):
            return 0.0
        stranded = len(pools) * slab / 2 / max(available_bytes, 1)
        return elastic_concurrency(slab, slabs, pools) * max(0.0, 1 - stranded)

    return min(valid, key=lambda b: (-round(requests_held(b), 9), loss(b), b))


def elastic_paddable(needs: Iterable[GroupNeeds]) -> list[bool]:
    """Pools whose blocks may be padded in the budget: the fixed (Mamba/GDN state) ones."""
    return [n.kind == "fixed" for n in needs]


@dataclass(frozen=True)
class ElasticSizing:
    """Elastic per-group pools: one byte budget of ``num_slabs`` slabs shared by every
    pool, lent to a pool a slab at a time while it needs it (``rust/src/byte_budget.rs``).
    No pool has a size of its own: each spans every page of the budget at its own page
    size, and how many blocks each holds moves with the traffic.

    Attributes:
        needs: one per pool, in pool order; ``block_bytes`` is one block across the
            layers of the pool's groups (with pipeline stages: the largest stage's).
        slab_bytes, num_slabs: the budget; slab 0 holds every pool's null block.
        max_model_len: the request length capacity is counted in.
        available_bytes: the memory the budget was cut from.
    """

    needs: tuple[GroupNeeds, ...]
    slab_bytes: int
    num_slabs: int
    max_model_len: int
    available_bytes: int

    @property
    def block_bytes(self) -> tuple[int, ...]:
        """What one block of each pool takes (all its layers)."""
        return tuple(n.block_bytes for n in self.needs)

    @property
    def page_bytes(self) -> tuple[int, ...]:
        """Each pool's page in the budget: its block stride, the bytes from one of its
        blocks to the next; a Mamba/GDN pool's blocks are padded where that fits more of
        them a slab (:func:`padded_stride`)."""
        return block_strides(self.slab_bytes, self.block_bytes, elastic_paddable(self.needs))

    @property
    def budget_bytes(self) -> int:
        return self.slab_bytes * self.num_slabs

    @property
    def kept_per_live(self) -> tuple[int, ...]:
        """Per pool, idle blocks other pools may not take back, per block in use: a fixed
        pool's ``state_factor - 1`` (an 'align'-mode state moves to a new block at every
        block boundary while the old one is read, so a request needs a second block then;
        the static split reserves the same), else none."""
        return tuple(n.state_factor - 1 if n.kind == "fixed" else 0 for n in self.needs)

    @property
    def pages_per_slab(self) -> tuple[int, ...]:
        return tuple(pages_per_slab(self.slab_bytes, p) for p in self.page_bytes)

    @property
    def num_pages(self) -> tuple[int, ...]:
        """Each pool's block-ID space: every page that lies in the budget (null included)."""
        return tuple(self.budget_bytes // p for p in self.page_bytes)

    @property
    def request_slabs(self) -> int:
        """Slabs one ``max_model_len`` request needs, each pool's blocks in slabs of its
        own, plus slab 0 (the null blocks)."""
        return 1 + sum(
            cdiv(n.blocks_per_request, k)
            for n, k in zip(self.needs, self.pages_per_slab, strict=True)
        )

    @property
    def edge_waste(self) -> float:
        """The largest share of a slab any pool loses at slab edges."""
        return slab_edge_loss(self.slab_bytes, self.block_bytes, self.page_bytes)

    @property
    def concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens the budget holds at once when all of it
        goes to such requests, each with its blocks in every pool (Mamba/GDN states
        included), counted in slab-sized shares of each pool (the null slab excluded).
        Shorter requests hold fewer attention blocks and the same states, so more of them
        fit; the split between pools follows the traffic."""
        return elastic_concurrency(
            self.slab_bytes,
            self.num_slabs,
            [(s, n.blocks_per_request) for s, n in zip(self.page_bytes, self.needs, strict=True)],
        )

    @property
    def tokens(self) -> int:
        """Token capacity: concurrency times ``max_model_len``."""
        return int(self.concurrency * self.max_model_len)


def size_elastic(
    needs: Sequence[GroupNeeds],
    available_bytes: int,
    *,
    max_model_len: int,
    max_pages_per_slab: int = ELASTIC_PAGES_PER_SLAB,
    min_slabs: int = ELASTIC_MIN_SLABS,
) -> ElasticSizing:
    """One byte budget of ``available_bytes`` for pools with the given ``needs`` (one per
    pool; ``block_bytes`` is a block across its layers), cut into slabs by
    :func:`choose_slab_bytes`.

    Raises:
        SizingError: one ``max_model_len`` request does not fit (what vLLM's own check
            refuses at startup): the slabs its blocks need, plus slab 0 (null blocks).
    """
    if not needs:
        raise ValueError("elastic per-group pools: at least one pool is needed")
    pages = [n.block_bytes for n in needs]
    slab = choose_slab_bytes(
        pages,
        available_bytes,
        blocks_per_request=[n.blocks_per_request for n in needs],
        paddable=elastic_paddable(needs),
        max_pages_per_slab=max_pages_per_slab,
        min_slabs=min_slabs,
    )
    result = ElasticSizing(
        tuple(needs), slab, max(available_bytes // slab, 2), max_model_len, available_bytes
    )
    have = available_bytes // slab
    if have < result.request_slabs:
        short = (result.request_slabs - have) * slab
        raise SizingError(
            f"elastic per-group KV-cache pools: one {max_model_len:,}-token request needs "
            f"{result.request_slabs} slabs of {slab:,} bytes (slab 0 holds the null blocks), "
            f"{available_bytes:,} bytes of KV-cache memory hold {have}; {short:,} bytes short",
            short,
            (),
        )
    return result


def divisor_block(hybrid: int, unit: int) -> int:
    """The largest multiple of ``unit`` (the configured block size) that divides ``hybrid``
    (vLLM's hybrid block size, a multiple of ``unit``) into two or more equal parts;
    ``unit`` itself where nothing larger does.

    Every block boundary of vLLM's layout is then one of ours too, and vLLM's rule raises
    this block back to ``hybrid`` (so the decode room, counted from that rule, is stock's).
    Blocks that do not divide it were tried (half of it, rounded down): at 16 GiB they left
    each running request more decode room than stock and lost chat cells to it.

    Raises:
        ValueError: ``unit`` not positive, or ``hybrid`` not a multiple of it.
    """
    if unit <= 0 or hybrid <= 0 or hybrid % unit:
        raise ValueError(
            f"divisor_block: hybrid block {hybrid} is not a positive multiple of the "
            f"configured block {unit}"
        )
    parts = hybrid // unit
    # The largest proper divisor of `parts` is parts / (its smallest prime factor).
    smallest = next((p for p in range(2, math.isqrt(parts) + 1) if parts % p == 0), parts)
    return unit * (parts // smallest)


def halved_block(hybrid: int, unit: int) -> int | None:
    """Half of ``hybrid`` (vLLM's hybrid block size) where that half is a whole number of
    ``unit`` blocks (the configured size), else None: the block 'align' mode runs per-group
    pools at by default (``HYBRID_ALLOC_FINE_ALIGN_BLOCKS`` unset), the one rule the worker
    hook applies and ``hybrid-alloc plan`` reports."""
    return hybrid // 2 if unit > 0 and hybrid % (2 * unit) == 0 else None
