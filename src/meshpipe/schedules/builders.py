"""Schedule builders: each returns a compute-only ``Schedule`` (lower it to add SEND/RECV).

``SCHEDULE_SPECS`` records each schedule once, beside its builder: its name, how many stages
a rank holds, the placement it runs on, whether its backward is split, and what it equals
at one stage per rank. ``build``, the config, ``compare`` and the tuner read these instead
of keeping name lists of their own; ``SCHEDULES`` is their names. The closed-form orders of
GPipe and 1F1B (one stage per rank) live here; see ``interleaved`` for interleaved and
combined 1F1B, ``zero_bubble`` for ZB-H1, ZB-V and DualPipeV, and ``list_scheduler`` for
1F1B on placements where a rank holds several stages (GPipe runs those breadth first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from meshpipe.schedules import table as codes
from meshpipe.schedules._building import check_count, make_schedule, warmup_steady_cooldown
from meshpipe.schedules.actions import B, F
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.table import ActionTable, stacked
from meshpipe.schedules.interleaved import combined_1f1b, interleaved_1f1b
from meshpipe.schedules.list_scheduler import list_schedule
from meshpipe.schedules.placement import (check_placement, loop_placement, resolve_placement,
                                          stages_by_rank, v_placement)
from meshpipe.schedules.validation import validate
from meshpipe.schedules.zero_bubble import dualpipe_v, zb_h1, zb_v

__all__ = ["SCHEDULES", "SCHEDULE_SPECS", "ScheduleSpec", "build", "combined_1f1b",
           "dualpipe_v", "gpipe", "interleaved_1f1b", "no_pipelining", "one_f_one_b",
           "schedule_spec", "zb_h1", "zb_v"]


def no_pipelining(num_microbatches: int, *, forward_only: bool = False) -> Schedule:
    """One rank, one stage: F0 B0 F1 B1 ... (gradient accumulation over the microbatches).

    Bubble: none (one rank never waits).
    """
    check_count("num_microbatches", num_microbatches)
    order = [a for m in range(num_microbatches) for a in (F(0, m), B(0, m))]
    return make_schedule("none", 1, num_microbatches, (0,), [order], forward_only)


def _one_stage_per_rank(placement: Sequence[int]) -> bool:
    return len(set(placement)) == len(placement)


def _placement_for(num_ranks: int, placement: Sequence[int] | None) -> tuple[int, ...]:
    return loop_placement(num_ranks) if placement is None else check_placement(placement,
                                                                               num_ranks)


def _breadth_first_order(stages: Sequence[int], num_microbatches: int) -> ActionTable:
    """GPipe on a rank holding ``stages``: every microbatch through one stage before the
    next, in stage order; then the backwards, stages in reverse. It cannot deadlock: a
    forward waits only on lower stages, a backward only on higher ones, which every rank
    runs first."""
    ordered = np.array(sorted(stages), np.int32)
    stage = np.concatenate([np.repeat(ordered, num_microbatches),
                            np.repeat(ordered[::-1], num_microbatches)])
    kind = np.repeat(np.array([codes.F_CODE, codes.B_CODE], np.int8),
                     ordered.size * num_microbatches)
    microbatch = np.tile(np.arange(num_microbatches, dtype=np.int32), 2 * ordered.size)
    return ActionTable.from_columns(kind, stage, microbatch, [kind.size])


def _one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> ActionTable:
    kind, microbatch = warmup_steady_cooldown(min(num_stages - stage - 1, num_microbatches),
                                              num_microbatches)
    return ActionTable.from_columns(kind, np.full(kind.size, stage), microbatch, [kind.size])


def _build_on_placement(name: str, num_ranks: int, num_microbatches: int,
                        placement: Sequence[int] | None, forward_only: bool) -> Schedule:
    stages = _placement_for(num_ranks, placement)
    check_count("num_microbatches", num_microbatches)
    one_stage_per_rank = _one_stage_per_rank(stages)
    if name == "gpipe":
        orders = stacked([_breadth_first_order(held, num_microbatches)
                          for held in stages_by_rank(stages)])
    elif one_stage_per_rank:
        orders = stacked([_one_f_one_b_order(held[0], len(stages), num_microbatches)
                          for held in stages_by_rank(stages)])
    else:
        orders = list_schedule(stages, num_microbatches, forward_only=forward_only)
        forward_only = False  # the list scheduler made forward-only orders already
    schedule = make_schedule(name, num_ranks, num_microbatches, stages, orders, forward_only)
    if not one_stage_per_rank:
        validate(schedule)
    return schedule


def gpipe(num_ranks: int, num_microbatches: int, *, placement: Sequence[int] | None = None,
          forward_only: bool = False) -> Schedule:
    """GPipe: every stage runs all its forwards, then all its backwards (microbatch order).

    ``placement`` (default: stage r on rank r) may be any stage -> rank map. A rank holding
    several stages runs them breadth first (all microbatches through a stage before its next
    stage; backwards in reverse stage order), which keeps every rank busy while the others
    work on its earlier stages: at pp 8, 9 microbatches and 4 stages per rank the bubble is
    16.3 % where depth-first orders leave 43.8 %. The order is validated.

    Bubble (one stage per rank, free communication, any F and B): ``(p-1) / (m+p-1)``;
    the simulation at F = I = W gives exactly that. Peak live activations: m on every rank.
    Any m >= 1.
    """
    return _build_on_placement("gpipe", num_ranks, num_microbatches, placement, forward_only)


def one_f_one_b(num_ranks: int, num_microbatches: int, *,
                placement: Sequence[int] | None = None, forward_only: bool = False) -> Schedule:
    """1F1B (PipeDream-flush): stage s runs ``min(S-s-1, m)`` warmup forwards, then
    alternates forward and backward, then drains the remaining backwards.

    ``placement`` (default: stage r on rank r) may be any stage -> rank map; where a rank
    holds several stages, its order comes from the greedy list scheduler (backwards first,
    at most ``S - s`` microbatches in flight on stage s; see ``list_scheduler``) and is
    validated.

    Bubble (one stage per rank, free communication, any F and B): ``(p-1) / (m+p-1)``, the
    same as GPipe, with peak live activations ``min(p-r, m)`` on rank r instead of m. The
    simulation at F = I = W gives exactly that. Any m >= 1.
    """
    return _build_on_placement("1f1b", num_ranks, num_microbatches, placement, forward_only)


def _require_placement(name: str, placement: str | Sequence[int] | None,
                       expected: tuple[int, ...], expected_name: str) -> None:
    if placement is None or placement == expected_name:
        return
    if isinstance(placement, str) or tuple(placement) != expected:
        raise ValueError(f"schedule {name!r} runs on the {expected_name} placement "
                         f"{expected}, not {placement!r}; leave placement unset or use "
                         f"'gpipe' / '1f1b' for other placements")


def _require_one_stage_per_rank(name: str, stages_per_rank: int) -> None:
    if stages_per_rank != 1:
        raise ValueError(f"schedule {name!r} holds one stage per rank, not {stages_per_rank}; "
                         f"use schedule 'interleaved' for several stages per rank")


# (num_ranks, num_microbatches, stages_per_rank, placement or None, forward_only)
Maker = Callable[[int, int, int, "tuple[int, ...] | None", bool], Schedule]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule's properties, the one place they are written.

    ``stages_per_rank``: "one" (a rank holds one stage), "two" (the V placement: a rank holds
    stage r and its mirror) or "any" (virtual stages). ``placement``: "loop", "v", or "any"
    (any stage -> rank map). ``interleaves``: its stages per rank interleave microbatches
    (Megatron's virtual pipeline), so a comparison at vpp k runs it at k. ``split_backward``:
    it runs each backward as I then W. ``one_rank``: it runs on one rank only.
    ``at_one_stage_per_rank``: the schedule it is identical to with one stage per rank.
    ``hides_all_to_all``: its OVERLAP actions run one microbatch's expert all-to-all behind
    another's compute (without experts it is the schedule it interleaves like).
    """

    name: str
    make: Maker
    stages_per_rank: str
    placement: str
    interleaves: bool = False
    split_backward: bool = False
    one_rank: bool = False
    at_one_stage_per_rank: str | None = None
    hides_all_to_all: bool = False

    @property
    def v_shaped(self) -> bool:
        return self.stages_per_rank == "two"

    def native_stages_per_rank(self, asked: int) -> int:
        """The stages per rank it runs with where ``asked`` virtual stages are asked for:
        that many if it interleaves, 2 on the V, else 1."""
        if self.interleaves:
            return asked
        return 2 if self.v_shaped else 1

    def check(self, num_ranks: int, stages_per_rank: int,
              placement: str | Sequence[int] | None) -> tuple[int, ...] | None:
        """Its constraints on the sizes and the placement (a one-line ValueError); the
        resolved placement for schedules that take any (None for the others)."""
        check_count("stages_per_rank", stages_per_rank)
        name = self.name
        if self.one_rank and num_ranks != 1:
            raise ValueError(f"schedule {name!r} (no pipelining) runs on 1 rank, got "
                             f"num_ranks={num_ranks}; use schedule '1f1b' for {num_ranks} "
                             f"ranks")
        if self.stages_per_rank == "one":
            _require_one_stage_per_rank(name, stages_per_rank)
        if self.stages_per_rank == "two" and stages_per_rank not in (1, 2):
            raise ValueError(f"schedule {name!r} holds 2 stages per rank (V placement), not "
                             f"{stages_per_rank}")
        if self.placement == "any":
            return resolve_placement(placement, num_ranks, stages_per_rank)
        if self.placement == "v":
            _require_placement(name, placement, v_placement(num_ranks), "v")
        else:
            loop = loop_placement(num_ranks, stages_per_rank if self.interleaves else 1)
            _require_placement(name, placement, (0,) if self.one_rank else loop, "loop")
        return None


