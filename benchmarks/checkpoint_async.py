"""How long a checkpoint stops training: synchronous saves against ``--checkpoint-async``
ones of the same state, on one CPU process.

    python benchmarks/checkpoint_async.py [--dim 1024] [--layers 4] [--rounds 3]

The reference transformer of the given sizes (default about 50M parameters: with AdamW's two
moments, 0.6 GB of state) trains a step, then its checkpoint is saved synchronously and in
the background, ``--rounds`` times each (in that order: the step taken during the background
write changes the state, so it comes after both saves). Recorded per save: the time training
was blocked (a synchronous save's whole write; a background one's snapshot into host
memory), the background write's own time, and the time of a training step taken while the
write goes on against one without. The two saves of a round are of the same state and their
files are compared tensor by tensor. Results in ``results/checkpoint_async.{md,json}``; a
benchmark records times, it never asserts them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu_bench import _one_rank_world
from harness import write_results
from meshpipe.train.checkpoints.store import Checkpointer, complete_checkpoints, read_tensors
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-save", action="store_true")
    return parser.parse_args(argv)


def checkpointer(trainer: Trainer, root: Path, background: bool) -> Checkpointer:
    """A second checkpointer of the trainer's state, writing under ``root``."""
    own = trainer.checkpointer
    return Checkpointer(root, own.parameters, own.optimizer, own.tp_group, own.scaler,
                        config=own.config, run_id="bench", keep=1, patience=600.0,
                        buckets=own.buckets, background=background)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp(prefix="meshpipe-checkpoint-async-"))
    _one_rank_world(torch.device("cpu"))
    config = TrainConfig(pp=1, schedule="none", dim=args.dim, layers=args.layers, heads=8,
                         kv_heads=8, seq_len=128, microbatches=2, microbatch_size=1,
                         steps=1000, eval_every=0, timeline_step=0, progress=False,
                         out_dir=str(scratch / "run"))
    trainer = Trainer(config)
    trainer.train_step(0)
    state_bytes = sum(p.numel() * 4 * 3 for _, p in trainer.parameters)
    saves = {"sync": checkpointer(trainer, scratch / "sync", False),
             "async": checkpointer(trainer, scratch / "async", True)}
    rows: dict[str, list[dict]] = {"sync": [], "async": []}
    quiet_steps, step = [], 1
    for _ in range(args.rounds):
        for name in ("sync", "async"):  # the same state: the step below comes after both
            start = time.perf_counter()
            saves[name].save(step)
            blocked = time.perf_counter() - start
            row = {"blocked_s": blocked}
            if name == "async":
                begun = time.perf_counter()
                trainer.train_step(step)  # a step while the write goes on
                row["step_during_write_s"] = time.perf_counter() - begun
                saves[name].finish()
                row["background_s"] = time.perf_counter() - start
            rows[name].append(row)
        equal = _same_files(scratch, step)
        rows["async"][-1]["files_equal_sync"] = equal
        begun = time.perf_counter()
        trainer.train_step(step + 1)  # a step without a write
        quiet_steps.append(time.perf_counter() - begun)
        step += 2
    result = {"args": vars(args), "state_gb": state_bytes / 1e9, "rows": rows,
              "quiet_step_s": quiet_steps}
    table = to_markdown(result)
    print(table)
    if not args.no_save:
        write_results(RESULTS, "checkpoint_async", result, table)
    return 0


def _same_files(scratch: Path, step: int) -> bool:
    """Whether the synchronous and the background checkpoint of ``step`` hold equal tensors."""
    found = [next(info for info in complete_checkpoints(scratch / name) if info.step == step)
             for name in ("sync", "async")]
    ours, theirs = (read_tensors(info.directory) for info in found)
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def to_markdown(result: dict) -> str:
    sync, background = result["rows"]["sync"], result["rows"]["async"]
    median = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
    return "\n".join([
        "# Checkpoints: synchronous against --checkpoint-async", "",
        f"One CPU process, the reference transformer of dim {result['args']['dim']} x "
        f"{result['args']['layers']} layers: {result['state_gb']:.2f} GB of state (weights "
        f"and AdamW's moments); {len(sync)} saves of each kind; medians.", "",
        "| save | training blocked s | background write s | step during the write s |",
        "|---|---:|---:|---:|",
        f"| synchronous | {median(sync, 'blocked_s'):.3f} | - | - |",
        f"| background | {median(background, 'blocked_s'):.3f} | "
        f"{median(background, 'background_s'):.3f} | "
        f"{median(background, 'step_during_write_s'):.3f} |", "",
        f"A step without a write: {statistics.median(result['quiet_step_s']):.3f} s. Blocked "
        f"time of a background save: "
        f"{median(background, 'blocked_s') / median(sync, 'blocked_s'):.1%} of a synchronous "
        f"save's. Files of each round's two saves equal: "
        f"{all(row['files_equal_sync'] for row in background)}."])


if __name__ == "__main__":
    sys.exit(main())
