"""The plugin's startup lines, logged under vLLM's logging configuration.

A process that builds ``EngineArgs`` runs vLLM's general plugins before it configures
vLLM's logging (0.32 and 0.33: ``EngineArgs.__post_init__`` loads the plugins, then
``LLM.__init__``, ``create_engine_config`` or ``vllm serve``'s argument handling calls
``vllm.logger.configure_logging``). That is the ``LLM`` process, which holds the engine
core itself with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and ``vllm serve``'s API server.
An INFO line logged there before the configuration is lost: the ``vllm`` logger has no
handler yet and Python's last-resort handler prints warnings only.

:func:`log` therefore logs at once where vLLM has configured its logging in this process
(the engine-core and worker processes configure it before they load plugins), and
otherwise keeps the line and logs it right after vLLM's ``configure_logging`` has run, so
that it follows the level, format and stream the user chose. The wrapper is removed again
once the kept lines are out.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from hybrid_alloc.integration import hooks

_LOGGER_MODULE = "vllm.logger"
# (logger, level, msg, args, where the line was logged: file, line, function)
_pending: list[tuple[logging.Logger, int, str, tuple[Any, ...], tuple[str, int, str]]] = []


def _configured() -> bool:
    # vLLM records the configuration it applied last in this process (None before the
    # first); ``configure_logging_if_needed`` compares against it.
    import vllm.logger

    return getattr(vllm.logger, "_last_configured_logging_config", None) is not None


def _flush() -> None:
    lines = list(_pending)
    _pending.clear()
    _hooks.uninstall()
    for logger, level, msg, args, (path, line, function) in lines:
        if logger.isEnabledFor(level):
            # made now, so that vLLM's record factory (installed by its configuration) adds
            # what its format prints; the place is the plugin's call, not this module
            record = logger.makeRecord(logger.name, level, path, line, msg, args, None, function)
            logger.handle(record)


def _after_configure(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def configure_logging(*args: Any, **kwargs: Any) -> Any:
        result = stock(*args, **kwargs)
        _flush()
        return result

    return configure_logging


# ``configure_logging_if_needed`` looks ``configure_logging`` up in its own module on each
# call, so wrapping the module attribute catches every path that configures logging late.
_hooks = hooks.HookSet(
    [(_LOGGER_MODULE, None, "configure_logging", _after_configure)],
    hooks.log_missing(logging.getLogger("vllm.hybrid_alloc"), logging.DEBUG),
)


def log(logger: logging.Logger, level: int, msg: str, *args: Any) -> None:
    """``logger.log(level, msg, *args)`` now if vLLM's logging is configured in this
    process, else as soon as vLLM configures it."""
    if _configured():
        logger.log(level, msg, *args, stacklevel=2)
        return
    path, line, function, _ = logger.findCaller(False, 2)
    _pending.append((logger, level, msg, args, (path, line, function)))
    _hooks.install()
    if not _hooks.installed():  # a vLLM this module cannot hook: log now, as before
        _flush()


def pending() -> int:
    """How many lines wait for vLLM's logging configuration in this process."""
    return len(_pending)
