"""KV-cache capacity planner for hybrid (attention + Mamba/GDN) models.

Given a model's KV-cache layers (:mod:`hybrid_alloc.model_specs`) and a KV memory budget, it
sizes three layouts and reports token capacity and maximum concurrency for each:

* **stock** - vLLM 0.32's single shared pool. ``Platform._align_hybrid_block_size`` raises the
  attention block size until one attention page covers one Mamba page and pads the Mamba page
  to it; every KV-cache group then aliases one ``num_blocks`` of ``bytes_per_block`` (the
  largest group's bytes); capacity is ``get_max_concurrency_for_kv_cache_config`` (blocks over
  the per-request blocks of *every* group) times ``max_model_len``.
* **ours** - per-group pools as the engine core builds them: one KV-cache group per distinct
  layer spec (no equal-size split, so one null block per spec), one pool per group at its
  natural page size, no unification or padding, sized by :mod:`hybrid_alloc.sizing` (the
  engine's sizing model; this module only translates the model's layers into its inputs).
  Fixed Mamba/GDN pools first, then window-bounded attention pools for ``max_num_seqs``
  requests, then the rest to the groups that grow with the sequence, in proportion to one
  ``max_model_len`` request. Capacity counts only the growing groups. A budget that does not
  hold the fixed pools plus one ``max_model_len`` request in every growing pool does not fit
  (the engine refuses to start with it).
* **physical** - the limit no allocator can beat: KV bytes minus the bounded per-request state
  of ``max_num_seqs`` requests, over the bytes one token costs in the growing layers.

How the model's layers map onto the sizing model's groups:

* Full attention grows with the sequence, at ``block_size``.
* Mamba/GDN in ``mamba_cache_mode='none'`` or ``'align'`` is fixed: the states a running
  request holds (:func:`hybrid_alloc.sizing.mamba_blocks_per_request`, the count vLLM's
  ``MambaSpec.max_memory_usage_bytes`` reserves), for ``max_num_seqs`` requests; an 'align'
  pool holds ``align_cache_factor`` times that (default the engine's
  :data:`hybrid_alloc.sizing.ALIGN_CACHE_FACTOR`, 2: as many cached states as live ones;
  factor 1 is capacity first). A partial prefix hit needs one copy-on-write block for one
  step; if none is free the request waits a step (no deadlock: running requests keep their
  count constant and finishing ones return theirs).
* ``'all'``: every ``mamba_block_size`` tokens leave a cached state, so Mamba grows with the
  sequence and shares the leftover memory with attention. ``mamba_block_size`` defaults to the
  block size stock vLLM would use, so both layouts checkpoint at the same interval. (vLLM
  itself accepts only 'none' and 'align'; the 'all' column models the same sizing with Mamba
  counted as growing.)
* Sliding-window and chunked-local attention are bounded: ``max_num_seqs`` times vLLM's
  per-request admission cap (window plus ``max_num_batched_tokens`` in flight, see
  :func:`hybrid_alloc.sizing.sliding_window_blocks`), unless that cap reaches what a
  full-attention request of ``max_model_len`` takes: then the group grows. Where no group
  grows (every attention layer windowed), the windowed groups share the leftover memory as
  growing ones would.

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

from hybrid_alloc import sizing
from hybrid_alloc.model_specs import (
    AttentionLayerSpec,
    LayerSpec,
    MambaLayerSpec,
    ModelSpec,
)
from hybrid_alloc.sizing import ALIGN_CACHE_FACTOR as ALIGN_CACHE_FACTOR
from hybrid_alloc.sizing import cdiv as cdiv

MambaCacheMode = Literal["none", "align", "all"]
MAMBA_CACHE_MODES: tuple[str, ...] = ("none", "align", "all")

# Smallest kernel block of vLLM's CUDA attention backends (MultipleOf(16)); the hybrid block
# size is a multiple of it.
KERNEL_BLOCK_SIZE = 16

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


def load_model(source: str | Path, specs: str = "auto", **dtypes: str) -> ModelSpec:
    """:func:`load_config` then :func:`~hybrid_alloc.vllm_specs.load_model_spec`: the
    layers from vLLM's own model class where vLLM is installed (``specs='auto'``), else
    from :func:`~hybrid_alloc.model_specs.model_from_config`'s table."""
    from hybrid_alloc.vllm_specs import load_model_spec

    return load_model_spec(load_config(source), specs, **dtypes)


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
    elastic: sizing.ElasticSizing | None = None
    """Elastic per-group pools (``HYBRID_ALLOC_ELASTIC_POOLS=1``): one byte budget every
    group's pool draws from; None where one ``max_model_len`` request does not fit."""

    @property
    def ours_unused_bytes(self) -> int:
        return self.params.kv_bytes - self.ours.total_bytes


