"""pytest configuration: hypothesis profiles and the state-machine step report (shared
helpers live in :mod:`tests.helpers`)."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, Phase, settings

# Hypothesis profiles: "ci" (default) is derandomized with a fixed budget; "long" digs deeper;
# "mutants" is "ci" without shrinking (scripts/mutation_check.py: a mutant is caught by any
# failing example, and shrinking one is most of the time a caught mutant costs).
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
settings.register_profile(
    "mutants",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYBRID_ALLOC_HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the P/D pairs run again after a NIXL timing failure, and the state-machine
    steps that changed state, per machine and per rule (a rule that returned early, was
    refused, or only looked something up is not a step)."""
    from tests.helpers import PD_PAIRS_RUN, PD_RUNS_AGAIN, RULES_RUN, STEPS

    write = terminalreporter.write_line
    if PD_PAIRS_RUN[0]:
        again = len(PD_RUNS_AGAIN)
        tail = ":" if again else ""
        write(f"P/D pairs started: {PD_PAIRS_RUN[0]}; {again} after a NIXL timing failure{tail}")
        for report in PD_RUNS_AGAIN:
            write(f"  {report}")
    if not STEPS:
        return
    per_machine: dict[str, dict[str, int]] = {}
    for (machine, rule), n in STEPS.items():
        per_machine.setdefault(machine, {})[rule] = n
    total = sum(STEPS.values())
    write(f"state-changing state-machine steps: {total} (of {sum(RULES_RUN.values())} rules run)")
    for machine, rules in sorted(per_machine.items()):
        parts = ", ".join(f"{rule} {n}" for rule, n in sorted(rules.items()))
        write(f"  {machine}: {sum(rules.values())} ({parts})")
