"""pytest configuration: hypothesis profiles and the state-machine step report (shared
helpers live in :mod:`tests.helpers`)."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

# Hypothesis profiles: "ci" (default) is derandomized with a fixed budget; "long" digs deeper.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYBRID_ALLOC_HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.helpers import MACHINE_STEPS

    if MACHINE_STEPS:
        total = sum(MACHINE_STEPS.values())
        parts = ", ".join(f"{name}: {n}" for name, n in sorted(MACHINE_STEPS.items()))
        terminalreporter.write_line(f"state-machine steps: {total} ({parts})")
