"""Small pieces shared by the schedule builders."""

from __future__ import annotations

from typing import Iterable, Sequence

from meshpipe.schedules.actions import Action, Kind, Schedule


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``; a TypeError or ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def forward_part(action: Action) -> Action | None:
    """What an action leaves in a forward-only (inference) schedule: its forward, if any."""
    if action.kind is Kind.F:
        return action
    if action.kind is Kind.OVERLAP:
        return action.parts[0]
    return None


def forward_only_order(actions: Iterable[Action]) -> tuple[Action, ...]:
    """A training order with its backward work removed.

    Forwards depend only on forwards, so keeping the forwards of an executable order (and
    the forward half of each OVERLAP) in their relative order stays executable.
    """
    return tuple(f for f in map(forward_part, actions) if f is not None)


def make_schedule(name: str, num_ranks: int, num_microbatches: int,
                  placement: Sequence[int], ranks: Sequence[Iterable[Action]],
                  forward_only: bool) -> Schedule:
    """The Schedule of per-rank orders, reduced to its forwards when ``forward_only``."""
    orders = [forward_only_order(actions) if forward_only else tuple(actions)
              for actions in ranks]
    return Schedule(num_ranks, len(placement), num_microbatches, tuple(placement),
                    tuple(orders), name)
