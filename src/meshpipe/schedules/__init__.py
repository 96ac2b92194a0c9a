"""Pipeline schedules as plain data: Python and numpy, nothing here imports torch."""

from meshpipe.schedules.actions import Action, Kind
from meshpipe.schedules.builders import SCHEDULES, build, gpipe, no_pipelining, one_f_one_b
from meshpipe.schedules.compare import Comparison, compare
from meshpipe.schedules.interleaved import combined_1f1b, interleaved_1f1b
from meshpipe.schedules.lowering import lower
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.zero_bubble import dualpipe_v, zb_h1, zb_v
from meshpipe.schedules.placement import (PLACEMENTS, loop_placement, resolve_placement,
                                          v_placement, wraparound_placement)
from meshpipe.schedules.costs import (RECOMPUTE_MODES, BackwardCostMismatch, CostModel,
                                      fit_costs, recompute_compute_fraction,
                                      recompute_memory_fraction)
from meshpipe.schedules.simulator import Simulation, SimulationDeadlock, simulate
from meshpipe.schedules.timeline import Timeline, TimedAction
from meshpipe.schedules.validation import ScheduleError, validate

__all__ = [
    "RECOMPUTE_MODES", "Action", "BackwardCostMismatch", "Comparison", "CostModel", "Kind", "PLACEMENTS",
    "SCHEDULES", "Schedule", "ScheduleError", "Simulation", "SimulationDeadlock", "TimedAction", "Timeline", "build",
    "combined_1f1b", "compare", "dualpipe_v", "gpipe", "interleaved_1f1b", "loop_placement",
    "fit_costs", "lower", "no_pipelining", "one_f_one_b", "recompute_compute_fraction",
    "recompute_memory_fraction", "resolve_placement", "simulate", "v_placement",
    "validate", "wraparound_placement", "zb_h1", "zb_v",
]
