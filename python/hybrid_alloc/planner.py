"""KV-cache capacity planner for hybrid (attention + Mamba/GDN) models.

Given a model's KV-cache layers (:mod:`hybrid_alloc.model_specs`) and a KV memory budget, it
sizes three layouts and reports token capacity and maximum concurrency for each:

* **stock** - vLLM 0.32's single shared pool. ``Platform._align_hybrid_block_size`` raises the
  attention block size until one attention page covers one Mamba page and pads the Mamba page
  to it; every KV-cache group then aliases one ``num_blocks`` of ``bytes_per_block`` (the
  largest group's bytes); capacity is ``get_max_concurrency_for_kv_cache_config`` (blocks over
  the per-request blocks of *every* group) times ``max_model_len``.
* **ours** - what :mod:`hybrid_alloc.sizing` builds at engine start: one KV-cache group per
  distinct layer spec (no equal-size split, so one null block per spec), one pool per group
  at its natural page size, no unification or padding, each pool in its own 4 KiB-aligned
  region. Pools whose per-request need is bounded are sized first for ``max_num_seqs``
  requests; the memory left goes to the groups that grow with sequence length, split so that
  they all reach the same token count. Capacity counts only the growing groups.
* **physical** - the limit no allocator can beat: KV bytes minus the bounded per-request state
  of ``max_num_seqs`` requests, over the bytes one token costs in the growing layers.

Sizing rules for ours (the decisions, and why):

* Full attention grows with the sequence: it gets the memory left over, at ``block_size``.
* Mamba/GDN in ``mamba_cache_mode='none'``: each request holds its running state plus one
  scratch state per speculative token, so the pool is ``max_num_seqs * (1 + spec) + 1`` blocks
  (the ``+ 1`` is the null block every pool reserves). Admission can never starve on it.
* ``'align'`` (prefix caching): a running request holds the state of the previous step (the
  copy source), the running state, the speculative scratch states and, for vLLM's Mamba2 mixer,
  one prefill checkpoint block: ``2 + spec + checkpoint`` blocks, exactly what vLLM's own
  ``MambaSpec.max_memory_usage_bytes`` reserves per request in align mode. That is the
  admission minimum (and what the physical limit counts). States of finished requests stay
  cached in free blocks until reused, but under full load a pool of exactly that size keeps
  almost none, so the pool is ``align_cache_factor`` times it, plus the null block; the
  factor defaults to :mod:`hybrid_alloc.sizing`'s ``ALIGN_CACHE_FACTOR`` (2: as many cached
  states as live ones). Factor 1 is capacity first. A partial prefix hit needs one
  copy-on-write block for one step; if none is free the request waits a step. It cannot
  deadlock: running requests keep their count constant and finishing ones return theirs.
* ``'all'``: every ``mamba_block_size`` tokens leave a cached state, so Mamba grows with the
  sequence and shares the leftover memory with attention. ``mamba_block_size`` defaults to the
  block size stock vLLM would use, so both layouts checkpoint at the same interval. (vLLM 0.32
  itself accepts only 'none' and 'align'; its 'all' column here is a model of the same sizing
  with Mamba counted as growing.)
* Sliding-window and chunked-local attention are bounded by their window: a fixed pool of
  ``max_num_seqs`` times vLLM's per-request admission cap
  (``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block) + 1`` for sliding,
  ``cdiv(min(chunk + max_num_batched_tokens, max_model_len), block)`` for chunked) plus the null
  block, so every admitted request can hold its window and its in-flight chunk. A window that
  covers ``max_model_len`` makes the group a growing one.

Stock numbers assume a CUDA attention backend whose smallest kernel block is 16 tokens
(FlashAttention, FlashInfer, Triton), tensor parallel size 1, no KV-cache offload or HiSparse.
Ours counts usable blocks (null block excluded); the engine's log line, like vLLM's, counts
the null block too, so it reads one block higher.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from hybrid_alloc.model_specs import (
    AttentionLayerSpec,
    LayerSpec,
    MambaLayerSpec,
    ModelSpec,
    model_from_config,
)

MambaCacheMode = Literal["none", "align", "all"]
MAMBA_CACHE_MODES: tuple[str, ...] = ("none", "align", "all")

# Smallest kernel block of vLLM's CUDA attention backends (MultipleOf(16)); the hybrid block
# size is a multiple of it.
KERNEL_BLOCK_SIZE = 16
# Mirrors of hybrid_alloc.sizing (which imports vLLM, so it cannot be imported here);
# tests/test_planner.py checks they agree.
ALIGN_CACHE_FACTOR = 2
REGION_ALIGNMENT = 4096


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- configs


def shipped_configs() -> dict[str, str]:
    """Names of the shipped configs (``qwen3.5-0.8b`` ...) mapped to their file names."""
    root = resources.files("hybrid_alloc.configs")
    return {
        entry.name.removesuffix(".json"): entry.name
        for entry in root.iterdir()
        if entry.name.endswith(".json")
    }


def load_config(source: str | Path) -> dict[str, Any]:
    """Read a ``config.json``: a file, a folder holding one, or a shipped config's name.

    Raises:
        FileNotFoundError: none of the three matches.
    """
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    key = str(source).strip().lower().removesuffix(".json")
    names = shipped_configs()
    if key in names:
        text = resources.files("hybrid_alloc.configs").joinpath(names[key]).read_text("utf-8")
        return json.loads(text)
    raise FileNotFoundError(
        f"{source!r} is neither a config.json, a folder holding one, nor a shipped config "
        f"({', '.join(sorted(names))})"
    )


def load_model(source: str | Path, **dtypes: str) -> ModelSpec:
    """:func:`load_config` then :func:`~hybrid_alloc.model_specs.model_from_config`."""
    return model_from_config(load_config(source), **dtypes)


# --------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class KVGroup:
    """A KV-cache group: layers of one spec sharing one block table."""

    spec: LayerSpec
    num_layers: int

    @property
    def label(self) -> str:
        if isinstance(self.spec, AttentionLayerSpec):
            return {"full": "attention", "sliding": "sliding", "chunked": "chunked"}[self.spec.kind]
        return self.spec.kind


def spec_groups(model: ModelSpec) -> list[KVGroup]:
    """One group per distinct layer spec, in layer order (ours: groups need not match in
    size, because they do not share a pool)."""
    counts: dict[LayerSpec, int] = {}
    for layer in model.layers:
        counts[layer] = counts.get(layer, 0) + 1
    return [KVGroup(spec, n) for spec, n in counts.items()]


def kv_cache_groups(model: ModelSpec) -> list[KVGroup]:
    """Group layers as vLLM's ``_get_kv_cache_groups_uniform_page_size`` does.

    Layers of one spec form a bucket; buckets are split into groups of ``group_size`` layers,
    where ``group_size`` is the smallest bucket (or the largest, when the largest is under 1.5x
    the smallest, to avoid padding layers). The last group of a bucket may be short.
    """
    buckets = spec_groups(model)
    if not buckets:
        return []
    smallest = min(b.num_layers for b in buckets)
    largest = max(b.num_layers for b in buckets)
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[KVGroup] = []
    for bucket in buckets:
        count = bucket.num_layers
        n = cdiv(count, group_size)
        # vLLM deals layers round-robin (layers[i::n]), so group sizes differ by at most one.
        groups.extend(KVGroup(bucket.spec, len(range(i, count, n))) for i in range(n))
    return groups


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PoolRow:
    """One KV-cache group's pool (stock: its view of the shared pool)."""

    group: int
    kind: str
    num_layers: int
    page_bytes: int  # one layer's page (stock: padded)
    block_size: int  # tokens one block covers
    num_blocks: int  # including the null block
    grows: bool  # grows with sequence length (counted in capacity)
    blocks_per_request: int  # a request at max_model_len (fixed pools: its cap)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class Layout:
    """A sized layout: its pools, memory used, token capacity and maximum concurrency."""

    name: str
    rows: tuple[PoolRow, ...]
    total_bytes: int
    concurrency: float
    tokens: int
    # False when the bounded pools (plus one block per growing pool) exceed the budget; the
    # growing pools then get no blocks and ``shortfall_bytes`` says how much is missing.
    feasible: bool = True
    shortfall_bytes: int = 0

    def memory_map(self) -> tuple[tuple[int, int, int], ...]:
        """(group, byte offset, byte size) of each pool, laid out back to back."""
        out: list[tuple[int, int, int]] = []
        offset = 0
        for row in self.rows:
            out.append((row.group, offset, row.bytes))
            offset += row.bytes
        return tuple(out)


