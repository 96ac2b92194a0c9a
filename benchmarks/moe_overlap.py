"""Combined 1F1B vs 1F1B on mixture-of-experts models: step time, and how much of the
expert-parallel all-to-all wait co-scheduling hides.

    .venv/bin/python benchmarks/moe_overlap.py                  # ~4.5 min on 2 cores
    .venv/bin/python benchmarks/moe_overlap.py --compute-ms 20 --latency-factors 0.5,1,2
    .venv/bin/python benchmarks/moe_overlap.py --exchanges clone --real-latencies-ms 5
    .venv/bin/python benchmarks/moe_overlap.py --skip-real      # only the emulated part

Part 1 (real) trains the reference MoE transformer with ``meshpipe.train.run`` on local
gloo processes (one thread each), ``--moe-experts 4 --ep 2 --dp 2``, at pp 1 (2 processes)
and pp 2 x vpp 2 (4 processes on the 2 cores), and reports the median step time over the
steps after the first (``metrics.json``) of ``--repeats`` runs (alternating which schedule
runs first) for ``combined-1f1b`` against the same order without the pairing (``1f1b`` at
pp 1; ``interleaved`` at vpp 2, the order ``combined-1f1b`` pairs there). At pp 1 it also
runs with ``MESHPIPE_EMULATED_COMM_LATENCY_S`` set in the parent before the processes spawn
(``--real-latencies-ms``). The emulated latency is a floor: an exchange's result arrives
``max(L after its post, when the real all-to-all finished)``, so it adds at most
exchanges x L to a step (less where the real exchange already takes part of L); the table
shows what it added to each schedule against the runs without it, and the share of the
sequential run's added time that the combined run did not pay. Real step times on a
2-core machine move by 10-20 % from run to run (and between runs more than within one);
the JSON keeps every step and each run's median.

Part 2 (emulated, exact accounting) runs a toy sub-step module on 2 gloo processes with
meshpipe's Executor and Stage, pp 1, ``build("combined-1f1b", 1, m)`` against
``build("1f1b", 1, m)``. The module has ``--layers`` layers of: a compute piece, the
*dispatch* exchange, a compute piece, the *combine* exchange; then a final piece (so a
forward has 2N+1 pieces and 2N exchanges). A compute piece sleeps ``c`` (``--compute-ms``)
in forward and ``2c`` in backward (a custom autograd function), so compute costs are known
and use no CPU. The communication thread's emulated latency ``L``
(``comm_worker().latency_s``, set in each worker) is swept over ``--latency-factors`` x c.
Each ``--exchanges`` mode is one table: ``clone`` (the exchange is a local copy, so every
exchange waits exactly L: the exact accounting) and ``all-to-all`` (a real all-to-all of
equal halves between the two ranks on the communication thread; the ranks then also wait
for each other, and the wait is ``max(L, the real exchange)``). The total all-to-all wait
of a step is (exchanges posted, forward and backward) x L = m x 4N x L, and the hidden
share is

    (1F1B step - combined step) / total all-to-all wait.

At pp 1 combined 1F1B is "F0; (F1;B0); ...; (F(m-1);B(m-2)); B(m-1)": F0 and B(m-1) run
alone and hide nothing, so at most (m-1)/m of the wait can be hidden. Beside the measured
figures: the *runtime model* (the same alternation as ``co_schedule``, backward piece
first, each task waiting for its own exchange: no overhead, exact sleeps) and the
*simulator* (``meshpipe.schedules.simulate`` with ``CostModel(forward=(2N+1)c,
backward=(2N+1)2c, a2a=2N L)``, whose OVERLAP costs ``max(F + B, 2 a2a)``: the ideal of
perfect interleaving). ``trace_events()`` on rank 0 gives where the time went: the compute
pieces, the exposed waits (in OVERLAP actions and in the lone F0 / B(m-1)) and the rest;
and a second hidden share free of the sleeps' noise (a sleep overshoots by 0.1-1 ms, which
moves a step by tens of ms): 1 - exposed wait of the combined step / that of the 1F1B step.
With strict alternation an exchange of the backward travels during one forward piece (c)
and one of the forward during one backward piece (2c), so the runtime hides everything in
an OVERLAP while L <= c and exposes L - c per backward exchange beyond; the simulator's
``max(F + B, 2 a2a)`` does not see that limit.

Writes ``<out>/moe_overlap.json`` and ``.md`` (default ``benchmarks/results``). Benchmarks
print and record; they never assert a time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from harness import load_average, write_results
from moe_emulated import emulated_rows
from meshpipe.runtime.substeps import LATENCY_ENV
from meshpipe.train.config import TrainConfig

# ------------------------------------------------------------------------ arguments


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    # part 1
    parser.add_argument("--steps", type=int, default=6, help="real training steps per run")
    parser.add_argument("--real-latencies-ms", type=_floats, default=[2.0, 5.0],
                        help="emulated latencies of the real pp 1 runs (besides none)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per real schedule and latency (alternating order)")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--skip-vpp", action="store_true", help="only the pp 1 real layout")
    # part 2
    parser.add_argument("--layers", type=int, default=2, help="MoE layers of the toy module")
    parser.add_argument("--compute-ms", type=float, default=10.0,
                        help="forward sleep of one compute piece (backward: x --backward-factor)")
    parser.add_argument("--backward-factor", type=float, default=2.0)
    parser.add_argument("--latency-factors", type=_floats, default=[0, 0.25, 0.5, 1, 2],
                        help="emulated latencies as multiples of --compute-ms")
    parser.add_argument("--emulated-steps", type=int, default=5,
                        help="steps per schedule and latency; the first is dropped")
    parser.add_argument("--exchanges", type=lambda t: t.split(","),
                        default=["clone", "all-to-all"],
                        help="exchange modes of part 2, one table each: clone, all-to-all")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


# ------------------------------------------------------------------- part 1: real


REAL_LAYOUTS = (  # (pp, vpp, sequential counterpart of combined-1f1b)
    (1, 1, "1f1b"),
    (2, 2, "interleaved"),
)


def _exchanges_per_rank_step(config: TrainConfig) -> int:
    """Exchanges one rank posts in a step: dispatch + combine per MoE layer, forward and
    backward, per microbatch (the most loaded pipeline rank)."""
    from meshpipe.train.run.plan import build_schedule, layers_per_stage

    schedule = build_schedule(config)
    per_stage = layers_per_stage(config, schedule)
    moe_layers = [sum(1 for layer in range(start, start + count)
                      if layer % config.moe_every == 0)
                  for start, count in zip(_starts(per_stage), per_stage)]
    most = max(sum(moe_layers[s] for s in schedule.stages_of(r))
               for r in range(schedule.num_ranks))
    return 4 * most * config.microbatches


def _starts(counts: list[int]) -> list[int]:
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


def _run_with_latency(run, config: TrainConfig, latency: float) -> dict:
    """``run(config)`` in a temporary directory, its processes spawned with the emulated
    latency in their environment (read when ``meshpipe.runtime.substeps`` is imported)."""
    previous = os.environ.get(LATENCY_ENV)
    os.environ[LATENCY_ENV] = str(latency)
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            return run(replace(config, out_dir=out_dir))
    finally:
        if previous is None:
            os.environ.pop(LATENCY_ENV, None)
        else:
            os.environ[LATENCY_ENV] = previous


def real_rows(args: argparse.Namespace) -> list[dict]:
    from meshpipe.train.loop.trainer import run

    base = TrainConfig(dp=2, ep=2, moe_experts=4, microbatches=args.microbatches,
                       steps=args.steps, warmup_steps=1, eval_every=0, timeline_step=0,
                       progress=False)
    rows = []
    for pp, vpp, sequential in REAL_LAYOUTS[:1] if args.skip_vpp else REAL_LAYOUTS:
        # The emulated latencies only at pp 1: a 4-process run takes ~13 s on 2 cores.
        latencies = [0.0] + ([ms / 1000 for ms in args.real_latencies_ms if ms > 0]
                             if pp == 1 else [])
        for latency in latencies:
            row = {"pp": pp, "vpp": vpp, "dp": 2, "ep": 2, "latency_ms": 1000 * latency}
            steady: dict[str, list[float]] = {"sequential": [], "combined": []}
            run_medians: dict[str, list[float]] = {"sequential": [], "combined": []}
            for repeat in range(args.repeats):
                # Alternate which schedule runs first, so drifting load hits both alike.
                order = [sequential, "combined-1f1b"][::1 if repeat % 2 == 0 else -1]
                for schedule in order:
                    config = replace(base, pp=pp, vpp=vpp, schedule=schedule)
                    row["processes"] = config.world_size
                    row["exchanges_per_rank_step"] = _exchanges_per_rank_step(config)
                    row.setdefault("load_average_1min_before_runs", []).append(
                        (load_average() or [None])[0])
                    metrics = _run_with_latency(run, config, latency)
                    seconds = [h["step_seconds"] for h in metrics["history"][1:]]
                    key = "combined" if schedule == "combined-1f1b" else "sequential"
                    row[f"{key}_schedule"] = schedule
                    row[f"{key}_last_loss"] = metrics["history"][-1]["loss"]
                    steady[key] += [1000 * s for s in seconds]
                    run_medians[key].append(1000 * statistics.median(seconds))
            for key in steady:
                row[f"{key}_ms"] = statistics.median(steady[key])
                row[f"{key}_run_medians_ms"] = run_medians[key]
                row[f"{key}_steps_ms"] = steady[key]
            row["combined_over_sequential"] = row["combined_ms"] / row["sequential_ms"]
            print({k: v for k, v in row.items() if not k.endswith("steps_ms")}, flush=True)
            rows.append(row)
    for row in rows:  # what the latency added to each schedule, and what combined hid
        if row["latency_ms"] == 0:
            continue
        zero = next(r for r in rows if (r["pp"], r["vpp"], r["latency_ms"])
                    == (row["pp"], row["vpp"], 0.0))
        row["at_most_added_ms"] = row["exchanges_per_rank_step"] * row["latency_ms"]
        for key in ("sequential", "combined"):
            row[f"{key}_added_ms"] = row[f"{key}_ms"] - zero[f"{key}_ms"]
        row["added_hidden_share"] = (1 - row["combined_added_ms"] / row["sequential_added_ms"]
                                     if row["sequential_added_ms"] > 0 else None)
    return rows


# ------------------------------------------------------------ part 2: emulated network


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def to_markdown(real: list[dict], emulated: list[dict], args: argparse.Namespace) -> str:
    lines = []
    if real:
        lines += ["Real MoE model (`meshpipe.train.run`, dim 64, 4 layers all MoE, 4 experts "
                  f"top-1, dp 2, ep 2, {args.microbatches} microbatches of 2 x 64 tokens, "
                  f"median of steps 2..{args.steps}). Latency: the emulated floor L on every "
                  "exchange; added = step minus the same run without latency; at most = "
                  "exchanges per rank and step x L; hidden = 1 - combined added / "
                  "sequential added.", "",
                  "| pp x vpp | processes | L | sequential | sequential step | "
                  "combined-1f1b step | combined / sequential | added: sequential / "
                  "combined (at most) | hidden |",
                  "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in real:
            added = ("-" if r["latency_ms"] == 0 else
                     f"{r['sequential_added_ms']:.0f} / {r['combined_added_ms']:.0f} ms "
                     f"({r['at_most_added_ms']:.0f} ms)")
            lines.append(f"| {r['pp']} x {r['vpp']} | {r['processes']} | "
                         f"{r['latency_ms']:g} ms | {r['sequential_schedule']} | "
                         f"{_ms(r['sequential_ms'])} | {_ms(r['combined_ms'])} | "
                         f"{r['combined_over_sequential']:.2f} | {added} | "
                         f"{_pct(r.get('added_hidden_share'))} |")
        lines.append("")
    c, n, m = args.compute_ms, args.layers, args.microbatches
    for exchange in dict.fromkeys(r["exchange"] for r in emulated):
        rows = [r for r in emulated if r["exchange"] == exchange]
        how = ("a local copy: every exchange waits exactly L" if exchange == "clone" else
               "a real all-to-all between the 2 ranks: an exchange waits max(L, the "
               "all-to-all and the other rank)")
        lines += [f"Emulated slow network, exchange = {how}. Toy module: {n} layers "
                  f"({2 * n + 1} pieces, {2 * n} exchanges per forward), piece compute c = "
                  f"{c:g} ms forward / {c * args.backward_factor:g} ms backward (sleep), pp 1, "
                  f"{m} microbatches, median of steps 2..{args.emulated_steps}. Hidden = "
                  "(1F1B step - combined step) / all-to-all wait, the wait being exchanges "
                  f"x L (ceiling (m-1)/m = {100 * (m - 1) / m:.1f} %); 1F1B's measured wait "
                  "is rank 0's time spent waiting on exchanges (trace); hidden (trace) = 1 - "
                  "rank 0's exposed wait in the combined step / in the 1F1B step, free of "
                  "the noise of the sleeps.", "",
                  "| L | L / c | 1F1B step | combined step | all-to-all wait per step "
                  "(1F1B measured) | hidden (measured) | hidden (trace) | "
                  "hidden (runtime model) | hidden (simulator) |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['latency_ms']:g} ms | {r['latency_over_compute']:g} | "
                         f"{_ms(r['sequential_ms'])} | {_ms(r['combined_ms'])} | "
                         f"{_ms(r['total_wait_ms'])} ({_ms(r['sequential_rank0_exposed_ms'])}) | "
                         f"{_pct(r['hidden_share'])} | {_pct(r['hidden_share_trace'])} | "
                         f"{_pct(r['hidden_share_runtime_model'])} | "
                         f"{_pct(r['hidden_share_simulated'])} |")
        lines += ["", f"Where the combined step went ({exchange}; rank 0, trace_events; exposed "
                  "= waiting on an exchange's result; other = executor, autograd and "
                  "co-scheduling overhead, the loss), beside the models' combined step:", "",
                  "| L / c | compute pieces | exposed in OVERLAPs | exposed in F0 + B(m-1) | "
                  "other | combined step: runtime model / simulator |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['latency_over_compute']:g} | "
                         f"{_ms(r['combined_rank0_compute_ms'])} | "
                         f"{_ms(r['combined_rank0_exposed_overlap_ms'])} | "
                         f"{_ms(r['combined_rank0_exposed_alone_ms'])} | "
                         f"{_ms(r['combined_rank0_other_ms'])} | "
                         f"{_ms(r['combined_runtime_model_ms'])} / "
                         f"{_ms(r['combined_simulated_ms'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version(), "torch": torch.__version__,
               "load_average_before": load_average()}
    real = [] if args.skip_real else real_rows(args)
    machine["load_average_after_real"] = load_average()
    emulated = emulated_rows(args)
    machine["load_average_after"] = load_average()
    table = to_markdown(real, emulated, args)
    print(table)
    seconds = time.perf_counter() - started
    json_path, _ = write_results(
        args.out, "moe_overlap",
        {"machine": machine, "arguments": {k: str(v) for k, v in vars(args).items()},
         "benchmark_seconds": seconds, "real": real, "emulated": emulated}, table)
    print(f"wrote {json_path} and .md ({seconds:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
