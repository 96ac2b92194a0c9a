"""Greedy list scheduling of 1F1B for placements where a rank holds several stages.

With one stage per rank, 1F1B has a closed-form order (and GPipe always has one: breadth
first, see ``builders.gpipe``). When a rank holds several stages (the wrap-around layout, loop placements with several rounds, any explicit map), the
order of its work is found by simulating the pipeline at unit costs and letting each idle
rank start the best *ready* action:

- costs: a forward takes 1 time unit, a backward 2 (the usual backward = 2 x forward);
- a forward F(s, m) is ready once F(s-1, m) has finished; a backward B(s, m) once F(s, m)
  and B(s+1, m) have finished; every stage runs its forwards, and its backwards, in
  microbatch order;
- a ready backward goes before a ready forward, and stage s keeps at most
  ``num_stages - s`` microbatches in flight (forwarded, not yet backwarded), the in-flight
  limit of classic 1F1B (forward-only runs have no limit: nothing is ever backwarded);
- ties go to the lowest microbatch, then the highest stage (depth first: the microbatch that
  is furthest along, or for backwards the stage that feeds the most remaining work).

The result is the order in which the simulated ranks ran their actions, so it is executable
by construction: every action started after what it consumes had finished. It cannot stall,
because the last stage can always run the backward of a microbatch it has forwarded and each
stage's in-flight limit is at least 1.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from meshpipe.schedules.actions import Action, Kind
from meshpipe.schedules.placement import stages_by_rank

FORWARD_COST = 1
BACKWARD_COST = 2

_NEVER = float("inf")


class _Pipeline:
    """The simulated state: which forwards and backwards each stage has started, and when
    each one ends."""

    def __init__(self, placement: Sequence[int], num_microbatches: int,
                 forward_only: bool) -> None:
        self.num_stages = len(placement)
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.stages_of = stages_by_rank(placement)
        self.next_forward = [0] * self.num_stages
        self.next_backward = [0] * self.num_stages
        self.forward_end = [[_NEVER] * num_microbatches for _ in range(self.num_stages)]
        self.backward_end = [[_NEVER] * num_microbatches for _ in range(self.num_stages)]

    def in_flight_limit(self, stage: int) -> int | None:
        """1F1B's cap on microbatches forwarded but not yet backwarded (none without
        backwards)."""
        if not self.forward_only:
            return self.num_stages - stage
        return None

    def ready_forward(self, stage: int, now: float) -> int | None:
        microbatch = self.next_forward[stage]
        if microbatch >= self.num_microbatches:
            return None
        if stage > 0 and self.forward_end[stage - 1][microbatch] > now:
            return None
        limit = self.in_flight_limit(stage)
        if limit is not None and microbatch - self.next_backward[stage] >= limit:
            return None
        return microbatch

    def ready_backward(self, stage: int, now: float) -> int | None:
        if self.forward_only:
            return None
        microbatch = self.next_backward[stage]
        if microbatch >= self.next_forward[stage] or self.forward_end[stage][microbatch] > now:
            return None
        if stage + 1 < self.num_stages and self.backward_end[stage + 1][microbatch] > now:
            return None
        return microbatch

    def pick(self, rank: int, now: float) -> Action | None:
        """The action rank ``rank`` starts at ``now`` (None: nothing is ready)."""
        forwards = []
        backwards = []
        for stage in self.stages_of[rank]:
            if (microbatch := self.ready_forward(stage, now)) is not None:
                forwards.append((microbatch, -stage))
            if (microbatch := self.ready_backward(stage, now)) is not None:
                backwards.append((microbatch, -stage))
        if backwards:
            microbatch, negative_stage = min(backwards)
            kind = Kind.B
        elif forwards:
            microbatch, negative_stage = min(forwards)
            kind = Kind.F
        else:
            return None
        return Action(kind, -negative_stage, microbatch)

    def start(self, action: Action, now: float) -> float:
        """Record ``action`` as started at ``now``; returns its end time."""
        stage, microbatch = action.stage, action.microbatch
        if action.kind is Kind.F:
            end = now + FORWARD_COST
            self.forward_end[stage][microbatch] = end
            self.next_forward[stage] += 1
        else:
            end = now + BACKWARD_COST
            self.backward_end[stage][microbatch] = end
            self.next_backward[stage] += 1
        return end


def list_schedule(placement: Sequence[int], num_microbatches: int, *,
                  forward_only: bool = False) -> list[list[Action]]:
    """Per-rank action orders of 1F1B on ``placement``, by the greedy rule above."""
    pipeline = _Pipeline(placement, num_microbatches, forward_only)
    num_ranks = len(pipeline.stages_of)
    per_stage = 1 if forward_only else 2
    remaining = pipeline.num_stages * num_microbatches * per_stage
    orders: list[list[Action]] = [[] for _ in range(num_ranks)]
    busy_until = [0.0] * num_ranks
    ends: list[float] = []
    now = 0.0
    while remaining:
        for rank in range(num_ranks):
            if busy_until[rank] <= now and (action := pipeline.pick(rank, now)) is not None:
                end = pipeline.start(action, now)
                busy_until[rank] = end
                heapq.heappush(ends, end)
                orders[rank].append(action)
                remaining -= 1
        if remaining and not ends:
            raise RuntimeError(f"1f1b list scheduler stalled at time {now} on placement "
                               f"{tuple(placement)} with {num_microbatches} microbatches; "
                               f"this is a bug in meshpipe, please report it")
        if remaining:
            now = heapq.heappop(ends)
            while ends and ends[0] <= now:
                heapq.heappop(ends)
    return orders
