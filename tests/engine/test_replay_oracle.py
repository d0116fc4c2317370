"""The recompute-replay oracle (:func:`tests.helpers.check_recompute_replay`) on made-up
engine results: it accepts exactly the runs it documents and names the request otherwise."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.helpers import check_recompute_replay, replay_prompts

PROMPTS = [[5, 6, 7], [8, 9, 10]]
STOCK = {"outputs": [[1, 2, 3, 4], [5, 6, 7, 8]]}


def _run(outputs: list[list[int]], resumed: dict[str, list[list[int]]]) -> dict[str, Any]:
    return {
        "prompts": PROMPTS,
        "outputs": outputs,
        "probe": {"before_reset": {"resumed": resumed}},
    }


def _replay(run: dict[str, Any], outputs: list[list[int]]) -> dict[str, Any]:
    return {"prompts": replay_prompts(run), "outputs": outputs, "metrics": {"preemptions": 0}}


def _good() -> tuple[dict[str, Any], dict[str, Any]]:
    # Request 1 resumed twice: before any output, then after two tokens, from a hit of 3.
    run = _run([[1, 2, 3, 4], [5, 6, 9, 9]], {"1": [[0, 0], [2, 3]]})
    return run, _replay(run, [[1, 2, 3, 4], [9, 9, 0, 0]])


def test_replay_prompts_append_the_outputs_of_the_last_resumption() -> None:
    run, _ = _good()
    assert replay_prompts(run) == [[5, 6, 7], [8, 9, 10, 5, 6]]


def test_accepts_a_run_explained_by_its_replay() -> None:
    run, replay = _good()
    assert check_recompute_replay(STOCK, run, replay) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda run, replay: run["outputs"][0].__setitem__(3, 0), "request 0: never resumed"),
        (lambda run, replay: run["outputs"][1].__setitem__(1, 0), "request 1: differs before"),
        (lambda run, replay: replay["outputs"][1].__setitem__(0, 1), "request 1: not its replay"),
        (
            lambda run, replay: run["probe"]["before_reset"]["resumed"]["1"].append([3, 3]),
            "request 1 resumed after outputs [2, 3]",
        ),
        (
            lambda run, replay: run["probe"]["before_reset"]["resumed"]["1"][1].__setitem__(1, 4),
            "request 1: recompute from [4]",
        ),
        (lambda run, replay: replay["metrics"].__setitem__("preemptions", 1), "preemptions"),
        (lambda run, replay: replay["prompts"][1].pop(), "the replay ran other prompts"),
    ],
)
def test_rejects(change: Any, message: str) -> None:
    run, replay = (copy.deepcopy(x) for x in _good())
    prompts = copy.deepcopy(replay["prompts"])
    change(run, replay)
    if replay["prompts"] == prompts:
        # The replay that would go with the changed run, so that the check under test fails.
        replay["prompts"] = replay_prompts(run)
    with pytest.raises(AssertionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_recompute_replay(STOCK, run, replay)
