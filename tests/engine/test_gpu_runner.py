"""vLLM's GPU worker code that touches block IDs and KV tensors, driven on CPU.

No GPU run of vLLM is possible here, so these tests call the genuine vLLM functions the
worker hooks (:mod:`hybrid_alloc.integration.worker.runner`) wrap, on real CPU tensors laid out by
vLLM's own ``allocate_kv_cache`` over a config from the engine sizing, with a stand-in
``self`` holding only the attributes each function reads:

* the scheduler side: ``KVCacheManager.take_new_block_ids`` on a real manager and
  per-group coordinator (new IDs tagged with their group);
* zeroing: the V1 and V2 GPU runners' ``_init_kv_zero_meta``, vLLM's ``KVBlockZeroer``
  (construction and ``zero_block_ids``), the V1 runner's ``_zero_block_ids`` call site and
  the CPU runner's ``_zero_block_ids``. The one thing replaced is the zeroer's Triton kernel
  (``vllm.v1.worker.utils._zero_kv_blocks_kernel``; Triton has no CPU backend here): a
  stand-in zeroes the bytes the kernel would (segment address + block ID x block stride,
  one page) and refuses to write outside the KV-cache allocation;
* the V2 runner's fabricated block IDs: its ``prepare_dummy_attn`` and ``set_dummy_context``
  (as the runner calls it) on a real ``InputBatch.make_dummy``, and its kernel warmup
  (``warmup_kernels``) up to the ``execute_model`` calls it makes.

Not executed: the runners' ``execute_model`` / ``_dummy_run`` around these calls, the
attention and Mamba kernels that read the block tables, CUDA-graph capture, and the GPU
worker's own startup (``initialize_from_config``); those call sites were read only. Each
test also runs the same vLLM functions without the hooks and shows what goes wrong there.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hybrid_alloc.integration import versions
from hybrid_alloc.integration.kv_cache_config import PerGroupKVCacheConfig
from tests.planner.specs import MAX_LEN, attention, small_engine_config, small_mamba

pytestmark = pytest.mark.skipif(
    not versions.is_supported(versions.installed_version()),
    reason="the worker hooks are installed only on the vLLM releases in versions.py",
)

CPU = torch.device("cpu")
MAX_NUM_SEQS = 16  # small_engine_config's


# ------------------------------------------------------------------------- fixtures
@pytest.fixture
def hooks() -> Iterator[None]:
    """The runner hooks installed for the test (and only those)."""
    from hybrid_alloc.integration.worker import runner

    runner.install_gpu_runner_hooks()
    assert runner.gpu_runner_hooks_installed()
    try:
        yield
    finally:
        runner.uninstall_gpu_runner_hooks()


@pytest.fixture
def no_hooks() -> None:
    from hybrid_alloc.integration.worker import runner

    runner.uninstall_gpu_runner_hooks()
    assert not runner.gpu_runner_hooks_installed()


def engine(
    mode: str,
    specs: dict[str, Any],
    memory: int = 4 << 20,
    layout: str = "LBHNC",
    elastic: bool = False,
) -> PerGroupKVCacheConfig:
    """The engine core's config for these layer specs (``engine_sizing``), laid out for
    the workers' KV-cache ``layout``: the static split, or elastic pools (every group's
    layers viewing one budget)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    cfg = small_engine_config(mode, caching=mode == "align")
    cfg.cache_config.get_resolved_kv_cache_layout = lambda: KVCacheLayout[layout]
    groups = sizing.build_groups(specs)
    if elastic:
        budget = sizing.size_elastic_groups(cfg, groups, [memory], [specs])
        config = sizing.build_elastic_config(cfg, groups, budget)
    else:
        config = sizing.build_config(cfg, groups, sizing.size_groups(cfg, groups, memory))
    assert isinstance(config, PerGroupKVCacheConfig) and config.zero_new_blocks
    assert (config.elastic is not None) == elastic
    return config


