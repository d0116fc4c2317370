"""The vLLM plugin (entry point ``vllm.general_plugins: hybrid_alloc``).

vLLM runs general plugins once per process before it builds the KV-cache coordinator and
the scheduler, including in the engine-core process that owns them. :func:`register`
reads the two switches (:mod:`hybrid_alloc.settings`), checks that the installed vLLM is a
release hybrid_alloc was tested against (:mod:`.versions`) and installs the Rust pool
(:func:`hybrid_alloc.integration.install`). Its INFO lines wait for vLLM's logging
configuration in a process that runs the plugin first (:mod:`.startup_log`).

On a vLLM it was not tested against, nothing is patched: vLLM stays stock and one warning
names the supported releases, unless ``HYBRID_ALLOC_BACKEND=rust`` was set explicitly, in
which case startup stops with that message. This module imports only vLLM's logger until
the version is known.
"""

from __future__ import annotations

import logging
import os

from hybrid_alloc import integration
from hybrid_alloc.integration import startup_log, versions
from hybrid_alloc.settings import (
    ENV_VAR,
    backend_is_explicit,
    check_environment,
    per_group_pools_enabled,
    selected_backend,
)


def _logger() -> logging.Logger:
    # vLLM's own logger (its ``*_once`` methods). Lines logged before vLLM configures its
    # logging in this process go through :mod:`.startup_log`, which holds them until then.
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.hybrid_alloc")
    except ImportError:  # pragma: no cover - a vLLM without its logger module
        return logging.getLogger("vllm.hybrid_alloc")


logger = _logger()
_active: str | None = None


def register() -> None:
    """Entry point: install the selected backend in this process (idempotent).

    Raises:
        ValueError: a switch has a value that is not understood.
        RuntimeError: ``HYBRID_ALLOC_BACKEND=rust`` was set explicitly on a vLLM release
            hybrid_alloc was not tested against.
    """
    global _active
    check_environment()  # raises ValueError, failing startup, on an unknown name or value
    backend = selected_backend()
    per_group = per_group_pools_enabled() and backend == "rust"
    version = versions.installed_version()
    if backend == "rust" and not versions.is_supported(version):
        message = versions.unsupported_message(version)
        if backend_is_explicit():
            raise RuntimeError(f"{ENV_VAR}=rust: {message}")
        if _active != "unsupported":
            logger.warning("hybrid_alloc: %s", message)
        integration.uninstall()
        _active = "unsupported"
        return
    if backend == "rust":
        integration.install(per_group_pools=per_group)
    else:
        integration.uninstall()
    _install_cpu_gdn_spec_fix()
    _install_cpu_mamba2_align_fix()
    if _active == backend:
        return
    _active = backend
    startup_log.log(
        logger,
        logging.INFO,
        "hybrid_alloc: KV-cache block pool backend is '%s' (%s, pid %d, vLLM %s)%s",
        backend,
        ENV_VAR,
        os.getpid(),
        version,
        ", per-group pools on" if per_group else "",
    )


def _install_cpu_gdn_spec_fix() -> None:
    """vLLM 0.32's CPU GDN speculative-decoding fix (:mod:`.worker.cpu_gdn_spec`), with either pool
    backend: tokens must not depend on which state block a pool hands out."""
    from hybrid_alloc.integration.worker import cpu_gdn_spec
    from hybrid_alloc.settings import CPU_GDN_SPEC_FIX_ENV_VAR, cpu_gdn_spec_fix_enabled

    if not cpu_gdn_spec_fix_enabled():
        cpu_gdn_spec.uninstall()
        return
    if not cpu_gdn_spec.is_installed() and cpu_gdn_spec.install():
        startup_log.log(
            logger,
            logging.INFO,
            "hybrid_alloc: vLLM %s CPU GDN speculative decoding: conv history of rows "
            "shorter than 1 + num_speculative_tokens corrected (%s=0 leaves vLLM's)",
            versions.installed_version(),
            CPU_GDN_SPEC_FIX_ENV_VAR,
        )


def _install_cpu_mamba2_align_fix() -> None:
    """vLLM 0.32's CPU Mamba2 'align' checkpoints (:mod:`.worker.cpu_mamba2_align`), with either
    pool backend: both run the same kernels."""
    from hybrid_alloc.integration.worker import cpu_mamba2_align
    from hybrid_alloc.settings import CPU_MAMBA2_ALIGN_FIX_ENV_VAR, cpu_mamba2_align_fix_enabled

    if not cpu_mamba2_align_fix_enabled():
        cpu_mamba2_align.uninstall()
        return
    if not cpu_mamba2_align.is_installed() and cpu_mamba2_align.install():
        startup_log.log(
            logger,
            logging.INFO,
            "hybrid_alloc: vLLM %s CPU Mamba2 prefix caching: mid-prefill checkpoints "
            "('align' mode) saved by a chunked CPU scan (%s=0 leaves vLLM's)",
            versions.installed_version(),
            CPU_MAMBA2_ALIGN_FIX_ENV_VAR,
        )


def active_backend() -> str | None:
    """The backend installed in this process (``'unsupported'`` when vLLM was left stock
    because of its version), or None if the plugin has not run."""
    return _active
