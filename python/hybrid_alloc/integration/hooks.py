"""Wrapping vLLM functions in place and putting them back: one mechanism for every set of
hooks the plugin installs (the GPU runners' in :mod:`.worker.runner`, offloading's in
:mod:`.kv_transfer.offload`).

A hook names (module, owning class or None for a module-level function, attribute, wrapper
factory). Installing replaces the attribute with ``factory(vLLM's object)``; uninstalling
restores vLLM's object, or deletes the wrapper where the class only inherited the attribute
(so the class resolves to its base's again). Installing is idempotent, and an attribute that
already holds one of our wrappers (a reloaded module list, a second hook set naming the same
function) is not wrapped twice.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from hybrid_alloc.integration import versions

Hook = tuple[str, str | None, str, Callable[[Any], Any]]
HookKey = tuple[str, str | None, str]
_WRAPS = "_hybrid_alloc_wraps"  # on each wrapper: the vLLM object it wraps


def _target(module_name: str, owner: str | None) -> Any:
    module = importlib.import_module(module_name)
    return module if owner is None else getattr(module, owner)


class HookSet:
    """The hooks ``hooks``, installed together. ``on_missing(key, error)`` is told about a
    module this vLLM build cannot import (that hook is skipped)."""

    def __init__(
        self, hooks: Sequence[Hook], on_missing: Callable[[HookKey, Exception], None]
    ) -> None:
        self.hooks = tuple(hooks)
        self._on_missing = on_missing
        # key -> vLLM's own object while wrapped (None: inherited, deleted on uninstall)
        self._stock: dict[HookKey, Any] = {}

    def install(self) -> None:
        """Wrap every hook's attribute (only on the vLLM releases in :mod:`.versions`); an
        attribute the target neither has nor inherits is left alone."""
        if not versions.is_supported(versions.installed_version()):
            return
        for module_name, owner, attr, wrap in self.hooks:
            key = (module_name, owner, attr)
            if key in self._stock:
                continue
            try:
                target = _target(module_name, owner)
            except Exception as e:
                self._on_missing(key, e)
                continue
            own = vars(target).get(attr)
            inherited = getattr(target, attr, None) if own is None and owner else None
            current = own if own is not None else inherited
            if current is None or hasattr(current, _WRAPS):
                continue
            wrapper = wrap(current)
            setattr(wrapper, _WRAPS, current)
            self._stock[key] = own
            setattr(target, attr, wrapper)

    def uninstall(self) -> None:
        for key, stock in list(self._stock.items()):
            target = _target(key[0], key[1])
            if stock is None:
                delattr(target, key[2])
            else:
                setattr(target, key[2], stock)
            del self._stock[key]

    def installed(self) -> bool:
        return bool(self._stock)

    def stock(self, key: HookKey) -> Any:
        """vLLM's own object behind an installed hook (KeyError if it is not installed)."""
        if key not in self._stock:
            raise KeyError(f"hook {'.'.join(filter(None, key))} is not installed")
        return getattr(vars(_target(key[0], key[1]))[key[2]], _WRAPS)


def log_missing(
    logger: logging.Logger, level: int, consequence: str = ""
) -> Callable[[HookKey, Exception], None]:
    """An ``on_missing`` that logs the hook's dotted name, the error and ``consequence``."""

    def on_missing(key: HookKey, error: Exception) -> None:
        name = ".".join(filter(None, key))
        logger.log(level, "hybrid_alloc: %s not hooked (%s)%s", name, error, consequence)

    return on_missing
