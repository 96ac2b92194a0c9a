"""Training step time by tensor parallelism and precision, and peak memory by recompute mode.

    .venv/bin/python benchmarks/train_tp_precision.py            # ~3-5 min on 2 cores
    .venv/bin/python benchmarks/train_tp_precision.py --steps 8 --dim 256

Part 1 trains the reference transformer with ``meshpipe.train.run`` (local gloo processes,
one thread each) for every combination of tensor parallelism (tp 1, tp 2) and precision
(fp32, bf16), at pp 1 and at pp 2, and reports the median step time over the steps after
the first (``metrics.json``). tp 2 uses twice the processes of tp 1, so on a 2-core machine
tp 2 at pp 2 runs 4 processes on 2 cores.

Part 2 runs one training step of a single process per recompute mode (none, full,
selective), each in a fresh interpreter, and reports the process's peak resident memory
(``ru_maxrss``) above the same process's memory just before the step, and the step time.
The model is sized so that activations dominate (long sequences, several microbatches held
by GPipe).

Writes ``<out>/train_tp_precision.json`` and ``.md`` (default ``benchmarks/results``).
Benchmarks print and record; they never assert a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from harness import write_results
from meshpipe.train.config import TrainConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--memory-seq-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def step_time_rows(args: argparse.Namespace) -> list[dict]:
    from meshpipe.train.loop.trainer import run

    rows = []
    base = TrainConfig(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.heads,
                       seq_len=args.seq_len, microbatches=args.microbatches, steps=args.steps,
                       warmup_steps=1, eval_every=0, timeline_step=0, progress=False)
    for pp in (1, 2):
        for tp in (1, 2):
            for dtype in ("fp32", "bf16"):
                with tempfile.TemporaryDirectory() as out_dir:
                    config = replace(base, pp=pp, tp=tp, dtype=dtype, out_dir=out_dir,
                                     schedule="1f1b" if pp > 1 else "none")
                    metrics = run(config)
                steady = [h["step_seconds"] for h in metrics["history"][1:]]
                row = {"pp": pp, "tp": tp, "dtype": dtype, "processes": config.world_size,
                       "step_ms": 1000 * statistics.median(steady),
                       "last_loss": metrics["history"][-1]["loss"]}
                print(row, flush=True)
                rows.append(row)
    return rows


_MEMORY_PROBE = r"""
import json, resource, sys, time, torch
from meshpipe.models import Transformer, TransformerConfig, causal_lm_loss
torch.set_num_threads(1)
seq, dim, layers, heads, microbatches, recompute = json.loads(sys.argv[1])
model = Transformer(TransformerConfig(dim=dim, n_layers=layers, n_heads=heads,
                                      max_seq_len=seq), recompute=recompute)
tokens = torch.randint(0, 256, (microbatches, 1, seq))
targets = torch.randint(0, 256, (microbatches, 1, seq))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
losses = [causal_lm_loss(model(t), y) / microbatches for t, y in zip(tokens, targets)]
sum(losses).backward()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_above_start_mib": (peak - before) / 1024, "step_s": seconds}))
"""


def memory_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    for recompute in ("none", "selective", "full"):
        spec = [args.memory_seq_len, args.dim, args.layers, args.heads, args.microbatches,
                recompute]
        done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, json.dumps(spec)],
                              capture_output=True, text=True, check=True)
        row = {"recompute": recompute, "seq_len": args.memory_seq_len,
               "microbatches_held": args.microbatches, **json.loads(done.stdout)}
        print(row, flush=True)
        rows.append(row)
    return rows


def to_markdown(steps: list[dict], memory: list[dict]) -> str:
    lines = ["| pp | tp | processes | fp32 step | bf16 step | bf16 / fp32 |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_key = {(r["pp"], r["tp"], r["dtype"]): r for r in steps}
    for pp, tp in sorted({(r["pp"], r["tp"]) for r in steps}):
        fp32, bf16 = by_key[(pp, tp, "fp32")], by_key[(pp, tp, "bf16")]
        lines.append(f"| {pp} | {tp} | {fp32['processes']} | {fp32['step_ms']:.0f} ms | "
                     f"{bf16['step_ms']:.0f} ms | {bf16['step_ms'] / fp32['step_ms']:.2f} |")
    lines += ["", "| recompute | peak memory above start | step |", "| --- | ---: | ---: |"]
    for row in memory:
        lines.append(f"| {row['recompute']} | {row['peak_above_start_mib']:.0f} MiB | "
                     f"{1000 * row['step_s']:.0f} ms |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    steps = step_time_rows(args)
    memory = memory_rows(args)
    table = to_markdown(steps, memory)
    print(table)
    json_path, _ = write_results(
        args.out, "train_tp_precision",
        {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
         "arguments": {k: str(v) for k, v in vars(args).items()},
         "step_times": steps, "recompute_memory": memory}, table)
    print(f"wrote {json_path} and .md")


if __name__ == "__main__":
    main()
