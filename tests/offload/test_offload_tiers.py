"""vLLM's tiering spec with a filesystem tier behind the CPU tier, on per-group pools
(:mod:`hybrid_alloc.integration.kv_transfer.offload_tiers` and the shared-region host copies of
:mod:`hybrid_alloc.integration.kv_transfer.offload`).

Driven with vLLM's own ``TieringOffloadingSpec``, its manager and its filesystem tier; only
the KV cache is a test double (per-group layer views over one allocation, as the worker
builds them). The restart test is the tier's point: engine A stores blocks of both groups,
they reach files; engine B (a new spec, manager, worker, shared region and device) finds
them, promotes them through its CPU tier and loads them into its own pools, byte for byte.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from hybrid_alloc.integration.kv_transfer import offload, offload_tiers
from tests.offload.caches import (
    CONFIG_MODULE,
    block_bytes,
    build_caches,
    gpu_spec,
    layer_views,
    offload_vllm_config,
    per_group_config,
    plain_config,
)

REGION_MODULE = "vllm.v1.kv_offload.cpu.shared_offload_region"
TIERING_MODULE = "vllm.v1.kv_offload.tiering.spec"


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The offload hooks installed, on a platform that is neither CUDA-like nor XPU."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self=None: False)
    monkeypatch.setattr(type(current_platform), "is_xpu", lambda self=None: False)
    was_installed = offload.is_installed()
    offload.install()
    try:
        yield
    finally:
        if not was_installed:
            offload.uninstall()


def tiering_config(kv_cache_config: Any, root: Path, engine: str, **extra: Any) -> Any:
    build = offload._per_group_build_offloading_config(
        importlib.import_module(CONFIG_MODULE).build_offloading_config
    )
    vllm_config = offload_vllm_config(
        spec_name="TieringOffloadingSpec",
        secondary_tiers=[
            {"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}
        ],
        **extra,
    )
    vllm_config.kv_transfer_config.engine_id = engine
    return build(vllm_config, kv_cache_config)


# ------------------------------------------------------------ shared host region
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_host_copies_land_in_the_shared_region(blocks_per_chunk: int) -> None:
    """With vLLM's shared offload region the worker's chunks are its slices of each chunk
    row, where the scheduler side (and so every secondary tier) reads them."""
    region_cls = importlib.import_module(REGION_MODULE).SharedOffloadRegion
    kv, views, members = build_caches([(10, [(48, 48), (48, 40)]), (20, [(64, 64)])])
    page_bytes = [48, 48, 64]
    chunks = 6
    cpu_page = sum(page_bytes) * blocks_per_chunk
    row = -(-cpu_page // 4096) * 4096
    engine = f"hybrid-alloc-test-{uuid.uuid4().hex}"
    region = region_cls(engine, chunks, 0, row, cpu_page)
    scheduler_side = region_cls(engine, chunks, None, row, cpu_page)
    try:
        worker = offload.HostCopyOffloadingWorker(kv, blocks_per_chunk, chunks, region=region)
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        # Group 0: blocks 3, 7 (its first two); group 1: block 12 (its first).
        bpc = blocks_per_chunk
        store_chunks = [4, 1] if bpc == 1 else [4]
        store_chunks += [5]
        worker.submit_store(1, gpu_spec([[3, 7], [12]], [0, 0]), CPULoadStoreSpec(store_chunks))
        assert [r.success for r in worker.get_finished()] == [True]
        rows = torch.frombuffer(scheduler_side.create_kv_memoryview(), dtype=torch.int8)
        rows = rows.view(chunks, row)

        def host(chunk: int, tensor: int, slot: int) -> torch.Tensor:
            start = sum(page_bytes[:tensor]) * bpc + slot * page_bytes[tensor]
            return rows[chunk, start : start + page_bytes[tensor]]

        placed = [(3, store_chunks[0], 0), (7, store_chunks[-2 if bpc == 1 else 0], 1 % bpc)]
        for tensor in members[0]:
            page = kv.group_data_refs[0][members[0].index(tensor)].page_size_bytes
            for block, chunk, slot in placed:
                assert torch.equal(host(chunk, tensor, slot)[:page], views[tensor][block][:page])
        assert torch.equal(host(5, members[1][0], 0), views[members[1][0]][12])
        # Back into other blocks (a restart's device): the same bytes.
        worker.submit_load(2, CPULoadStoreSpec(store_chunks), gpu_spec([[0, 1], [2]], [0, 0]))
        assert [r.success for r in worker.get_finished()] == [True]
        for position, (block, _, _) in enumerate(placed):
            for tensor in members[0]:
                page = kv.group_data_refs[0][members[0].index(tensor)].page_size_bytes
                assert torch.equal(views[tensor][position][:page], views[tensor][block][:page])
        assert torch.equal(views[members[1][0]][2], views[members[1][0]][12])
        worker.shutdown()
        assert not os.path.exists(region.mmap_path)
    finally:
        scheduler_side.cleanup()
        region.cleanup()


# ------------------------------------------------------------ file naming
def _file_mapper(offloading_config: Any, root: Path, stock: bool = False) -> Any:
    """vLLM's FileMapper for a spec with ``offloading_config``: as the hooks build it, or
    (``stock``) by vLLM's own builder behind the installed hook."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.file_mapper import FileMapper

    spec = SimpleNamespace(config=offloading_config)
    if not stock:
        return FileMapper.from_offloading_spec(str(root), spec)
    build = offload.stock(offload_tiers.FILE_MAPPER_MODULE, "FileMapper", "from_offloading_spec")
    return build.__func__(FileMapper, str(root), spec)