def three_pools(
    mode: str = "align", layout: str = "LBHNC", layers: int = 1, elastic: bool = False
) -> PerGroupKVCacheConfig:
    """Mamba + full attention + sliding window (``layers`` layers each): three pools of
    three sizes."""
    specs = {}
    for i in range(layers):
        specs.update(
            {f"m.{i}": small_mamba(mode), f"f.{i}": attention(), f"w.{i}": attention(window=64)}
        )
    return engine(mode, specs, layout=layout, elastic=elastic)


def gid_of(config: PerGroupKVCacheConfig, kind: type, window: bool | None = None) -> int:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    for gid, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) is kind or (window and isinstance(spec, SlidingWindowSpec)):
            return gid
    raise KeyError(kind)


def kinds(config: PerGroupKVCacheConfig) -> tuple[int, int, int]:
    """(Mamba, full attention, sliding window) group IDs."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    return (
        gid_of(config, MambaSpec),
        gid_of(config, FullAttentionSpec),
        gid_of(config, SlidingWindowSpec, window=True),
    )


# ---------------------------------------------------------------- scheduler side
def new_attention_blocks(
    config: PerGroupKVCacheConfig, drain_first: bool = False
) -> tuple[Any, dict[int, list[int]], dict[int, list[int]]]:
    """Two requests admitted on vLLM's manager over per-group pools (with ``drain_first``,
    the new IDs of the first taken before the second is admitted, as a scheduler step
    would). Returns the manager, its new IDs not yet taken, each group's IDs allocated
    since the last take, and the first request's IDs, by group."""
    from hybrid_alloc import integration
    from tests.helpers import new_request, per_group_manager

    mgr = per_group_manager(config)
    reqs = [new_request(f"r{i}", [i * 1000 + t for t in range(n)]) for i, n in ((0, 300), (1, 100))]

    def admit(req: Any) -> None:
        integration.install(per_group_pools=False)  # our pools' batched calls
        try:
            assert mgr.allocate_slots(req, req.num_tokens) is not None
        finally:
            integration.uninstall()
        req.num_computed_tokens = req.num_tokens

    def ids_of(req: Any) -> dict[int, list[int]]:
        return {
            gid: [b for b in ids if b != 0]
            for gid, ids in enumerate(mgr.get_block_ids(req.request_id))
        }

    admit(reqs[0])
    if drain_first:
        mgr.take_new_block_ids()
    admit(reqs[1])
    first, second = ids_of(reqs[0]), ids_of(reqs[1])
    since = second if drain_first else {g: first[g] + second[g] for g in first}
    return mgr, since, first


def test_tagged_ids_round_trip() -> None:
    config = three_pools()
    counts = config.group_num_blocks()
    # The ranges stack, the primary (first growing) pool's groups first: its IDs, most
    # of the list (vLLM lists attention blocks only), travel as they are.
    order = config.tag_order()
    assert sorted(order) == [0, 1, 2]
    primary = next(layout for layout in config.pool_layouts if layout.grows)
    assert order[: len(primary.group_ids)] == list(primary.group_ids)
    offsets = config.zero_id_offsets()
    assert offsets[order[0]] == 0
    for before, after in itertools.pairwise(order):
        assert offsets[after] == offsets[before] + counts[before]
    assert config.tag_block_ids(order[0], [5, 1, 3]) == [5, 1, 3]
    tagged = [t for g in range(3) for t in config.tag_block_ids(g, [0, 1, counts[g] - 1])]
    assert len(set(tagged)) == 9
    assert config.split_tagged_block_ids(tagged) == {g: [0, 1, counts[g] - 1] for g in range(3)}
    # Any order, groups interleaved, repeats kept: each group's IDs come back ascending.
    mixed = config.tag_block_ids(2, [7, 2]) + config.tag_block_ids(0, [4, 4]) + tagged[::-1]
    split = config.split_tagged_block_ids(mixed)
    assert split[0] == sorted([4, 4, 0, 1, counts[0] - 1])
    assert split[2] == sorted([7, 2, 0, 1, counts[2] - 1])
    assert split[1] == [0, 1, counts[1] - 1]
    assert config.split_tagged_block_ids([]) == {}
    for outside in (sum(counts), -1):
        with pytest.raises(ValueError, match=f"tagged block ID {outside} is outside"):
            config.split_tagged_block_ids([3, outside, 4])
    # Stock vLLM's rule (Mamba layers: zero), only where the engine sizing asks for it.
    assert config.needs_kv_cache_zeroing
    from dataclasses import replace

    assert not replace(config, zero_new_blocks=False).needs_kv_cache_zeroing
    # The stacking is worked out once per set of pool layouts: a config given other
    # layouts (or a copy made with them) stacks those, not the ones it had.
    grown = tuple(
        replace(layout, num_blocks=layout.num_blocks + 7) for layout in config.pool_layouts
    )
    config.pool_layouts = grown
    assert config.group_num_blocks() == [n + 7 for n in counts]
    assert config.zero_id_offsets()[order[1]] == counts[order[0]] + 7
    assert config.split_tagged_block_ids([counts[order[0]] + 7]) == {order[1]: [0]}


