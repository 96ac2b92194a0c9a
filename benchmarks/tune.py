"""How well ``meshpipe tune`` predicts: its top picks' predicted step time against the
step time ``meshpipe train`` measures for them on this machine.

    .venv/bin/python benchmarks/tune.py                # about 2-3 min on 2 cores
    .venv/bin/python benchmarks/tune.py --picks 5 --steps 10 --dim 256

It tunes the reference transformer for ``--world-size`` processes (``meshpipe.train.tune``:
a short measured run of its base layout, then every layout simulated), then trains each of
the ``--picks`` fastest predicted layouts (skipping a layout that only renames the schedule
of an earlier pick at the same predicted time) with ``meshpipe.train.run`` (local gloo processes,
one thread each) for ``--steps`` steps and takes the median step time over the steps after
the first two (``metrics.json``: rank 0's step time, data to optimizer step). The ratio
measured / predicted is the figure; the goal is within 10 %. The base layout's own
measurement is in the JSON too (the tuner is fitted to it, so it predicts that one best).

Writes ``<out>/tune.json`` and ``<out>/tune.md`` (default ``benchmarks/results``).
Benchmarks print and record; they never assert a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from common import load_average

from meshpipe.schedules.tune import Prediction, table
from meshpipe.train.config import TrainConfig
from meshpipe.train.trainer import run
from meshpipe.train.tune import config_for, tune

WARMUP_STEPS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--picks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
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


def compare_pick(place: int, prediction: Prediction, base: TrainConfig) -> dict:
    config = config_for(prediction.layout, base)
    measured = measured_step_s(config)
    row = {"rank": place, **asdict(prediction.layout),
           "predicted_ms": 1000 * prediction.step_s,
           "predicted_pipeline_ms": 1000 * prediction.pipeline_s,
           "measured_ms": 1000 * measured, "ratio": measured / prediction.step_s}
    print(row, flush=True)
    return row


def to_markdown(rows: list[dict]) -> str:
    lines = ["| rank | layout | predicted step | measured step | measured / predicted |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for row in rows:
        layout = (f"pp {row['pp']}, vpp {row['vpp']}, dp {row['dp']}, cp {row['cp']}, "
                  f"{row['microbatches']} x {row['microbatch_size']}, {row['schedule']}")
        lines.append(f"| {row['rank']} | {layout} | {row['predicted_ms']:.1f} ms | "
                     f"{row['measured_ms']:.1f} ms | {row['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


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
    rows = [compare_pick(place, prediction, base)
            for place, prediction in distinct_picks(result.predictions, args.picks)]
    markdown = to_markdown(rows)
    print(markdown)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(
        {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
         "load_average": {"before": load_before, "after": load_average()},
         "arguments": {k: str(v) for k, v in vars(args).items()},
         "measurement": asdict(result.measurement), "profile": asdict(result.profile),
         "tuner_table": ranking, "picks": rows}, indent=2))
    (args.out / "tune.md").write_text(f"Tuner's top {args.picks}:\n\n{ranking}\n"
                                      f"Predicted vs measured:\n\n{markdown}")
    print(f"wrote {args.out / 'tune.json'} and .md")


if __name__ == "__main__":
    main()