def test_files_name_the_per_group_layout(hooked: None, tmp_path: Path) -> None:
    """Per-group pools write under a directory whose name hashes their host layout (each
    layer's page); vLLM's shared layout keeps vLLM's own directory."""
    stock_build = importlib.import_module(CONFIG_MODULE).build_offloading_config
    config = per_group_config(padded_mamba=True)
    per_group = tiering_config(config, tmp_path, "e")
    mapper = _file_mapper(per_group, tmp_path)
    assert mapper.get_run_config()["kv_layout"] == per_group.extra_config[offload_tiers.LAYOUT_KEY]
    offload.uninstall()
    unhooked = _file_mapper(per_group, tmp_path)
    assert "kv_layout" not in unhooked.get_run_config()
    assert unhooked.base_path != mapper.base_path
    offload.install()
    plain = stock_build(offload_vllm_config(), plain_config())
    assert offload_tiers.LAYOUT_KEY not in plain.extra_config
    assert (
        _file_mapper(plain, tmp_path).base_path
        == _file_mapper(plain, tmp_path, stock=True).base_path
    )


def test_a_directory_of_other_settings_is_refused(hooked: None, tmp_path: Path) -> None:
    """A tier directory whose config.json names other settings (another layout, dtype,
    group partition) is refused with an error naming it; never loaded."""
    per_group = tiering_config(per_group_config(), tmp_path, "e")
    mapper = _file_mapper(per_group, tmp_path)
    path = Path(mapper.get_config_file_path())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(mapper.get_run_config()))
    _file_mapper(per_group, tmp_path)  # the same settings: accepted
    other = {**mapper.get_run_config(), "dtype": "float16"}
    path.write_text(json.dumps(other))
    with pytest.raises(RuntimeError, match=r"other settings \(differing: dtype\)"):
        _file_mapper(per_group, tmp_path)
    path.write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable"):
        _file_mapper(per_group, tmp_path)


