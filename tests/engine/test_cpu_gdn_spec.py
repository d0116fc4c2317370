"""The CPU GDN speculative path as the plugin leaves it (vLLM 0.32: with
:mod:`hybrid_alloc.integration.worker.cpu_gdn_spec` installed; 0.33: vLLM's own): whatever a state
block held before (another request's history, as a reused block of any pool holds), each
step reads the request's own conv history.

The ``_spec_forward`` the plugin leaves runs on real CPU tensors; only vLLM's SSM kernel is
replaced by a stand-in that hands back the conv output, so each step's conv is checked too.
Without the correction, vLLM 0.32 fails these tests: after a step shorter than
``1 + num_speculative_tokens`` (an n-gram request with no match) the next step reads
columns the request never wrote, and a short step after an accepted draft crashes. This
is the bug that made per-group pools' tokens differ from stock's under n-gram speculation
(issue 18).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

WIDTH = 4
DIM = 6


@pytest.fixture(scope="module")
def spec_forward() -> Iterator[Any]:
    """``_spec_forward`` as the plugin leaves it in this process."""
    from hybrid_alloc.integration.worker import cpu_gdn_spec

    try:
        module = importlib.import_module(cpu_gdn_spec.MODULE)
    except Exception as e:  # a vLLM build without the CPU GDN ops
        pytest.skip(f"{cpu_gdn_spec.MODULE} does not import: {e}")
    cpu_gdn_spec.install()
    try:
        yield module
    finally:
        cpu_gdn_spec.uninstall()


class _StubOps:
    """Stands in for vLLM's CPU SSM kernel: hands back the conv output it was given (as
    ``v``), so that the test sees what the conv computed."""

    @staticmethod
    def fused_sigmoid_gating_delta_rule_update_spec_cpu(*, v: Any, **_: Any) -> Any:
        return v.clone()


def _torch_conv_only(monkeypatch: Any, module: Any) -> None:
    """Run the conv in torch whatever the CPU: on one with AMX or Arm bf16, vLLM sends a
    batch whose rows all have the same length to its native conv kernel (and the plugin
    leaves such batches to it), for which the stand-in SSM kernel above cannot stand in.
    The tests check the conv that runs in torch, so they run the same path on every
    machine; `test_equal_rows_left_to_the_native_kernel` checks the dispatch."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(module, "is_arm_bf16", lambda: False)


def _layer() -> Any:
    gen = torch.Generator().manual_seed(0)
    conv1d = SimpleNamespace(
        weight=torch.randn(DIM, 1, WIDTH, generator=gen), bias=torch.randn(DIM, generator=gen)
    )
    return SimpleNamespace(
        conv1d=conv1d,
        activation="silu",
        A_log=None,
        dt_bias=None,
        rearrange_mixed_qkv=lambda x: (x[None], x[None], x[None]),
    )


def _run(
    module: Any, num_spec: int, steps: list[tuple[int, int]], seed: int, monkeypatch: Any
) -> None:
    """One request in state slot 3 of 5, whose slot first holds noise (an earlier owner's
    history) except for the ``WIDTH - 1`` columns its prefill wrote; then ``steps`` of
    (tokens this step, tokens accepted). Before each step the columns the step reads must
    be the request's last ``WIDTH - 1`` accepted inputs."""
    monkeypatch.setattr(module, "ops", _StubOps)
    _torch_conv_only(monkeypatch, module)
    gen = torch.Generator().manual_seed(seed)
    state_len = WIDTH - 1 + num_spec
    conv_buf = torch.randn(5, DIM, state_len, generator=gen)  # stale everywhere
    history = torch.randn(DIM, WIDTH - 1, generator=gen)
    conv_buf[3][:, : WIDTH - 1] = history  # what the request's prefill wrote
    slots = torch.tensor([[3, *range(4, 4 + num_spec)]]) % 5
    accepted = 1
    layer = _layer()
    for i, (q, keep) in enumerate(steps):
        offset = accepted - 1
        read = conv_buf[3][:, offset : offset + WIDTH - 1]
        assert torch.equal(read, history), f"step {i}: read columns the request never wrote"
        x = torch.randn(q, DIM, generator=gen)
        metadata = SimpleNamespace(
            num_spec_decodes=1,
            spec_state_indices_tensor=slots,
            spec_query_start_loc=torch.tensor([0, q]),
            num_accepted_tokens=torch.tensor([accepted]),
        )
        out = module._spec_forward(layer, metadata, x, x, x, conv_buf, None, WIDTH, state_len)
        # This step's conv: the request's history followed by its inputs.
        want = torch.nn.functional.conv1d(
            torch.cat([history, x.transpose(0, 1)], dim=-1)[None],
            layer.conv1d.weight,
            layer.conv1d.bias,
            groups=DIM,
        )[0]
        torch.testing.assert_close(out, torch.nn.functional.silu(want).transpose(0, 1))
        # The accepted inputs x[0..keep) join the history the next step must read.
        history = torch.cat([history, x[:keep].transpose(0, 1)], dim=-1)[:, -(WIDTH - 1) :]
        accepted = keep


