"""Lowering: add the SEND/RECV actions that move data between stages on different ranks.

For every stage-to-stage edge whose two stages sit on different ranks:

- ``SEND_F(s, m)`` goes on rank(s) right after the action that computes F(s, m), and
  ``SEND_B(s, m)`` right after the action that computes the input gradient of (s, m) (a B,
  an I, or the B half of an OVERLAP). The last stage sends no forward, stage 0 no gradient,
  W sends nothing. An action's sends follow the order of its parts (forward first).
- ``RECV_F(s, m)`` (the output of stage s-1) goes on rank(s) before the action computing
  F(s, m); ``RECV_B(s, m)`` (the gradient of stage s's output, from stage s+1) before the
  action computing B/I(s, m).

Stages adjacent on one rank hand over locally: no action is added for them.

Where receives go ("as early as the order allows"): a receive is posted ``lookahead``
compute actions before its consumer (default 1: right before the compute action that
precedes the consumer, so the transfer overlaps that compute), or at the start of the
list when the consumer is among the first ``lookahead`` actions. Point-to-point messages
match in posting order (NCCL has no tags), so for every pair of ranks the receives on the
destination must follow the order of the sends on the source; when a peer sends a message
that this rank consumes after a later message of the same peer, its receive moves up next
to the later message's receive. So a receive is posted at most ``lookahead`` compute
actions before its own consumer or before the consumer of a later message from the same
peer: receive buffers are allocated shortly before they are used, not all at the start
of the step.
"""

from __future__ import annotations

import numpy as np

from meshpipe.schedules._building import check_count
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.table import (B_CODE, F_CODE, I_CODE, RECV_B_CODE, RECV_F_CODE,
                                      SEND_B_CODE, SEND_F_CODE, ActionTable, Parts,
                                      positions_in_runs, stable_order)
from meshpipe.schedules.validation import check_work

__all__ = ["lower"]


def lower(schedule: Schedule, *, lookahead: int = 1) -> Schedule:
    """``schedule`` with SEND/RECV actions for every edge between ranks (see module doc).

    ``lookahead``: how many compute actions ahead of its consumer a receive is posted
    (0 = right before the consumer). The input must be compute-only and complete (every
    (stage, microbatch) has its work; ``ScheduleError`` otherwise); whether it runs to the
    end is ``validate``'s question, and lowering keeps the answer: the lowered schedule
    deadlocks exactly when the compute-only one does.
    """
    check_count("lookahead", lookahead, minimum=0)
    if check_work(schedule).lowered:
        raise ValueError(f"schedule {schedule.name!r} is already lowered (it holds SEND/RECV "
                         f"actions); lower the compute-only schedule once")
    table = schedule.table
    traffic = _Traffic(schedule)
    receives = traffic.receives(lookahead)
    sends = traffic.sends
    del traffic  # what lowering still needs is the sends and receives: free the rest
    return schedule.replace_ranks(_merged(table, sends, receives))


class _Messages(Parts):
    """SEND or RECV actions to insert (the columns of ``Parts``): ``row`` is the compute row
    a send follows, or the compute row a receive precedes."""