# ------------------------------------------------------------ restart
class Engine:
    """One engine's offloading side: vLLM's tiering spec (its manager: CPU tier plus the
    filesystem tier) and the worker the hooks give it, over a fresh per-group device."""

    def __init__(self, kv_cache_config: Any, root: Path) -> None:
        spec_cls = importlib.import_module(TIERING_MODULE).TieringOffloadingSpec
        self.engine = f"hybrid-alloc-test-{uuid.uuid4().hex}"
        self.spec = spec_cls(tiering_config(kv_cache_config, root, self.engine))
        self.backing, self.views = layer_views(kv_cache_config)
        self.backing.zero_()
        self.worker = self.spec.get_worker(
            offload.per_group_canonical_caches(kv_cache_config, self.views)
        )
        self.manager = self.spec.get_manager()
        self.ctx = ReqContext(req_id="r")
        self.manager.on_new_request(self.ctx)

    def settle(self, keys: list[Any], want: LookupResult, timeout: float = 30.0) -> None:
        """Poll the manager (as the scheduler does each step) until every key reads
        ``want``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [self.manager.lookup(k, self.ctx) for k in keys]
            if all(f is want for f in found):
                return
            assert time.monotonic() < deadline, found
            self.end_step()
            time.sleep(0.01)

    def end_step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def close(self) -> None:
        self.manager.on_request_finished(self.ctx)
        for tier in self.manager.secondary_tiers:
            tier.drain_jobs()
        self.end_step()
        self.manager.shutdown()
        self.worker.shutdown()


def test_blocks_survive_a_restart(hooked: None, tmp_path: Path) -> None:
    config = per_group_config(padded_mamba=True)
    # (group, block ID in its pool, block hash) of what engine A stores.
    stored = [(0, 3, b"m" * 32), (1, 7, b"a" * 32), (1, 9, b"b" * 32), (2, 5, b"w" * 32)]
    keys = [make_offload_key(h, g) for g, _, h in stored]
    a = Engine(config, tmp_path)
    try:
        gen = torch.Generator().manual_seed(3)
        a.backing.copy_(torch.randint(-128, 128, a.backing.shape, generator=gen).to(torch.int8))
        out = a.manager.prepare_store(keys, a.ctx)
        assert out is not None and list(out.keys_to_store) == keys
        blocks = [[b for g, b, _ in stored if g == gid] for gid in range(3)]
        a.worker.submit_store(1, gpu_spec(blocks, [0, 0, 0]), out.store_spec)
        assert [r.success for r in a.worker.get_finished()] == [True]
        a.manager.complete_store(keys, a.ctx)
        a.settle(keys, LookupResult.HIT)
        want = {
            (g, b): {name: block_bytes(a.views[name], n, b, p) for name, n, p in layers(config, g)}
            for g, b, _ in stored
        }
    finally:
        a.close()
    written = list(tmp_path.glob("*_r0/*/*/*.bin"))
    assert len(written) == len(keys)

    b = Engine(config, tmp_path)
    try:
        assert b.engine != a.engine
        b.settle(keys, LookupResult.HIT)  # found in the files, promoted to the CPU tier
        load = b.manager.prepare_load(keys, b.ctx)
        dst = [[1], [2, 4], [0]]  # other blocks of B's own pools
        b.worker.submit_load(2, load, gpu_spec(dst, [0, 0, 0]))
        assert [r.success for r in b.worker.get_finished()] == [True]
        b.manager.complete_load(keys, b.ctx)
        for (g, block, _), dst_block in zip(stored, [1, 2, 4, 0], strict=True):
            for name, n, p in layers(config, g):
                got = block_bytes(b.views[name], n, dst_block, p)
                assert torch.equal(got, want[(g, block)][name]), (g, block, name)
    finally:
        b.close()


def layers(config: Any, gid: int) -> list[tuple[str, int, int]]:
    """(layer, its pool's block count, real page bytes) of group ``gid``'s layers."""
    group = config.kv_cache_groups[gid]
    num_blocks = config.layout_of_group(gid).num_blocks
    return [
        (name, num_blocks, offload.real_page_bytes(spec))
        for name, spec in offload._layer_specs(group).items()
    ]
