"""Unit tests of :mod:`hybrid_alloc.integration.kv_transfer.offload` (no engine runs): the host-copy
transfer worker, the per-group views of the KV cache, the offload sizing wrapper around
vLLM's ``build_offloading_config``, and the hooks' install/uninstall.

vLLM classes are imported inside the tests: the modules differ between vLLM 0.32 and 0.33.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hybrid_alloc.integration.kv_transfer import offload, offload_tiers
from tests.offload.caches import (
    ATTENTION_PAGE,
    CONFIG_MODULE,
    MAMBA_PAGE,
    base,
    block_bytes,
    build_caches,
    cpu_spec,
    gpu_spec,
    layer_views,
    offload_vllm_config,
    per_group_config,
    plain_config,
)

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
CPU_SPEC_MODULE = "vllm.v1.kv_offload.cpu.spec"
HOOKED = (
    (CONNECTOR_MODULE, None, "build_offloading_config"),
    (WORKER_MODULE, "OffloadingConnectorWorker", "register_kv_caches"),
    (CPU_SPEC_MODULE, "CPUOffloadingSpec", "get_worker"),
)

# The worker-level tests' KV cache: group 0 has 3 layers of 48-byte pages over a pool of 10
# blocks, group 1 one layer of 64-byte pages over a pool of 20 (block IDs are pool-scoped:
# block 3 of group 0 and block 3 of group 1 are different data).
TWO_GROUPS: list[tuple[int, list[tuple[int, int]]]] = [
    (10, [(48, 48), (48, 48), (48, 48)]),
    (20, [(64, 64)]),
]
NUM_CHUNKS = 12


def host_buffers(worker: offload.HostCopyOffloadingWorker) -> list[torch.Tensor]:
    """The worker's host buffers (one per row view; rows ``c * bpc ...`` hold chunk c)."""
    return [h.flatten(0, 1) for h in worker._host]


