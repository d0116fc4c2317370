"""vLLM's native KV offloading (``--kv-offloading-size``) with per-group pools, and a host
copy path that lets it run on CPU platforms.

vLLM's ``OffloadingConnector`` keys offloaded blocks by (group, hash) and sends the worker
each group's block IDs separately (``GPULoadStoreSpec.group_sizes``), so pool-scoped IDs
reach the worker intact. Three places assume one shared pool or a GPU; the hooks here
replace them, each acting only where the assumption breaks:

* **offload sizing** (``build_offloading_config``): bytes per offloaded block are taken as
  the first KV tensor's size over ``kv_cache_config.num_blocks``. With per-group pools
  every tensor spans the whole backing allocation and ``num_blocks`` is the primary
  pool's, so that figure mixes groups. A block of group ``g`` is stored in the rows of
  ``g``'s layers; the host buffers hold one row per layer, so a host chunk costs the sum of
  every offloaded layer's page (:func:`per_group_bytes_per_block`);
* **the worker's view of the KV cache** (``OffloadingConnectorWorker.register_kv_caches``):
  vLLM views every layer with the one ``num_blocks``; here each layer is viewed with its own
  group's pool size and block stride (:func:`per_group_canonical_caches`);
* **the transfer path** (``CPUOffloadingSpec.get_worker``): vLLM's handler copies with CUDA
  streams and refuses other platforms. On a platform that is neither CUDA-like nor XPU the
  spec gets :class:`HostCopyOffloadingWorker`, which copies rows with plain tensor indexing.
  On CUDA vLLM's own handler runs, fed with the per-group views above.

**Failed loads.** vLLM's connector asserts that every transfer succeeds, and vLLM's scheduler
can map block-level load errors back to requests only with one KV-cache group. Here a load
that fails (in any group) fails its whole request instead, through vLLM's request-level
path (``failed_recving``), which is right for any number of groups: the worker-side
connector reports the request as received-with-failure (:func:`_failure_aware_get_finished`,
:func:`_with_failed_receives`); vLLM's scheduler then, under ``kv_load_failure_policy=
"recompute"``, frees the request's blocks (none of them was cached: a block is cached only
after its load succeeded) and computes the request again, or under ``"fail"`` (vLLM's default)
ends it with an error; the scheduler keeps serving the others either way. The
scheduler-side connector drops the failed load's entries from the offload index
(:func:`_dropping_failed_loads`), so no later request loads them again.
``kv_connector_extra_config["hybrid_alloc_inject_load_failures"]`` (a test aid) makes the
host-copy worker fail loads on purpose: ``{"groups": [KV-cache group IDs], "count": N}``
fails the first N loads that carry blocks of those groups, after writing half of each such
group's blocks (a torn write, as a real failure could leave).

**Secondary tiers** (vLLM's tiering spec, e.g. its filesystem tier): the tiers copy chunk
rows of vLLM's shared host region, so there the host-copy worker keeps its buffers in that
region (:func:`_worker_region`); which tiers are served and how their files name the
per-group layout: :mod:`.offload_tiers`. **Groups that disagree** (one group's offloaded
prefix longer than another's): vLLM's lookup serves the longest prefix every group holds;
:func:`_logging_disagreeing_groups` says so at debug level.

Everything else of the connector (its scheduler side, the offload index, eviction, the
metrics) is vLLM's, unchanged.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

from hybrid_alloc.integration import hooks
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from hybrid_alloc.integration.kv_transfer import offload_tiers

logger = init_logger("vllm.hybrid_alloc")

_CONFIG_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"
_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
_CPU_SPEC_MODULE = "vllm.v1.kv_offload.cpu.spec"
_SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"


def _offloaded_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    config = importlib.import_module(_CONFIG_MODULE)
    return tuple(config.get_offloading_group_ids(kv_cache_config))


def real_page_bytes(spec: Any) -> int:
    """Bytes of one block's data in one layer, without the padding vLLM may add to a page
    (attention: ``unpadded_page_size_bytes``; Mamba: the page without ``page_size_padded``)."""
    unpadded = getattr(spec, "unpadded_page_size_bytes", None)
    if unpadded is not None:
        return int(unpadded)
    if getattr(spec, "page_size_padded", None) is not None:
        return int(replace(spec, page_size_padded=None).page_size_bytes)
    return int(spec.page_size_bytes)


def _layer_specs(group: Any) -> dict[str, Any]:
    per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    return {name: (per_layer or {}).get(name, group.kv_cache_spec) for name in group.layer_names}


def per_group_bytes_per_block(kv_cache_config: PerGroupKVCacheConfig) -> int:
    """Host bytes one offloaded chunk of one block costs a worker: one page in every
    offloaded layer (the host buffers keep one row per layer, whatever group the chunk
    belongs to)."""
    total = 0
    for gid in _offloaded_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[gid]
        total += sum(spec.page_size_bytes for spec in _layer_specs(group).values())
    return total


def _per_group_build_offloading_config(stock: Callable[..., Any]) -> Callable[..., Any]:
    def build_offloading_config(vllm_config: Any, kv_cache_config: Any) -> Any:
        config = stock(vllm_config, kv_cache_config)
        if not isinstance(kv_cache_config, PerGroupKVCacheConfig) or not (
            config.worker_kv_bytes_per_block
        ):
            return config
        bytes_per_block = per_group_bytes_per_block(kv_cache_config)
        layout = offload_tiers.per_group_layout(
            [
                (
                    gid,
                    [
                        (name, int(spec.page_size_bytes))
                        for name, spec in _layer_specs(kv_cache_config.kv_cache_groups[gid]).items()
                    ],
                )
                for gid in _offloaded_group_ids(kv_cache_config)
            ],
            bytes_per_block,
        )
        return replace(
            config,
            worker_kv_bytes_per_block=bytes_per_block,
            extra_config={**config.extra_config, offload_tiers.LAYOUT_KEY: layout},
        )

    return build_offloading_config


def _block_rows(cache: torch.Tensor, num_blocks: int, page_bytes: int) -> torch.Tensor:
    """``cache`` (one layer's KV view, any dtype, blocks first, possibly split into kernel
    blocks) as int8 rows: ``(num_blocks, page_bytes)`` with the view's own block stride."""
    if cache.shape[0] != num_blocks:
        if cache.shape[0] % num_blocks:
            raise RuntimeError(
                f"KV view of {cache.shape[0]} blocks cannot hold the pool's {num_blocks}"
            )
        cache = cache.unflatten(0, (num_blocks, -1))
    elem = cache.element_size()
    stride = cache.stride(0) * elem
    if stride < page_bytes:
        raise RuntimeError(f"KV view's block stride {stride} B is below its page {page_bytes} B")
    return torch.empty(0, dtype=torch.int8, device=cache.device).set_(
        cache.untyped_storage(),
        cache.storage_offset() * elem,
        (num_blocks, page_bytes),
        (stride, 1),
    )


