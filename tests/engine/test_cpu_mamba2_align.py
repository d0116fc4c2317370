"""vLLM 0.32's CPU Mamba2 prefill path as the plugin leaves it
(:mod:`hybrid_alloc.integration.worker.cpu_mamba2_align` installed): 'align' mode's mid-prefill
checkpoints are saved right.

* The scan asked for chunk states returns the state at every chunk end of vLLM's own chunk
  layout (``_compute_chunk_metadata``, with checkpoint splits and partial first chunks),
  equal to a plain token-by-token SSM recurrence (float64) at every boundary; its outputs
  and final states are bit for bit those of vLLM's one-go CPU scan.
* The whole checkpoint (conv history and SSM state) that a prefill writes for its block
  boundary is what a prefill that stopped at that boundary leaves (the conv history bit for
  bit, the SSM state to float32 rounding), and
  resuming from it gives the full prefill's outputs and final states: what a later request
  with that prefix (a prefix-cache hit) starts from.

Without the correction vLLM's CPU scan returns one state per row whatever it is asked
(:func:`test_vllm_cpu_scan_ignores_the_request`), the IndexError of issue 31.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

HEADS, HEAD_DIM, GROUPS, D_STATE, WIDTH = 2, 8, 1, 8, 4
STATE_LEN = WIDTH - 1
X_DIM = HEADS * HEAD_DIM
CONV_DIM = X_DIM + 2 * GROUPS * D_STATE
CPU_SCAN_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm"


@pytest.fixture(scope="module")
def fixed() -> Iterator[Any]:
    """The modules as the plugin leaves them in this process (skipped where the fix is not
    needed: another vLLM release, or not a CPU build)."""
    from hybrid_alloc.integration.worker import cpu_mamba2_align

    try:
        if not cpu_mamba2_align.needed():
            pytest.skip("vLLM's CPU Mamba2 path needs no correction here")
        scan = importlib.import_module(cpu_mamba2_align.SCAN_MODULE)
        mixer = importlib.import_module(cpu_mamba2_align.MIXER_MODULE)
    except ImportError as e:
        pytest.skip(f"vLLM's Mamba2 modules do not import: {e}")
    # vLLM's own CPU scan, which vllm-cpu binds into the scan module (another test may
    # have left the plugin's hook there already).
    stock_scan = importlib.import_module(CPU_SCAN_MODULE)._mamba_chunk_scan_combined_fwd_cpu
    assert cpu_mamba2_align.install()
    try:
        assert getattr(mixer, cpu_mamba2_align.CHECKPOINT_ATTR) is cpu_mamba2_align.store_checkpoint
        yield type("Fixed", (), {"scan": scan, "mixer": mixer, "stock_scan": stock_scan})
    finally:
        cpu_mamba2_align.uninstall()
    assert getattr(scan, cpu_mamba2_align.SCAN_ATTR) is stock_scan


# ------------------------------------------------------------------ the reference
def reference_scan(
    x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any, dt_bias: Any, init: Any, starts: list[int]
) -> tuple[Any, Any]:
    """Mamba2's recurrence token by token, in float64: per head ``h``,
    ``s = exp(dt_h * A_h) * s + dt_h * x_h B^T``, ``y_h = s C + D_h x_h``, with
    ``dt_h = softplus(dt + dt_bias)``. Returns the outputs ``(tokens, heads, head_dim)``
    and the state after every token ``(tokens, heads, head_dim, d_state)``."""
    f64 = torch.float64
    group = torch.arange(HEADS) // (HEADS // GROUPS)
    outputs = torch.empty(x.shape, dtype=f64)
    after = torch.empty(x.shape[0], HEADS, HEAD_DIM, D_STATE, dtype=f64)
    for row in range(len(starts) - 1):
        state = init[row].to(f64).clone()
        for t in range(starts[row], starts[row + 1]):
            step = torch.nn.functional.softplus(dt[t].to(f64) + dt_bias.to(f64))  # (heads,)
            decay = torch.exp(step * A.to(f64))
            b, c = B[t].to(f64)[group], C[t].to(f64)[group]  # (heads, d_state)
            xt = x[t].to(f64)  # (heads, head_dim)
            state = decay[:, None, None] * state + (step[:, None] * xt)[:, :, None] * b[:, None]
            outputs[t] = (state * c[:, None, :]).sum(-1) + D.to(f64)[:, None] * xt
            after[t] = state
    return outputs, after


# ------------------------------------------------------------------ workloads
Row = tuple[int, int, int]
"""(tokens computed before this step, tokens this step, checkpoint offset or 0)."""


def row_strategy(chunk_size: int) -> Any:
    def with_offset(computed: int, query: int) -> Any:
        offsets = st.just(0)
        if query > STATE_LEN + 1:
            offsets = st.one_of(st.just(0), st.integers(STATE_LEN, query - 1))
        return st.tuples(st.just(computed), st.just(query), offsets)

    return st.tuples(st.integers(0, 3 * chunk_size), st.integers(1, 5 * chunk_size)).flatmap(
        lambda cq: with_offset(*cq)
    )


def chunk_layout(chunk_size: int, rows: list[Row]) -> tuple[list[int], ...]:
    """vLLM's own chunk layout for these prefill rows: (chunk bounds, chunk owners, last
    chunk per row, checkpoint chunk per row or -1)."""
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder

    starts = [0]
    for _, query, _ in rows:
        starts.append(starts[-1] + query)
    offsets = [o for _, _, o in rows]
    return BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(
        chunk_size,
        len(rows),
        torch.tensor([c for c, _, _ in rows]),
        torch.tensor(starts),
        offsets if any(offsets) else None,
    )


def scan_inputs(tokens: int, batch: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> Any:
        return torch.randn(*shape, generator=gen) * scale

    return {
        "x": rand(tokens, HEADS, HEAD_DIM),
        "dt": rand(tokens, HEADS, scale=0.5),
        "A": -torch.rand(HEADS, generator=gen) * 0.5 - 0.05,
        "B": rand(tokens, GROUPS, D_STATE, scale=0.5),
        "C": rand(tokens, GROUPS, D_STATE, scale=0.5),
        "D": rand(HEADS),
        "dt_bias": rand(HEADS, scale=0.1),
        "initial_states": rand(batch, HEADS, HEAD_DIM, D_STATE),
    }


def varlen(
    scan: Any,
    inputs: dict[str, Any],
    chunk_size: int,
    layout: Any,
    starts: list[int],
    intermediate: bool,
) -> tuple[Any, Any]:
    """``mamba_chunk_scan_combined_varlen`` as the mixer calls it; returns (out, states)."""
    bounds, owners, last, _ = layout
    out = torch.empty_like(inputs["x"])
    states = scan.mamba_chunk_scan_combined_varlen(
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
        inputs["C"],
        chunk_size=chunk_size,
        cu_seqlens=torch.tensor(starts, dtype=torch.int32),
        cu_chunk_seqlens=torch.tensor(bounds, dtype=torch.int32),
        last_chunk_indices=torch.tensor(last, dtype=torch.int32),
        seq_idx=torch.tensor(owners, dtype=torch.int32),
        out=out,
        D=inputs["D"],
        z=None,
        dt_bias=inputs["dt_bias"],
        initial_states=inputs["initial_states"],
        dt_softplus=True,
        return_intermediate_states=intermediate,
        state_dtype=torch.float32,
    )
    return out, states


# ------------------------------------------------------------------ the scan
@settings(max_examples=40, deadline=None)
@given(
    chunk_size=st.sampled_from([4, 8, 16]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_chunk_states_equal_the_recurrence(
    fixed: Any, chunk_size: int, data: st.DataObject, seed: int
) -> None:
    """At every chunk end the returned state is the recurrence's state there; outputs are
    the recurrence's; final states and outputs are those of vLLM's one-go scan, exactly."""
    rows = data.draw(st.lists(row_strategy(chunk_size), min_size=1, max_size=4))
    layout = chunk_layout(chunk_size, rows)
    bounds, owners, last, checkpoints = layout
    starts = [0]
    for _, query, _ in rows:
        starts.append(starts[-1] + query)
    inputs = scan_inputs(starts[-1], len(rows), seed)

    out, states = varlen(fixed.scan, inputs, chunk_size, layout, starts, intermediate=True)
    want_out, after = reference_scan(
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
        inputs["C"],
        inputs["D"],
        inputs["dt_bias"],
        inputs["initial_states"],
        starts,
    )
    assert states.shape == (len(bounds) - 1, HEADS, HEAD_DIM, D_STATE)
    for chunk in range(len(bounds) - 1):
        end = bounds[chunk + 1]
        want = (
            after[end - 1]
            if end > starts[owners[chunk]]
            else inputs["initial_states"][owners[chunk]]
        )
        torch.testing.assert_close(
            states[chunk].double(),
            want,
            rtol=1e-4,
            atol=1e-4,
            msg=lambda m, c=chunk: f"chunk {c} (layout {bounds}): {m}",
        )
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-4)
    for row, chunk in enumerate(checkpoints):
        if chunk >= 0:  # the checkpoint chunk ends exactly on the checkpoint
            assert bounds[chunk + 1] == starts[row] + rows[row][2]

    stock_out, stock_final = varlen(fixed.scan, inputs, chunk_size, layout, starts, False)
    assert torch.equal(states[torch.tensor(last)], stock_final)
    assert torch.equal(out, stock_out)


def test_vllm_cpu_scan_ignores_the_request(fixed: Any) -> None:
    """vLLM's own CPU scan, asked for chunk states, returns one state per row: the reason
    for the correction (if this fails, vLLM fixed it and the hook can go)."""
    rows = [(0, 40, 20), (8, 30, 0)]
    layout = chunk_layout(8, rows)
    starts = [0, 40, 70]
    inputs = scan_inputs(70, 2, 0)
    states = fixed.stock_scan(
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
        inputs["C"],
        8,
        torch.empty_like(inputs["x"]),
        D=inputs["D"],
        dt_bias=inputs["dt_bias"],
        initial_states=inputs["initial_states"],
        return_intermediate_states=True,
        seq_idx=torch.tensor(layout[1], dtype=torch.int32),
        cu_seqlens=torch.tensor(starts, dtype=torch.int32),
        cu_chunk_seqlens=torch.tensor(layout[0], dtype=torch.int32),
        last_chunk_indices=torch.tensor(layout[2], dtype=torch.int32),
        dt_softplus=True,
    )
    assert states.shape[0] == 2 < len(layout[0]) - 1


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        (([0, 8, 16], [0, 0], [1], [-1]), "row 0"),  # 4 tokens of the row in no chunk
        (([0, 12, 8, 20], [0, 0, 0], [2], [-1]), "decrease"),
        (([0, 8, 20], [0, 1], [1], [-1]), "names row 1 of 1"),
    ],
)
def test_bad_chunk_layout_is_refused(fixed: Any, layout: Any, named: str) -> None:
    """Chunk metadata that does not tile the rows is refused, naming what is wrong, before
    anything is written."""
    inputs = scan_inputs(20, 1, 0)
    with pytest.raises(RuntimeError, match=named):
        varlen(fixed.scan, inputs, 8, layout, [0, 20], True)


# ------------------------------------------------------------------ the whole checkpoint
class Caches:
    """A Mamba2 layer's paged states: conv history ``(blocks, dim, STATE_LEN)`` (stored
    dim-first, or token-first and seen transposed, as the mixer sees either layout) and SSM
    states."""

    def __init__(self, blocks: int, dim_first: bool, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        if dim_first:
            self.conv = torch.randn(blocks, CONV_DIM, STATE_LEN, generator=gen)
        else:
            self.conv = torch.randn(blocks, STATE_LEN, CONV_DIM, generator=gen).transpose(-1, -2)
        self.ssm = torch.randn(blocks, HEADS, HEAD_DIM, D_STATE, generator=gen)

    def copy(self) -> Caches:
        other = object.__new__(Caches)
        other.conv = (
            self.conv.clone()
            if self.conv.is_contiguous()
            else (self.conv.transpose(-1, -2).clone().transpose(-1, -2))
        )
        other.ssm = self.ssm.clone()
        return other


def prefill(
    fixed: Any,
    caches: Caches,
    tokens: Any,
    rows: list[tuple[int, bool, int, int]],
    chunk_size: int,
    weight: Any,
    bias: Any,
) -> Any:
    """One prefill step of Mamba2 rows as ``MambaMixer2.conv_ssm_forward`` runs it on CPU:
    conv (vLLM's CPU conv, from and into each row's block), split, scan, checkpoints,
    final states. ``rows``: (block, has a prior state, checkpoint offset or 0, checkpoint
    block); ``tokens``: the rows' pre-conv inputs ``(tokens, CONV_DIM)``, row after row,
    whose lengths are given by ``starts``. Returns the scan's outputs."""
    from types import SimpleNamespace

    starts = tokens.starts
    blocks = torch.tensor([r[0] for r in rows])
    has_init = torch.tensor([r[1] for r in rows])
    x = tokens.values.transpose(0, 1)  # (dim, tokens), as the mixer hands it on
    conv_out = fixed.mixer.causal_conv1d_fn(
        x,
        weight,
        bias,
        activation="silu",
        conv_states=caches.conv,
        has_initial_state=has_init,
        cache_indices=blocks,
        metadata=None,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    ).transpose(0, 1)
    xs, Bs, Cs = torch.split(conv_out, [X_DIM, GROUPS * D_STATE, GROUPS * D_STATE], dim=-1)
    computed = [chunk_size // 2 if r[1] else 0 for r in rows]  # any: only the layout reads it
    offsets = [r[2] for r in rows]
    layout = chunk_layout(
        chunk_size,
        [
            (c, starts[i + 1] - starts[i], o)
            for i, (c, o) in enumerate(zip(computed, offsets, strict=True))
        ],
    )
    gen = torch.Generator().manual_seed(5)  # the same dt and weights in every call
    per_token_dt = torch.randn(tokens.total_len, HEADS, generator=gen) * 0.5
    inputs = {
        "x": xs.reshape(-1, HEADS, HEAD_DIM),
        "dt": per_token_dt[tokens.positions],
        "A": -torch.rand(HEADS, generator=gen) * 0.5 - 0.05,
        "B": Bs.reshape(-1, GROUPS, D_STATE),
        "C": Cs.reshape(-1, GROUPS, D_STATE),
        "D": torch.randn(HEADS, generator=gen),
        "dt_bias": torch.randn(HEADS, generator=gen) * 0.1,
        "initial_states": torch.where(has_init[:, None, None, None], caches.ssm[blocks], 0),
    }
    has_checkpoints = any(offsets)
    out, states = varlen(fixed.scan, inputs, chunk_size, layout, starts, has_checkpoints)
    if has_checkpoints:
        checkpoint = SimpleNamespace(
            checkpoint_offsets=torch.tensor(offsets, dtype=torch.int32),
            state_indices=torch.tensor([r[3] if r[2] else 0 for r in rows]),
        )
        chunk_idx = torch.tensor([max(i, 0) for i in layout[3]])
        fixed.mixer.store_prefill_checkpoint(
            checkpoint,
            chunk_idx,
            x,
            caches.conv,
            states,
            caches.ssm,
            torch.tensor(starts, dtype=torch.int32),
            state_len=STATE_LEN,
        )
        states = states[torch.tensor(layout[2])]
    caches.ssm[blocks] = states
    return out


class Tokens:
    """Pre-conv inputs of some rows: ``values`` row after row, ``starts`` their offsets,
    ``positions`` each token's index in the full prompt sequence (``total_len`` of them),
    so that per-token inputs are the same whichever step a token runs in."""

    def __init__(self, full: Any, spans: list[tuple[int, int]], total_len: int) -> None:
        self.values = torch.cat([full[a:b] for a, b in spans])
        self.positions = torch.cat([torch.arange(a, b) for a, b in spans])
        self.starts = [0]
        for a, b in spans:
            self.starts.append(self.starts[-1] + b - a)
        self.total_len = total_len


@pytest.mark.parametrize("dim_first", [True, False], ids=["dim_first", "token_first"])
@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    chunk_size=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)
def test_checkpoint_is_the_state_a_prefill_to_it_leaves(
    fixed: Any, dim_first: bool, data: st.DataObject, chunk_size: int, seed: int
) -> None:
    """A prefill step whose rows cross a block boundary writes each row's checkpoint block:
    its conv history and SSM state are those a prefill stopping at the boundary leaves in
    the row's own block; a prefill resuming from the checkpoint (a prefix-cache hit) then
    gives the same outputs and final states as the step that ran through."""
    n = data.draw(st.integers(1, 3))
    lens = data.draw(st.lists(st.integers(STATE_LEN + 2, 6 * chunk_size), min_size=n, max_size=n))
    offsets = [data.draw(st.integers(STATE_LEN, q - 1)) for q in lens]
    prior = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    gen = torch.Generator().manual_seed(seed)
    spans, pos = [], 0
    for q in lens:
        spans.append((pos, pos + q))
        pos += q
    full = torch.randn(pos, CONV_DIM, generator=gen)
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen) * 0.5
    bias = torch.randn(CONV_DIM, generator=gen)
    start = Caches(2 * n + 1, dim_first, seed)
    own = [1 + i for i in range(n)]  # each row's running block
    ckpt = [1 + n + i for i in range(n)]  # each row's checkpoint block

    through = start.copy()
    out = prefill(
        fixed,
        through,
        Tokens(full, spans, pos),
        [(own[i], prior[i], offsets[i], ckpt[i]) for i in range(n)],
        chunk_size,
        weight,
        bias,
    )
    stopped = start.copy()
    heads = [(a, a + o) for (a, _), o in zip(spans, offsets, strict=True)]
    prefill(
        fixed,
        stopped,
        Tokens(full, heads, pos),
        [(own[i], prior[i], 0, 0) for i in range(n)],
        chunk_size,
        weight,
        bias,
    )
    for i in range(n):
        assert torch.equal(through.conv[ckpt[i]], stopped.conv[own[i]]), f"row {i}: conv history"
        # vLLM's kernel rounds differently for a row cut off the 8-token grid: close, not equal
        torch.testing.assert_close(
            through.ssm[ckpt[i]], stopped.ssm[own[i]], msg=lambda m, i=i: f"row {i} SSM: {m}"
        )

    resumed = through.copy()
    for i in range(n):  # resume in the checkpoint blocks, not the rows' own
        resumed.conv[own[i]] = torch.nan
        resumed.ssm[own[i]] = torch.nan
    tails = [(a + o, b) for (a, b), o in zip(spans, offsets, strict=True)]
    tail_out = prefill(
        fixed,
        resumed,
        Tokens(full, tails, pos),
        [(ckpt[i], True, 0, 0) for i in range(n)],
        chunk_size,
        weight,
        bias,
    )
    # The through step ran the spans back to back from 0: a token's row in `out` is its
    # position.
    torch.testing.assert_close(tail_out, out[torch.cat([torch.arange(a, b) for a, b in tails])])
    for i in range(n):
        torch.testing.assert_close(resumed.ssm[ckpt[i]], through.ssm[own[i]])
        assert torch.equal(resumed.conv[ckpt[i]], through.conv[own[i]]), f"row {i}: final conv"


def test_checkpoint_inside_the_conv_window_is_refused(fixed: Any) -> None:
    """A checkpoint fewer than ``width - 1`` tokens into its query (vLLM's scheduler never
    makes one) would need history this step no longer has: refused, nothing written."""
    from types import SimpleNamespace

    caches = Caches(3, True, 0)
    before = caches.copy()
    checkpoint = SimpleNamespace(
        checkpoint_offsets=torch.tensor([STATE_LEN - 1], dtype=torch.int32),
        state_indices=torch.tensor([2]),
    )
    with pytest.raises(RuntimeError, match=r"row 0 \(state block 2\)"):
        fixed.mixer.store_prefill_checkpoint(
            checkpoint,
            torch.tensor([0]),
            torch.randn(CONV_DIM, 10),
            caches.conv,
            torch.randn(2, HEADS, HEAD_DIM, D_STATE),
            caches.ssm,
            torch.tensor([0, 10], dtype=torch.int32),
            state_len=STATE_LEN,
        )
    assert torch.equal(caches.conv, before.conv) and torch.equal(caches.ssm, before.ssm)