@dataclass(frozen=True, kw_only=True)
class StockLayout(Layout):
    """vLLM's shared pool: one ``num_blocks`` of ``bytes_per_block`` for every group."""

    num_blocks: int
    bytes_per_block: int
    block_size: int
    mamba_page_bytes: int  # unpadded
    padded_page_bytes: int
    # Attention tokens left in the shared pool once max_num_seqs requests hold their bounded
    # blocks: stock at the operating point ours and the physical limit are sized for.
    tokens_at_max_num_seqs: int


@dataclass(frozen=True)
class PhysicalLimit:
    fixed_bytes: int  # bounded state of max_num_seqs requests
    bytes_per_token: float  # in the layers that grow with sequence length
    tokens: int
    concurrency: float


@dataclass(frozen=True)
class PlanParams:
    kv_bytes: int
    max_num_seqs: int
    num_spec_tokens: int
    mamba_cache_mode: str
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    mamba_block_size: int  # tokens per cached state in 'all' mode (ours)
    align_cache_factor: int


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    params: PlanParams
    groups: tuple[KVGroup, ...]  # ours: one per distinct spec
    stock_groups: tuple[KVGroup, ...]  # vLLM's equal-size split
    stock: StockLayout
    ours: Layout
    physical: PhysicalLimit

    @property
    def ours_unused_bytes(self) -> int:
        return self.params.kv_bytes - self.ours.total_bytes


