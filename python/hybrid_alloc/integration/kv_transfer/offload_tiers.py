"""Secondary offload tiers (vLLM's tiering spec) with per-group pools: which tiers are
served, and how files name the host layout they were written under.

vLLM's ``TieringOffloadingSpec`` keeps the CPU tier in a shared host region and copies whole
chunk rows between it and its secondary tiers; the filesystem tier (``type: "fs"``) writes
one file per (group, block hash) under a directory named by a hash of the run's fields
(``FileMapper``: model, dtype, KV-cache groups and their layers, tokens per block,
parallelism). Those fields do not say how a chunk row is laid out, and per-group pools lay
it out differently from vLLM's shared pool (each layer's own page instead of one padded
page for all), so a file written by one could be read by the other as garbage. Here:

* the offload config built for per-group pools carries the layout (``LAYOUT_KEY`` in its
  extra config: every offloaded group's layers and their page bytes, bytes per block);
* :func:`layout_named_file_mapper` adds that layout to the ``FileMapper``'s fields, so
  files written under another layout live in another directory and are never looked up;
* the directory's ``config.json`` (vLLM writes it when it creates the directory) must
  match this run's fields: a directory written under other fields is refused with an error
  naming it, never loaded.

The host copy worker (:class:`.offload.HostCopyOffloadingWorker`) writes into the same
shared region as vLLM's worker would, so the tiers read the bytes it stored.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

LAYOUT_KEY = "hybrid_alloc_kv_layout"
"""Offload config extra-config key: the host layout of per-group pools (absent: vLLM's)."""

SERVED_TIERS = ("fs",)
"""Secondary tier types tested with per-group pools (vLLM's tiering spec)."""


def per_group_layout(
    groups: list[tuple[int, list[tuple[str, int]]]], bytes_per_block: int
) -> dict[str, Any]:
    """The layout identity of a per-group host chunk: per offloaded group, its layers with
    their page bytes in row order, and the bytes one block costs."""
    return {
        "kv_pools": "hybrid_alloc per-group",
        "groups": [
            {"group": gid, "pages": [[name, page] for name, page in layers]}
            for gid, layers in groups
        ],
        "bytes_per_block": bytes_per_block,
    }


def secondary_tiers_unsupported_reason(extra_config: dict[str, Any]) -> str | None:
    """Why per-group pools cannot serve the tiering spec's secondary tiers (None: every tier
    is one of :data:`SERVED_TIERS`)."""
    tiers = extra_config.get("secondary_tiers") or []
    if not isinstance(tiers, list):
        return "secondary_tiers is not a list"
    for tier in tiers:
        kind = tier.get("type") if isinstance(tier, dict) else None
        if kind not in SERVED_TIERS or (isinstance(tier, dict) and tier.get("module_path")):
            return (
                f"secondary offload tier {kind!r} (per-group pools serve the "
                f"{', '.join(SERVED_TIERS)} tier only)"
            )
    return None


def _normalised(fields: dict[str, Any]) -> Any:
    return json.loads(json.dumps(fields, sort_keys=True))


def check_run_config(mapper: Any) -> None:
    """Refuse a tier directory whose ``config.json`` names other fields than this run's
    (written under another model, group partition, page layout or dtype)."""
    path = mapper.get_config_file_path()
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"KV offload directory {os.path.dirname(path)}: unreadable {path}: {e}"
        ) from e
    want = _normalised(mapper.get_run_config())
    if found != want:
        differing = sorted(k for k in set(found) | set(want) if found.get(k) != want.get(k))
        raise RuntimeError(
            f"KV offload directory {os.path.dirname(path)} holds blocks written under other "
            f"settings (differing: {', '.join(differing)}); refusing to load them. Point the "
            "tier's root_dir elsewhere or remove that directory."
        )


def check_writable(root_dir: str) -> None:
    """Refuse, at startup, a tier directory this process cannot create or write a file in:
    vLLM's tier threads would otherwise fail every store later, one log line at a time."""
    try:
        os.makedirs(root_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root_dir, prefix=".hybrid_alloc_probe_"):
            pass
    except OSError as e:
        raise RuntimeError(
            f"KV offload filesystem tier: root_dir {root_dir!r} cannot be written "
            f"({type(e).__name__}: {e}); point the tier's root_dir at a writable directory"
        ) from e


def layout_named_file_mapper(stock: Any) -> Any:
    """``FileMapper.from_offloading_spec`` whose fields also name a per-group host layout
    and which refuses a directory written under other fields."""
    build: Callable[..., Any] = stock.__func__

    def from_offloading_spec(
        cls: Any, root_dir: str, offloading_spec: Any, *args: Any, **kwargs: Any
    ) -> Any:
        check_writable(root_dir)
        mapper = build(cls, root_dir, offloading_spec, *args, **kwargs)
        layout = offloading_spec.config.extra_config.get(LAYOUT_KEY)
        if layout is not None:
            mapper.fields["kv_layout"] = layout
            mapper.base_path = cls._compute_base_path(root_dir, mapper.fields)
        check_run_config(mapper)
        return mapper

    return classmethod(from_offloading_spec)


FILE_MAPPER_MODULE = "vllm.v1.kv_offload.file_mapper"
