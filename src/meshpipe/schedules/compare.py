"""Every schedule side by side: build and simulate each at the same sizes and costs.

``compare`` is what ``meshpipe schedule compare`` tabulates (``render.comparison_table``).
A schedule whose builder rejects the sizes stays in the comparison with the builder's
message as its reason; a schedule that a builder produces but that cannot run
(``ScheduleError``, e.g. a deadlock) is a bug and is raised, never tabulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshpipe.schedules.builders import SCHEDULES, build, schedule_spec
from meshpipe.schedules.costs import CostModel
from meshpipe.schedules.simulator import Simulation, simulate
from meshpipe.schedules.validation import ScheduleError

@dataclass(frozen=True)
class Comparison:
    """One schedule in a comparison: its simulation, or why it cannot run at these sizes."""

    name: str
    stages_per_rank: int
    simulation: Simulation | None
    reason: str | None = None

    @property
    def peak_activations(self) -> int | None:
        """The largest per-rank peak of live (stage, microbatch) pairs; None if not run."""
        return None if self.simulation is None else max(self.simulation.peak_activations)

    @property
    def peak_activation_memory(self) -> float | None:
        """The largest per-rank peak of ``activation_bytes`` (see ``compare``); None if not run."""
        if self.simulation is None or self.simulation.peak_activation_bytes is None:
            return None
        return max(self.simulation.peak_activation_bytes)

    def as_dict(self) -> dict[str, object]:
        """Plain values for JSON: sizes, makespan, bubbles, peaks, or the reason."""
        row: dict[str, object] = {"schedule": self.name, "stages_per_rank": self.stages_per_rank}
        if self.simulation is None:
            row["reason"] = self.reason
            return row
        simulation = self.simulation
        row.update(makespan=simulation.makespan, bubble_ratio=simulation.bubble_ratio,
                   bubble_ratios=list(simulation.bubble_ratios),
                   peak_activations=list(simulation.peak_activations))
        if simulation.peak_activation_bytes is not None:
            row["peak_activation_memory"] = list(simulation.peak_activation_bytes)
        return row


def compare(num_ranks: int, num_microbatches: int, *, stages_per_rank: int = 2,
            costs: CostModel | None = None, names: Sequence[str] | None = None,
            forward_only: bool = False) -> tuple[Comparison, ...]:
    """Build and simulate every schedule (or those in ``names``) at the same sizes.

    ``costs`` describe one rank's share of the model (one stage of a ``num_ranks``-stage
    split); ``activation_bytes`` defaults to 1, one microbatch's activations on that
    share; ``costs.with_recompute(mode)`` compares under activation recomputation (its
    memory is then in units of activations without recomputation); ``costs.a2a`` > 0 (an
    MoE model's expert-parallel all-to-all) is what the schedules with OVERLAP actions,
    combined-1f1b and dualpipe-v, hide behind compute. Each schedule runs
    ``costs.for_stages_of(schedule)`` (a schedule with v stages per rank: 1/v of them per
    stage), so makespans and activation memory compare like for like. Each schedule runs
    with its spec's ``native_stages_per_rank(stages_per_rank)`` stages per rank, the figure every
    row reports. A schedule whose builder (or the cost model)
    rejects the sizes is kept with the error message as its ``reason``, so one unsupported
    size never hides the others; a ``ScheduleError`` (a built schedule that cannot run) is
    raised with a note naming the schedule, and an unknown name is a ValueError.
    """
    chosen = SCHEDULES if names is None else tuple(names)
    unknown = [name for name in chosen if name not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; choose from {', '.join(SCHEDULES)}")
    costs = CostModel() if costs is None else costs
    if costs.activation_bytes is None:
        costs = replace(costs, activation_bytes=1.0)
    rows = []
    for name in chosen:
        count = schedule_spec(name).native_stages_per_rank(stages_per_rank)
        try:
            schedule = build(name, num_ranks, num_microbatches, stages_per_rank=count,
                             forward_only=forward_only)
            simulation = simulate(schedule, costs.for_stages_of(schedule))
        except ScheduleError as error:
            error.add_note(f"comparing schedule {name!r} with {num_ranks} ranks, "
                           f"{num_microbatches} microbatches, {count} stages per rank")
            raise
        except ValueError as error:
            rows.append(Comparison(name, count, None, str(error)))
            continue
        rows.append(Comparison(name, count, simulation))
    return tuple(rows)