def randomize(buffers: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in buffers:
        buf.copy_(torch.randint(-128, 128, buf.shape, generator=gen).to(torch.int8))


def clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def assert_all_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"buffer {i} differs"


def results(worker: offload.HostCopyOffloadingWorker) -> list[tuple[int, bool, int]]:
    return [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()]


# ------------------------------------------------------------ 1. round trips
# (blocks per chunk, each group's block IDs, each group's first block index, the chunks,
# the host rows each group's blocks land in, bytes moved)
ROUND_TRIPS = {
    "one block per chunk": (
        1,
        [[3, 7, 1], [3, 12]],
        [0, 0],
        [5, 0, 9, 2, 11],
        [[5, 0, 9], [2, 11]],
        560,
    ),
    "two per chunk, both groups enter their first chunk midway": (
        2,
        [[3, 8, 0, 5], [3, 19, 7]],
        [3, 5],
        [4, 1, 6, 0, 7],
        [[9, 2, 3, 12], [1, 14, 15]],
        768,
    ),
    "two per chunk, group 0 empty": (2, [[], [3, 4, 5]], [0, 1], [6, 2], [[], [13, 4, 5]], 192),
    "three per chunk, group 1 at a chunk boundary": (
        3,
        [[3, 9, 0, 6, 2], [3, 16]],
        [4, 6],
        [2, 0, 5],
        [[7, 8, 0, 1, 2], [15, 16]],
        848,
    ),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_host_copy_round_trip(case: str) -> None:
    bpc, blocks, indices, chunks, rows, size = ROUND_TRIPS[case]
    kv, dev, members = build_caches(TWO_GROUPS)
    worker = offload.HostCopyOffloadingWorker(kv, bpc, NUM_CHUNKS)
    host = host_buffers(worker)
    assert [tuple(h.shape) for h in host] == [(NUM_CHUNKS * bpc, 48)] * 3 + [(NUM_CHUNKS * bpc, 64)]
    randomize(host, seed=1)
    dev_before, host_before = clones(dev), clones(host)
    gpu, cpu = gpu_spec(blocks, indices), cpu_spec(chunks)

    assert worker.submit_store(11, gpu, cpu) is True
    expected = clones(host_before)
    for g, group_blocks in enumerate(blocks):
        for t in members[g]:
            expected[t][rows[g]] = dev_before[t][group_blocks]
    assert_all_equal(host, expected)
    assert_all_equal(dev, dev_before)
    assert results(worker) == [(11, True, size)]
    assert worker.get_finished() == []

    for g, group_blocks in enumerate(blocks):
        for t in members[g]:
            dev[t][group_blocks] = 0
    host_stored = clones(host)
    assert worker.submit_load(12, cpu, gpu) is True
    assert_all_equal(dev, dev_before)
    assert_all_equal(host, host_stored)
    if blocks[0] and blocks[1]:  # block 3 of each group came back with its own data
        assert not torch.equal(dev[0][3], dev[3][3][:48])
    assert results(worker) == [(12, True, size)]
    assert worker.get_finished() == []


def test_results_queue_per_job() -> None:
    """Two jobs before get_finished: one result each, in submission order, then none."""
    kv, _, _ = build_caches(TWO_GROUPS)
    worker = offload.HostCopyOffloadingWorker(kv, 1, NUM_CHUNKS)
    worker.submit_store(1, gpu_spec([[2], []], [0, 0]), cpu_spec([0]))
    worker.submit_store(2, gpu_spec([[], [2, 3]], [0, 0]), cpu_spec([1, 2]))
    worker.wait({1, 2})
    assert results(worker) == [(1, True, 144), (2, True, 128)]
    assert results(worker) == []


def test_loaded_block_ids_are_pool_scoped() -> None:
    """A chunk stored from group 1's block 3 loads into group 1's block 17 only; group 0's
    block 17 does not exist (pool of 10), and its rows stay as they were."""
    kv, dev, _ = build_caches(TWO_GROUPS)
    worker = offload.HostCopyOffloadingWorker(kv, 1, NUM_CHUNKS)
    worker.submit_store(1, gpu_spec([[], [3]], [0, 0]), cpu_spec([4]))
    before = clones(dev)
    worker.submit_load(2, cpu_spec([4]), gpu_spec([[], [17]], [0, 0]))
    assert torch.equal(dev[3][17], before[3][3])
    want = clones(before)
    want[3][17] = before[3][3]
    assert_all_equal(dev, want)


def test_injected_load_failure_tears_one_group() -> None:
    """``LoadFailures({1}, 1)``: the first load that carries blocks of offloaded group 1
    reports failure (no size, no time) after writing the first half of group 1's blocks;
    group 0's blocks load in full; a load without group-1 blocks does not count; stores
    never fail; the next load succeeds."""
    kv, dev, members = build_caches(TWO_GROUPS)
    worker = offload.HostCopyOffloadingWorker(kv, 1, NUM_CHUNKS, offload.LoadFailures({1}, 1))
    gpu, cpu = gpu_spec([[3, 4], [5, 6, 7, 8]], [0, 0]), cpu_spec([0, 1, 2, 3, 4, 5])
    assert worker.submit_store(1, gpu, cpu) is True
    assert results(worker) == [(1, True, 2 * 144 + 4 * 64)]
    stored = clones(dev)

    def wipe() -> None:
        for t in members[0]:
            dev[t][[3, 4]] = 0
        dev[3][[5, 6, 7, 8]] = 0

    wipe()
    assert worker.submit_load(2, cpu_spec([0, 1]), gpu_spec([[3, 4], []], [0, 0])) is True
    assert results(worker) == [(2, True, 2 * 144)]
    wipe()
    assert worker.submit_load(3, cpu, gpu) is True
    (failed,) = worker.get_finished()
    assert (failed.job_id, failed.success, failed.transfer_size) == (3, False, None)
    assert failed.transfer_time is None
    want = clones(stored)
    want[3][[7, 8]] = 0
    assert_all_equal(dev, want)
    wipe()
    assert worker.submit_load(4, cpu, gpu) is True
    assert results(worker) == [(4, True, 2 * 144 + 4 * 64)]
    assert_all_equal(dev, stored)


# ------------------------------------------------------------ 2. padded rows
@pytest.mark.parametrize(
    "row, page",
    [(80, 48), (80, 45), (36 << 10, (32 << 10) + 24)],
    ids=["copied as int64", "odd page copied as int8", "page copied row by row"],
)
def test_padding_bytes_are_not_copied(row: int, page: int) -> None:
    """Rows wider than their ref's page: only the first ``page`` bytes of a row move, in
    either direction; the padding of the destination keeps its bytes."""
    kv, dev, _ = build_caches([(8, [(row, page)]), (8, [(64, 64)])])
    worker = offload.HostCopyOffloadingWorker(kv, 1, 4)
    host = host_buffers(worker)[0]
    assert host.shape == (4, row)
    randomize(host_buffers(worker), seed=2)
    host_before, dev_before = host.clone(), dev[0].clone()

    worker.submit_store(1, gpu_spec([[2, 5], []], [0, 0]), cpu_spec([1, 3]))
    want = host_before.clone()
    want[[1, 3], :page] = dev_before[[2, 5], :page]
    assert torch.equal(host, want)
    assert torch.equal(host[[1, 3], page:], host_before[[1, 3], page:])
    assert results(worker) == [(1, True, 2 * page)]

    randomize([dev[0]], seed=3)
    dev_random = dev[0].clone()
    worker.submit_load(2, cpu_spec([1, 3]), gpu_spec([[2, 5], []], [0, 0]))
    want = dev_random.clone()
    want[[2, 5], :page] = host[[1, 3], :page]
    assert torch.equal(dev[0], want)
    assert torch.equal(dev[0][[2, 5], page:], dev_random[[2, 5], page:])
    assert results(worker) == [(2, True, 2 * page)]


def test_page_wider_than_row_is_refused() -> None:
    kv, _, _ = build_caches([(4, [(48, 56)])])
    with pytest.raises(RuntimeError, match="page of 56 B is wider than its 48 B KV row"):
        offload.HostCopyOffloadingWorker(kv, 1, 2)


# ------------------------------------------------------------ 3. mismatched specs
def _worker_and_state() -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    kv, dev, _ = build_caches(TWO_GROUPS)
    worker = offload.HostCopyOffloadingWorker(kv, 1, NUM_CHUNKS)
    randomize(host_buffers(worker), seed=4)
    return worker, dev, host_buffers(worker)


def _submit(worker: Any, job: int, direction: str, gpu: Any, cpu: Any) -> Any:
    if direction == "store":
        return worker.submit_store(job, gpu, cpu)
    return worker.submit_load(job, cpu, gpu)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("sizes, indices", [([1], [0]), ([1, 0, 0], [0, 0, 0]), ([1, 0], [0])])
def test_wrong_group_count_raises_before_copying(
    direction: str, sizes: list[int], indices: list[int]
) -> None:
    """Group sizes (or first block indices, which vLLM's spec class keeps equal in number;
    a duck-typed spec here) for another number of groups than the worker's two."""
    worker, dev, host = _worker_and_state()
    before_dev, before_host = clones(dev), clones(host)
    if len(sizes) == len(indices):
        gpu = base().GPULoadStoreSpec([3], sizes, indices)
    else:
        ids = np.array([3], dtype=np.int32)
        gpu = SimpleNamespace(block_ids=ids, group_sizes=sizes, block_indices=indices)
    pattern = rf"offload job 7: {len(sizes)} groups of block IDs for 2 offloaded groups"
    with pytest.raises(RuntimeError, match=pattern):
        _submit(worker, 7, direction, gpu, cpu_spec([0]))
    assert_all_equal(dev, before_dev)
    assert_all_equal(host, before_host)
    assert worker.get_finished() == []


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize(
    "bpc, chunks",
    [(1, [0, 1, 2, 5]), (1, [0, 1]), (1, []), (2, [0, 1, 2, 5]), (2, [0, 1])],
    ids=["one more", "one fewer", "none", "two per chunk, one more", "two per chunk, one fewer"],
)
def test_chunk_count_mismatch_raises_before_copying(
    direction: str, bpc: int, chunks: list[int]
) -> None:
    """Group 0's blocks 3 and 7 and group 1's block 3 need 3 chunks, of one block or of
    two (group 0's first block index 1 enters its first chunk midway, so its two blocks
    span two chunks): any other count is refused before either side is touched."""
    kv, dev, _ = build_caches(TWO_GROUPS)
    worker = offload.HostCopyOffloadingWorker(kv, bpc, NUM_CHUNKS)
    host = host_buffers(worker)
    randomize(host, seed=4)
    before_dev, before_host = clones(dev), clones(host)
    gpu = gpu_spec([[3, 7], [3]], [1, 0])
    pattern = rf"offload job 8: 3 block IDs and {len(chunks)} chunks do not match the group sizes"
    with pytest.raises(RuntimeError, match=pattern):
        _submit(worker, 8, direction, gpu, cpu_spec(chunks))
    assert worker.get_finished() == []
    assert_all_equal(dev, before_dev)
    assert_all_equal(host, before_host)
    # The same job with the right count goes through.
    assert _submit(worker, 9, direction, gpu, cpu_spec([0, 1, 2])) is True
    assert results(worker) == [(9, True, 2 * 3 * 48 + 64)]


def _extra_submit_load_arguments() -> dict[str, Any]:
    """Keyword arguments vLLM's ``OffloadingWorker.submit_load`` declares beyond
    (job_id, src_spec, dst_spec), as vLLM's connector worker passes them (0.33:
    ``expedited=True`` for loads its request waits on within the step)."""
    params = inspect.signature(base().OffloadingWorker.submit_load).parameters
    extra = [p for p in params if p not in ("self", "job_id", "src_spec", "dst_spec")]
    return {name: True for name in extra}


def test_submit_load_takes_vllms_arguments() -> None:
    """vLLM 0.33 passes ``expedited=True`` for loads waited on within the step."""
    kv, dev, _ = build_caches(TWO_GROUPS)
    worker = offload.HostCopyOffloadingWorker(kv, 1, NUM_CHUNKS)
    worker.submit_store(1, gpu_spec([[4], []], [0, 0]), cpu_spec([0]))
    want = dev[0][4].clone()
    kwargs = _extra_submit_load_arguments()
    assert worker.submit_load(2, cpu_spec([0]), gpu_spec([[6], []], [0, 0]), **kwargs) is True
    assert torch.equal(dev[0][6], want)


# ------------------------------------------------------------ 4. per-group views
def test_per_group_canonical_caches() -> None:
    config = per_group_config()
    sizes = config.group_num_blocks()
    assert len(set(sizes)) == 3, sizes  # three pools of different sizes
    groups = [list(g.layer_names) for g in config.kv_cache_groups]
    assert groups == [["m.0", "m.1"], ["a.0", "a.1"], ["w.0"]]
    backing, views = layer_views(config)
    kv = offload.per_group_canonical_caches(config, views)

    padded = MAMBA_PAGE + 512
    pages = {"m.0": padded, "m.1": padded, "a.0": ATTENTION_PAGE, "a.1": ATTENTION_PAGE}
    pages["w.0"] = ATTENTION_PAGE
    names = [n for g in groups for n in g]
    assert len(kv.tensors) == len(names)
    # One ref per layer of the group, in layer order, with the real (unpadded) page.
    assert [[r.tensor_idx for r in refs] for refs in kv.group_data_refs] == [[0, 1], [2, 3], [4]]
    assert [[r.page_size_bytes for r in refs] for refs in kv.group_data_refs] == [
        [MAMBA_PAGE, MAMBA_PAGE],
        [ATTENTION_PAGE, ATTENTION_PAGE],
        [ATTENTION_PAGE],
    ]
    storage = backing.untyped_storage().data_ptr()
    for idx, name in enumerate(names):
        gid = config.group_of_layer(name)
        num_blocks, page = sizes[gid], pages[name]
        canonical = kv.tensors[idx]
        rows, view = canonical.tensor, views[name]
        assert rows.dtype == torch.int8
        assert tuple(rows.shape) == (num_blocks, page), name
        assert canonical.page_size_bytes == page
        assert rows.untyped_storage().data_ptr() == storage
        assert rows.data_ptr() == view.data_ptr()
        block_stride = view.stride(0) * view.element_size() * (view.shape[0] // num_blocks)
        assert rows.stride() == (block_stride, 1), name
        for b in range(num_blocks):
            assert torch.equal(rows[b], block_bytes(view, num_blocks, b, page)), (name, b)
    # Writes through a row land in the layer's block (the views alias the KV cache).
    kv.tensors[3].tensor[5] = 7
    assert bool((block_bytes(views["a.1"], sizes[1], 5, ATTENTION_PAGE) == 7).all())


def test_block_rows_refuses_views_that_do_not_fit() -> None:
    config = per_group_config(padded_mamba=False)
    _, views = layer_views(config)
    short = dict(views)
    short["a.0"] = views["a.0"][:-1]  # one block fewer than the pool
    with pytest.raises(RuntimeError, match="cannot hold the pool's"):
        offload.per_group_canonical_caches(config, short)
    tight = dict(views)
    num_blocks = config.group_num_blocks()[0]
    tight["m.0"] = views["m.0"].as_strided((num_blocks, 64), (64, 1))  # stride below page
    with pytest.raises(RuntimeError, match=f"block stride 64 B is below its page {MAMBA_PAGE} B"):
        offload.per_group_canonical_caches(config, tight)


# ------------------------------------------------------------ 5. offload sizing
@pytest.mark.parametrize("padded_mamba", [False, True])
def test_offload_bytes_per_block_per_group(padded_mamba: bool) -> None:
    stock = importlib.import_module(CONFIG_MODULE).build_offloading_config
    wrapped = offload._per_group_build_offloading_config(stock)
    config = per_group_config(padded_mamba)
    vllm_config = offload_vllm_config()
    theirs = stock(vllm_config, config)
    ours = wrapped(vllm_config, config)
    mamba = MAMBA_PAGE + (512 if padded_mamba else 0)
    # One host row per offloaded layer: 2 Mamba + 2 full attention + 1 sliding window.
    assert [g.group_id for g in ours.groups] == [0, 1, 2]
    assert ours.worker_kv_bytes_per_block == 2 * mamba + 3 * ATTENTION_PAGE
    assert offload.per_group_bytes_per_block(config) == ours.worker_kv_bytes_per_block
    # vLLM's figure (the shared allocation over the primary pool) mixes the groups.
    assert theirs.worker_kv_bytes_per_block == config.kv_cache_tensors[0].size // config.num_blocks
    assert theirs.worker_kv_bytes_per_block != ours.worker_kv_bytes_per_block
    # The host layout is named in the extra config (for the file names of secondary tiers).
    layout = ours.extra_config[offload_tiers.LAYOUT_KEY]
    assert layout["bytes_per_block"] == ours.worker_kv_bytes_per_block
    assert layout["groups"] == [
        {"group": 0, "pages": [["m.0", mamba], ["m.1", mamba]]},
        {"group": 1, "pages": [["a.0", ATTENTION_PAGE], ["a.1", ATTENTION_PAGE]]},
        {"group": 2, "pages": [["w.0", ATTENTION_PAGE]]},
    ]
    assert (
        replace(
            theirs,
            worker_kv_bytes_per_block=ours.worker_kv_bytes_per_block,
            extra_config={**theirs.extra_config, offload_tiers.LAYOUT_KEY: layout},
        )
        == ours
    )


def test_offload_bytes_per_block_plain_config_unchanged() -> None:
    stock = importlib.import_module(CONFIG_MODULE).build_offloading_config
    wrapped = offload._per_group_build_offloading_config(stock)
    vllm_config = offload_vllm_config(blocks_per_chunk=2)
    ours = wrapped(vllm_config, plain_config())
    assert ours.worker_kv_bytes_per_block == 2 * ATTENTION_PAGE  # size // num_blocks
    assert offload_tiers.LAYOUT_KEY not in ours.extra_config
    assert ours == stock(vllm_config, plain_config())
    assert ours.cache.blocks_per_chunk == 2


# ------------------------------------------------------------ 6. install / uninstall
def hook_targets() -> list[tuple[Any, str]]:
    """(module or class, attribute) of every hook of offload.install, the three this file
    is about first."""
    keys = [(m, o, a) for m, o, a, _ in offload._HOOKS]
    assert set(HOOKED) <= set(keys), keys
    out = []
    for module_name, owner, attr in [*HOOKED, *(k for k in keys if k not in HOOKED)]:
        module = importlib.import_module(module_name)
        out.append((module if owner is None else getattr(module, owner), attr))
    return out


def hooked_attributes() -> list[Any]:
    """Each hooked attribute as its owner defines it (None: inherited, not its own)."""
    return [vars(target).get(attr) for target, attr in hook_targets()]


@pytest.fixture
def stock_offload() -> Iterator[None]:
    """vLLM's offloading functions unhooked for the test, the previous state restored."""
    was_installed = offload.is_installed()
    offload.uninstall()
    try:
        yield
    finally:
        offload.uninstall()
        if was_installed:
            offload.install()


def test_install_uninstall_restore_vllms_functions(stock_offload: None) -> None:
    config_module = importlib.import_module(CONFIG_MODULE)
    original_config_fn = config_module.build_offloading_config
    originals = hooked_attributes()
    resolved = [getattr(target, attr) for target, attr in hook_targets()]
    assert all(o is not None for o in originals[: len(HOOKED)])
    assert not offload.is_installed()
    offload.install()
    wrapped = hooked_attributes()
    assert offload.is_installed()
    assert all(w is not None and w is not o for w, o in zip(wrapped, originals, strict=True))
    offload.install()  # idempotent: nothing wrapped twice
    assert all(a is w for a, w in zip(hooked_attributes(), wrapped, strict=True))
    assert config_module.build_offloading_config is original_config_fn
    offload.uninstall()
    assert not offload.is_installed()
    assert all(a is o for a, o in zip(hooked_attributes(), originals, strict=True))
    offload.uninstall()
    assert all(a is o for a, o in zip(hooked_attributes(), originals, strict=True))
    offload.install()
    offload.uninstall()
    assert all(a is o for a, o in zip(hooked_attributes(), originals, strict=True))
    after = [getattr(target, attr) for target, attr in hook_targets()]
    # (== : a classmethod resolves to a new bound method on every access)
    assert all(a == r for a, r in zip(after, resolved, strict=True))


def test_register_kv_caches_hook(stock_offload: None) -> None:
    """Per-group configs: the hooked register_kv_caches hands the per-group views to
    _init_worker; canonical_layout is refused; other configs reach vLLM's function."""
    offload.install()
    worker_cls = importlib.import_module(WORKER_MODULE).OffloadingConnectorWorker
    config = per_group_config(padded_mamba=False)
    _, views = layer_views(config)
    seen: list[Any] = []
    fake = SimpleNamespace(
        kv_cache_config=config,
        spec=SimpleNamespace(config=SimpleNamespace(canonical_layout=False)),
        _init_worker=seen.append,
    )
    worker_cls.register_kv_caches(fake, views)
    (kv,) = seen
    assert [tuple(t.tensor.shape) for t in kv.tensors] == [
        (config.group_num_blocks()[config.group_of_layer(n)], t.page_size_bytes)
        for n, t in zip(["m.0", "m.1", "a.0", "a.1", "w.0"], kv.tensors, strict=True)
    ]
    fake.spec.config.canonical_layout = True
    with pytest.raises(RuntimeError, match="canonical_layout is not supported"):
        worker_cls.register_kv_caches(fake, views)
    # A plain config goes to vLLM's own function (which reads fields the fake lacks).
    plain = SimpleNamespace(kv_cache_config=plain_config(), _init_worker=seen.append)
    with pytest.raises(AttributeError, match="vllm_config"):
        worker_cls.register_kv_caches(plain, views)
    assert len(seen) == 1


# ------------------------------------------------------------ 7. the get_worker hook
@pytest.fixture
def host_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """A platform that is neither CUDA-like nor XPU (vLLM 0.32's CPU build is; 0.33's CUDA
    wheel without a GPU reports an unspecified platform)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self=None: False)
    monkeypatch.setattr(type(current_platform), "is_xpu", lambda self=None: False)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_get_worker_on_host_platform(
    stock_offload: None, host_platform: None, blocks_per_chunk: int
) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    config = per_group_config(padded_mamba=False)
    _, views = layer_views(config)
    kv = offload.per_group_canonical_caches(config, views)
    build = offload._per_group_build_offloading_config(
        importlib.import_module(CONFIG_MODULE).build_offloading_config
    )
    offloading_config = build(offload_vllm_config(blocks_per_chunk=blocks_per_chunk), config)
    spec = CPUOffloadingSpec(offloading_config)
    per_block = 2 * MAMBA_PAGE + 3 * ATTENTION_PAGE
    aligned = -(-per_block * blocks_per_chunk // spec.BLOCK_SIZE_ALIGNMENT)
    assert spec.num_chunks == (64 << 20) // (aligned * spec.BLOCK_SIZE_ALIGNMENT) > 0
    with pytest.raises(Exception, match="only supported on CUDA-alike"):
        spec.get_worker(kv)  # vLLM's own, unhooked

    offload.install()
    worker = spec.get_worker(kv)
    assert isinstance(worker, offload.HostCopyOffloadingWorker)
    assert spec.get_worker(kv) is worker
    host = host_buffers(worker)
    rows = spec.num_chunks * blocks_per_chunk
    assert [tuple(h.shape) for h in host] == [(rows, t.tensor.shape[1]) for t in kv.tensors]
    # The host buffers hold exactly what the scheduler side sized: chunks x bytes per chunk.
    assert sum(h.numel() for h in host) == spec.num_chunks * blocks_per_chunk * per_block
    assert sum(h.numel() for h in host) <= 64 << 20


def test_get_worker_on_cuda_is_vllms(stock_offload: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA-like platform the hook defers to vLLM's get_worker (its create_worker)."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self=None: True)
    config = per_group_config(padded_mamba=False)
    build = offload._per_group_build_offloading_config(
        importlib.import_module(CONFIG_MODULE).build_offloading_config
    )
    spec = CPUOffloadingSpec(build(offload_vllm_config(), config))
    made: list[Any] = []
    sentinel = object()
    spec.create_worker = lambda kv: made.append(kv) or sentinel
    offload.install()
    assert spec.get_worker("caches") is sentinel
    assert spec.get_worker("caches") is sentinel
    assert made == ["caches"]
