"""Fixtures the engine tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Qwen3-Next (3 GDN : 1 attention), written once per module."""
    from tests.support.tiny_model import write_tiny_hybrid_model

    return write_tiny_hybrid_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")
