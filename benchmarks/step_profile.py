"""Where a GPU training step's time goes: ``torch.profiler`` over training steps of
``gpu_bench``'s model through meshpipe's trainer, per variant (eager, ``--pack``,
``--compile``, both), with the step's wall time beside the GPU's busy time.

    python benchmarks/step_profile.py                       # eager, pack, compile
    python benchmarks/step_profile.py --variants pack-compile
    python benchmarks/step_profile.py --variants pack --layers 4

Prints, per variant, the median wall time of the profiled steps, the summed time of the
GPU's kernels (wall minus that is time the GPU waited for the host), the kernel launches,
dtype casts and the host's waits for the GPU (``SYNCS``: a wait drains the GPU's queue, and
the GPU then idles while the host launches again) per step, and the operators with the most
self time on the host and on the GPU.
Writes ``<out>/step_profile.md`` when ``--out`` is given. Single process, one GPU
(``--cpu-rehearsal`` tries it on the CPU). A benchmark records times; it never asserts them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import gpu_bench
from gpu_attention import sync
from meshpipe.train.data.corpus import load_corpus
from meshpipe.train.loop.trainer import Trainer

# variant: (--compile, --pack)
VARIANTS = {"eager": (False, False), "pack": (False, True), "compile": (True, False),
            "pack-compile": (True, True)}
# The CUDA driver and runtime calls that launch a kernel, as the profiler names them.
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaLaunchKernelExC")
# The CUDA runtime calls in which the host waits for the GPU (a copy to or from pageable
# host memory waits too: ``cudaMemcpy`` and the stream synchronization an ``.item()`` makes).
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                        default=["eager", "pack", "compile"])
    parser.add_argument("--top", type=int, default=12, help="operators listed per table")
    parser.add_argument("--profiled-steps", type=int, default=2)
    known, rest = parser.parse_known_args(argv)
    bench = gpu_bench.parse_args(rest)  # model sizes, --warmup, --cpu-rehearsal
    return argparse.Namespace(**{**vars(bench), **vars(known)})


def profile_variant(variant: str, args, device: torch.device, scratch: str,
                    corpus: str) -> str:
    compiled, packed = VARIANTS[variant]
    config = gpu_bench.train_config(args, scratch, device, args.seq_len[0], compiled=compiled,
                                    packed_from=corpus if packed else "")
    config = dataclasses.replace(config, steps=args.warmup + args.profiled_steps)
    trainer = Trainer(config)
    for step in range(args.warmup):
        trainer.train_step(step)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.type == "cuda" else [])
    walls = []
    with profile(activities=activities) as prof:
        for step in range(args.warmup, args.warmup + args.profiled_steps):
            start = time.perf_counter()
            trainer.train_step(step)
            sync(device)
            walls.append(time.perf_counter() - start)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # not their ops too
    gpu_us = sum(e.self_device_time_total for e in kernels) / args.profiled_steps
    wall_ms = statistics.median(walls) * 1e3
    launches = sum(e.count for e in events if e.key in LAUNCHES) / args.profiled_steps
    casts = sum(e.count for e in events if e.key == "aten::_to_copy") / args.profiled_steps
    waits = sum(e.count for e in events if e.key in SYNCS) / args.profiled_steps
    lines = [f"## {variant}", "",
             f"wall {wall_ms:.1f} ms/step (median of {args.profiled_steps} profiled), GPU "
             f"kernels {gpu_us / 1e3:.1f} ms/step, {launches:,.0f} kernel launches/step, "
             f"{casts:,.0f} dtype casts (`aten::_to_copy`)/step, {waits:,.0f} host waits for "
             f"the GPU/step", "", "Host self time:", "",
             "```",
             events.table(sort_by="self_cpu_time_total", row_limit=args.top,
                          max_name_column_width=60),
             "```"]
    if device.type == "cuda":
        lines += ["", "GPU self time:", "", "```",
                  events.table(sort_by="self_device_time_total", row_limit=args.top,
                               max_name_column_width=60), "```"]
    del trainer
    gc.collect()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu") if args.cpu_rehearsal else torch.device("cuda", 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("step_profile: no CUDA device: nothing to profile")
        return 0
    gpu_bench._one_rank_world(device)
    try:
        with tempfile.TemporaryDirectory(prefix="meshpipe-step-profile-") as scratch:
            corpus = Path(scratch, "corpus.txt")
            corpus.write_bytes(load_corpus())
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
            sections = [f"# Step profile: {name}, torch {torch.__version__}"]
            for variant in args.variants:
                section = profile_variant(variant, args, device, scratch, str(corpus))
                print(section, flush=True)
                sections.append(section)
    finally:
        dist.destroy_process_group()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_profile.md").write_text("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