def per_group_canonical_caches(
    kv_cache_config: PerGroupKVCacheConfig, kv_caches: dict[str, Any]
) -> Any:
    """vLLM's ``CanonicalKVCaches`` for per-group pools: one int8 row view per offloaded
    layer, sized by that layer's own pool, and per offloaded group the refs of its layers
    (each ref copies the layer's real page bytes, padding left out)."""
    base = importlib.import_module("vllm.v1.kv_offload.base")
    tensors: list[Any] = []
    group_refs: list[list[Any]] = []
    for gid in _offloaded_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[gid]
        num_blocks = kv_cache_config.layout_of_group(gid).num_blocks
        refs = []
        for name, spec in _layer_specs(group).items():
            rows = _block_rows(kv_caches[name], num_blocks, spec.page_size_bytes)
            tensors.append(base.CanonicalKVCacheTensor(tensor=rows, page_size_bytes=rows.shape[1]))
            refs.append(
                base.CanonicalKVCacheRef(
                    tensor_idx=len(tensors) - 1, page_size_bytes=real_page_bytes(spec)
                )
            )
        group_refs.append(refs)
    return base.CanonicalKVCaches(tensors=tensors, group_data_refs=group_refs)


def _sized_spec_init(stock: Callable[..., None]) -> Callable[..., None]:
    """``CPUOffloadingSpec.__init__`` that refuses a host size below one chunk: vLLM sizes
    ``num_chunks`` by floor division and would run with no host tier at all."""

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        stock(self, config, *args, **kwargs)
        if config.worker_kv_bytes_per_block > 0 and self.num_chunks == 0:
            size = int(self.extra_config.get("cpu_bytes_to_use") or 0)
            need = int(self.kv_bytes_per_chunk)
            raise ValueError(
                f"KV offloading: cpu_bytes_to_use={size} B (kv_offloading_size="
                f"{size / (1 << 30):.6g} GiB) is below one offloaded chunk of {need} B "
                f"(one block of every offloaded KV-cache group, groups "
                f"{', '.join(str(g.group_id) for g in config.groups)}, x "
                f"{self.blocks_per_chunk} block(s) per chunk, for every worker); set "
                f"kv_offloading_size to at least {need / (1 << 30):.6g} GiB"
            )

    return __init__