# --------------------------------------------------------------------------- per-request


def request_need(spec: LayerSpec, block: int, p: PlanParams) -> tuple[sizing.GroupKind, int]:
    """A layer spec's kind in the sizing model and the blocks of ``block`` tokens one
    request at ``max_model_len`` takes (bounded and fixed groups: their per-request cap)."""
    L = p.max_model_len
    if isinstance(spec, MambaLayerSpec):
        mode = p.mamba_cache_mode
        blocks = sizing.mamba_blocks_per_request(
            mode,
            p.num_spec_tokens,
            spec.prefill_checkpoint_blocks,
            max_model_len=L,
            block_size=block,
        )
        return sizing.mamba_group_kind(mode), blocks
    if spec.kind == "full":
        return "growing", sizing.full_attention_blocks(L, block)
    assert spec.window is not None
    in_flight = p.max_num_batched_tokens
    if spec.kind == "sliding":
        blocks = sizing.sliding_window_blocks(spec.window, block, in_flight, L)
    else:
        blocks = sizing.chunked_local_blocks(spec.window, block, in_flight, L)
    return sizing.windowed_kind(blocks, block, L), blocks


def _kinds(model: ModelSpec, p: PlanParams) -> dict[LayerSpec, tuple[sizing.GroupKind, bool]]:
    """Each distinct spec's kind at ours' block size, and whether it counts in capacity
    (grows, or is bounded where nothing grows). Stock and the physical limit use the same
    kinds, so all three layouts count the same layers (a window cap near max_model_len
    could otherwise be bounded at one block size and not at another)."""
    specs = list(dict.fromkeys(model.layers))
    kinds = [request_need(spec, p.block_size, p)[0] for spec in specs]
    counted = sizing.counted_in_capacity(kinds)
    return {spec: (kind, c) for spec, kind, c in zip(specs, kinds, counted, strict=True)}


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
    kinds = _kinds(model, p)
    rows: list[PoolRow] = []
    for i, g in enumerate(groups):
        spec = g.spec
        if isinstance(spec, AttentionLayerSpec) and not model.mamba_layers:
            page = spec.page_bytes(block)
        else:
            # After alignment every page is the attention page (Mamba pages padded up to it).
            page = attn_page
        if isinstance(g.spec, MambaLayerSpec) and p.mamba_cache_mode == "none":
            tokens_per_block = p.max_model_len  # vLLM's mamba_block_size in 'none' mode
        else:
            tokens_per_block = block
        _, per_req = request_need(g.spec, block, p)
        grows = kinds[g.spec][1]
        rows.append(PoolRow(i, g.label, g.num_layers, page, tokens_per_block, 0, grows, per_req))
    bytes_per_block = max(r.block_bytes for r in rows)
    num_blocks = p.kv_bytes // bytes_per_block
    rows = [_with_blocks(r, num_blocks) for r in rows]
    # get_max_concurrency_for_kv_cache_config: one pool, every group's per-request blocks.
    concurrency = num_blocks / sum(r.blocks_per_request for r in rows)
    tokens = int(concurrency * p.max_model_len)
    fixed = sum(r.blocks_per_request for r in rows if not r.grows)
    growing = sum(1 for r in rows if r.grows)
    free = max(0, num_blocks - 1 - p.max_num_seqs * fixed)
    windows_counted = any(kind == "bounded" and c for kind, c in kinds.values())
    if windows_counted:
        # Window groups counted because nothing grows: a held token is not a context token,
        # so count max_model_len requests of their capped size, as vLLM's figure does.
        at_seqs = int(free / sum(r.blocks_per_request for r in rows if r.grows) * p.max_model_len)
    else:
        at_seqs = free // growing * block if growing else 0
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


