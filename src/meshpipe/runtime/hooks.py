"""The callables an ``Executor`` runs at given moments of a step, and where those moments fall
in a rank's action list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from meshpipe.schedules.actions import Action, Kind


@dataclass
class OverlapHooks:
    """Callables run around the halves of every OVERLAP action, each given that half (an F or
    a B action): ``pre_forward`` and ``pre_backward`` before the co-scheduled compute (in that
    order), ``post_forward`` and ``post_backward`` after it (e.g. to post or wait for
    pipeline messages around the combined step)."""

    pre_forward: Callable[[Action], None] | None = None
    pre_backward: Callable[[Action], None] | None = None
    post_forward: Callable[[Action], None] | None = None
    post_backward: Callable[[Action], None] | None = None


@dataclass
class StageHooks:
    """Callables given a stage index at two moments of every step: ``before_first_forward``
    before the stage's first forward of the step (e.g. to wait for its weights, gathered
    while the step began), ``after_last_backward`` once the step's last gradient
    contribution to its weights is done (its last B, or its last W under split backward),
    e.g. to start reducing them while the pipeline runs its remaining actions. They must not
    wait on other pipeline ranks: those may be waiting on this rank's next action."""

    before_first_forward: Callable[[int], None] | None = None
    after_last_backward: Callable[[int], None] | None = None


def stage_moments(actions: Sequence[Action]) -> tuple[dict[int, list[int]],
                                                      dict[int, list[int]]]:
    """For a rank's action list: the stages whose first forward is at each index, and the
    stages whose last weight-gradient action (B, or W under split backward) is."""
    first_forward: dict[int, int] = {}
    last_backward: dict[int, int] = {}
    for index, action in enumerate(actions):
        for part in action.computations:
            if part.kind is Kind.F:
                first_forward.setdefault(part.stage, index)
            elif part.kind in (Kind.B, Kind.W):
                last_backward[part.stage] = index
    before: dict[int, list[int]] = {}
    after: dict[int, list[int]] = {}
    for stage, index in first_forward.items():
        before.setdefault(index, []).append(stage)
    for stage, index in last_backward.items():
        after.setdefault(index, []).append(stage)
    return before, after
