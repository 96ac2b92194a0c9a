"""How well ``meshpipe tune`` predicts: its top picks' predicted step time against the
step time ``meshpipe train`` measures for them on this machine.

    .venv/bin/python benchmarks/tune_picks.py                # about 2-3 min on 2 cores
    .venv/bin/python benchmarks/tune_picks.py --picks 5 --steps 10 --dim 256

It tunes the reference transformer for ``--world-size`` processes (``meshpipe.train.tune.tuner``:
a short measured run of its base layout, then every layout simulated), then trains each of
the ``--picks`` fastest predicted layouts (skipping a layout that only renames the schedule
of an earlier pick at the same predicted time) with ``meshpipe.train.run`` (local gloo processes,
one thread each) for ``--steps`` steps and takes the median step time over the steps after
the first two (``metrics.json``: rank 0's step time, data to optimizer step). It does that
``--rounds`` times, every pick once per round (so a slow spell of the machine touches every
pick alike), and a pick's measured step is the median of its rounds. The ratio
measured / predicted is the figure; the goal is within 10 %.

The tuner's base layout (the one it measured and fitted to) is trained in the same rounds:
its measured / predicted says how far the machine moved between the tuner's run and the
benchmark's (the tuner predicts its base layout at what it measured).

Writes ``<out>/tune_picks.json`` and ``<out>/tune_picks.md`` (default ``benchmarks/results``).
Benchmarks print and record; they never assert a time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from harness import load_average, write_results

from meshpipe.schedules.ranking import Prediction, table
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import run
from meshpipe.train.tune.measure import config_for
from meshpipe.train.tune.tuner import tune

WARMUP_STEPS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--picks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def measured_step_s(config: TrainConfig) -> float:
    """Median step time of a short ``meshpipe train`` run, after the warm-up steps."""
    with tempfile.TemporaryDirectory(prefix="meshpipe-bench-tune-") as out_dir:
        metrics = run(replace(config, out_dir=out_dir))
    steady = [h["step_seconds"] for h in metrics["history"][WARMUP_STEPS:]]
    return statistics.median(steady)


def distinct_picks(predictions: list[Prediction], count: int) -> list[tuple[int, Prediction]]:
    """The first ``count`` predictions (with their places) that are not the same layout as an
    earlier pick under another schedule name with the same predicted step (with one
    microbatch GPipe, 1F1B and combined 1F1B are one order): measuring those again says
    nothing new."""
    picks: list[tuple[int, Prediction]] = []
    for place, prediction in enumerate(predictions, start=1):
        shape = replace(prediction.layout, schedule="")
        if any(replace(p.layout, schedule="") == shape and p.step_s == prediction.step_s
               for _, p in picks):
            continue
        picks.append((place, prediction))
        if len(picks) == count:
            break
    return picks


def measure_in_rounds(predictions: dict[str, Prediction], base: TrainConfig,
                      rounds: int) -> dict[str, list[float]]:
    """Each prediction's layout trained once per round, in turn; seconds per round."""
    seconds: dict[str, list[float]] = {name: [] for name in predictions}
    for round_ in range(rounds):
        for name, prediction in predictions.items():
            seconds[name].append(measured_step_s(config_for(prediction.layout, base)))
            print(f"round {round_ + 1}: {name}: {1000 * seconds[name][-1]:.1f} ms", flush=True)
    return seconds


def row_of(name: str, prediction: Prediction, seconds: list[float]) -> dict:
    measured = statistics.median(seconds)
    return {"rank": name, **asdict(prediction.layout),
            "predicted_ms": 1000 * prediction.step_s,
            "predicted_pipeline_ms": 1000 * prediction.pipeline_s,
            "rounds_ms": [1000 * s for s in seconds],
            "measured_ms": 1000 * measured, "ratio": measured / prediction.step_s}


def to_markdown(rows: list[dict]) -> str:
    lines = ["| rank | layout | predicted step | measured step | rounds | measured / predicted |",
             "| ---: | --- | ---: | ---: | --- | ---: |"]
    for row in rows:
        layout = (f"pp {row['pp']}, vpp {row['vpp']}, dp {row['dp']}, cp {row['cp']}, "
                  f"{row['microbatches']} x {row['microbatch_size']}, {row['schedule']}")
        rounds = ", ".join(f"{ms:.0f}" for ms in row["rounds_ms"])
        lines.append(f"| {row['rank']} | {layout} | {row['predicted_ms']:.1f} ms | "
                     f"{row['measured_ms']:.1f} ms | {rounds} | {row['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def base_prediction(result) -> Prediction:
    """The tuner's prediction for the layout it measured."""
    return next(p for p in result.predictions if p.layout == result.measurement.layout)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base = TrainConfig(dim=args.dim, layers=args.layers, heads=args.heads,
                       kv_heads=max(1, args.heads // 2), seq_len=args.seq_len,
                       microbatch_size=args.microbatch_size, microbatches=args.microbatches,
                       steps=args.steps, warmup_steps=1, eval_every=0, timeline_step=0,
                       progress=False)
    load_before = load_average()
    result = tune(base, args.world_size, None)
    ranking = table(result.predictions, args.picks)
    print(ranking, flush=True)
    picks = {str(place): prediction
             for place, prediction in distinct_picks(result.predictions, args.picks)}
    runs = {**picks, "base": base_prediction(result)}
    measured = measure_in_rounds(runs, base, args.rounds)
    rows = [row_of(name, prediction, measured[name]) for name, prediction in runs.items()]
    markdown = to_markdown(rows)
    print(markdown)
    json_path, _ = write_results(
        args.out, "tune_picks",
        {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
         "load_average": {"before": load_before, "after": load_average()},
         "arguments": {k: str(v) for k, v in vars(args).items()},
         "measurement": asdict(result.measurement), "profile": asdict(result.profile),
         "tuner_table": ranking, "picks": rows},
        f"Tuner's top {args.picks}:\n\n{ranking}\n"
        f"Predicted vs measured (median of {args.rounds} rounds; `base`: the layout the "
        f"tuner measured, at the step it measured):\n\n{markdown}")
    print(f"wrote {json_path} and .md")


if __name__ == "__main__":
    main()
