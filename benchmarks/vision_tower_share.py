"""A vision-language model's training step over tensor- or context-parallel ranks, against
the same step of another source tree: what sharing the tower's images out saves.

    python benchmarks/vision_tower_share.py --trees now=src before=/tmp/before/src

A random Qwen2-VL with a tower heavier than its decoder (decoder 64 x 2, tower 256 x 6,
224-pixel images: 256 patches each, 1-2 a caption, packed into 512 tokens) trains
``--steps`` steps under ``meshpipe train`` on CPU processes of one thread each, once per
layout and tree in a round, the trees' order alternating between rounds; a run's time is
the median of its steps after the first (``metrics.jsonl``'s ``step_seconds``). Each tree
is a ``src`` folder put first on ``PYTHONPATH`` (make one of another commit with ``git
worktree add``). Results in ``results/vision_tower_share.{md,json}``; a benchmark records
figures, it never asserts them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gpu_bench_vision import vision_model  # noqa: E402
from harness import RESULTS, load_average, paired_ratios, write_results  # noqa: E402

LAYOUTS = {"tp2": ("--tp", "2"), "ring2": ("--cp-ring", "2")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=["now=src"], metavar="NAME=SRC")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def model_and_data(scratch: Path) -> tuple[Path, Path]:
    from meshpipe.train.data.shapes import write_shapes_corpus

    sizes = argparse.Namespace(dim=64, layers=2, heads=4, kv_heads=2, vision_dim=256,
                               vision_depth=6, image=224)
    model = vision_model(sizes, scratch / "model")
    data = write_shapes_corpus(scratch / "shapes", 64, min_images=1, max_images=2,
                               sizes=((224, 224),))
    return model, data


def step_seconds(tree: Path, layout: tuple[str, ...], model: Path, data: Path,
                 out: Path, steps: int) -> float:
    """The median step of one ``meshpipe train`` run with ``tree`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "meshpipe", "train", "--model", str(model), "--data",
               str(data), "--pack", "--seq-len", "512", "--microbatches", "2",
               "--microbatch-size", "1", "--steps", str(steps), "--pp", "1", *layout,
               "--eval-every", "0", "--no-progress", "--out-dir", str(out)]
    subprocess.run(command, env=env, check=True, capture_output=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [record["step_seconds"] for record in records if "step_seconds" in record]
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = dict(tree.split("=", 1) for tree in args.trees)
    scratch = Path(tempfile.mkdtemp(prefix="meshpipe-vision-tower-share-"))
    model, data = model_and_data(scratch)
    load_before = load_average()
    seconds: dict[str, dict[str, list[float]]] = {
        layout: {name: [] for name in trees} for layout in args.layouts}
    for round_number in range(args.rounds):
        order = list(trees) if round_number % 2 == 0 else list(reversed(trees))
        for layout in args.layouts:
            for name in order:
                run = scratch / f"run-{layout}-{name}-{round_number}"
                seconds[layout][name].append(step_seconds(
                    Path(trees[name]), LAYOUTS[layout], model, data, run, args.steps))
                print(f"round {round_number} {layout} {name}: "
                      f"{seconds[layout][name][-1]:.3f} s", flush=True)
    names = list(trees)
    lines = ["# A vision-language step with the tower's images shared out, by source tree", "",
             "Qwen2-VL-like: decoder 64 x 2, tower 256 x 6, 224 px images (1-2 a caption), "
             f"packed 512 tokens, 2 microbatches of 1, fp32, pp 1, CPU processes of one "
             f"thread; median step of {args.steps - 1} after the first, per run; "
             f"{args.rounds} rounds. Load {load_before} before, {load_average()} after.", "",
             "| layout | " + " | ".join(f"{name} s (rounds)" for name in names)
             + (f" | {names[0]} / {names[1]} by round |" if len(names) > 1 else " |"),
             "|---|" + "---|" * len(names) + ("---|" if len(names) > 1 else "")]
    for layout in args.layouts:
        cells = [", ".join(f"{value:.3f}" for value in seconds[layout][name])
                 for name in names]
        if len(names) > 1:
            ratios = paired_ratios(seconds[layout][names[0]], seconds[layout][names[1]])
            cells.append(", ".join(f"{ratio:.2f}" for ratio in ratios))
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    json_path, md_path = write_results(args.out, "vision_tower_share",
                                       {"trees": trees, "seconds": seconds,
                                        "args": vars(args) | {"out": str(args.out)}}, table)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
