"""The plugin's startup lines (``hybrid_alloc.integration.startup_log``): logged at once
where vLLM has configured its logging in the process, and otherwise held until vLLM's
``configure_logging`` has run (the ``LLM`` process, which holds the engine core with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, loads the plugins first), at the plugin's own place
and under the level the configuration set. The engine tests check the line in every
engine run, one process or three (``tests.helpers.run_engines``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm.logger

from hybrid_alloc.integration import startup_log


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[logging.Logger, _Lines]]:
    # depends on monkeypatch so that its own teardown (below) runs before monkeypatch puts
    # vLLM's logger module back
    # lines an earlier test's register() left waiting (vLLM's logging is not configured in
    # this test process) and their hook, out of the way
    startup_log._pending.clear()
    startup_log._hooks.uninstall()
    logger = logging.getLogger("vllm.hybrid_alloc.startup_log_test")
    handler = _Lines()
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield logger, handler
    finally:
        startup_log._pending.clear()  # a failed test's held lines stay with it
        startup_log._hooks.uninstall()
        logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def _plugin_call(logger: logging.Logger, level: int, n: int) -> None:
    startup_log.log(logger, level, "hybrid_alloc: line %d", n)


def _configure_later(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """vLLM's logging not configured yet in this process; its ``configure_logging``
    replaced by one that only records the configuration it was given."""
    applied: list[Any] = []

    def configure_logging(config: Any) -> None:
        applied.append(config)
        vllm.logger._last_configured_logging_config = config

    monkeypatch.setattr(vllm.logger, "_last_configured_logging_config", None)
    monkeypatch.setattr(vllm.logger, "configure_logging", configure_logging)
    return applied


def test_lines_wait_for_vllms_logging_configuration(
    monkeypatch: pytest.MonkeyPatch, lines: tuple[logging.Logger, _Lines]
) -> None:
    from vllm.config.logging import LoggingConfig

    logger, handler = lines
    applied = _configure_later(monkeypatch)
    recording = vllm.logger.configure_logging
    _plugin_call(logger, logging.INFO, 1)
    _plugin_call(logger, logging.INFO, 2)
    assert handler.records == [] and startup_log.pending() == 2
    assert vllm.logger.configure_logging is not recording  # wrapped while lines wait

    config = LoggingConfig()
    vllm.logger.configure_logging_if_needed(config)  # the LLM constructor's call
    assert applied == [config]
    assert [r.getMessage() for r in handler.records] == [
        "hybrid_alloc: line 1",
        "hybrid_alloc: line 2",
    ]
    assert {(r.funcName, r.filename) for r in handler.records} == {
        ("_plugin_call", "test_startup_log.py")
    }
    assert startup_log.pending() == 0
    assert vllm.logger.configure_logging is recording  # vLLM's function back once they are out

    _plugin_call(logger, logging.INFO, 3)  # configured now: at once
    assert [r.getMessage() for r in handler.records][-1] == "hybrid_alloc: line 3"
    assert vllm.logger.configure_logging is recording


def test_held_lines_follow_the_level_vllm_configures(
    monkeypatch: pytest.MonkeyPatch, lines: tuple[logging.Logger, _Lines]
) -> None:
    """A user who asked for warnings only does not get the held INFO line."""
    from vllm.config.logging import LoggingConfig

    logger, handler = lines
    _configure_later(monkeypatch)
    _plugin_call(logger, logging.INFO, 1)
    _plugin_call(logger, logging.WARNING, 2)
    logger.setLevel(logging.WARNING)  # what the user's configuration sets
    vllm.logger.configure_logging_if_needed(LoggingConfig())
    assert [r.getMessage() for r in handler.records] == ["hybrid_alloc: line 2"]
    assert startup_log.pending() == 0


def test_lines_log_at_once_where_vllm_configured_logging(
    monkeypatch: pytest.MonkeyPatch, lines: tuple[logging.Logger, _Lines]
) -> None:
    """The engine-core and worker processes configure logging before they load plugins."""
    from vllm.config.logging import LoggingConfig

    logger, handler = lines
    monkeypatch.setattr(vllm.logger, "_last_configured_logging_config", LoggingConfig())
    stock = vllm.logger.configure_logging
    _plugin_call(logger, logging.INFO, 7)
    assert [(r.getMessage(), r.funcName) for r in handler.records] == [
        ("hybrid_alloc: line 7", "_plugin_call")
    ]
    assert startup_log.pending() == 0 and vllm.logger.configure_logging is stock