class _Traffic:
    """Who sends what to whom, and where each rank consumes what it receives.

    A message is numbered by its receive: ``(is_gradient * num_stages + receiving stage) *
    num_microbatches + microbatch``.
    """

    def __init__(self, schedule: Schedule) -> None:
        table = schedule.table
        self.schedule = schedule
        self.size = schedule.num_stages * schedule.num_microbatches
        self.index = np.int32 if max(len(table), 2 * self.size) < 1 << 30 else np.int64
        self.consumer = np.zeros(2 * self.size, self.index)
        columns = [list(column) for column in
                   zip(*(self._scan(table.parts_between(begin, end))
                         for begin, end in table.ranges()))]
        rows, kinds, stages, microbatches, self.source, self.destination, self.message = (
            _joined(columns, index) for index in range(len(columns)))
        self.sends = _Messages(rows, kinds, stages, microbatches)

    def _scan(self, parts: Parts) -> tuple[np.ndarray, ...]:
        """Record where ``parts`` consume messages; return the sends they make: row, kind,
        stage, microbatch, source and destination rank, message number."""
        schedule = self.schedule
        table = schedule.table
        num_microbatches, last = schedule.num_microbatches, schedule.num_stages - 1
        size = self.size
        placement = np.asarray(schedule.placement, np.int32)
        rank = (np.searchsorted(table.offsets, parts.row, side="right") - 1).astype(np.int32)
        stage = parts.stage.astype(np.int64)
        is_f, is_gradient = parts.kind == F_CODE, (parts.kind == B_CODE) | (parts.kind == I_CODE)
        downstream = np.minimum(stage + 1, last)
        upstream = np.maximum(stage - 1, 0)
        sends_forward = is_f & (stage < last) & (placement[downstream] != rank)
        sends_gradient = is_gradient & (stage > 0) & (placement[upstream] != rank)
        consumes_forward = is_f & (stage > 0) & (placement[upstream] != rank)
        consumes_gradient = is_gradient & (stage < last) & (placement[downstream] != rank)
        consuming = consumes_forward | consumes_gradient
        slot = stage * num_microbatches + parts.microbatch
        self.consumer[np.where(consumes_forward, slot, size + slot)[consuming]] = \
            (parts.row - table.offsets[rank])[consuming]
        sending = sends_forward | sends_gradient
        forward = sends_forward[sending]
        peer = np.where(sends_forward, downstream, upstream)[sending]
        microbatch = parts.microbatch[sending]
        return (parts.row[sending].astype(self.index),
                np.where(forward, SEND_F_CODE, SEND_B_CODE).astype(np.int8),
                parts.stage[sending], microbatch, rank[sending], placement[peer],
                (np.where(forward, 0, size) + peer * num_microbatches + microbatch).astype(
                    self.index))

    def receives(self, lookahead: int) -> _Messages:
        """The RECV actions, one per send and in the sends' order; ``row`` is the global
        row of the compute action each is posted before (see the module doc)."""
        schedule = self.schedule
        num_ranks, num_microbatches = schedule.num_ranks, schedule.num_microbatches
        bounds = np.searchsorted(self.source, np.arange(num_ranks + 1))
        offsets = schedule.table.offsets
        row = np.empty(self.message.size, self.index)
        for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            row[begin:end] = offsets[self.destination[begin:end]] + \
                self._slots(begin, end, lookahead)
        is_gradient, rest = np.divmod(self.message, self.size)
        stage, microbatch = np.divmod(rest, num_microbatches)
        return _Messages(row,
                         np.where(is_gradient == 1, RECV_B_CODE, RECV_F_CODE).astype(np.int8),
                         stage.astype(np.int32), microbatch.astype(np.int32))

    def _slots(self, begin: int, end: int, lookahead: int) -> np.ndarray:
        """Where the receives of sends ``begin:end`` (one source rank's) go on their
        destination: ``lookahead`` before their consumer, and never after the receive of a
        later message from the same rank (a suffix minimum per destination, in send
        order)."""
        earliest = np.maximum(self.consumer[self.message[begin:end]] - lookahead, 0)
        destination = self.destination[begin:end]
        by_destination = stable_order(destination, self.schedule.num_ranks)
        peers = destination[by_destination]
        group = np.zeros(peers.size, np.int64)
        np.cumsum(peers[1:] != peers[:-1], out=group[1:])
        span = int(earliest.max(initial=0)) + 1
        lifted = (earliest[by_destination] + group * span)[::-1]
        slots = np.empty_like(earliest)
        slots[by_destination] = np.minimum.accumulate(lifted)[::-1] - group * span
        return slots


def _merged(table: ActionTable, sends: _Messages, receives: _Messages) -> ActionTable:
    """``table`` with each send right after its row (in order) and each receive right before
    its row (in order)."""
    rows = len(table)
    total = rows + receives.row.size + sends.row.size
    index = np.int32 if total < 1 << 31 else np.int64
    before = np.zeros(rows + 1, index)  # receives before row g, sends after rows < g
    np.cumsum(np.bincount(receives.row, minlength=rows), out=before[1:])
    sent = np.zeros(rows + 1, index)
    np.cumsum(np.bincount(sends.row, minlength=rows), out=sent[1:])
    own = np.arange(rows, dtype=index)
    own += before[1:]
    own += sent[:-1]
    receive_at = (receives.row + before[receives.row] + sent[receives.row]
                  + _order_within_rows(receives.row))
    send_at = own[sends.row] + 1 + positions_in_runs(sends.row)
    kind, stage, microbatch = (np.empty(total, np.int8), np.empty(total, np.int32),
                               np.empty(total, np.int32))
    for position, (kinds, stages, microbatches) in (
            (own, (table.kind, table.stage, table.microbatch)),
            (receive_at, (receives.kind, receives.stage, receives.microbatch)),
            (send_at, (sends.kind, sends.stage, sends.microbatch))):
        kind[position] = kinds
        stage[position] = stages
        microbatch[position] = microbatches
    offsets = table.offsets + before[table.offsets] + sent[table.offsets]
    lowered = ActionTable(kind, stage, microbatch, offsets)
    if not table.overlap_rows.size:
        return lowered
    return lowered.with_overlaps(own[table.overlap_rows], table.overlap_stage,
                                 table.overlap_microbatch)


def _joined(columns: list[list[np.ndarray]], index: int) -> np.ndarray:
    """Column ``index`` of ``columns`` (pieces per range) as one array; the pieces are
    released as the result is made."""
    joined = np.concatenate(columns[index])
    columns[index] = []
    return joined


def _order_within_rows(rows: np.ndarray) -> np.ndarray:
    """Per element, how many earlier elements hold the same row (mostly none: only those
    sharing a row are sorted)."""
    index = np.arange(rows.size, dtype=rows.dtype)
    last = np.full(int(rows.max(initial=-1)) + 1, -1, rows.dtype)
    last[rows] = index
    order = np.zeros(rows.size, rows.dtype)
    shared = np.flatnonzero(last[rows] != index)
    if not shared.size:
        return order
    shared_rows = np.unique(rows[shared])
    members = np.flatnonzero(np.isin(rows, shared_rows))
    by_row = members[np.argsort(rows[members], kind="stable")]
    order[by_row] = positions_in_runs(rows[by_row])
    return order
