"""Small pieces shared by the schedule builders."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from meshpipe.schedules.actions import Action, Kind
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules import table as codes
from meshpipe.schedules.table import ActionTable


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


def forward_only_table(table: ActionTable) -> ActionTable:
    """``forward_only_order`` of every rank of a table: its F rows and the forward halves of
    its OVERLAP rows, in order."""
    keep = (table.kind == codes.F_CODE) | (table.kind == codes.OVERLAP_CODE)
    counts = np.bincount(table.rank_of_rows()[keep], minlength=table.num_ranks)
    return ActionTable.from_columns(np.full(int(keep.sum()), codes.F_CODE, np.int8),
                                    table.stage[keep], table.microbatch[keep], counts)


def warmup_steady_cooldown(warmup: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """The 1F1B shape over ``total`` items: ``warmup`` forwards, then forward ``warmup + k``
    and backward ``k`` in turn, then the remaining backwards. Per position: its kind (F or
    B code) and its item; forwards and backwards each take the items in order."""
    steady = total - warmup
    is_forward = np.concatenate([np.ones(warmup, bool), np.tile([True, False], steady),
                                 np.zeros(warmup, bool)])
    item = np.empty(is_forward.size, np.int64)
    item[is_forward] = np.arange(total)
    item[~is_forward] = np.arange(total)
    return np.where(is_forward, codes.F_CODE, codes.B_CODE).astype(np.int8), item


def make_schedule(name: str, num_ranks: int, num_microbatches: int,
                  placement: Sequence[int], ranks: Sequence[Iterable[Action]] | ActionTable,
                  forward_only: bool) -> Schedule:
    """The Schedule of per-rank orders (``Action`` sequences, or one table of every rank),
    reduced to its forwards when ``forward_only``."""
    if isinstance(ranks, ActionTable):
        orders = forward_only_table(ranks) if forward_only else ranks
    else:
        orders = [forward_only_order(actions) if forward_only else tuple(actions)
                  for actions in ranks]
    return Schedule(num_ranks, len(placement), num_microbatches, tuple(placement), orders,
                    name)
