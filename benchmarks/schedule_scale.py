"""Schedule core at scale: time and memory to build, lower, validate and simulate.

    .venv/bin/python benchmarks/schedule_scale.py              # every case below
    .venv/bin/python benchmarks/schedule_scale.py --skip-large # leave out p=512/v=2/m=4096
    .venv/bin/python benchmarks/schedule_scale.py --no-memory  # times only (one pass)

For each case the phases run back to back on one schedule: ``build`` (compute actions),
``lower`` (insert SEND/RECV), ``validate`` (the lowered schedule), ``simulate`` (the compute
schedule under the default cost model, with its bubble and peak-activation sweeps) and
``simulate lowered`` (the same on the lowered schedule, about three times as many actions;
its figures are identical). ``total s`` is the first four phases (the issue's figure).
Times come from a pass without tracing, run in a fresh process whose peak resident memory
is ``peak RSS MiB`` (everything: the interpreter, numpy and the first four phases, with
the compute-only and the lowered schedule both held); peak memory per
phase (``tracemalloc``: Python objects and numpy arrays) from a second pass, because
tracing slows allocation-heavy code. Writes ``<out>/schedule_scale.json`` and
``schedule_scale.md`` (default ``benchmarks/results``). A benchmark prints and records; it
never asserts.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import platform
import resource
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness import write_results
from meshpipe.schedules.builders import build
from meshpipe.schedules.lowering import lower
from meshpipe.schedules import simulate
from meshpipe.schedules.validation import validate

PHASES = ("build", "lower", "validate", "simulate", "simulate lowered")
GOAL_PHASES = PHASES[:4]


@dataclass(frozen=True)
class Case:
    schedule: str
    ranks: int
    stages_per_rank: int
    microbatches: int

    @property
    def label(self) -> str:
        return (f"{self.schedule} p={self.ranks} v={self.stages_per_rank} "
                f"m={self.microbatches}")


CASES = (
    Case("1f1b", 64, 1, 512),
    Case("zb-h1", 64, 1, 512),
    Case("interleaved", 64, 2, 512),
    Case("zb-v", 64, 2, 512),
    Case("interleaved", 512, 2, 4096),
)
LARGE = CASES[-1]


def run_phases(case: Case, measure: Callable[[str, Callable[[], object]], object]) -> dict:
    """Run the phases through ``measure(phase, work)``; return what the run produced."""
    schedule = measure("build", lambda: build(case.schedule, case.ranks, case.microbatches,
                                              stages_per_rank=case.stages_per_rank))
    lowered = measure("lower", lambda: lower(schedule))
    measure("validate", lambda: validate(lowered))

    def simulate_and_sweep(target):
        simulation = simulate(target)
        return simulation, simulation.bubble_ratio, simulation.peak_activations

    simulation, bubble, peaks = measure("simulate", lambda: simulate_and_sweep(schedule))
    del simulation
    simulation, bubble, peaks = measure("simulate lowered", lambda: simulate_and_sweep(lowered))
    return {
        "compute_actions": sum(len(actions) for actions in schedule.ranks),
        "lowered_actions": sum(len(actions) for actions in lowered.ranks),
        "makespan": simulation.makespan,
        "bubble_ratio": bubble,
        "peak_activations_rank0": peaks[0],
    }


def timed_pass(case: Case) -> tuple[dict[str, float], dict, float]:
    """Phase times, what the run produced, and the process's peak resident MiB up to the
    end of the first four phases (``simulate lowered`` comes after)."""
    seconds: dict[str, float] = {}
    peak_rss: list[float] = []

    def measure(phase: str, work: Callable[[], object]) -> object:
        gc.collect()
        start = time.perf_counter()
        result = work()
        seconds[phase] = time.perf_counter() - start
        if phase == GOAL_PHASES[-1]:
            peak_rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return result

    produced = run_phases(case, measure)
    return seconds, produced, peak_rss[0]


def timed_pass_in_fresh_process(case: Case) -> tuple[dict[str, float], dict, float]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(timed_pass, (case,))


def memory_pass(case: Case) -> dict[str, float]:
    """Per phase, its peak traced memory (MiB) above what earlier phases still hold; and
    ``total``, the highest traced memory of the whole run."""
    peaks: dict[str, float] = {"total": 0.0}

    def measure(phase: str, work: Callable[[], object]) -> object:
        gc.collect()
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = work()
        peak = tracemalloc.get_traced_memory()[1]
        peaks[phase] = (peak - before) / 2**20
        peaks["total"] = max(peaks["total"], peak / 2**20)
        return result

    tracemalloc.start()
    try:
        run_phases(case, measure)
    finally:
        tracemalloc.stop()
    return peaks


def markdown(results: list[dict], with_memory: bool) -> str:
    header = ["case", "actions (lowered)", *(f"{p} s" for p in PHASES), "total s",
              "peak RSS MiB"]
    if with_memory:
        header += [f"{p} MiB" for p in PHASES] + ["peak MiB"]
    header += ["bubble"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for result in results:
        seconds = result["seconds"]
        cells = [result["case"], f"{result['lowered_actions']:,}",
                 *(f"{seconds[p]:.2f}" for p in PHASES),
                 f"{sum(seconds[p] for p in GOAL_PHASES):.2f}", f"{result['peak_rss_mib']:.0f}"]
        if with_memory:
            memory = result["memory_mib"]
            cells += [f"{memory[p]:.0f}" for p in PHASES] + [f"{memory['total']:.0f}"]
        cells.append(f"{100 * result['bubble_ratio']:.2f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-large", action="store_true",
                        help=f"leave out {LARGE.label} (about a minute with tracing)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the tracemalloc pass (times only)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = [c for c in CASES if not (args.skip_large and c == LARGE)]
    results = []
    for case in cases:
        print(f"{case.label}: timing ...", flush=True)
        seconds, produced, peak_rss = timed_pass_in_fresh_process(case)
        result = {"case": case.label, **case.__dict__, **produced, "seconds": seconds,
                  "peak_rss_mib": peak_rss}
        print("  " + ", ".join(f"{p} {seconds[p]:.2f} s" for p in PHASES)
              + f"; {produced['lowered_actions']:,} lowered actions; peak RSS "
              f"{peak_rss:.0f} MiB", flush=True)
        if not args.no_memory:
            print(f"{case.label}: tracing memory ...", flush=True)
            result["memory_mib"] = memory_pass(case)
            print("  " + ", ".join(f"{p} {result['memory_mib'][p]:.0f} MiB" for p in PHASES)
                  + f"; peak {result['memory_mib']['total']:.0f} MiB", flush=True)
        results.append(result)
    table = markdown(results, with_memory=not args.no_memory)
    print()
    print(table)
    environment = {"python": sys.version.split()[0], "platform": platform.platform(),
                   "processor": platform.processor() or platform.machine()}
    paths = write_results(
        args.out, "schedule_scale", {"environment": environment, "results": results},
        f"Schedule core at scale ({environment['python']}, {environment['platform']}); "
        f"seconds and peak RSS from an untraced pass in a fresh process (total: build, "
        f"lower, validate and simulate), MiB per phase from a tracemalloc pass.\n\n{table}")
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
