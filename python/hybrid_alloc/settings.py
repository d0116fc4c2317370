"""The environment switches users set, parsed without importing vLLM.

* ``HYBRID_ALLOC_BACKEND``: which block pool vLLM's KV-cache coordinator builds. ``rust``
  (the default once hybrid_alloc is installed) selects the Rust pool; ``vllm`` keeps vLLM's
  stock Python pool.
* ``HYBRID_ALLOC_PER_GROUP_POOLS``: with the Rust backend, whether hybrid models get one pool
  per KV-cache group (default on; ``0`` keeps the Rust pool a drop-in for vLLM's one shared
  pool).
* ``HYBRID_ALLOC_ELASTIC_POOLS``: with per-group pools, whether the pools share one byte
  budget that moves between them with the traffic (default on) rather than a static split
  sized up front for ``max_num_seqs`` requests (``0``).
* ``HYBRID_ALLOC_CPU_GDN_SPEC_FIX``: on vLLM 0.32 CPU platforms, whether the plugin corrects
  the GDN speculative-decoding conv history (default on; :mod:`hybrid_alloc.integration.
  cpu_gdn_spec`). Applied with both backends, so they run the same kernel.
* ``HYBRID_ALLOC_CPU_MAMBA2_ALIGN_FIX``: on vLLM 0.32 CPU platforms, whether the plugin
  gives the Mamba2 layers the mid-prefill checkpoints of 'align' mode (prefix caching)
  (default on; :mod:`hybrid_alloc.integration.worker.cpu_mamba2_align`). Both backends.
* ``HYBRID_ALLOC_FINE_ALIGN_BLOCKS``: with per-group pools and Mamba 'align' mode (prefix
  caching), where vLLM raises the block size to one state page: unset (``half``), per-group
  pools at half of vLLM's block where that is a whole number of configured blocks, else
  vLLM's layout; ``0``: vLLM's layout always; ``1``: the configured block size;
  ``divisor``: the largest block that divides vLLM's into two or more equal parts. Finer
  blocks give finer prefix hits but move each state to a new page every block, and under
  memory pressure that preempts more than stock (see the README).
* ``HYBRID_ALLOC_KEEP_STATE_PAGES``: with elastic pools and fine 'align' blocks, whether a
  state pool keeps one idle page per live state out of other pools' reach (default off).

Any other ``HYBRID_ALLOC_*`` variable is refused at startup (:func:`check_environment`): a
misspelt switch would otherwise leave its setting on the default without a word.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_VAR = "HYBRID_ALLOC_BACKEND"
BACKENDS = ("rust", "vllm")
DEFAULT_BACKEND = "rust"

PER_GROUP_ENV_VAR = "HYBRID_ALLOC_PER_GROUP_POOLS"
_TRUE = ("", "1", "true", "yes", "on")  # unset or empty: on
_FALSE = ("0", "false", "no", "off")

CPU_GDN_SPEC_FIX_ENV_VAR = "HYBRID_ALLOC_CPU_GDN_SPEC_FIX"
CPU_MAMBA2_ALIGN_FIX_ENV_VAR = "HYBRID_ALLOC_CPU_MAMBA2_ALIGN_FIX"

ELASTIC_ENV_VAR = "HYBRID_ALLOC_ELASTIC_POOLS"
ELASTIC_DEFAULT = True

KEEP_STATE_PAGES_ENV_VAR = "HYBRID_ALLOC_KEEP_STATE_PAGES"
KEEP_STATE_PAGES_DEFAULT = False

FINE_ALIGN_BLOCKS_ENV_VAR = "HYBRID_ALLOC_FINE_ALIGN_BLOCKS"
# What HYBRID_ALLOC_FINE_ALIGN_BLOCKS asks for (:func:`fine_align_blocks`).
FINE_ALIGN_OFF = "off"
FINE_ALIGN_HALF = "half"
FINE_ALIGN_CONFIGURED = "configured"
FINE_ALIGN_DIVISOR = "divisor"
FINE_ALIGN_BLOCKS_DEFAULT = FINE_ALIGN_HALF

PREFIX = "HYBRID_ALLOC_"
SWITCHES = (
    ENV_VAR,
    PER_GROUP_ENV_VAR,
    ELASTIC_ENV_VAR,
    CPU_GDN_SPEC_FIX_ENV_VAR,
    CPU_MAMBA2_ALIGN_FIX_ENV_VAR,
    KEEP_STATE_PAGES_ENV_VAR,
    FINE_ALIGN_BLOCKS_ENV_VAR,
)
# Read by the project's own scripts and tests (setup_env.sh, test.sh, conftest), not by the
# plugin; they reach engine processes started by the tests, so they are not refused.
TOOLING = (
    "HYBRID_ALLOC_VENV",
    "HYBRID_ALLOC_VENV_033",
    "HYBRID_ALLOC_SLOW_E2E",
    "HYBRID_ALLOC_PUSH_E2E",
    "HYBRID_ALLOC_HYPOTHESIS_PROFILE",
)


def backend_is_explicit(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_BACKEND`` is set to a non-empty value."""
    env = os.environ if environ is None else environ
    return bool(env.get(ENV_VAR, "").strip())