@pytest.mark.parametrize("num_spec", [1, 2])
def test_short_step_then_full_step(spec_forward: Any, num_spec: int, monkeypatch: Any) -> None:
    """An n-gram request without a match (one token), then drafts: the second step must
    read the history the first step left (vLLM 0.32 alone reads stale columns here)."""
    full = 1 + num_spec
    _run(spec_forward, num_spec, [(1, 1), (full, 1), (1, 1), (full, full), (1, 1)], 1, monkeypatch)


@settings(max_examples=60, deadline=None)
@given(
    num_spec=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_random_steps(spec_forward: Any, num_spec: int, seed: int, data: st.DataObject) -> None:
    """Any mix of short and full steps and accepted counts: every step reads exactly the
    request's own last inputs, never what an earlier owner of the slot left."""
    step = st.integers(1, 1 + num_spec).flatmap(lambda q: st.tuples(st.just(q), st.integers(1, q)))
    steps = data.draw(st.lists(step, min_size=1, max_size=8))
    with pytest.MonkeyPatch.context() as m:
        _run(spec_forward, num_spec, steps, seed, m)


def _serve(
    module: Any, num_spec: int, steps: list[list[tuple[int, int]]], slots: list[int], stale: str
) -> list[Any]:
    """Two requests decoded side by side in one batch, in conv-buffer ``slots`` of 6 whose
    earlier contents are ``stale`` (``noise`` or ``zeros``), as two pools would hand them
    out; ``steps[t][r]`` is request r's (tokens, accepted) at step t. Returns each step's
    output. Inputs and prefill histories depend only on the requests, not on the slots."""
    gen = torch.Generator().manual_seed(7)
    state_len = WIDTH - 1 + num_spec
    conv_buf = torch.zeros(6, DIM, state_len)
    if stale == "noise":
        conv_buf.normal_(generator=torch.Generator().manual_seed(99))
    for slot in slots:
        conv_buf[slot][:, : WIDTH - 1] = torch.randn(DIM, WIDTH - 1, generator=gen)
    accepted = [1, 1]
    layer = _layer()
    outputs = []
    for step in steps:
        lens = [q for q, _ in step]
        x = torch.randn(sum(lens), DIM, generator=gen)
        metadata = SimpleNamespace(
            num_spec_decodes=2,
            spec_state_indices_tensor=torch.tensor([[s, *[(s + 1) % 6] * num_spec] for s in slots]),
            spec_query_start_loc=torch.tensor([0, lens[0], sum(lens)]),
            num_accepted_tokens=torch.tensor(accepted),
        )
        outputs.append(
            module._spec_forward(layer, metadata, x, x, x, conv_buf, None, WIDTH, state_len)
        )
        accepted = [keep for _, keep in step]
    return outputs


@settings(max_examples=40, deadline=None)
@given(num_spec=st.integers(1, 3), data=st.data())
def test_tokens_do_not_depend_on_the_pool(
    spec_forward: Any, num_spec: int, data: st.DataObject
) -> None:
    """The differential form of the property per-group pools broke: the same requests in
    other state blocks, over other leftovers (noise or zeros), give the same outputs at
    every step."""
    step = st.integers(1, 1 + num_spec).flatmap(lambda q: st.tuples(st.just(q), st.integers(1, q)))
    steps = data.draw(st.lists(st.lists(step, min_size=2, max_size=2), min_size=1, max_size=6))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(spec_forward, "ops", _StubOps)
        _torch_conv_only(m, spec_forward)
        one = _serve(spec_forward, num_spec, steps, [0, 2], "zeros")
        other = _serve(spec_forward, num_spec, steps, [4, 1], "noise")
    for t, (a, b) in enumerate(zip(one, other, strict=True)):
        torch.testing.assert_close(a, b, msg=f"step {t}: outputs depend on the state blocks")


def test_equal_rows_left_to_the_native_kernel(spec_forward: Any, monkeypatch: Any) -> None:
    """On a CPU with AMX (or Arm bf16) the plugin's ``_spec_forward`` leaves a batch to
    vLLM's native conv kernel only when every row is full length (``1 +
    num_speculative_tokens``); a batch with a short row, even one whose rows all have
    that one length (which vLLM 0.32 alone sends to the kernel), is corrected in torch."""
    from hybrid_alloc.integration.worker import cpu_gdn_spec

    if not cpu_gdn_spec.is_installed():
        pytest.skip("vLLM's own _spec_forward here (no correction installed)")
    native_calls: list[int] = []

    class NativeOps(_StubOps):
        @staticmethod
        def causal_conv1d_update_cpu(*, x: Any, **_: Any) -> Any:
            native_calls.append(x.shape[1])
            return x.clone()

    monkeypatch.setattr(spec_forward, "ops", NativeOps)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(spec_forward, "is_conv_state_dim_first", lambda: False)
    for lens, native in (([2, 2], True), ([1, 1], False), ([1, 2], False), ([2, 1], False)):
        native_calls.clear()
        _serve(spec_forward, 1, [[(q, 1) for q in lens]], [0, 2], "zeros")
        assert bool(native_calls) is native, lens
