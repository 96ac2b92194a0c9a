"""Ops a training step dispatches, meshpipe's trainer against a plain PyTorch loop.

    python benchmarks/step_ops.py                     # CPU, dim 64 x 4 layers, fp32 and bf16
    python benchmarks/step_ops.py --device cuda --dim 2048 --layers 16 --seq-len 2048

On a GPU an eager step is bound by the host launching kernels (``docs/gpu.md``), and every
op that computes is at least one launch. This counts the aten ops of one training step
(``TorchDispatchMode``, so it runs the same on a CPU): all of them, and those that compute
(views and ``detach`` launch nothing), with the ten most frequent, per runner and
precision. Runners: meshpipe's trainer (one stage, 1F1B, gradient clipping, AdamW;
``--dtype bf16`` is bfloat16 weights with float32 masters), with its projections apart and
joint (``--joint-projections``, what CUDA runs by default), in bf16 also with the
gradient accumulation fused (``--grad-accumulation-fusion``, on by default on CUDA: on a
CPU each fused product casts its two operands to float32, ``_to_copy`` that CUDA's
``addmm`` into float32 does not make), and the plain loop of
``gpu_bench`` (the same model, autocast on float32 weights, ``clip_grad_norm_``, AdamW). It
also times both, ``--rounds`` rounds in alternating order, median. Writes
``<out>/step_ops.json`` and ``.md`` when ``--out`` is given. Single process. A benchmark
records; it never asserts.
"""

from __future__ import annotations

import argparse
import collections
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpu_bench
from gpu_attention import sync
from harness import load_average, write_results
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import Trainer

DTYPES = ("fp32", "bf16")
# Ops that make a view or an alias of their input: no kernel on any device.
NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "detach", "expand", "slice", "split",
             "unsqueeze", "squeeze", "as_strided", "permute", "select", "alias", "chunk",
             "unbind", "split_with_sizes", "reshape", "_reshape_alias", "unflatten"}


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def config_for(args, dtype: str, out_dir: str, **flags) -> TrainConfig:
    return TrainConfig(pp=1, device=args.device, dim=args.dim, layers=args.layers,
                       heads=args.heads, kv_heads=args.kv_heads, seq_len=args.seq_len,
                       microbatches=args.microbatches, microbatch_size=1, dtype=dtype,
                       steps=3 + args.rounds, warmup_steps=1, eval_every=0, timeline_step=0,
                       progress=False, out_dir=out_dir,
                       **{"joint_projections": "off", "grad_accumulation_fusion": "off",
                          **flags})


def runners(args, dtype: str, out_dir: str, device: torch.device) -> dict:
    """The trainer with its projections apart and joint (``--joint-projections``), in bf16
    also with its gradient accumulation fused (``--grad-accumulation-fusion``; both on by
    default on CUDA only), and the plain loop."""
    variants = {"meshpipe trainer": {},
                "meshpipe trainer, joint projections": {"joint_projections": "on"}}
    if dtype == "bf16":
        variants["meshpipe trainer, joint projections, fused accumulation"] = {
            "joint_projections": "on", "grad_accumulation_fusion": "on"}
    runs = {}
    for name, flags in variants.items():
        trainer = Trainer(config_for(args, dtype, out_dir, **flags))
        steps = iter(range(10 ** 6))
        runs[name] = lambda trainer=trainer, steps=steps: trainer.train_step(next(steps))
    runs["plain loop"], _ = gpu_bench._plain_runner(config_for(args, dtype, out_dir),
                                                    device)()
    return runs


def measure(runs: dict, device: torch.device, rounds: int) -> dict:
    results = {}
    for name, run in runs.items():
        run()
        run()  # warm: the optimizer's state exists
        counter = CountOps()
        with counter:
            run()
        computing = {op: n for op, n in counter.ops.items() if op not in NO_KERNEL}
        results[name] = {"ops": sum(counter.ops.values()),
                         "computing_ops": sum(computing.values()),
                         "top": collections.Counter(computing).most_common(10), "ms": []}
    for turn in range(rounds):
        order = list(runs) if turn % 2 == 0 else list(reversed(runs))
        for name in order:
            sync(device)
            start = time.perf_counter()
            runs[name]()
            sync(device)
            results[name]["ms"].append(1e3 * (time.perf_counter() - start))
    for result in results.values():
        result["median_ms"] = statistics.median(result["ms"])
    return results


def to_markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Ops per training step: meshpipe's trainer and a plain loop "
             f"({result['device']}, torch {result['torch']})", "",
             f"Reference transformer dim {a['dim']}, {a['layers']} layers, seq {a['seq_len']}, "
             f"{a['microbatches']} microbatches of 1; ops counted in one step after two; time "
             f"the median of {a['rounds']} rounds in alternating order. Load average before "
             f"{result['load_before']}, after {result['load_after']}.", "",
             "| precision | runner | ops | computing ops | ms/step | most frequent computing ops |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for dtype, rows in result["rows"].items():
        for name, row in rows.items():
            top = ", ".join(f"{op} {n}" for op, n in row["top"][:6])
            lines.append(f"| {dtype} | {name} | {row['ops']} | {row['computing_ops']} | "
                         f"{row['median_ms']:.1f} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    gpu_bench._one_rank_world(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.machine()} CPU, 1 thread"
    result = {"device": name, "torch": torch.__version__, "args": vars(args) | {"out": None},
              "load_before": load_average(), "rows": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for dtype in args.dtypes:
            result["rows"][dtype] = measure(runners(args, dtype, scratch, device), device,
                                            args.rounds)
    result["load_after"] = load_average()
    table = to_markdown(result)
    print(table)
    if args.out is not None:
        write_results(args.out, "step_ops", result, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