@pytest.mark.parametrize("drain_first", [False, True])
def test_scheduler_sends_new_ids_tagged_by_group(drain_first: bool, hooks: None) -> None:
    """``KVCacheManager.take_new_block_ids`` (vLLM's, over our per-group coordinator):
    each group's new attention blocks since the last take, tagged, so that the worker can
    split them back; Mamba blocks are not on the list (vLLM records attention managers
    only)."""
    config = three_pools()
    _, full, window = kinds(config)
    mgr, allocated, _ = new_attention_blocks(config, drain_first)
    tagged = mgr.take_new_block_ids()
    split = config.split_tagged_block_ids(tagged)
    assert set(split) == {full, window}
    for gid in (full, window):
        assert sorted(split[gid]) == sorted(allocated[gid])
    assert mgr.take_new_block_ids() == []  # drained


def test_stock_scheduler_list_mixes_pools(no_hooks: None) -> None:
    """Without the hooks the list is the managers' pool-scoped IDs back to back: the same
    number stands for blocks of different pools, which no worker can tell apart."""
    config = three_pools()
    _, full, window = kinds(config)
    mgr, allocated, _ = new_attention_blocks(config)
    flat = mgr.take_new_block_ids()
    assert sorted(flat) == sorted(allocated[full] + allocated[window])
    assert set(allocated[full]) & set(allocated[window])


# ---------------------------------------------------------------- zeroing
class CpuZeroKernel:
    """Stand-in for ``_zero_kv_blocks_kernel[grid](...)`` on CPU memory: for every block ID
    and segment, zero ``page`` int32 words at ``addr + block_id * block_stride`` words, as
    the Triton kernel does; a write outside ``[lo, hi)`` is refused (AssertionError)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def __getitem__(self, grid: Any) -> Any:
        return self.launch

    def launch(
        self, seg_addrs: Any, seg_block_strides: Any, seg_page_sizes: Any, idx: Any, **_: Any
    ) -> None:
        segments = list(
            zip(
                [int(a) for a in seg_addrs.to(torch.int64).tolist()],
                seg_block_strides.tolist(),
                seg_page_sizes.tolist(),
                strict=True,
            )
        )
        for block_id in idx.tolist():
            for addr, stride, page in segments:
                start = addr + 4 * block_id * stride
                end = start + 4 * page
                assert self.lo <= start and end <= self.hi, (
                    f"block {block_id}: bytes {start - self.lo}..{end - self.lo} outside the "
                    f"KV-cache allocation of {self.hi - self.lo} bytes"
                )
                ctypes.memset(start, 0, 4 * page)


def kv_caches(config: PerGroupKVCacheConfig, layout: str = "LBHNC") -> dict[str, torch.Tensor]:
    """vLLM's worker allocation for the config (CPU), every element 1."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    caches = allocate_kv_cache(config, CPU, KVCacheLayout[layout])
    for cache in caches.values():
        cache.fill_(1)
    return caches


def allocation_bounds(caches: dict[str, torch.Tensor]) -> tuple[int, int]:
    storages = {
        c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in caches.values()
    }
    assert len(storages) == 1  # one backing allocation
    ((ptr, size),) = storages.items()
    return ptr, ptr + size