# --------------------------------------------------------------------------- per-request


def _window_blocks(spec: AttentionLayerSpec, block: int, p: PlanParams) -> int:
    """vLLM's per-request admission cap of a sliding-window / chunked-local layer."""
    assert spec.window is not None
    if spec.kind == "sliding":
        tokens = min(spec.window - 1 + p.max_num_batched_tokens, p.max_model_len)
        return cdiv(tokens, block) + 1
    return cdiv(min(spec.window + p.max_num_batched_tokens, p.max_model_len), block)


def _grows(spec: LayerSpec, mode: str, max_model_len: int) -> bool:
    if isinstance(spec, MambaLayerSpec):
        return mode == "all"
    return spec.kind == "full" or (spec.window is not None and spec.window >= max_model_len)


def _mamba_states_per_request(spec: MambaLayerSpec, mode: str, spec_tokens: int) -> int:
    """States a running request holds in 'none' / 'align' mode (see the module docstring)."""
    if mode == "align":
        return 2 + spec_tokens + spec.prefill_checkpoint_blocks
    return 1 + spec_tokens


def _blocks_per_request(spec: LayerSpec, block: int, p: PlanParams) -> int:
    """Blocks one request at ``max_model_len`` takes (bounded groups: their per-request cap)."""
    if isinstance(spec, MambaLayerSpec):
        if p.mamba_cache_mode == "all":
            # One state per block of tokens, plus the speculative scratch states.
            return cdiv(p.max_model_len, block) + p.num_spec_tokens
        return _mamba_states_per_request(spec, p.mamba_cache_mode, p.num_spec_tokens)
    if spec.kind == "full":
        return cdiv(p.max_model_len, block)
    # vLLM's own cap, also when the window covers max_model_len (then it is cdiv(L, b) + 1).
    return _window_blocks(spec, block, p)


# --------------------------------------------------------------------------- stock


