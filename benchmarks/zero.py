"""--zero 0/1/2 at dp 1, 2 and 4 (and pp 2 x dp 2): weight, optimizer-state and gradient
bytes per rank beside the memory model's prediction, peak resident memory, and the step time
(``--dtype bf16``: bfloat16 weights with float32 masters, sharded at --zero 1/2).

    .venv/bin/python benchmarks/zero.py                  # ~3 min on 2 cores
    .venv/bin/python benchmarks/zero.py --dim 512 --steps 8

Each case trains the reference transformer on ``pp x dp`` local gloo processes (one thread
each) through ``Trainer`` and measures on rank 0:

- weight bytes: the weights the stages compute with, plus (bf16) the float32 masters or the
  shard of them a rank keeps;
- state bytes: the AdamW moments the rank's optimizer holds (every state tensor's bytes),
  per parameter of the model, beside ``schedules.ranking.state_bytes``'s share for them
  (8 B whole, 8/dp B sharded);
- gradient bytes: what the rank holds once a step's gradients are reduced (the whole
  gradients, or its shard pieces: 4 B or 4/dp B per parameter);
- peak resident memory (``ru_maxrss``) of the rank after the steps, which also holds the
  weights, activations, torch and the data;
- the median step time over the steps after the first; ``overlap no`` reduces every bucket
  after the pipeline step (the order before buckets started in each stage's last backward;
  with pp 1 there is one stage, so overlap has little to hide behind; at pp 2, 1F1B, the
  last stage's buckets reduce while the first stage runs its last backwards).

Writes ``<out>/zero.json`` and ``.md`` (default ``benchmarks/results``). Benchmarks print
and record; they never assert a time.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import tempfile
from pathlib import Path

import torch

from harness import join_ranks, load_average, report, spawn_ranks, write_results
from meshpipe.schedules.ranking import (GRADIENT_BYTES, LOW_PRECISION_WEIGHT_BYTES,
                                       MASTER_BYTES, MOMENT_BYTES, WEIGHT_BYTES)
from meshpipe.train.config import TrainConfig

# (pp, dp, zero, overlap)
CASES = [(1, 1, 0, True), (1, 2, 0, False), (1, 2, 0, True), (1, 2, 1, True), (1, 2, 2, True),
         (1, 4, 0, True), (1, 4, 1, True), (1, 4, 2, True), (2, 2, 0, False), (2, 2, 0, True),
         (2, 2, 1, True), (2, 2, 2, True)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: bfloat16 weights with float32 masters, sharded under "
                             "--zero 1/2 (written to zero_bf16.*)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def _held_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(rank: int, world_size: int, init_file: str, result_file: str, config: TrainConfig,
            overlap: bool) -> None:
    torch.set_num_threads(1)
    join_ranks(rank, world_size, init_file)
    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    trainer._overlap = overlap
    gradients = trainer.gradients
    parameters = sum(p.numel() for p in gradients.params)
    seconds = []
    for step in range(config.steps):
        seconds.append(trainer.train_step(step).seconds)
    trainer._run(trainer.executor, trainer.train_data, config.steps)
    gradients.reduce()
    gradient_bytes = _held_bytes(p.grad for p in gradients.held)
    if gradients.sharded:  # zero 1 keeps the whole gradients besides the reduced shards
        gradient_bytes += _held_bytes(p.grad for p in gradients.params)
    state_bytes = _held_bytes(state[key] for state in trainer.optimizer.state.values()
                              for key in ("exp_avg", "exp_avg_sq"))
    if rank == 0:
        report(result_file, {
            "parameters": parameters, "state_bytes": state_bytes,
            "gradient_bytes": gradient_bytes, "weight_bytes": _weight_bytes(trainer),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "median_step_ms": 1000 * statistics.median(seconds[1:])})


def _weight_bytes(trainer) -> int:
    """The weights the stages compute with, their float32 masters where they have their own
    (``--dtype bf16``: whatever memory the masters still hold) and the masters' shards the
    gradient buckets keep (under ``--zero 1/2``)."""
    model = {id(p): p for stage in trainer.stages.values() for p in stage.module.parameters()}
    masters = [m for _, m in trainer.parameters if id(m) not in model]
    return (_held_bytes(model.values()) + sum(m.untyped_storage().nbytes() for m in masters)
            + sum(4 * bucket.shard_numel for bucket in trainer.gradients.buckets
                  if bucket.owns_values))


def _predicted_weight_bytes(dtype: str, replicas: int) -> float:
    """fp32: the weights; bf16: bfloat16 weights and float32 masters (a shard of them each
    under --zero 1/2)."""
    if dtype == "fp32":
        return WEIGHT_BYTES
    return LOW_PRECISION_WEIGHT_BYTES + MASTER_BYTES / replicas


def row(pp: int, dp: int, zero: int, overlap: bool, measured: dict, dtype: str) -> dict:
    replicas = dp if zero else 1
    parameters = measured["parameters"]
    return {"pp": pp, "dp": dp, "zero": zero, "overlap": overlap, **measured,
            "weight_bytes_per_parameter": measured["weight_bytes"] / parameters,
            "predicted_weight_bytes_per_parameter": _predicted_weight_bytes(dtype, replicas),
            "state_bytes_per_parameter": measured["state_bytes"] / parameters,
            "predicted_state_bytes_per_parameter": MOMENT_BYTES / replicas,
            "gradient_bytes_per_parameter": measured["gradient_bytes"] / parameters,
            "predicted_gradient_bytes_per_parameter": GRADIENT_BYTES * (
                1 + 1 / replicas if zero == 1 else 1 / replicas)}


def markdown(rows: list[dict], args: argparse.Namespace, loads: list) -> str:
    lines = [f"# --zero 0/1/2: memory and step time ({platform.machine()}, torch "
             f"{torch.__version__}, CPU, gloo, --dtype {args.dtype})", "",
             f"Reference transformer dim {args.dim}, {args.layers} layers, seq-len "
             f"{args.seq_len}; {args.steps} steps, median after the first; bytes of rank 0's "
             f"stage. Load average before {loads[0]}, after {loads[1]}.", "",
             "| pp | dp | zero | overlap | weight B/param (predicted) | state B/param "
             "(predicted) | gradient B/param (predicted) | peak RSS MiB | step ms |",
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['pp']} | {r['dp']} | {r['zero']} | {'yes' if r['overlap'] else 'no'} | "
            f"{r['weight_bytes_per_parameter']:.3f} "
            f"({r['predicted_weight_bytes_per_parameter']:.3f}) | "
            f"{r['state_bytes_per_parameter']:.3f} ({r['predicted_state_bytes_per_parameter']:.3f})"
            f" | {r['gradient_bytes_per_parameter']:.3f} "
            f"({r['predicted_gradient_bytes_per_parameter']:.3f}) | {r['peak_rss_mib']:.0f} | "
            f"{r['median_step_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    loads = [load_average()]
    for pp, dp, zero, overlap in CASES:
        config = TrainConfig(pp=pp, schedule="1f1b" if pp > 1 else "none", dp=dp, zero=zero,
                             dim=args.dim,
                             layers=args.layers, heads=8, seq_len=args.seq_len,
                             microbatches=4, steps=args.steps, warmup_steps=1, eval_every=0,
                             timeline_step=0, progress=False, out_dir=tempfile.mkdtemp(),
                             dtype=args.dtype)
        measured = spawn_ranks(measure, config.world_size, config, overlap)
        rows.append(row(pp, dp, zero, overlap, measured, args.dtype))
        print(rows[-1], flush=True)
    loads.append(load_average())
    table = markdown(rows, args, loads)
    print(table)
    name = "zero" if args.dtype == "fp32" else f"zero_{args.dtype}"
    write_results(args.out, name, {"rows": rows, "load_average": loads, "args": {
        key: str(value) for key, value in vars(args).items()}}, table)


if __name__ == "__main__":
    main()
