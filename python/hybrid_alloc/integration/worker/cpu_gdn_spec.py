"""vLLM 0.32's CPU GDN speculative path keeps a request's conv history in the wrong columns
when a request has fewer tokens this step than ``1 + num_speculative_tokens``.

The CPU GDN layers (Qwen3-Next, Qwen3.5) keep a wide conv buffer per request under
speculative decoding: ``state_len = width - 1 + num_spec`` columns, the history the next
step reads starting at column ``num_accepted - 1``. After a step of ``q`` tokens the history
must be the window's last ``width - 2`` columns followed by the ``q`` new inputs, from
column 0. vLLM 0.32's torch fallback (every CPU without AMX or Arm bf16) instead keeps
``state_len - q`` columns from past the window and appends the inputs at the end. That is
only the same thing when ``q`` is the full ``1 + num_spec``. A request the n-gram drafter
found no match for runs with ``q = 1``, and the next step then reads columns the request
never wrote: whatever an earlier owner of that state block left there. The tokens depend
on which block the pool handed out, so two pools (stock vLLM's shared pool, our per-group
pools, whose compact state pools reuse blocks within a step or two) give different tokens
for the same requests. vLLM 0.33 writes ``B[:, :width - 2 + q]`` and runs its native
kernel only on full-length rows; this module gives 0.32 the same history.

The same roll also crashes vLLM 0.32 ("The size of tensor a (..) must match the size of
tensor b (..)") when a short row follows a step whose drafts were accepted: its slice runs
past the buffer.

The correction replaces ``_spec_forward`` on the torch-fallback path: the conv of each row
(:func:`_spec_conv`, reading the window vLLM reads and writing the history where the next
step reads it), then vLLM's own SSM kernel, unchanged. Full-length rows get the same
columns as vLLM's roll gives them. Installed by the plugin on CPU platforms for both
pool backends, so that stock vLLM's pool and ours run the same kernel;
``HYBRID_ALLOC_CPU_GDN_SPEC_FIX=0`` leaves vLLM's function alone.

On CPUs with AMX or Arm bf16, vLLM 0.32 sends a batch whose rows all have one length to
its native conv kernel, short rows included, and that kernel keeps a short row's history
no better: on such a CPU (measured on an AMX Xeon, 2026-12-01) the n-gram engine test's
tokens differed between stock's pool and ours. The correction leaves a batch to the
native kernel only when every row is full length (``1 + num_speculative_tokens``), as
vLLM 0.33 does, and runs any batch with a short row through the conv above.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from hybrid_alloc.integration import hooks, versions

logger = logging.getLogger("vllm.hybrid_alloc")

MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"


def _uses_native_conv(module: Any, seq_lens: list[int], width: int, state_len: int) -> bool:
    """Whether the batch goes to vLLM's native conv kernel: vLLM 0.32's own test (a CPU
    with AMX or Arm bf16, width 4, rows of one length), and every row full length, the
    one case that kernel keeps the history for as the next step reads it."""
    import torch

    native_cpu = bool(torch.cpu._is_amx_tile_supported()) or bool(module.is_arm_bf16())
    return (
        native_cpu
        and width == 4
        and len(seq_lens) > 0
        and all(q == state_len - (width - 2) for q in seq_lens)
    )


def _spec_conv(
    module: Any,
    layer: Any,
    metadata: Any,
    mixed_qkv_spec: Any,
    conv_buf: Any,
    width: int,
    starts: list[int],
) -> Any:
    """The conv of every speculative row, leaving each row's history where its next step
    reads it.

    Row ``i`` reads ``width - 1`` columns from ``num_accepted - 1`` (the history after the
    tokens accepted last step), convolves them with its ``q`` inputs, and stores the
    window's last ``width - 2`` columns and the ``q`` inputs from column 0: whatever
    ``a >= 1`` of these tokens the next step accepts, columns ``a - 1 ..`` are then the
    ``width - 1`` inputs before token ``a + 1``. Needs ``width - 2 + q <= state_len``,
    which ``q <= 1 + num_speculative_tokens`` guarantees.
    """
    import torch
    import torch.nn.functional as F

    n = len(starts) - 1
    slots = metadata.spec_state_indices_tensor[:n, 0].tolist()
    accepted = metadata.num_accepted_tokens[:n].tolist()
    weight = module._unpacked_conv_weight(layer).unsqueeze(1)
    bias = layer.conv1d.bias
    conv_out = torch.empty_like(mixed_qkv_spec)
    dim = mixed_qkv_spec.size(-1)
    for i in range(n):
        start, q = starts[i], starts[i + 1] - starts[i]
        if q == 0:
            continue
        history = conv_buf[slots[i]]  # (dim, state_len)
        if width - 2 + q > history.shape[-1] or int(accepted[i]) < 1:
            raise RuntimeError(
                f"CPU GDN speculative row {i} (state slot {slots[i]}): {q} tokens, "
                f"{int(accepted[i])} accepted, do not fit a conv history of "
                f"{history.shape[-1]} columns"
            )
        offset = int(accepted[i]) - 1
        window = history[:, offset : offset + width - 1]
        x = mixed_qkv_spec[start : start + q].transpose(0, 1).to(history.dtype)
        inputs = torch.cat([window, x], dim=-1)  # a new tensor: window is read before the write
        out = F.conv1d(inputs.unsqueeze(0), weight, bias, groups=dim)[0]
        if layer.activation == "silu":
            out = F.silu(out)
        conv_out[start : start + q] = out.transpose(0, 1).to(conv_out.dtype)
        history[:, : width - 2 + q] = inputs[:, 1:]
    return conv_out


def _spec_recurrence(
    module: Any, layer: Any, metadata: Any, conv_out: Any, b_spec: Any, a_spec: Any, ssm: Any
) -> Any:
    """vLLM's own multi-slot SSM kernel over the conv output (unchanged: it already resumes
    from slot ``num_accepted - 1`` and keeps one state per draft position)."""
    import torch

    n = int(metadata.num_spec_decodes)
    query, key, value = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(conv_out))
    return module.ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        q=query,
        k=key,
        v=value,
        a=a_spec,
        b=b_spec,
        initial_state_source=ssm,
        spec_state_indices=metadata.spec_state_indices_tensor[:n].to(torch.int32).contiguous(),
        num_accepted_tokens=metadata.num_accepted_tokens[:n].to(torch.int32).contiguous(),
        cu_seqlens=metadata.spec_query_start_loc[: n + 1].to(torch.int32).contiguous(),
        use_qk_l2norm_in_kernel=True,
    )


def _corrected_spec_forward(stock: Callable[..., Any]) -> Callable[..., Any]:
    import importlib

    module = importlib.import_module(MODULE)

    def _spec_forward(
        layer: Any,
        attn_metadata_i: Any,
        mixed_qkv_spec: Any,
        b_spec: Any,
        a_spec: Any,
        conv_buf: Any,
        ssm_state: Any,
        width: int,
        state_len: int,
    ) -> Any:
        n = int(attn_metadata_i.num_spec_decodes)
        starts = [int(s) for s in attn_metadata_i.spec_query_start_loc[: n + 1].tolist()]
        lens = [b - a for a, b in itertools.pairwise(starts)]
        if _uses_native_conv(module, lens, width, state_len):
            return stock(
                layer,
                attn_metadata_i,
                mixed_qkv_spec,
                b_spec,
                a_spec,
                conv_buf,
                ssm_state,
                width,
                state_len,
            )
        conv_out = _spec_conv(
            module, layer, attn_metadata_i, mixed_qkv_spec, conv_buf, width, starts
        )
        return _spec_recurrence(module, layer, attn_metadata_i, conv_out, b_spec, a_spec, ssm_state)

    return _spec_forward


_hooks = hooks.HookSet(
    [(MODULE, None, "_spec_forward", _corrected_spec_forward)],
    hooks.log_missing(logger, logging.DEBUG),
)


def needed() -> bool:
    """Whether this process runs vLLM's CPU GDN path of a release that needs the fix."""
    if not versions.is_supported(versions.installed_version()):
        return False
    if not versions.release().cpu_gdn_spec_history_fix:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def install() -> bool:
    """Wrap ``_spec_forward`` where :func:`needed` (idempotent); True if installed."""
    if needed():
        _hooks.install()
    return _hooks.installed()


def uninstall() -> None:
    _hooks.uninstall()


def is_installed() -> bool:
    return _hooks.installed()