def stock_block_size(model: ModelSpec, block_size: int, num_spec_tokens: int) -> int:
    """The attention block size vLLM 0.32 picks for a hybrid model.

    ``_align_hybrid_block_size``: the smallest multiple of ``max(16, block_size)`` whose
    attention page (one layer, K and V) covers the largest Mamba page, rounded up to a multiple
    of the backends' kernel block (16); never below ``block_size``.
    """
    attn, mamba = model.attention_layers, model.mamba_layers
    if not attn or not mamba:
        return block_size
    attn_token = max(a.bytes_per_token for a in attn)
    mamba_page = max(m.state_bytes(num_spec_tokens) for m in mamba)
    align = max(KERNEL_BLOCK_SIZE, block_size)
    size = align * cdiv(mamba_page, align * attn_token)
    size = KERNEL_BLOCK_SIZE * cdiv(size, KERNEL_BLOCK_SIZE)
    return max(block_size, size)


def _stock(model: ModelSpec, groups: list[KVGroup], p: PlanParams) -> StockLayout:
    attn = model.attention_layers
    if len({a.bytes_per_token for a in attn}) > 1:
        # vLLM would rescale block sizes per attention spec; no supported family needs it.
        raise NotImplementedError("stock model assumes one attention page size per model")
    block = stock_block_size(model, p.block_size, p.num_spec_tokens)
    attn_page = block * attn[0].bytes_per_token
    mamba_page = max((m.state_bytes(p.num_spec_tokens) for m in model.mamba_layers), default=0)
    rows: list[PoolRow] = []
    for i, g in enumerate(groups):
        spec = g.spec
        if isinstance(spec, AttentionLayerSpec) and not model.mamba_layers:
            page = spec.page_bytes(block)
        else:
            # After alignment every page is the attention page (Mamba pages padded up to it).
            page = attn_page
        grows = _grows(g.spec, p.mamba_cache_mode, p.max_model_len)
        if isinstance(g.spec, MambaLayerSpec) and p.mamba_cache_mode == "none":
            tokens_per_block = p.max_model_len  # vLLM's mamba_block_size in 'none' mode
        else:
            tokens_per_block = block
        per_req = _blocks_per_request(g.spec, block, p)
        rows.append(PoolRow(i, g.label, g.num_layers, page, tokens_per_block, 0, grows, per_req))
    bytes_per_block = max(r.block_bytes for r in rows)
    num_blocks = p.kv_bytes // bytes_per_block
    rows = [_with_blocks(r, num_blocks) for r in rows]
    # get_max_concurrency_for_kv_cache_config: one pool, every group's per-request blocks.
    concurrency = num_blocks / sum(r.blocks_per_request for r in rows)
    tokens = int(concurrency * p.max_model_len)
    fixed = sum(r.blocks_per_request for r in rows if not r.grows)
    growing = sum(1 for r in rows if r.grows)
    free = num_blocks - 1 - p.max_num_seqs * fixed
    at_seqs = max(0, free) // growing * block if growing else 0
    return StockLayout(
        name="stock",
        rows=tuple(rows),
        total_bytes=num_blocks * bytes_per_block,
        concurrency=concurrency,
        tokens=tokens,
        num_blocks=num_blocks,
        bytes_per_block=bytes_per_block,
        block_size=block,
        mamba_page_bytes=mamba_page,
        padded_page_bytes=attn_page if model.mamba_layers else 0,
        tokens_at_max_num_seqs=at_seqs,
    )


def _with_blocks(row: PoolRow, num_blocks: int) -> PoolRow:
    return PoolRow(
        row.group,
        row.kind,
        row.num_layers,
        row.page_bytes,
        row.block_size,
        num_blocks,
        row.grows,
        row.blocks_per_request,
    )


# --------------------------------------------------------------------------- ours


