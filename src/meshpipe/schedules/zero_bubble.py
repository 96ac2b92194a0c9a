"""Zero-bubble schedules, which split a backward into I (input gradient, on the critical path)
and W (weight gradient, movable into bubbles): ZB-H1 and ZB-V (Qi et al., "Zero Bubble
Pipeline Parallelism", 2024) and DualPipeV (the V-shaped DualPipe of DeepSeek-V3, as
torch.distributed.pipelining ships it), which also co-schedules forwards with backwards.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from meshpipe.schedules import table as codes
from meshpipe.schedules._building import check_count, make_schedule
from meshpipe.schedules.actions import Action, Kind
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.placement import loop_placement, v_placement
from meshpipe.schedules.table import ActionTable, stacked


class _RankProgram:
    """Appends actions to one rank's order, numbering the microbatches of each (stage, kind)
    in sequence, as every stage handles microbatches in order. A full backward B counts as
    both the I and the W of its microbatch."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self._next: dict[tuple[int, Kind], int] = {}

    def count(self, kind: Kind, stage: int) -> int:
        """How many ``kind`` actions of ``stage`` are in the order so far (B counts as I)."""
        return self._next.get((stage, Kind.I if kind is Kind.B else kind), 0)

    def take(self, kind: Kind, stage: int) -> Action:
        """The next ``kind`` action of ``stage``, counted but not yet placed in the order."""
        microbatch = self.count(kind, stage)
        for counted in ((Kind.I, Kind.W) if kind is Kind.B else (kind,)):
            self._next[(stage, counted)] = microbatch + 1
        return Action(kind, stage, microbatch)

    def add(self, kind: Kind, stage: int) -> Action:
        action = self.take(kind, stage)
        self.order.append(action)
        return action

    def add_overlap(self, forward_stage: int, backward_stage: int) -> None:
        forward = self.take(Kind.F, forward_stage)
        self.order.append(Action.overlap(forward, self.take(Kind.B, backward_stage)))


def zb_h1(num_ranks: int, num_microbatches: int, *, forward_only: bool = False) -> Schedule:
    """ZB-H1: 1F1B with the backward split into I and W, and W deferred to fill the tail.

    Rank r runs ``min(p-1-r, m)`` warmup forwards, then for every microbatch k in order: the
    next forward (while any are left), I(k), and W(k - r) once k >= r; the r deferred W's
    close its list. Rank r thus holds its W's r microbatches behind its I's, which fills the
    cooldown bubble. Peak live activations (forwarded, W not yet run): ``min(p, m)`` on
    every rank, 1F1B's largest (its rank 0), as the paper states. Any m >= 1; one stage per
    rank.

    Bubble (published, free communication): ``(p-1)(F + I - W)`` time per rank, against
    1F1B's ``(p-1)(F + I + W)``: one third of it at F = I = W. Simulated at F = I = W = 1
    with m >= p: makespan ``3m + p - 1``, bubble ratio ``(p-1) / (3m + p - 1)``, exactly
    the published figure. With m < p there are too few deferred W's to fill the tail: the
    makespan is ``2m + 2p - 1``.
    """
    check_count("num_ranks", num_ranks)
    check_count("num_microbatches", num_microbatches)
    ranks = stacked([_zb_h1_order(rank, num_ranks, num_microbatches)
                     for rank in range(num_ranks)])
    return make_schedule("zb-h1", num_ranks, num_microbatches, loop_placement(num_ranks),
                         ranks, forward_only)