def group_needs(groups: list[KVGroup], p: PlanParams) -> list[sizing.GroupNeeds]:
    """The sizing model's view of each group at its natural page size."""
    needs = []
    for i, g in enumerate(groups):
        page, tokens_per_block = _natural(g, p)
        kind, per_req = request_need(g.spec, tokens_per_block, p)
        factor = 1
        if isinstance(g.spec, MambaLayerSpec):
            factor = sizing.mamba_state_factor(p.mamba_cache_mode, p.align_cache_factor)
        name = f"group {i} ({g.label} x{g.num_layers} layers)"
        needs.append(sizing.GroupNeeds(name, kind, page, g.num_layers, per_req, factor))
    return needs


def ours_layout(groups: list[KVGroup], p: PlanParams) -> Layout:
    """Per-group pools as :func:`hybrid_alloc.sizing.size_pools` sizes them; a budget it
    refuses gives an infeasible layout (fixed pools only, with the shortfall)."""
    needs = group_needs(groups, p)
    block_sizes = [_natural(g, p)[1] for g in groups]
    try:
        result = sizing.size_pools(
            needs,
            available_bytes=p.kv_bytes,
            max_num_seqs=p.max_num_seqs,
            max_model_len=p.max_model_len,
        )
    except sizing.SizingError as exc:
        fixed = {pool.needs: pool.num_blocks for pool in exc.fixed_pools}
        rows = tuple(
            _row(i, g, n, fixed.get(n, 0), n not in fixed, bs)
            for i, (g, n, bs) in enumerate(zip(groups, needs, block_sizes, strict=True))
        )
        return Layout(
            name="ours",
            rows=rows,
            total_bytes=sum(r.bytes for r in rows),
            concurrency=0.0,
            tokens=0,
            feasible=False,
            shortfall_bytes=exc.shortfall_bytes,
        )
    rows = tuple(
        _row(i, g, pool.needs, pool.num_blocks, pool.grows, bs)
        for i, (g, pool, bs) in enumerate(zip(groups, result.pools, block_sizes, strict=True))
    )
    return Layout(
        name="ours",
        rows=rows,
        total_bytes=result.used_bytes,
        concurrency=result.concurrency,
        tokens=result.tokens,
    )


def _row(
    i: int, g: KVGroup, needs: sizing.GroupNeeds, blocks: int, grows: bool, block_size: int
) -> PoolRow:
    return PoolRow(
        i,
        g.label,
        g.num_layers,
        needs.page_bytes,
        block_size,
        blocks,
        grows,
        needs.blocks_per_request,
    )


# --------------------------------------------------------------------------- physical