def _per_group_register_kv_caches(stock: Callable[..., None]) -> Callable[..., None]:
    def register_kv_caches(self: Any, kv_caches: dict[str, Any]) -> None:
        config = self.kv_cache_config
        if not isinstance(config, PerGroupKVCacheConfig):
            stock(self, kv_caches)
            return
        if self.spec.config.canonical_layout:
            raise RuntimeError(
                "per-group KV-cache pools: the offloading connector's canonical_layout is "
                "not supported; leave it off or set HYBRID_ALLOC_PER_GROUP_POOLS=0"
            )
        self._init_worker(per_group_canonical_caches(config, kv_caches))

    return register_kv_caches


# Pages at least this large are copied row by row (each a memcpy at memory bandwidth);
# smaller ones by one gather and one scatter per layer, which costs less than a Python-level
# loop over small rows. Measured in benches/bench_offload.py's shapes: 32 KiB rows copy at
# about the same speed either way, 960 KiB rows twice as fast row by row.
_ROW_COPY_MIN_BYTES = 32 << 10


def _widest_pair(
    rows: torch.Tensor, host: torch.Tensor, page: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (int8, ``(blocks, row bytes)``) and ``host`` (int8, ``(chunks, blocks per
    chunk, row bytes)``) narrowed to their first ``page`` bytes and viewed as the widest
    integer type whose size divides the page, every stride and the storage offsets."""
    if page > rows.shape[-1] or page > host.shape[-1]:
        raise RuntimeError(f"page of {page} B is wider than its {rows.shape[-1]} B KV row")
    for dtype in (torch.int64, torch.int32, torch.int16):
        width = torch.empty(0, dtype=dtype).element_size()
        fits = all(
            t.shape[-1] % width == 0
            and t.storage_offset() % width == 0
            and all(stride % width == 0 for stride in t.stride()[:-1])
            for t in (rows, host)
        )
        if page % width == 0 and fits:
            return rows.view(dtype)[:, : page // width], host.view(dtype)[..., : page // width]
    return rows[:, :page], host[..., :page]


def _copy_rows(
    device: torch.Tensor,
    host: torch.Tensor,
    blocks: torch.Tensor,
    chunks: torch.Tensor,
    slots: torch.Tensor,
    store: bool,
) -> int:
    """Copy KV rows ``device[blocks[i]]`` to (``store``) or from host ``host[chunks[i],
    slots[i]]``; returns the number of rows."""
    count = len(blocks)
    page = device.shape[1] * device.element_size()
    flat = host[:, 0] if host.shape[1] == 1 else None  # one block per chunk: 2-D rows
    if page >= _ROW_COPY_MIN_BYTES:  # one memcpy per row: memory-bandwidth bound
        if flat is not None:
            for b, c in zip(blocks.tolist(), chunks.tolist(), strict=True):
                (flat[c] if store else device[b]).copy_(device[b] if store else flat[c])
        else:
            for b, c, k in zip(blocks.tolist(), chunks.tolist(), slots.tolist(), strict=True):
                (host[c, k] if store else device[b]).copy_(device[b] if store else host[c, k])
    elif flat is not None:  # a plain row gather / scatter
        if store:
            flat.index_copy_(0, chunks, device.index_select(0, blocks))
        else:
            device.index_copy_(0, blocks, flat.index_select(0, chunks))
    elif store:
        host.index_put_((chunks, slots), device.index_select(0, blocks))
    else:
        device.index_copy_(0, blocks, host[chunks, slots])
    return count


INJECT_KEY = "hybrid_alloc_inject_load_failures"


class LoadFailures:
    """Loads to fail on purpose (``kv_connector_extra_config[INJECT_KEY]``): the first
    ``count`` loads that carry blocks of any of ``positions`` (offloaded-group positions)."""

    def __init__(self, positions: set[int], count: int) -> None:
        self.positions = positions
        self.remaining = count

    @classmethod
    def from_extra_config(cls, spec_config: Any) -> LoadFailures | None:
        raw = spec_config.extra_config.get(INJECT_KEY)
        if not raw:
            return None
        offloaded = [g.group_id for g in spec_config.groups]
        unknown = set(raw.get("groups", ())) - set(offloaded)
        if unknown:
            raise ValueError(
                f"{INJECT_KEY}: groups {sorted(unknown)} are not offloaded (offloaded KV-cache "
                f"groups: {offloaded})"
            )
        positions = {offloaded.index(g) for g in raw.get("groups", ())}
        return cls(positions, int(raw.get("count", 1)))

    def take(self, positions: Any) -> bool:
        """Whether a load carrying blocks at ``positions`` fails (and counts it)."""
        if self.remaining <= 0 or not self.positions.intersection(positions):
            return False
        self.remaining -= 1
        return True


class HostCopyOffloadingWorker:
    """Moves blocks between the KV cache and host buffers with plain tensor copies.

    vLLM's CPU-tier transfer handler needs CUDA streams; on CPU platforms the KV cache is
    host memory already, so a copy is a row gather. Transfers run to completion when they
    are submitted (the connector submits stores at the start of the step after the one that
    wrote the blocks, and loads before the forward pass that reads them), and are reported
    finished at the next :meth:`get_finished`.

    Host layout, as vLLM's handler lays it out so the scheduler-side sizing (and a secondary
    tier reading the chunks) agrees: per KV row view, a ``(num_chunks, blocks_per_chunk,
    page)`` buffer; a group's blocks use the buffers of that group's layers only. Without
    ``region`` each buffer is private memory. With ``region`` (vLLM's
    ``SharedOffloadRegion``, which the tiering spec's scheduler side also maps) the buffers
    are this worker's consecutive slices of every chunk row, as vLLM's own worker carves
    them, so secondary tiers (the filesystem) see the bytes the worker stored. The worker
    owns ``region`` once constructed and releases it on :meth:`shutdown`.
    """

    def __init__(
        self,
        kv_caches: Any,
        blocks_per_chunk: int,
        num_chunks: int,
        fail_loads: LoadFailures | None = None,
        region: Any = None,
    ) -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
        self._fail_loads = fail_loads
        self._region = region
        tensors = [t.tensor for t in kv_caches.tensors]
        self._blocks_per_chunk = blocks_per_chunk
        self._host = [self._host_buffer(num_chunks, blocks_per_chunk, t.shape[1]) for t in tensors]
        # Per group, per layer: (KV rows, host chunks), both narrowed to the ref's page and
        # viewed with the widest element that divides it (row gathers of int8 elements run
        # several times slower than of int64 ones).
        self._refs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [
            [
                _widest_pair(
                    tensors[ref.tensor_idx], self._host[ref.tensor_idx], ref.page_size_bytes
                )
                for ref in refs
            ]
            for refs in kv_caches.group_data_refs
        ]
        self._done: list[Any] = []
        logger.info(
            "hybrid_alloc: KV offloading by host copies: %d buffers of %d chunks, %.1f MiB%s",
            len(self._host),
            num_chunks,
            sum(h.numel() for h in self._host) / 2**20,
            " in the shared offload region" if region is not None else "",
        )

    def _host_buffer(self, num_chunks: int, bpc: int, page: int) -> torch.Tensor:
        if self._region is None:
            return torch.zeros((num_chunks, bpc, page), dtype=torch.int8)
        return self._region.create_next_worker_view(bpc * page).unflatten(1, (bpc, page))

    def _host_slots(
        self, chunk_ids: np.ndarray, first_block: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk, slot in chunk) of ``count`` consecutive blocks of a request starting at
        its block ``first_block``, stored in ``chunk_ids`` (the first chunk may be entered
        midway)."""
        bpc = self._blocks_per_chunk
        logical = np.arange(count, dtype=np.int64) + first_block % bpc
        chunks = chunk_ids.astype(np.int64)[logical // bpc]
        return torch.from_numpy(chunks), torch.from_numpy(logical % bpc)

    def _transfer(self, job_id: int, device_spec: Any, chunk_ids: np.ndarray, store: bool) -> bool:
        start = time.perf_counter()
        bpc = self._blocks_per_chunk
        sizes: Sequence[int] = device_spec.group_sizes
        if not len(sizes) == len(device_spec.block_indices) == len(self._refs):
            raise RuntimeError(
                f"offload job {job_id}: {len(sizes)} groups of block IDs for "
                f"{len(self._refs)} offloaded groups"
            )
        num_chunks_needed = sum(
            -(-(n + first % bpc) // bpc)
            for n, first in zip(sizes, device_spec.block_indices, strict=True)
            if n
        )
        if sum(sizes) != len(device_spec.block_ids) or num_chunks_needed != len(chunk_ids):
            # Checked before any copy: a refused job leaves both sides as they were.
            raise RuntimeError(
                f"offload job {job_id}: {len(device_spec.block_ids)} block IDs and "
                f"{len(chunk_ids)} chunks do not match the group sizes {list(sizes)}"
            )
        failing = (
            not store
            and self._fail_loads is not None
            and self._fail_loads.take(i for i, n in enumerate(sizes) if n)
        )
        moved = 0
        block_pos = chunk_pos = 0
        for position, (refs, size, first) in enumerate(
            zip(self._refs, sizes, device_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            num_chunks = -(-(size + first % bpc) // bpc)
            blocks = torch.from_numpy(
                device_spec.block_ids[block_pos : block_pos + size].astype(np.int64)
            )
            chunks, slots = self._host_slots(
                chunk_ids[chunk_pos : chunk_pos + num_chunks], first, size
            )
            block_pos += size
            chunk_pos += num_chunks
            if failing and self._fail_loads is not None and position in self._fail_loads.positions:
                # A torn write: the first half of the group's blocks only.
                blocks, chunks, slots = blocks[: size // 2], chunks[: size // 2], slots[: size // 2]
            for device, host in refs:
                page = device.shape[1] * device.element_size()
                moved += _copy_rows(device, host, blocks, chunks, slots, store) * page
        base = importlib.import_module("vllm.v1.kv_offload.base")
        if failing:
            logger.warning("hybrid_alloc: injected KV offload load failure (job %d)", job_id)
        self._done.append(
            base.TransferResult(
                job_id=job_id,
                success=not failing,
                transfer_size=None if failing else moved,
                transfer_time=None if failing else time.perf_counter() - start,
            )
        )
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._transfer(job_id, src_spec, np.asarray(dst_spec.block_ids), store=True)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """``expedited`` (vLLM 0.33: a load waited on within the step) changes nothing here:
        every transfer completes when it is submitted."""
        del expedited
        return self._transfer(job_id, dst_spec, np.asarray(src_spec.block_ids), store=False)

    def get_finished(self) -> list[Any]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every transfer completed when it was submitted."""

    def shutdown(self) -> None:
        self._refs = []
        self._host = []
        if self._region is not None:
            self._region.cleanup()
            self._region = None


def _worker_region(spec: Any) -> Any:
    """The shared host region a spec's worker must write into, or None for private buffers.

    Specs whose scheduler side reads the host chunks itself (the tiering spec: its secondary
    tiers copy chunk rows between the region and, say, files) keep them in vLLM's
    ``SharedOffloadRegion``, mapped by the scheduler and every worker; this worker slot is
    opened as vLLM's own worker opens it for that spec."""
    if not spec._uses_shared_region() or spec.num_chunks <= 0:
        return None
    region_module = importlib.import_module("vllm.v1.kv_offload.cpu.shared_offload_region")
    return region_module.SharedOffloadRegion(
        engine_id=spec.config.engine_id,
        num_chunks=spec.num_chunks,
        rank=0 if spec.replicated_layout else spec.config.parallel.rank,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )


def _host_copy_get_worker(stock: Callable[..., Any]) -> Callable[..., Any]:
    def get_worker(self: Any, kv_caches: Any) -> Any:
        from vllm.platforms import current_platform

        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return stock(self, kv_caches)
        if getattr(self, "_worker", None) is None:
            region = _worker_region(self)
            try:
                self._worker = HostCopyOffloadingWorker(
                    kv_caches,
                    self.blocks_per_chunk,
                    self.num_chunks,
                    LoadFailures.from_extra_config(self.config),
                    region,
                )
            except BaseException:
                if region is not None:
                    region.cleanup()
                raise
        return self._worker

    return get_worker


# ---------------------------------------------------------------- failed loads
_FAILED = "_hybrid_alloc_failed_receives"  # worker-side connector: requests whose load failed


def _failure_aware_get_finished(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``OffloadingConnectorWorker.get_finished`` that takes failed transfers: a failed load
    completes its job (so the scheduler side releases its offload entries) and its request
    is reported received (vLLM's contract for failed receives) and remembered as failed; a
    failed store has no request to fail and stops the worker with an error naming it."""

    def get_finished(self: Any, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        del finished_req_ids  # stores never finish requests here (vLLM's rule too)
        if self.worker is None:
            raise RuntimeError("offloading connector: KV caches were never registered")
        received: set[str] = set()
        failed: set[str] = getattr(self, _FAILED, set())
        meta = self._connector_worker_meta
        for result in self.worker.get_finished():
            is_load = result.job_id in self._load_jobs
            # vLLM 0.33 also runs loads for no request (None): nothing to fail for those.
            req_id = self._load_jobs.pop(result.job_id, None)
            if not result.success:
                if not is_load:
                    raise RuntimeError(f"KV offload store job {result.job_id} failed")
                if req_id is not None:
                    failed.add(req_id)
            elif result.transfer_time is not None and result.transfer_size is not None:
                stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                stats.record(result.transfer_size, result.transfer_time)
            meta.mark_completed(result.job_id)
            if req_id is not None:
                received.add(req_id)
        setattr(self, _FAILED, failed)
        return set(), received

    return get_finished


def _with_failed_receives(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``OffloadingConnector.get_transfer_results`` that also reports the requests whose
    load failed (``failed_recving``: vLLM's request-level failure path, the one that holds
    for any number of KV-cache groups)."""

    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        results = stock(self, finished_req_ids)
        worker = getattr(self, "connector_worker", None)
        failed = getattr(worker, _FAILED, None)
        if failed:
            results.failed_recving |= failed & results.finished_recving
            failed -= results.failed_recving
        return results

    return get_transfer_results


def drop_offloaded_keys(manager: Any, keys: Sequence[Any]) -> list[Any]:
    """Remove ``keys`` from a CPU offload manager's index and free their chunks, except
    those another transfer still holds (they stay, as any in-use entry does). Returns the
    keys removed."""
    removed = []
    for key in keys:
        chunk = manager._policy.get(key)
        if chunk is None or not chunk.is_ready or chunk.ref_cnt != 0:
            continue
        manager._policy.remove(key)
        manager._num_evictable_cache_chunks -= 1
        manager._free_chunk(chunk)
        removed.append(key)
    if removed and manager.events is not None:
        base = importlib.import_module("vllm.v1.kv_offload.base")
        manager.events.append(
            base.OffloadingEvent(keys=removed, medium=manager.medium, removed=True)
        )
    return removed


def _dropping_failed_loads(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``OffloadingConnectorScheduler.update_connector_output`` that, once a failed load's
    job completes, removes that load's entries from the offload index (where the CPU
    manager's index allows it), so that no later request reads them again."""

    def update_connector_output(self: Any, connector_output: Any) -> None:
        failed = set(getattr(connector_output, "failed_recving", ()) or ())
        doomed = [
            key
            for job in self._jobs.values()
            if not job.is_store and job.req_id in failed
            for key in job.keys
        ]
        stock(self, connector_output)
        if doomed and hasattr(self.manager, "_policy"):
            removed = drop_offloaded_keys(self.manager, doomed)
            logger.warning(
                "hybrid_alloc: KV offload load failed for request(s) %s; %d of its %d "
                "offloaded entries dropped from the index",
                ", ".join(sorted(failed)),
                len(removed),
                len(doomed),
            )

    return update_connector_output


def _cpu_index(manager: Any) -> Any:
    """The CPU tier's key index of an offload manager (plain or tiering), or None."""
    index = getattr(manager, "_policy", None)
    if index is None:
        index = getattr(getattr(manager, "primary_tier", None), "_policy", None)
    return index


def stored_extents(self: Any, req_status: Any) -> list[tuple[int, int]]:
    """(KV-cache group, tokens up to its furthest chunk stored and ready in the CPU tier)
    per offloaded group of a request: a side-effect-free peek at the index (a lookup
    would start promotions from secondary tiers and count in the metrics)."""
    index = _cpu_index(self.manager)
    if index is None:
        return []
    extents = []
    for group, state in zip(self.config.kv_group_configs, req_status.group_states, strict=True):
        furthest = 0
        for position, key in enumerate(state.offload_keys, start=1):
            chunk = index.get(key)
            if chunk is not None and chunk.is_ready:
                furthest = position
        extents.append((group.group_idx, furthest * group.tokens_per_chunk))
    return extents


def _logging_disagreeing_groups(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``OffloadingConnectorScheduler._lookup`` that, at debug level, says when the request's
    groups hold offloaded prefixes of different lengths: vLLM's lookup then serves the
    longest prefix present in every group, and the line names what each group held."""

    def _lookup(self: Any, req_status: Any, *args: Any, **kwargs: Any) -> Any:
        hit = stock(self, req_status, *args, **kwargs)
        if hit is None or not logger.isEnabledFor(logging.DEBUG):
            return hit
        try:
            extents = stored_extents(self, req_status)
        except Exception as e:  # a debug aid must never fail a lookup
            logger.debug("hybrid_alloc: offload extents not read: %s", e)
            return hit
        served = req_status.num_locally_computed_tokens + hit
        if len({tokens for _, tokens in extents}) > 1 and any(t > served for _, t in extents):
            logger.debug(
                "hybrid_alloc: request %s: offloaded prefixes differ across KV-cache groups "
                "(%s); loading %d tokens, the longest prefix every group holds (%d computed "
                "locally)",
                req_status.req.request_id,
                ", ".join(f"group {g}: {t} tokens" for g, t in extents),
                hit,
                req_status.num_locally_computed_tokens,
            )
        return hit

    return _lookup


# (module, class or None, attribute, wrapper factory)
_HOOKS: tuple[tuple[str, str | None, str, Callable[[Any], Any]], ...] = (
    (_CONNECTOR_MODULE, None, "build_offloading_config", _per_group_build_offloading_config),
    (
        _WORKER_MODULE,
        "OffloadingConnectorWorker",
        "register_kv_caches",
        _per_group_register_kv_caches,
    ),
    (_CPU_SPEC_MODULE, "CPUOffloadingSpec", "get_worker", _host_copy_get_worker),
    (_CPU_SPEC_MODULE, "CPUOffloadingSpec", "__init__", _sized_spec_init),
    (_WORKER_MODULE, "OffloadingConnectorWorker", "get_finished", _failure_aware_get_finished),
    (_CONNECTOR_MODULE, "OffloadingConnector", "get_transfer_results", _with_failed_receives),
    (
        _SCHEDULER_MODULE,
        "OffloadingConnectorScheduler",
        "update_connector_output",
        _dropping_failed_loads,
    ),
    (_SCHEDULER_MODULE, "OffloadingConnectorScheduler", "_lookup", _logging_disagreeing_groups),
    (
        offload_tiers.FILE_MAPPER_MODULE,
        "FileMapper",
        "from_offloading_spec",
        offload_tiers.layout_named_file_mapper,
    ),
)
_hooks = hooks.HookSet(_HOOKS, hooks.log_missing(logger, logging.DEBUG))


def install() -> None:
    """Wrap the functions in ``_HOOKS`` (idempotent). A module this vLLM build cannot import
    is left alone (the connector cannot run there either)."""
    _hooks.install()


def uninstall() -> None:
    _hooks.uninstall()


def is_installed() -> bool:
    return _hooks.installed()


def stock(module_name: str, owner: str | None, attr: str) -> Any:
    """vLLM's own object behind an installed hook."""
    return _hooks.stock((module_name, owner, attr))
