"""Offload settings that cannot work are refused when the engine builds its offloading spec
and tier, not left to fail (or to run with no host tier) later: a filesystem tier directory
that cannot be written, and a host size below one block of every offloaded group."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hybrid_alloc.integration.kv_transfer import offload, offload_tiers
from tests.offload.caches import CONFIG_MODULE, offload_vllm_config, per_group_config


@pytest.fixture
def hooked() -> Iterator[None]:
    was_installed = offload.is_installed()
    offload.install()
    try:
        yield
    finally:
        if not was_installed:
            offload.uninstall()


def _offloading_config(**extra: Any) -> Any:
    build = offload._per_group_build_offloading_config(
        importlib.import_module(CONFIG_MODULE).build_offloading_config
    )
    return build(offload_vllm_config(**extra), per_group_config(padded_mamba=False))


def _spec_class() -> Any:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    return CPUOffloadingSpec


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_host_size_below_one_chunk_is_refused(hooked: None, blocks_per_chunk: int) -> None:
    fits = _spec_class()(_offloading_config(blocks_per_chunk=blocks_per_chunk))
    need = fits.kv_bytes_per_chunk
    assert fits.num_chunks > 0 and need > 0
    # Exactly one chunk is accepted.
    one = _spec_class()(
        _offloading_config(cpu_bytes_to_use=need, blocks_per_chunk=blocks_per_chunk)
    )
    assert one.num_chunks == 1
    with pytest.raises(ValueError) as err:
        _spec_class()(
            _offloading_config(cpu_bytes_to_use=need - 1, blocks_per_chunk=blocks_per_chunk)
        )
    message = str(err.value)
    assert f"cpu_bytes_to_use={need - 1} B" in message
    assert f"{need} B" in message and "kv_offloading_size" in message
    assert "groups 0, 1, 2" in message and f"{blocks_per_chunk} block(s) per chunk" in message


def test_unhooked_vllm_runs_without_a_host_tier() -> None:
    """What the check prevents: vLLM alone accepts the size and sizes zero chunks."""
    was_installed = offload.is_installed()
    offload.uninstall()
    try:
        spec = _spec_class()(_offloading_config(cpu_bytes_to_use=1000))
        assert spec.num_chunks == 0
    finally:
        if was_installed:
            offload.install()


def _file_mapper(root: Path) -> Any:
    from vllm.v1.kv_offload.file_mapper import FileMapper

    spec = SimpleNamespace(config=_offloading_config())
    return FileMapper.from_offloading_spec(str(root), spec)


def test_unwritable_tier_directory_is_refused(hooked: None, tmp_path: Path) -> None:
    # A path under a regular file: no process can create it (root ignores permission bits).
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    bad = blocker / "kv"
    with pytest.raises(RuntimeError) as err:
        _file_mapper(bad)
    assert str(bad) in str(err.value) and "cannot be written" in str(err.value)
    assert not bad.exists()


def test_missing_tier_directory_is_created(hooked: None, tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    mapper = _file_mapper(root)
    assert root.is_dir() and list(root.iterdir()) == []  # the probe file is gone
    assert mapper.base_path.startswith(str(root))


def test_check_writable_names_the_directory(tmp_path: Path) -> None:
    offload_tiers.check_writable(str(tmp_path))
    (tmp_path / "f").write_text("")
    with pytest.raises(RuntimeError, match=r"root_dir '.*/f/x' cannot be written"):
        offload_tiers.check_writable(str(tmp_path / "f" / "x"))