def _natural(g: KVGroup, p: PlanParams) -> tuple[int, int]:
    """(page bytes of one layer, tokens per block) of a group at its natural page size."""
    spec = g.spec
    if isinstance(spec, MambaLayerSpec):
        page = spec.state_bytes(p.num_spec_tokens)
        if p.mamba_cache_mode == "all":
            return page, p.mamba_block_size
        if p.mamba_cache_mode == "align":
            return page, p.block_size
        return page, p.max_model_len
    return spec.page_bytes(p.block_size), p.block_size


def _fixed_blocks(g: KVGroup, per_req: int, p: PlanParams) -> int:
    factor = p.align_cache_factor if isinstance(g.spec, MambaLayerSpec) else 1
    if p.mamba_cache_mode != "align":
        factor = 1
    return p.max_num_seqs * per_req * factor + 1


def _tokens_fitting(remaining: int, growing: list[tuple[int, int]]) -> int:
    """Largest T with sum over (block_bytes, block_size) of (cdiv(T, bs) + 1) * bytes <= rem."""

    def cost(t: int) -> int:
        return sum((cdiv(t, bs) + 1) * b for b, bs in growing)

    if cost(0) > remaining:
        return -1
    lo = 0
    hi = remaining * max(bs for _, bs in growing) // min(b for b, _ in growing) + 1
    while lo < hi:  # invariant: cost(lo) fits
        mid = (lo + hi + 1) // 2
        if cost(mid) <= remaining:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _ours(groups: list[KVGroup], p: PlanParams) -> Layout:
    rows: list[PoolRow] = []
    for i, g in enumerate(groups):
        page, tokens_per_block = _natural(g, p)
        grows = _grows(g.spec, p.mamba_cache_mode, p.max_model_len)
        per_req = _blocks_per_request(g.spec, tokens_per_block, p)
        blocks = 0 if grows else _fixed_blocks(g, per_req, p)
        rows.append(
            PoolRow(i, g.label, g.num_layers, page, tokens_per_block, blocks, grows, per_req)
        )
    fixed_bytes = sum(r.bytes for r in rows if not r.grows)
    growing = [r for r in rows if r.grows]
    if not growing:
        raise ValueError("model has no KV-cache group that grows with sequence length")
    # sizing.py sets aside one region alignment per pool for padding between regions.
    remaining = p.kv_bytes - fixed_bytes - REGION_ALIGNMENT * len(rows)
    t = _tokens_fitting(remaining, [(r.block_bytes, r.block_size) for r in growing])
    if t < 1:
        need = fixed_bytes + REGION_ALIGNMENT * len(rows)
        need += sum(2 * r.block_bytes for r in growing)
        return Layout(
            name="ours",
            rows=tuple(rows),
            total_bytes=fixed_bytes,
            concurrency=0.0,
            tokens=0,
            feasible=False,
            shortfall_bytes=need - p.kv_bytes,
        )
    rows = [_with_blocks(r, cdiv(t, r.block_size) + 1) if r.grows else r for r in rows]
    concurrency = min((r.num_blocks - 1) / r.blocks_per_request for r in rows if r.grows)
    return Layout(
        name="ours",
        rows=tuple(rows),
        total_bytes=sum(r.bytes for r in rows),
        concurrency=concurrency,
        tokens=int(concurrency * p.max_model_len),
    )


# --------------------------------------------------------------------------- physical


