"""Page faults of a Ulysses step with glibc's own malloc thresholds against
``keep_freed_memory``'s (``runtime.host_memory``), on two CPU processes.

    python benchmarks/host_memory.py [--rounds 4] [--steps 10]

Each round starts a fresh pair of processes with glibc's thresholds and a fresh pair with
the kept ones (alternating which goes first), runs ``--warmup`` Ulysses context-parallel
attention steps (forward and backward, sequence 2,048, 8 heads of 64) and counts the minor
page faults of each of the next ``--steps``: every fault is a 4 KiB page the kernel maps and
clears because memory freed by the last step went back to the system. A count per step is
noisy (a heap grows once now and then, in both settings), so the table gives the faults
summed over a round's steps, per rank. Results in ``results/host_memory.{md,json}``; a
benchmark records counts, it never asserts them.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path

import torch

from harness import join_ranks, load_average, report, spawn_ranks, write_results

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def _ulysses_faults(rank: int, world_size: int, steps: int, warmup: int) -> list[int]:
    """Minor page faults of each Ulysses step after the warmup, on this rank."""
    from meshpipe.context import UlyssesAttention

    seq, heads, head_dim = 2048, 8, 64
    generator = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, seq // world_size, heads, head_dim,
                           generator=generator).requires_grad_() for _ in range(3))
    grad = torch.randn(1, seq // world_size, heads, head_dim)
    attention = UlyssesAttention()
    faults = []
    for _ in range(warmup + steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        attention(q, k, v, causal=True).backward(grad)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults[warmup:]


def _worker(rank: int, world_size: int, init_file: str, result_file: str, keep: bool,
            steps: int, warmup: int) -> None:
    import torch.distributed as dist

    from meshpipe.runtime.host_memory import keep_freed_memory

    torch.set_num_threads(1)
    took = keep_freed_memory() if keep else False
    join_ranks(rank, world_size, init_file)
    faults = _ulysses_faults(rank, world_size, steps, warmup)
    every_rank: list = [None] * world_size
    dist.all_gather_object(every_rank, faults)
    if rank == 0:
        report(result_file, {"settings took": took, "faults per rank": every_rank})
    dist.destroy_process_group()


def _table(result: dict) -> str:
    lines = ["# Page faults of a Ulysses cp 2 step: glibc's malloc thresholds against kept "
             "memory", "",
             f"{result['steps']} steps after {result['warmup']} of warmup, two fresh processes "
             "per case and round; faults summed over the steps, per rank. Load average "
             f"before {result['load before']}, after {result['load after']}.", "",
             "| round | glibc's thresholds (rank 0, rank 1) | kept (rank 0, rank 1) |",
             "|---|---|---|"]
    for number, row in enumerate(result["rounds"], start=1):
        cells = [", ".join(str(sum(rank)) for rank in row[case]) for case in ("glibc", "kept")]
        lines.append(f"| {number} | {cells[0]} | {cells[1]} |")
    lines += ["", "Median faults per step, over every step and rank: glibc's thresholds "
              f"{result['median per step']['glibc']}, kept {result['median per step']['kept']}; "
              f"mean {result['mean per step']['glibc']} against {result['mean per step']['kept']}.",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {"steps": args.steps, "warmup": args.warmup, "load before": load_average(),
              "rounds": []}
    for number in range(args.rounds):
        order = ("glibc", "kept") if number % 2 == 0 else ("kept", "glibc")
        row = {}
        for case in order:
            measured = spawn_ranks(_worker, 2, case == "kept", args.steps, args.warmup)
            row[case] = measured["faults per rank"]
        result["rounds"].append(row)
        print(f"round {number + 1}: " + "; ".join(
            f"{case} {[sum(rank) for rank in row[case]]}" for case in ("glibc", "kept")),
            flush=True)
    result["load after"] = load_average()
    every_step = {case: [step for row in result["rounds"] for rank in row[case] for step in rank]
                  for case in ("glibc", "kept")}
    result["median per step"] = {case: statistics.median(steps)
                                 for case, steps in every_step.items()}
    result["mean per step"] = {case: round(statistics.fmean(steps), 1)
                               for case, steps in every_step.items()}
    json_path, md_path = write_results(args.out, "host_memory", result, _table(result))
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