def selected_backend(environ: Mapping[str, str] | None = None) -> str:
    """The backend named by ``HYBRID_ALLOC_BACKEND`` (case and surrounding space ignored).

    Raises:
        ValueError: the variable names no known backend; the message lists the valid ones.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return DEFAULT_BACKEND
    value = raw.strip().lower()
    if value not in BACKENDS:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not a known backend; valid values are: " + ", ".join(BACKENDS)
        )
    return value


def per_group_pools_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_PER_GROUP_POOLS`` asks for per-group pools.

    Raises:
        ValueError: a value that is neither true-ish nor false-ish.
    """
    return _switch(PER_GROUP_ENV_VAR, environ)


def elastic_pools_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_ELASTIC_POOLS`` makes per-group pools elastic (unset: on;
    ``0`` keeps the static split).

    Raises:
        ValueError: a value that is neither true-ish nor false-ish.
    """
    return _switch(ELASTIC_ENV_VAR, environ, default=ELASTIC_DEFAULT)


def keep_state_pages_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_KEEP_STATE_PAGES`` makes elastic pools keep one idle state
    page per live 'align'-mode state out of other pools' reach (unset: off; see the
    README's "Under the step-time model" for where it wins and where it costs).

    Raises:
        ValueError: a value that is neither true-ish nor false-ish.
    """
    return _switch(KEEP_STATE_PAGES_ENV_VAR, environ, default=KEEP_STATE_PAGES_DEFAULT)


def fine_align_blocks(environ: Mapping[str, str] | None = None) -> str:
    """What ``HYBRID_ALLOC_FINE_ALIGN_BLOCKS`` asks of 'align'-mode blocks under per-group
    pools where vLLM raises the block size: ``"half"`` (unset or empty, or ``half``: half of
    vLLM's block where that is a whole number of configured blocks, else vLLM's block),
    ``"off"`` (false-ish: vLLM's block), ``"configured"`` (true-ish: the configured block)
    or ``"divisor"`` (the largest multiple of the configured block that divides vLLM's into
    two or more equal parts).

    Raises:
        ValueError: a value that is none of those, naming the variable and what it takes.
    """
    env = os.environ if environ is None else environ
    raw = env.get(FINE_ALIGN_BLOCKS_ENV_VAR, "")
    value = raw.strip().lower()
    if value == "":
        return FINE_ALIGN_BLOCKS_DEFAULT
    if value == FINE_ALIGN_HALF:
        return FINE_ALIGN_HALF
    if value == FINE_ALIGN_DIVISOR:
        return FINE_ALIGN_DIVISOR
    if value in _TRUE:
        return FINE_ALIGN_CONFIGURED
    if value in _FALSE:
        return FINE_ALIGN_OFF
    raise ValueError(
        f"{FINE_ALIGN_BLOCKS_ENV_VAR}={raw!r} is not understood; valid values are: "
        f"{FINE_ALIGN_HALF}, {FINE_ALIGN_DIVISOR}, "
        + ", ".join(_TRUE[1:] + _FALSE)
        + f" (unset or empty: {FINE_ALIGN_HALF})"
    )


def cpu_gdn_spec_fix_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_CPU_GDN_SPEC_FIX`` leaves the CPU GDN fix on (unset: on).

    Raises:
        ValueError: a value that is neither true-ish nor false-ish.
    """
    return _switch(CPU_GDN_SPEC_FIX_ENV_VAR, environ)


def cpu_mamba2_align_fix_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HYBRID_ALLOC_CPU_MAMBA2_ALIGN_FIX`` leaves the CPU Mamba2 checkpoint fix on
    (unset: on).

    Raises:
        ValueError: a value that is neither true-ish nor false-ish.
    """
    return _switch(CPU_MAMBA2_ALIGN_FIX_ENV_VAR, environ)


def _switch(name: str, environ: Mapping[str, str] | None, default: bool = True) -> bool:
    env = os.environ if environ is None else environ
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value == "":
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not understood; valid values are: "
        + ", ".join(_TRUE[1:] + _FALSE)
        + f" (unset or empty: {'on' if default else 'off'})"
    )


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse unknown ``HYBRID_ALLOC_*`` variables and bad switch values, all at once.

    Raises:
        ValueError: naming the variable, its value and what is accepted.
    """
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in SWITCHES + TOOLING)
    if unknown:
        raise ValueError(
            "unknown hybrid_alloc setting(s) "
            + ", ".join(f"{k}={env[k]!r}" for k in unknown)
            + "; the switches are: "
            + ", ".join(SWITCHES)
        )
    selected_backend(env)
    per_group_pools_enabled(env)
    elastic_pools_enabled(env)
    cpu_gdn_spec_fix_enabled(env)
    cpu_mamba2_align_fix_enabled(env)
    keep_state_pages_enabled(env)
    fine_align_blocks(env)