def _physical(model: ModelSpec, p: PlanParams) -> PhysicalLimit:
    fixed = 0
    per_token = 0.0
    for layer in model.layers:
        if isinstance(layer, MambaLayerSpec):
            state = layer.state_bytes(p.num_spec_tokens)
            if p.mamba_cache_mode == "all":
                per_token += state / p.mamba_block_size
            else:
                states = _mamba_states_per_request(layer, p.mamba_cache_mode, p.num_spec_tokens)
                fixed += p.max_num_seqs * states * state
        elif _grows(layer, p.mamba_cache_mode, p.max_model_len):
            per_token += layer.bytes_per_token
        else:
            assert layer.window is not None
            fixed += p.max_num_seqs * min(layer.window, p.max_model_len) * layer.bytes_per_token
    tokens = int(max(0, p.kv_bytes - fixed) // per_token)
    return PhysicalLimit(fixed, per_token, tokens, tokens / p.max_model_len)


# --------------------------------------------------------------------------- entry point


def plan(
    model: ModelSpec,
    kv_bytes: int,
    *,
    max_num_seqs: int = 256,
    num_spec_tokens: int = 0,
    mamba_cache_mode: str = "none",
    block_size: int = 16,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 2048,
    mamba_block_size: int | None = None,
    align_cache_factor: int = ALIGN_CACHE_FACTOR,
) -> Plan:
    """Size the stock, ours and physical layouts for ``kv_bytes`` of KV-cache memory.

    Args:
        model: the model's KV-cache layers.
        kv_bytes: memory available to the KV cache (vLLM's ``available_memory``).
        max_num_seqs: most requests running at once; bounded pools are sized for it.
        num_spec_tokens: speculative tokens per step (MTP / EAGLE).
        mamba_cache_mode: ``none``, ``align`` (prefix caching) or ``all``.
        block_size: attention block size in tokens (ours; stock may raise it).
        max_model_len: the context length capacity is counted at (default: the model's
            ``max_position_embeddings``, as vLLM's).
        max_num_batched_tokens: in-flight tokens a sliding-window request may also hold.
        mamba_block_size: tokens per cached Mamba state in 'all' mode (ours; default: the
            stock block size, so both checkpoint at the same interval).
        align_cache_factor: an 'align' Mamba pool holds this many times the live states of
            ``max_num_seqs`` requests (the rest keeps cached states for prefix hits).

    A budget too small for ours' bounded pools gives ``plan.ours.feasible == False`` (stock
    and physical are still sized: stock shares one pool, so it runs with fewer requests).

    Raises:
        ValueError: bad arguments.
    """
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise ValueError(
            f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, "
            f"got {mamba_cache_mode!r}"
        )
    max_len = max_model_len or model.max_position_embeddings
    for name, value in (
        ("kv_bytes", kv_bytes),
        ("max_num_seqs", max_num_seqs),
        ("block_size", block_size),
        ("max_model_len", max_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("align_cache_factor", align_cache_factor),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_spec_tokens < 0:
        raise ValueError(f"num_spec_tokens must not be negative, got {num_spec_tokens}")
    if not model.attention_layers:
        raise ValueError(f"{model.name} has no attention layer; nothing grows with the sequence")
    mamba_block = mamba_block_size or stock_block_size(model, block_size, num_spec_tokens)
    params = PlanParams(
        kv_bytes=kv_bytes,
        max_num_seqs=max_num_seqs,
        num_spec_tokens=num_spec_tokens,
        mamba_cache_mode=mamba_cache_mode,
        block_size=block_size,
        max_model_len=max_len,
        max_num_batched_tokens=max_num_batched_tokens,
        mamba_block_size=mamba_block,
        align_cache_factor=align_cache_factor,
    )
    stock_groups, groups = kv_cache_groups(model), spec_groups(model)
    return Plan(
        model=model,
        params=params,
        groups=tuple(groups),
        stock_groups=tuple(stock_groups),
        stock=_stock(model, stock_groups, params),
        ours=_ours(groups, params),
        physical=_physical(model, params),
    )


def summary(p: Plan) -> Mapping[str, float]:
    """The headline numbers of a plan (what the CLI's last line and the benchmark print)."""
    stock = p.stock.tokens
    return {
        "stock_tokens": stock,
        "stock_tokens_at_max_num_seqs": p.stock.tokens_at_max_num_seqs,
        "ours_tokens": p.ours.tokens,
        "physical_tokens": p.physical.tokens,
        "ours_over_stock": p.ours.tokens / stock if stock else math.inf,
        "ours_over_physical": p.ours.tokens / p.physical.tokens if p.physical.tokens else 1.0,
        "stock_concurrency": p.stock.concurrency,
        "ours_concurrency": p.ours.concurrency,
        "physical_concurrency": p.physical.concurrency,
    }