@pytest.fixture
def cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Route the zeroer's kernel launch and host-to-device copy to CPU."""
    from vllm.v1.worker import utils

    box: dict[str, Any] = {}

    def install(caches: dict[str, torch.Tensor]) -> CpuZeroKernel:
        kernel = CpuZeroKernel(*allocation_bounds(caches))
        monkeypatch.setattr(utils, "_zero_kv_blocks_kernel", kernel)
        box["kernel"] = kernel
        return kernel

    # vLLM 0.33's CUDA wheel reports no CPU platform here and would pin host memory.
    monkeypatch.setattr(
        utils, "async_tensor_h2d", lambda data, device, dtype: torch.tensor(data, dtype=dtype)
    )
    return install


def attn_groups(config: PerGroupKVCacheConfig) -> list[list[Any]]:
    """The runners' ``attn_groups``: one AttentionGroup per KV-cache group (vLLM's class)."""
    from vllm.v1.worker.utils import AttentionGroup

    return [
        [AttentionGroup(object, list(g.layer_names), g.kv_cache_spec, gid)]  # type: ignore[arg-type]
        for gid, g in enumerate(config.kv_cache_groups)
    ]


def forward_context(caches: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {name: SimpleNamespace(kv_cache=kv) for name, kv in caches.items()}


def v2_runner(config: PerGroupKVCacheConfig, caches: dict[str, torch.Tensor]) -> Any:
    """What the V2 runner's ``_init_kv_zero_meta`` reads."""
    return SimpleNamespace(
        kv_cache_config=config,
        device=CPU,
        attn_groups=attn_groups(config),
        kernel_block_sizes=[g.kv_cache_spec.block_size for g in config.kv_cache_groups],
        compilation_config=SimpleNamespace(static_forward_context=forward_context(caches)),
        kv_block_zeroer=None,
    )


def v1_runner(config: PerGroupKVCacheConfig, caches: dict[str, torch.Tensor]) -> Any:
    """What the V1 runner's ``_init_kv_zero_meta`` and ``_zero_block_ids`` read."""
    groups = attn_groups(config)
    return SimpleNamespace(
        kv_cache_config=config,
        device=CPU,
        _kv_cache_spec_attn_group_iterator=lambda: (g for gs in groups for g in gs),
        _kernel_block_sizes=[g.kv_cache_spec.block_size for g in config.kv_cache_groups],
        runner_only_attn_layers=set(),
        compilation_config=SimpleNamespace(static_forward_context=forward_context(caches)),
    )


def zero_with_runner(runner_kind: str, config: Any, caches: Any, block_ids: list[int]) -> None:
    """vLLM's own runner code from zeroer construction to the zeroing call."""
    if runner_kind == "v2":
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        runner = v2_runner(config, caches)
        GPUModelRunner._init_kv_zero_meta(runner)  # type: ignore[arg-type]
        # The V2 runner's step (read, not run) calls exactly this with the scheduler's list.
        runner.kv_block_zeroer.zero_block_ids(block_ids)
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

        runner = v1_runner(config, caches)
        V1Runner._init_kv_zero_meta(runner)  # type: ignore[arg-type]
        V1Runner._zero_block_ids(runner, block_ids)  # type: ignore[arg-type]


def assert_zeroed_exactly(
    config: PerGroupKVCacheConfig, caches: dict[str, torch.Tensor], zeroed: dict[int, list[int]]
) -> None:
    """Blocks ``zeroed[g]`` of group g's layers are all zero; every other byte is as filled."""
    for gid, group in enumerate(config.kv_cache_groups):
        for name in group.layer_names:
            kv = caches[name]
            want = torch.ones(kv.shape[0], dtype=torch.bool)
            want[zeroed.get(gid, [])] = False
            ones = (kv == 1).reshape(kv.shape[0], -1).all(dim=1)
            zeros = (kv == 0).reshape(kv.shape[0], -1).all(dim=1)
            assert torch.equal(ones, want), (name, torch.nonzero(ones != want).flatten().tolist())
            assert torch.equal(zeros, ~want), name


@pytest.mark.parametrize(
    ("runner_kind", "layout", "layers"),
    [
        ("v2", "LBHNC", 1),
        ("v1", "LBHNC", 1),
        ("v2", "BHLNC", 2),
        ("v2", "LHBNC", 2),
        ("v1", "BLNHC", 2),
    ],
)
def test_gpu_runner_zeroes_each_groups_new_blocks(
    runner_kind: str, layout: str, layers: int, hooks: None, cpu_kernel: Any
) -> None:
    """The scheduler's tagged list, through the runner's zeroer: exactly each attention
    group's new blocks are zeroed, in that group's layers only (every layer of the group,
    whatever the KV-cache layout puts outside the block); Mamba state is untouched."""
    config = three_pools(layout=layout, layers=layers)
    mgr, allocated, _ = new_attention_blocks(config)
    tagged = mgr.take_new_block_ids()
    caches = kv_caches(config, layout)
    cpu_kernel(caches)
    zero_with_runner(runner_kind, config, caches, tagged)
    mamba, full, window = kinds(config)
    assert_zeroed_exactly(config, caches, {full: allocated[full], window: allocated[window]})
    # vLLM's warmup and EPLB zero tagged ID 0: the null block of the primary pool's first
    # group (full attention here), as stock zeroes its one pool's null block; and the
    # zeroer's warmup zeroes each attention group's null block.
    assert config.tag_order()[0] == full
    zero_with_runner(runner_kind, config, caches, [0])
    assert_zeroed_exactly(config, caches, {full: [0, *allocated[full]], window: allocated[window]})
    if runner_kind == "v2":
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        runner = v2_runner(config, caches)
        GPUModelRunner._init_kv_zero_meta(runner)  # type: ignore[arg-type]
        runner.kv_block_zeroer.warmup(config.num_blocks)
        assert_zeroed_exactly(
            config, caches, {full: [0, *allocated[full]], window: [0, *allocated[window]]}
        )
        assert mamba not in runner.kv_block_zeroer.zeroers or (
            runner.kv_block_zeroer.zeroers[mamba]._meta is None
        )


@pytest.mark.parametrize("runner_kind", ["v2", "v1"])
def test_stock_gpu_zeroer_cannot_take_several_pools(
    runner_kind: str, no_hooks: None, cpu_kernel: Any
) -> None:
    """vLLM's own zeroer views every attention layer with the primary pool's count: a
    smaller sliding-window pool fails its check; with one attention pool (no window) it
    builds, and a tagged ID of the second group runs past the end of the allocation."""
    config = three_pools()
    caches = kv_caches(config)
    cpu_kernel(caches)
    with pytest.raises(AssertionError, match="not a multiple"):
        zero_with_runner(runner_kind, config, caches, [1])

    two = engine("align", {"l.0": small_mamba("align"), "l.1": attention()})
    caches = kv_caches(two)
    cpu_kernel(caches)
    mamba = gid_of(two, type(small_mamba("align")))
    full = 1 - mamba
    # Stock takes untagged IDs: right with one attention pool.
    zero_with_runner(runner_kind, two, caches, [1, 2])
    assert_zeroed_exactly(two, caches, {full: [1, 2]})
    past = two.group_num_blocks()[full] + 5
    with pytest.raises(AssertionError, match="outside the KV-cache allocation"):
        zero_with_runner(runner_kind, two, caches, [past])


def cpu_runner(config: PerGroupKVCacheConfig, caches: dict[str, torch.Tensor]) -> Any:
    return SimpleNamespace(
        kv_cache_config=config,
        compilation_config=SimpleNamespace(static_forward_context=forward_context(caches)),
    )


def test_cpu_runner_zeroes_each_groups_full_attention_blocks(hooks: None) -> None:
    """vLLM's CPU runner zeroes new blocks of full-attention layers only; with the hooks
    it zeroes each group's own IDs there (the sliding-window IDs stay unzeroed, as vLLM's
    CPU runner leaves them)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    config = three_pools()
    _, full, _ = kinds(config)
    mgr, allocated, _ = new_attention_blocks(config)
    caches = kv_caches(config)
    CPUModelRunner._zero_block_ids(cpu_runner(config, caches), mgr.take_new_block_ids())  # type: ignore[arg-type]
    assert_zeroed_exactly(config, caches, {full: allocated[full]})


@pytest.mark.parametrize("runner_kind", ["v2", "v1", "cpu"])
def test_runners_zero_new_blocks_of_elastic_pools(
    runner_kind: str, hooks: None, cpu_kernel: Any
) -> None:
    """Elastic pools (every group's layers view one budget): the scheduler's tagged list,
    through the GPU runners' zeroer or the CPU runner, zeroes exactly the new attention
    blocks' pages (each layer's page at the group's block stride), no other byte of the
    budget: the pages of live blocks of different groups never share bytes."""
    config = three_pools(elastic=True)
    mgr, allocated, _ = new_attention_blocks(config)
    caches = kv_caches(config)
    cpu_kernel(caches)
    lo, hi = allocation_bounds(caches)
    raw = torch.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=torch.uint8)
    before = raw.clone()
    tagged = mgr.take_new_block_ids()
    if runner_kind == "cpu":
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        CPUModelRunner._zero_block_ids(cpu_runner(config, caches), tagged)  # type: ignore[arg-type]
        zeroed_groups = [kinds(config)[1]]  # vLLM's CPU runner zeroes full attention only
    else:
        zero_with_runner(runner_kind, config, caches, tagged)
        zeroed_groups = list(kinds(config)[1:])
    assert not torch.equal(raw, before)
    # Each new block's page is zero in every layer of its group; filled again with 1, the
    # budget is byte for byte what it was: nothing else was written.
    for gid in zeroed_groups:
        assert allocated[gid], gid
        for name in config.kv_cache_groups[gid].layer_names:
            for block in allocated[gid]:
                page = caches[name][block]
                assert bool((page == 0).all()), (name, block)
                page.fill_(1)
    assert torch.equal(raw, before)


def test_stock_cpu_runner_zeroes_other_pools_ids(no_hooks: None) -> None:
    """Without the hooks (vLLM's CPU runner, the scheduler's untagged list) every ID on the
    list is zeroed in the full-attention layers, the sliding-window pool's too. The pools
    hand out IDs independently (here: the window pool reuses blocks 3 and 4 while full
    attention gets fresh 20 and 21; the list is written by hand, the manager's own pools
    moved in step in the runs above), so full attention loses blocks it did not get anew."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    config = three_pools()
    _, full, window = kinds(config)
    caches = kv_caches(config)
    CPUModelRunner._zero_block_ids(cpu_runner(config, caches), [20, 21, 3, 4])  # type: ignore[arg-type]
    assert_zeroed_exactly(config, caches, {full: [3, 4, 20, 21]})
    # The same step with the hooks, its list tagged as the hooked scheduler sends it.
    from hybrid_alloc.integration.worker import runner

    caches = kv_caches(config)
    runner.install_gpu_runner_hooks()
    try:
        tagged = config.tag_block_ids(full, [20, 21]) + config.tag_block_ids(window, [3, 4])
        CPUModelRunner._zero_block_ids(cpu_runner(config, caches), tagged)  # type: ignore[arg-type]
    finally:
        runner.uninstall_gpu_runner_hooks()
    assert_zeroed_exactly(config, caches, {full: [20, 21]})


# ------------------------------------------------------- V2 runner's fabricated block IDs
def v2_dummy_runner(config: PerGroupKVCacheConfig) -> Any:
    """What the V2 runner's ``prepare_dummy_attn`` reads: its ``BlockTables`` (vLLM's class,
    built without its pinned staging buffers, which need CUDA: only the per-group input
    tables that the dummy runs fill), one column per block of a max-length request."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.worker.gpu.block_table import BlockTables

    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    tables = object.__new__(BlockTables)
    tables.block_sizes = [s.block_size for s in specs]
    tables.input_block_tables = [
        torch.zeros(MAX_NUM_SEQS, cdiv(MAX_LEN, s.block_size), dtype=torch.int32) for s in specs
    ]
    tables.slot_mappings = torch.zeros(len(specs), 256, dtype=torch.int64)
    tables._num_dirty_rows = 0  # vLLM 0.33's BlockTables tracks the rows dummy runs filled
    return SimpleNamespace(
        kv_cache_config=config,
        pcp_manager=None,
        block_tables=tables,
        device=CPU,
        max_model_len=MAX_LEN,
    )


def fabricate_dummy_ids(config: PerGroupKVCacheConfig, context_len: int) -> list[torch.Tensor]:
    """The V2 runner's dummy-run preparation (``execute_model`` with ``dummy_run``, read):
    ``prepare_dummy_attn`` with valid state slots, then ``set_dummy_context`` as the runner's
    module names it, with the primary pool's count as the runner passes it."""
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    runner = v2_dummy_runner(config)
    num_reqs, num_tokens = MAX_NUM_SEQS, MAX_NUM_SEQS
    batch = InputBatch.make_dummy(num_reqs, num_tokens, InputBuffers(MAX_NUM_SEQS, 256, CPU))
    tables, _ = v2.GPUModelRunner.prepare_dummy_attn(runner, batch, True)  # type: ignore[arg-type]
    v2.set_dummy_context(
        batch,
        runner.block_tables,
        context_len,
        config.num_blocks,
        runner.max_model_len,
        input_block_tables=tables,
    )
    return [t[:num_reqs] for t in tables]


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
@pytest.mark.parametrize("mode", ["align", "none"])
def test_v2_dummy_block_ids_stay_in_each_pool(mode: str, elastic: bool, hooks: None) -> None:
    config = three_pools(mode, elastic=elastic)
    counts = config.group_num_blocks()
    tables = fabricate_dummy_ids(config, context_len=MAX_LEN // 2)
    for gid, table in enumerate(tables):
        assert int(table.max()) < counts[gid], (gid, int(table.max()), counts[gid])
        assert int(table.min()) >= 0
    mamba = kinds(config)[0]
    assert int(tables[mamba].max()) > 0  # the state slots are there


def test_stock_v2_dummy_block_ids_overrun_smaller_pools(no_hooks: None) -> None:
    """vLLM's own dummy context in 'align' mode: the Mamba table gets IDs up to the primary
    pool's count, past the end of the Mamba pool."""
    config = three_pools("align")
    counts = config.group_num_blocks()
    mamba, full, _ = kinds(config)
    assert counts[mamba] < counts[full]
    tables = fabricate_dummy_ids(config, context_len=MAX_LEN // 2)
    assert int(tables[mamba].max()) >= counts[mamba]
    assert int(tables[full].max()) < counts[full]


def warmup_runner(config: PerGroupKVCacheConfig) -> Any:
    """What vLLM's V2 kernel warmup reads from the model runner (no speculative decoding,
    no encoder, last pipeline stage, no zeroer)."""
    return SimpleNamespace(
        adaptive_verification=None,
        rejection_sampler=None,
        speculative_config=None,
        vllm_config=SimpleNamespace(is_mm_encoder_only=False, num_lookahead_tokens=0),
        num_speculative_steps=0,
        decode_query_len=1,
        is_pooling_model=False,
        kv_cache_config=config,
        model_state=SimpleNamespace(max_encoder_len=0),
        is_encoder_decoder=False,
        max_model_len=MAX_LEN,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256),
        block_tables=SimpleNamespace(redirect_writes_to_null_block=False),
        kv_block_zeroer=None,
        kv_connector=SimpleNamespace(set_disabled=lambda disabled: None),
        is_last_pp_rank=True,
        model_config=SimpleNamespace(get_vocab_size=lambda: 64),
    )


def run_warmup(config: PerGroupKVCacheConfig, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """vLLM's ``warmup_kernels``, called as the GPU worker calls it (its module's name),
    up to the worker's ``execute_model``: the scheduler outputs it hands the worker."""
    from vllm.v1.worker import gpu_worker

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    outputs: list[Any] = []
    gpu_worker.warmup_kernels(warmup_runner(config), outputs.append, lambda grammar: None)  # type: ignore[arg-type]
    return outputs


def ids_by_group(outputs: list[Any]) -> dict[int, list[list[int]]]:
    """Every block-ID list handed over, by group."""
    out: dict[int, list[list[int]]] = {}
    for so in outputs:
        for req in so.scheduled_new_reqs:
            for gid, ids in enumerate(req.block_ids):
                out.setdefault(gid, []).append(list(ids))
        for per_group in so.scheduled_cached_reqs.new_block_ids:
            for gid, ids in enumerate(per_group or ()):
                out.setdefault(gid, []).append(list(ids))
    return out


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
@pytest.mark.parametrize("mode", ["none", "align"])
def test_v2_warmup_block_ids_stay_in_each_pool(
    mode: str, elastic: bool, hooks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = three_pools(mode, elastic=elastic)
    counts = config.group_num_blocks()
    by_group = ids_by_group(run_warmup(config, monkeypatch))
    assert set(by_group) == set(range(len(counts)))
    for gid, lists in by_group.items():
        flat = [b for ids in lists for b in ids]
        assert flat and max(flat) < counts[gid] and min(flat) >= 1, (gid, counts[gid])
        # Distinct within the pool wherever vLLM's were (it never hands one out twice).
        assert len(set(flat)) == len(flat) or len(flat) >= counts[gid]


def test_stock_v2_warmup_overruns_the_mamba_pool(
    no_hooks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's warmup draws every group's IDs from one counter bounded by the primary pool:
    in 'none' mode (a Mamba pool of max_num_seqs + 1 blocks) it overruns the Mamba pool."""
    config = three_pools("none")
    counts = config.group_num_blocks()
    mamba = kinds(config)[0]
    assert counts[mamba] == MAX_NUM_SEQS + 1
    by_group = ids_by_group(run_warmup(config, monkeypatch))
    assert max(b for ids in by_group[mamba] for b in ids) >= counts[mamba]


# ---------------------------------------------------------------- install, fallbacks
def test_hooks_install_and_restore() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    from hybrid_alloc.integration.worker import runner

    def targets() -> list[Any]:
        return [
            KVCacheManager.__dict__["take_new_block_ids"],
            V1Runner.__dict__["_init_kv_zero_meta"],
            CPUModelRunner.__dict__["_zero_block_ids"],
            v2.GPUModelRunner.__dict__["_init_kv_zero_meta"],
            v2.GPUModelRunner.__dict__["prepare_dummy_attn"],
            v2.set_dummy_context,
            gpu_worker.warmup_kernels,
        ]

    runner.uninstall_gpu_runner_hooks()
    stock = targets()
    runner.install_gpu_runner_hooks()
    try:
        runner.install_gpu_runner_hooks()  # idempotent: nothing wrapped twice
        hooked = targets()
        assert all(h is not s for h, s in zip(hooked, stock, strict=True))
        assert all(h._hybrid_alloc_wraps is s for h, s in zip(hooked, stock, strict=True))
    finally:
        runner.uninstall_gpu_runner_hooks()
    assert targets() == stock


def test_gpu_worker_limits_lift_with_the_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU worker (platform pinned to non-CPU) the engine sizing keeps vLLM's shared
    pool for 'align' under the V2 runner and for several attention pools only while the
    runner hooks are missing; the plugin installs them with per-group pools."""
    from vllm.platforms import current_platform

    from hybrid_alloc import integration
    from hybrid_alloc.integration.scheduler import engine_sizing as sizing

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    specs = {"l.0": small_mamba("align"), "l.1": attention(), "l.2": attention(window=64)}
    cfg = small_engine_config("align", caching=True)
    cfg.use_v2_model_runner = True
    integration.uninstall()
    assert "V2" in (sizing.unsupported_reason(cfg, [specs]) or "")
    cfg.use_v2_model_runner = False
    assert "several attention pools" in (sizing.unsupported_reason(cfg, [specs]) or "")
    integration.install(per_group_pools=True)
    try:
        cfg.use_v2_model_runner = True
        assert sizing.unsupported_reason(cfg, [specs]) is None
    finally:
        integration.uninstall()
