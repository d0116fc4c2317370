"""Startup refuses settings it does not understand: unknown ``HYBRID_ALLOC_*`` names and
switch values, through the plugin's entry point as vLLM calls it (before anything is
installed), each message naming the variable, its value and what is accepted."""

from __future__ import annotations

import pytest

from hybrid_alloc import settings
from hybrid_alloc.integration import plugin

SWITCH_PARSERS = {
    settings.PER_GROUP_ENV_VAR: settings.per_group_pools_enabled,
    settings.CPU_GDN_SPEC_FIX_ENV_VAR: settings.cpu_gdn_spec_fix_enabled,
    settings.CPU_MAMBA2_ALIGN_FIX_ENV_VAR: settings.cpu_mamba2_align_fix_enabled,
}


@pytest.mark.parametrize("name", sorted(SWITCH_PARSERS))
def test_on_off_switches(name: str) -> None:
    parse = SWITCH_PARSERS[name]
    assert parse({}) and parse({name: ""}) and parse({name: " On "}) and parse({name: "1"})
    assert not parse({name: "0"}) and not parse({name: "FALSE"}) and not parse({name: "off"})
    with pytest.raises(ValueError) as err:
        parse({name: "maybe"})
    message = str(err.value)
    assert name in message and "'maybe'" in message
    assert all(v in message for v in ("1", "true", "0", "false", "off"))


OFF_SWITCH_PARSERS = {
    # Costs memory where many short requests run; the layout's use of it below.
    settings.KEEP_STATE_PAGES_ENV_VAR: settings.keep_state_pages_enabled,
}


@pytest.mark.parametrize("name", sorted(OFF_SWITCH_PARSERS))
def test_off_unless_asked_switches(name: str) -> None:
    parse = OFF_SWITCH_PARSERS[name]
    assert not parse({}) and not parse({name: ""}) and not parse({name: "0"})
    assert parse({name: "1"}) and parse({name: "yes"}) and parse({name: " On "})
    with pytest.raises(ValueError, match=name) as err:
        parse({name: "maybe"})
    assert "unset or empty: off" in str(err.value)


def test_fine_align_blocks_values() -> None:
    """``HYBRID_ALLOC_FINE_ALIGN_BLOCKS``: halves by default, off, the configured block, or
    the divisor of vLLM's hybrid block; anything else is refused with what it takes. (The
    worker hook's use of it: tests/engine/test_integration.py.)"""
    name = settings.FINE_ALIGN_BLOCKS_ENV_VAR
    parse = settings.fine_align_blocks
    assert parse({}) == parse({name: ""}) == parse({name: " Half "}) == "half"
    assert parse({name: "0"}) == parse({name: "off"}) == "off"
    assert parse({name: "1"}) == parse({name: " On "}) == "configured"
    assert parse({name: "divisor"}) == parse({name: " Divisor "}) == "divisor"
    with pytest.raises(ValueError, match=name) as err:
        parse({name: "third"})
    message = str(err.value)
    assert "'third'" in message and "divisor" in message and "unset or empty: half" in message
    settings.check_environment({name: "divisor"})


def test_kept_state_pages_reach_the_layout_only_when_asked() -> None:
    """The engine's elastic layout carries the kept pages only with
    ``HYBRID_ALLOC_KEEP_STATE_PAGES`` on."""
    from hybrid_alloc import sizing
    from hybrid_alloc.integration.scheduler import engine_sizing

    name = settings.KEEP_STATE_PAGES_ENV_VAR
    needs = (
        sizing.GroupNeeds("attention", "growing", 16, 1, 4),
        sizing.GroupNeeds("state", "fixed", 64, 1, 1, state_factor=2),
    )
    elastic = sizing.ElasticSizing(needs, 64, 8, 64, 512)
    assert elastic.kept_per_live == (0, 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(name, raising=False)
        assert engine_sizing._as_elastic_layout(elastic).kept_per_live == ()
        mp.setenv(name, "1")
        assert engine_sizing._as_elastic_layout(elastic).kept_per_live == (0, 1)


def test_environment_with_only_known_names_passes() -> None:
    env = {
        settings.ENV_VAR: "vllm",
        settings.PER_GROUP_ENV_VAR: "0",
        settings.CPU_GDN_SPEC_FIX_ENV_VAR: "1",
        settings.CPU_MAMBA2_ALIGN_FIX_ENV_VAR: "0",
        "HYBRID_ALLOC_SLOW_E2E": "1",
        "HYBRID_ALLOC_VENV": "/somewhere",
        "VLLM_OTHER": "anything",
    }
    settings.check_environment(env)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"HYBRID_ALLOC_PER_GROUP_POOL": "0"}, "HYBRID_ALLOC_PER_GROUP_POOL='0'"),
        ({"HYBRID_ALLOC_BACKEND": "rust", "HYBRID_ALLOC_BAKEND": "vllm"}, "HYBRID_ALLOC_BAKEND"),
        ({settings.ENV_VAR: "python"}, "'python'"),
        ({settings.PER_GROUP_ENV_VAR: "2"}, settings.PER_GROUP_ENV_VAR),
        ({settings.CPU_GDN_SPEC_FIX_ENV_VAR: "auto"}, settings.CPU_GDN_SPEC_FIX_ENV_VAR),
        ({settings.CPU_MAMBA2_ALIGN_FIX_ENV_VAR: "x"}, settings.CPU_MAMBA2_ALIGN_FIX_ENV_VAR),
        ({settings.KEEP_STATE_PAGES_ENV_VAR: "some"}, settings.KEEP_STATE_PAGES_ENV_VAR),
        ({settings.FINE_ALIGN_BLOCKS_ENV_VAR: "16"}, settings.FINE_ALIGN_BLOCKS_ENV_VAR),
    ],
)
def test_bad_environment_is_refused(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match="HYBRID_ALLOC_") as err:
        settings.check_environment(env)
    assert named in str(err.value)
    if "is not understood" not in str(err.value) and "known backend" not in str(err.value):
        # An unknown name: the message lists the switches there are.
        assert all(s in str(err.value) for s in settings.SWITCHES)


@pytest.mark.parametrize(
    "env",
    [
        {"HYBRID_ALLOC_PERGROUP_POOLS": "0"},
        {settings.PER_GROUP_ENV_VAR: "maybe"},
        {settings.CPU_GDN_SPEC_FIX_ENV_VAR: "yes please"},
        {settings.CPU_MAMBA2_ALIGN_FIX_ENV_VAR: "sometimes"},
    ],
)
def test_plugin_refuses_at_startup(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """vLLM's plugin loader calls ``register``: a bad setting fails it before any hook is
    installed or removed."""
    from hybrid_alloc import integration
    from hybrid_alloc.integration.worker import cpu_gdn_spec, cpu_mamba2_align

    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def state() -> tuple[object, ...]:
        return (
            integration.installed(),
            cpu_gdn_spec.is_installed(),
            cpu_mamba2_align.is_installed(),
            plugin.active_backend(),
        )

    before = state()
    with pytest.raises(ValueError, match=next(iter(env))):
        plugin.register()
    assert state() == before