def _physical(model: ModelSpec, p: PlanParams) -> PhysicalLimit:
    kinds = _kinds(model, p)
    L = p.max_model_len
    fixed = 0
    per_token = 0.0
    for layer in model.layers:
        if isinstance(layer, MambaLayerSpec):
            state = layer.state_bytes(p.num_spec_tokens)
            if kinds[layer][1]:  # 'all' mode: one state per mamba_block_size tokens
                per_token += state / p.mamba_block_size
            else:
                states = sizing.mamba_blocks_per_request(
                    p.mamba_cache_mode, p.num_spec_tokens, layer.prefill_checkpoint_blocks
                )
                fixed += p.max_num_seqs * states * state
        elif layer.window is None:
            per_token += layer.bytes_per_token
        elif kinds[layer][1]:
            # A window that covers the context, or no layer grows: a max_model_len request
            # holds min(window, L) tokens here; spread over its L tokens.
            per_token += min(layer.window, L) * layer.bytes_per_token / L
        else:
            fixed += p.max_num_seqs * min(layer.window, L) * layer.bytes_per_token
    tokens = int(max(0, p.kv_bytes - fixed) // per_token)
    return PhysicalLimit(fixed, per_token, tokens, tokens / L)


# --------------------------------------------------------------------------- entry point


def plan_params(
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
) -> PlanParams:
    """Check and complete the settings of a plan.

    Args:
        model: the model's KV-cache layers.
        kv_bytes: memory available to the KV cache (vLLM's ``available_memory``).
        max_num_seqs: most requests running at once; bounded pools are sized for it.
        num_spec_tokens: speculative tokens per step (MTP / EAGLE).
        mamba_cache_mode: ``none``, ``align`` (prefix caching) or ``all``.
        block_size: attention block size in tokens (ours; stock may raise it).
        max_model_len: the context length capacity is counted at (default: the model's
            ``max_position_embeddings``, as vLLM's).
        max_num_batched_tokens: tokens in flight a windowed-attention request may also hold
            (vLLM's ``max_in_flight_tokens``: ``max_num_batched_tokens`` times the batches in
            flight, 2 with async scheduling; pass the product to model that).
        mamba_block_size: tokens per cached Mamba state in 'all' mode (ours; default: the
            stock block size, so both checkpoint at the same interval).
        align_cache_factor: an 'align' Mamba pool holds this many times the live states of
            ``max_num_seqs`` requests (the rest keeps cached states for prefix hits).

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
    return PlanParams(
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
    """Size the stock, ours and physical layouts for ``kv_bytes`` of KV-cache memory
    (arguments: see :func:`plan_params`).

    A budget too small for ours (the fixed and bounded pools plus one ``max_model_len``
    request in every growing pool) gives ``plan.ours.feasible == False``; stock and
    physical are still sized (stock shares one pool, so it runs with fewer requests).

    Raises:
        ValueError: bad arguments.
        NotImplementedError: attention layers of different page sizes (the stock model
            covers one; :func:`ours_layout` sizes ours for them).
    """
    params = plan_params(
        model,
        kv_bytes,
        max_num_seqs=max_num_seqs,
        num_spec_tokens=num_spec_tokens,
        mamba_cache_mode=mamba_cache_mode,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        mamba_block_size=mamba_block_size,
        align_cache_factor=align_cache_factor,
    )
    stock_groups, groups = kv_cache_groups(model), spec_groups(model)
    return Plan(
        model=model,
        params=params,
        groups=tuple(groups),
        stock_groups=tuple(stock_groups),
        stock=_stock(model, stock_groups, params),
        ours=ours_layout(groups, params),
        physical=_physical(model, params),
        elastic=elastic_layout(groups, params),
    )


def elastic_layout(groups: list[KVGroup], p: PlanParams) -> sizing.ElasticSizing | None:
    """Elastic pools as :func:`hybrid_alloc.sizing.size_elastic` sizes them (the engine's
    sizing model); None where one ``max_model_len`` request does not fit."""
    try:
        return sizing.size_elastic(
            group_needs(groups, p), p.kv_bytes, max_model_len=p.max_model_len
        )
    except sizing.SizingError:
        return None


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
        "elastic_tokens": p.elastic.tokens if p.elastic else 0,
        "elastic_concurrency": p.elastic.concurrency if p.elastic else 0.0,
        "elastic_over_stock": (p.elastic.tokens if p.elastic else 0) / stock if stock else math.inf,
    }