def _zb_v_rank_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """ZB-V's order on one rank for ``num_microbatches`` >= 2p - 1."""
    down, up = rank, 2 * num_ranks - 1 - rank
    program = _RankProgram()
    for _ in range(2 * (num_ranks - rank) - 1):
        program.add(Kind.F, down)
    for _ in range(rank):
        program.add(Kind.F, up)
        program.add(Kind.F, down)
    for _ in range(num_ranks - rank):
        for kind in (Kind.F, Kind.I, Kind.W):
            program.add(kind, up)
    while (program.count(Kind.F, up) < program.count(Kind.F, down)
           or program.count(Kind.F, down) < num_microbatches):
        if program.count(Kind.F, down) < num_microbatches:
            program.add(Kind.F, down)
        program.add(Kind.I, down)
        program.add(Kind.W, down)
        for kind in (Kind.F, Kind.I, Kind.W):
            program.add(kind, up)
    for _ in range(rank):
        program.add(Kind.I, down)
        program.add(Kind.I, up)
    for _ in range(num_ranks - rank):
        program.add(Kind.I, down)
        program.add(Kind.W, down)
    for stage in (up, down):
        while program.count(Kind.W, stage) < num_microbatches:
            program.add(Kind.W, stage)
    return program.order


def _zb_h1_order(rank: int, num_ranks: int, num_microbatches: int) -> ActionTable:
    """One rank's ZB-H1 order (see ``zb_h1``) as a table: warmup forwards; per step k the
    next forward (while any are left), I(k) and W(k - rank) (once k >= rank); the deferred
    W's."""
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    step = np.arange(num_microbatches)
    item = np.stack([warmup + step, step, step - rank], axis=1)
    present = np.stack([warmup + step < num_microbatches, np.ones_like(step, bool),
                        step >= rank], axis=1)
    kind = np.broadcast_to(np.array([codes.F_CODE, codes.I_CODE, codes.W_CODE], np.int8),
                           item.shape)
    deferred = np.arange(max(0, num_microbatches - rank), num_microbatches)
    microbatch = np.concatenate([np.arange(warmup), item[present], deferred])
    kinds = np.concatenate([np.full(warmup, codes.F_CODE, np.int8), kind[present],
                            np.full(deferred.size, codes.W_CODE, np.int8)])
    return ActionTable.from_columns(kinds, np.full(kinds.size, rank), microbatch, [kinds.size])


def zb_v(num_ranks: int, num_microbatches: int, *, forward_only: bool = False) -> Schedule:
    """ZB-V: the zero-bubble schedule on the V placement (2 stages per rank, rank r holds
    stages r and 2p-1-r). Peak live activations: 2p (stage, microbatch) pairs per rank
    for m >= 2p, each stage half of a 1F1B stage: the memory of 1F1B's rank 0.

    Rank r: ``2(p-r)-1`` forwards of its down stage; r pairs (F up, F down); ``p-r`` triples
    (F, I, W) of its up stage; then steady rounds of F/I/W down and F/I/W up until every
    forward is done; then I's with the W's deferred to the end. For m < 2p - 1 the order is
    built for 2p - 1 microbatches and the actions of the missing ones are dropped (as
    torch.distributed.pipelining's ScheduleZBVZeroBubble does), so any m >= 1 works.

    Bubble at F = I = W (every stage costing 1 per F, I and W; free communication):
    the paper's figure is zero bubble, and the simulation agrees in the paper's sense:
    every rank is busy without a gap from its first action to its last (the schedule is a
    parallelogram; the paper lets the next step fill the ramps). Measured over the whole
    step, rank p-1 cannot start before p-1 forwards have run, so the simulated makespan is
    ``6m + p - 1`` for 6m units of work per rank: bubble ratio ``(p-1) / (6m + p - 1)``,
    the lowest possible with that ramp, and half of ZB-H1's bubble time for the same work
    (ZB-H1 with p stages of twice the size: ``2(p-1)`` units). Shown for m >= 2p.
    """
    check_count("num_ranks", num_ranks)
    check_count("num_microbatches", num_microbatches)
    built_for = max(num_microbatches, 2 * num_ranks - 1)
    ranks = [[a for a in _zb_v_rank_order(rank, num_ranks, built_for)
              if a.microbatch < num_microbatches]
             for rank in range(num_ranks)]
    return make_schedule("zb-v", num_ranks, num_microbatches, v_placement(num_ranks), ranks,
                         forward_only)


