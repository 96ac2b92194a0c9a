"""--compile against eager on CPU: the first step (which compiles), the median step after it,
and the --check of the compiled step against one eager process, under pp 1, 1F1B and ZB-V.

    .venv/bin/python benchmarks/compile.py                   # ~4 min on 2 cores
    .venv/bin/python benchmarks/compile.py --dim 512 --steps 8

Each case trains the reference transformer on ``pp`` local gloo processes (one thread each)
through ``Trainer`` with inductor, torch's default compile backend (C++ code for CPU).
Inductor's on-disk cache is pointed at a fresh directory per run, so the first step's time
includes compiling; within a run, later cases of the same shapes reuse what earlier ones
compiled, as a second run would. ZB-V's weight half runs a compiled region's backward
again (docs/parallelism.md), which the step time shows.

Writes ``<out>/compile.json`` and ``.md`` (default ``benchmarks/results``). Benchmarks print
and record; they never assert a time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness import join_ranks, load_average, report, spawn_ranks, write_results
from meshpipe.train.config import TrainConfig

# (pp, schedule, compile)
CASES = [(1, "none", False), (1, "none", True), (2, "1f1b", False), (2, "1f1b", True),
         (2, "zb-v", False), (2, "zb-v", True)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def measure(rank: int, world_size: int, init_file: str, result_file: str,
            config: TrainConfig) -> None:
    torch.set_num_threads(1)
    join_ranks(rank, world_size, init_file)
    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    start = time.perf_counter()
    check = trainer.check_first_step()
    first = time.perf_counter() - start
    seconds = [trainer.train_step(step).seconds for step in range(config.steps)]
    if rank == 0:
        report(result_file, {"first_step_s": first, "median_step_ms":
                             1000 * statistics.median(seconds[1:]),
                             "check_passed": check["passed"],
                             "max_grad_difference": check["max_grad_difference"]})


def markdown(rows: list[dict], args: argparse.Namespace, loads: list) -> str:
    lines = [f"# --compile vs eager ({platform.machine()}, torch {torch.__version__}, CPU, "
             "gloo, inductor)", "",
             f"Reference transformer dim {args.dim}, {args.layers} layers, seq-len "
             f"{args.seq_len}, 4 microbatches of 2; {args.steps} steps, median after the "
             f"first. Load average before {loads[0]}, after {loads[1]}.", "",
             "| pp | schedule | compile | first step s | step ms | vs eager | --check "
             "(largest gradient diff) |",
             "| ---: | --- | --- | ---: | ---: | ---: | --- |"]
    eager = {(r["pp"], r["schedule"]): r["median_step_ms"] for r in rows if not r["compile"]}
    for r in rows:
        ratio = r["median_step_ms"] / eager[(r["pp"], r["schedule"])]
        verdict = "pass" if r["check_passed"] else "FAIL"
        lines.append(f"| {r['pp']} | {r['schedule']} | {'yes' if r['compile'] else 'no'} | "
                     f"{r['first_step_s']:.1f} | {r['median_step_ms']:.1f} | {ratio:.2f}x | "
                     f"{verdict} ({r['max_grad_difference']:.1e}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshpipe-inductor-")
    rows = []
    loads = [load_average()]
    for pp, schedule, compiled in CASES:
        config = TrainConfig(pp=pp, schedule=schedule, compile=compiled, dim=args.dim,
                             layers=args.layers, heads=8, seq_len=args.seq_len,
                             microbatches=4, microbatch_size=2, steps=args.steps,
                             warmup_steps=1, eval_every=0, timeline_step=0, progress=False,
                             out_dir=tempfile.mkdtemp())
        measured = spawn_ranks(measure, config.world_size, config)
        rows.append({"pp": pp, "schedule": schedule, "compile": compiled, **measured})
        print(rows[-1], flush=True)
    loads.append(load_average())
    table = markdown(rows, args, loads)
    print(table)
    write_results(args.out, "compile", {"rows": rows, "load_average": loads, "args": {
        key: str(value) for key, value in vars(args).items()}}, table)


if __name__ == "__main__":
    main()