SCHEDULE_SPECS: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("none", lambda p, m, v, placed, fo: no_pipelining(m, forward_only=fo),
                 stages_per_rank="one", placement="loop", one_rank=True),
    ScheduleSpec("gpipe", lambda p, m, v, placed, fo: gpipe(p, m, placement=placed,
                                                            forward_only=fo),
                 stages_per_rank="any", placement="any"),
    ScheduleSpec("1f1b", lambda p, m, v, placed, fo: one_f_one_b(p, m, placement=placed,
                                                                 forward_only=fo),
                 stages_per_rank="any", placement="any"),
    ScheduleSpec("interleaved", lambda p, m, v, placed, fo: interleaved_1f1b(
        p, m, v, forward_only=fo), stages_per_rank="any", placement="loop", interleaves=True,
                 at_one_stage_per_rank="1f1b"),
    ScheduleSpec("zb-h1", lambda p, m, v, placed, fo: zb_h1(p, m, forward_only=fo),
                 stages_per_rank="one", placement="loop", split_backward=True),
    ScheduleSpec("zb-v", lambda p, m, v, placed, fo: zb_v(p, m, forward_only=fo),
                 stages_per_rank="two", placement="v", split_backward=True),
    ScheduleSpec("dualpipe-v", lambda p, m, v, placed, fo: dualpipe_v(p, m, forward_only=fo),
                 stages_per_rank="two", placement="v", split_backward=True),
    ScheduleSpec("combined-1f1b", lambda p, m, v, placed, fo: combined_1f1b(
        p, m, v, forward_only=fo), stages_per_rank="any", placement="loop", interleaves=True,
                 hides_all_to_all=True),
)}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_SPECS)


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule ``name``; a one-line ValueError listing the names otherwise."""
    spec = SCHEDULE_SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return spec


def build(name: str, num_ranks: int, num_microbatches: int, *, stages_per_rank: int = 1,
          placement: str | Sequence[int] | None = None, forward_only: bool = False) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``).

    ``placement`` is a name ("loop", "v", "wraparound") or an explicit stage -> rank
    sequence; only "gpipe" and "1f1b" take arbitrary placements, the others run on their
    own ("interleaved" and "combined-1f1b" on loop with ``stages_per_rank``, "zb-v" and
    "dualpipe-v" on V). "combined-1f1b" with stages_per_rank > 1 is combined interleaved.
    """
    spec = schedule_spec(name)
    placed = spec.check(num_ranks, stages_per_rank, placement)
    return spec.make(num_ranks, num_microbatches, stages_per_rank, placed, forward_only)