def _dualpipe_v_rank_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """DualPipeV's eight phases on one rank (needs ``num_microbatches >= 2 * num_ranks``)."""
    down, up = rank, 2 * num_ranks - 1 - rank
    program = _RankProgram()
    pending_weights: deque[tuple[int, int]] = deque()

    def backward_input(stage: int) -> None:
        action = program.add(Kind.I, stage)
        pending_weights.append((stage, action.microbatch))

    def oldest_pending_weight() -> None:
        if pending_weights:
            stage, microbatch = pending_weights.popleft()
            program.order.append(Action(Kind.W, stage, microbatch))

    def backward(stage: int, split: bool) -> None:
        if split:
            backward_input(stage)
        else:
            program.add(Kind.B, stage)

    for _ in range(2 * (num_ranks - rank - 1)):
        program.add(Kind.F, down)
    for _ in range(rank + 1):
        program.add(Kind.F, down)
        program.add(Kind.F, up)
    for _ in range(num_ranks - rank - 1):
        backward_input(up)
        oldest_pending_weight()
        program.add(Kind.F, up)
    for step in range(num_microbatches - 2 * num_ranks + rank + 1):
        if step == 0 and rank == num_ranks - 1:
            program.add(Kind.F, down)  # not overlapped: it shortens the bubble
            program.add(Kind.B, up)
        else:
            program.add_overlap(down, up)
        program.add_overlap(up, down)
    for _ in range(num_ranks - rank - 1):
        program.add(Kind.B, up)
        program.add_overlap(up, down)
    split = False  # the second half of the last backwards splits into I and W
    for step in range(rank + 1):
        for stage in (up, down):
            if step == (rank + 1) // 2 and (rank % 2 == 1) == (stage == up):
                split = True
            backward(stage, split)
    for _ in range(num_ranks - rank - 1):
        oldest_pending_weight()
        backward(down, split)
    while pending_weights:
        oldest_pending_weight()
    return program.order


def dualpipe_v(num_ranks: int, num_microbatches: int, *, forward_only: bool = False) -> Schedule:
    """DualPipeV: DeepSeek's DualPipe folded onto the V placement (2 stages per rank).

    Eight phases on rank r: forwards of the down stage, then of both stages, a zero-bubble
    ramp (I, W, F of the up stage), the main phase of OVERLAP actions (forward of one stage
    co-scheduled with the full backward of the other), and a drain of backwards whose second
    half splits into I and W to fill the tail. Needs ``m >= 2p``. Peak live activations:
    2p + 1 (stage, microbatch) pairs per rank (DeepSeek's "PP + 1").

    Bubble (published by DeepSeek for DualPipeV with PP = 2p stages on p ranks):
    ``(p-1)(F&B + B - 3W)`` time per rank, F&B being the time of an OVERLAP and B of a full
    backward. Simulated at F = I = W = 1 with an OVERLAP costing F + B (the cost model
    without all-to-all: no gain from co-scheduling): makespan ``6m + 2(p-1)``, exactly the
    published ``(p-1)(3 + 2 - 3)``, bubble ratio ``(p-1) / (3m + p - 1)``: equal to ZB-H1's.
    Its advantage over ZB-H1 appears with expert-parallel all-to-alls (``CostModel.a2a`` >
    0): a plain F, B or I waits for its own, while an OVERLAP hides each behind the other
    half's compute; an explicit ``CostModel.overlap`` gives a measured OVERLAP time instead.
    """
    check_count("num_ranks", num_ranks)
    check_count("num_microbatches", num_microbatches)
    if num_microbatches < 2 * num_ranks:
        raise ValueError(f"dualpipe-v needs num_microbatches >= 2 * num_ranks "
                         f"(= {2 * num_ranks}), got {num_microbatches}; use "
                         f"{2 * num_ranks} microbatches or more, or schedule 'zb-v'")
    ranks = [_dualpipe_v_rank_order(rank, num_ranks, num_microbatches)
             for rank in range(num_ranks)]
    return make_schedule("dualpipe-v", num_ranks, num_microbatches, v_placement(num_ranks),
                         ranks, forward_only)
