"""Context-parallel benchmark: all-to-all aligned vs unaligned, attention step per strategy.

    .venv/bin/python benchmarks/cp.py                # defaults below; ~1 min on 2 cores
    .venv/bin/python benchmarks/cp.py --seq 4096 --iters 10

Part 1 times ``comm.collectives.all_to_all`` (scatter heads, gather sequence: the Ulysses
exchange) on the same number of bytes with aligned sizes (heads and sequence divisible by
the group: the single-copy fast path) and unaligned ones (exact per-peer blocks).
Part 2 times one attention step (forward + backward, causal) of a fixed global problem for
a single process (one SDPA call, meshpipe's ``LocalAttention``, and the ring's blockwise
kernel on one rank) and for Ulysses, ring (zigzag, and contiguous for contrast) and hybrid
at cp 2 and 4: forward and backward separately, the process CPU time a step takes (every
thread), and, from one extra profiled iteration on rank 0, how much of the step the
attention kernels take and how much communication (the ``meshpipe.comm.*`` profiler ranges:
posting, and waiting for, all-to-alls and ring transfers); the rest is copies and Python. A
step's time is the slowest rank's; the table shows the median over rounds.

Both parts time their cases in rounds: each round runs every case once, in turn, in the
same processes. In part 2 every round also runs the two one-process baselines on rank 0
(the other ranks idle), so each speed-up is a median of ratios taken within a round, and
a slower minute of a shared machine slows both sides of it. Every configuration runs in
freshly spawned gloo processes with ``torch.set_num_threads(1)``, malloc keeping freed
memory (``runtime.host_memory``) and, with a core per rank, each rank on cores of its own
(``runtime.host_cores``), as ``meshpipe train`` runs them; on a machine with fewer cores
than ranks the ranks share cores unbound, so read cp 4 on 2 cores as oversubscribed.

Writes ``<out>/cp.json`` and ``<out>/cp.md`` (default ``benchmarks/results``). A benchmark
prints and records times; it never asserts them.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from harness import join_ranks, paired_ratios, report, spawn_ranks, write_results
from meshpipe.comm.collectives import COMM_LABEL, all_to_all, split_sizes
from meshpipe.context.shards import contiguous_positions, hybrid_positions, zigzag_positions
from meshpipe.context import (HybridAttention, LocalAttention, RingAttention,
                              UlyssesAttention)
from meshpipe.runtime.host_cores import bind_to_own_cores
from meshpipe.runtime.host_memory import keep_freed_memory
from meshpipe.topology import ParallelLayout, Topology

HEAD_DIM_A2A = 64
SDPA = "SDPA, one call"
LOCAL = "local attention"


class OneCallSDPA(nn.Module):
    """torch's ``scaled_dot_product_attention`` over the whole sequence in one call: the
    one-process step the context-parallel goals are stated against. (meshpipe's own
    ``LocalAttention`` cuts a long causal square on CPU into smaller squares and
    rectangles, which skips masked work the single call does; it is the second baseline.)"""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Tensor | None = None,
                causal: bool = True) -> Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)


def _process_cpu_seconds() -> float:
    """User + system CPU time of this process, every thread (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048, help="global sequence length")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--a2a-tokens", type=int, default=768,
                        help="all-to-all: per-rank tokens of the aligned case, a multiple of 3")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5, help="attention rounds")
    parser.add_argument("--settle", type=int, default=1,
                        help="untimed runs of each case right before its timed run, per round")
    parser.add_argument("--a2a-iters", type=int, default=100,
                        help="all-to-all rounds (a few ms each: more are cheap)")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def _timed_rounds(steps: list[Callable[[], tuple]], warmup: int, iters: int,
                  settle: int) -> list[list[list[float]]]:
    """Per step, per round, the whole step and each phase the step reports (the seconds of
    its parts), each the slowest rank's (ranks start every step together at a barrier).

    The steps run in turn, round after round, in the same processes, so a slower minute of
    the machine slows every step it overlaps, and the ratio of two steps within a round
    stays put where the medians of steps timed one after the other would drift apart.
    Each step runs ``settle`` times untimed right before its timed run, so that what is
    timed follows the same step, as in a training loop, not a different one (whose heap
    and caches it would inherit).
    """
    results: list[list[list[float]]] = [[] for _ in steps]
    for round_index in range(warmup + iters):
        for step, rounds in zip(steps, results):
            for _ in range(settle):
                dist.barrier()
                step()
            dist.barrier()
            start = time.perf_counter()
            phases = step()
            elapsed = torch.tensor([time.perf_counter() - start, *phases], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_index >= warmup:
                rounds.append(elapsed.tolist())
    return results


def _paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median over rounds of one step's time over another's in the same round."""
    return statistics.median(paired_ratios(numerators, denominators))


def _summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}


# ------------------------------------------------------------------------- all-to-all


def _all_to_all_cases(world: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(case, local tokens, heads, gathered tokens): the same bytes per rank in each case.

    Aligned: 8 heads. Unaligned: 3 heads (not divisible by 2 or 4) on 8/3 as many tokens;
    the second unaligned case also gathers a sequence one token longer than world x local,
    so the ranks' sequence shards differ by one.
    """
    unaligned_tokens = tokens * 8 // 3
    ragged_total = world * unaligned_tokens + 1
    ragged_local = split_sizes(ragged_total, world)[dist.get_rank()]
    return [("aligned (8 heads)", tokens, 8, world * tokens),
            ("unaligned heads (3)", unaligned_tokens, 3, world * unaligned_tokens),
            ("unaligned heads + sequence", ragged_local, 3, ragged_total)]


def _exchange(x: Tensor, total: int) -> Callable[[], tuple]:
    def exchange() -> tuple:
        with torch.no_grad():
            all_to_all(x, None, scatter_dim=2, gather_dim=1, gather_size=total)
        return ()
    return exchange


def _all_to_all_rows(world: int, args: argparse.Namespace) -> list[dict]:
    cases = _all_to_all_cases(world, args.a2a_tokens)
    inputs = [torch.randn(1, local_tokens, heads, HEAD_DIM_A2A)
              for _, local_tokens, heads, _ in cases]
    timed = _timed_rounds([_exchange(x, total) for x, (*_, total) in zip(inputs, cases)],
                          args.warmup, args.a2a_iters, args.settle)
    aligned = [phases[0] for phases in timed[0]]
    rows = []
    for (case, *_), x, rounds in zip(cases, inputs, timed):
        times = [phases[0] for phases in rounds]
        megabytes = x.numel() * x.element_size() / 1e6
        rows.append({"cp": world, "case": case, "local_shape": list(x.shape),
                     "megabytes_per_rank": megabytes, **_summary(times),
                     "gb_per_s": megabytes / 1e3 / statistics.median(times),
                     "vs_aligned": _paired_ratio(times, aligned)})
    return rows


# -------------------------------------------------------------------------- attention


BASELINES = ((SDPA, "whole sequence", OneCallSDPA),
             (LOCAL, "whole sequence, split causal square", LocalAttention))


def _attention_cases(world: int) -> list[tuple[str, str, Callable[[int], tuple]]]:
    """(strategy, layout, builder: sequence length -> (attention, positions this rank holds))
    for the strategies measured against the one-process ``BASELINES``."""
    rank = dist.get_rank()

    def ring(layout_name: str) -> Callable[[int], tuple]:
        positions_of = zigzag_positions if layout_name == "zigzag" else contiguous_positions

        def build(seq: int) -> tuple:
            return RingAttention(), positions_of(seq, world, rank)
        return build

    def ulysses(seq: int) -> tuple:
        return UlyssesAttention(), contiguous_positions(seq, world, rank)

    def ulysses_unaligned(seq: int) -> tuple:
        return UlyssesAttention(), contiguous_positions(seq + 1, world, rank)

    def ulysses_head_groups(seq: int) -> tuple:
        return UlyssesAttention(head_groups=2), contiguous_positions(seq, world, rank)

    def hybrid(seq: int) -> tuple:
        topology = Topology.build(ParallelLayout(cp_ring=2, cp_ulysses=world // 2))
        coords = topology.coords
        return (HybridAttention(topology.cp_ring_group, topology.cp_ulysses_group),
                hybrid_positions(seq, 2, coords["cp_ring"], world // 2, coords["cp_ulysses"]))

    if world == 1:
        return [("ring kernel, 1 rank", "whole sequence", ring("contiguous"))]
    cases = [("ulysses", "contiguous", ulysses),
             ("ulysses", "contiguous, sequence + 1 (uneven shards)", ulysses_unaligned),
             ("ulysses, 2 head groups", "contiguous", ulysses_head_groups),
             ("ring", "zigzag", ring("zigzag")),
             ("ring", "contiguous", ring("contiguous"))]
    if world >= 4 and world % 2 == 0:
        cases.append((f"hybrid 2x{world // 2}", "zigzag x contiguous", hybrid))
    return cases


KERNEL_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _breakdown(step: Callable[[], object]) -> dict[str, float]:
    """Milliseconds of one profiled step spent in the attention kernels and in
    communication (the ``meshpipe.comm.*`` ranges), on this rank."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    kernel = comm = 0.0
    for event in profiler.key_averages():
        if event.key in KERNEL_OPS:
            kernel += event.self_cpu_time_total
        elif event.key.startswith(COMM_LABEL):
            comm += event.cpu_time_total
    return {"kernel_ms": kernel / 1e3, "comm_ms": comm / 1e3}


def _attention_step(attention: nn.Module, positions: Tensor | None,
                    args: argparse.Namespace) -> Callable[[], tuple[float, float, float]]:
    """One causal forward + backward of this rank's tokens: (forward, backward, process CPU)
    seconds."""
    local = args.seq if positions is None else len(positions)
    generator = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(args.batch, local, args.heads, args.head_dim, generator=generator)
    k = torch.randn(args.batch, local, args.kv_heads, args.head_dim, generator=generator)
    v = torch.randn(args.batch, local, args.kv_heads, args.head_dim, generator=generator)
    grad_out = torch.randn_like(q)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step() -> tuple[float, float, float]:
        for leaf in leaves:
            leaf.grad = None
        cpu = _process_cpu_seconds()
        start = time.perf_counter()
        out = attention(*leaves, positions=positions, causal=True)
        middle = time.perf_counter()
        out.backward(grad_out)
        end = time.perf_counter()
        return middle - start, end - middle, _process_cpu_seconds() - cpu
    return step


def _idle() -> tuple[float, float, float]:
    return 0.0, 0.0, 0.0


def _attention_rows(world: int, args: argparse.Namespace) -> list[dict]:
    """Every round runs the one-process baselines (on rank 0, the other ranks idle) and then
    every strategy, so each speed-up is a median of ratios within a round."""
    rank = dist.get_rank()
    measured = [(name, layout, args.seq,
                 _attention_step(module(), None, args) if rank == 0 else _idle)
                for name, layout, module in BASELINES]
    for strategy, layout, build in _attention_cases(world):
        attention, positions = build(args.seq)
        measured.append((strategy, layout, len(positions),
                         _attention_step(attention, positions, args)))
    timed = _timed_rounds([step for *_, step in measured], args.warmup, args.iters,
                          args.settle)
    sdpa, local = ([phases[0] for phases in rounds] for rounds in timed[:len(BASELINES)])
    reported = list(zip(measured, timed))[0 if world == 1 else len(BASELINES):]
    rows = []
    for (strategy, layout, tokens, step), rounds in reported:
        dist.barrier()
        breakdown = _breakdown(step)
        totals, forwards, backwards, cpus = (list(column) for column in zip(*rounds))
        rows.append({"strategy": strategy, "cp": world, "layout": layout,
                     "local_tokens": tokens, **_summary(totals),
                     "forward_ms": 1e3 * statistics.median(forwards),
                     "backward_ms": 1e3 * statistics.median(backwards),
                     "cpu_ms": 1e3 * statistics.median(cpus), **breakdown,
                     "sdpa_ms": 1e3 * statistics.median(sdpa),
                     "local_ms": 1e3 * statistics.median(local),
                     "vs_sdpa": _paired_ratio(sdpa, totals),
                     "vs_local": _paired_ratio(local, totals)})
    return rows


# ----------------------------------------------------------------------------- driver


def _worker(rank: int, world: int, init_file: str, result_file: str,
            args: argparse.Namespace) -> None:
    bind_to_own_cores(rank, world)
    torch.set_num_threads(1)
    keep_freed_memory()
    join_ranks(rank, world, init_file)
    try:
        result = {"attention": _attention_rows(world, args),
                  "all_to_all": _all_to_all_rows(world, args) if world > 1 else []}
        if rank == 0:
            report(result_file, result)
    finally:
        dist.destroy_process_group()
    # After torch.profiler ran in a gloo process, the interpreter's teardown aborts about one
    # exit in four here ("terminate called without an active exception"), after every
    # result is written: leave without it.
    sys.stdout.flush()
    os._exit(0)


def _markdown(config: dict, attention: list[dict], exchanges: list[dict]) -> str:
    lines = [
        "# Context-parallel benchmark",
        "",
        f"Causal attention step (forward + backward), batch {config['batch']}, sequence "
        f"{config['seq']}, {config['heads']} query / {config['kv_heads']} key-value heads, "
        f"head_dim {config['head_dim']}, float32, gloo on CPU, 1 thread per rank, "
        f"{config['cpu_count']} cores. Times: slowest rank, median of {config['iters']} "
        f"rounds.",
        "",
        "Every round runs the two one-process baselines (rank 0 alone on the whole sequence,",
        "the other ranks idle) and then each strategy, in the same processes; each is timed",
        f"right after {config['settle']} untimed run(s) of its own. The last two columns are",
        "speed-ups over the baselines: medians of the per-round ratios, so a slower minute",
        "of the machine slows both sides of a ratio. The baselines are one",
        f"`scaled_dot_product_attention` call (\"{SDPA}\", what the goals are stated",
        f"against) and meshpipe's `LocalAttention` (\"{LOCAL}\"), which on CPU splits the",
        "causal square and so skips masked work the single call does.",
        "",
        "Forward and backward are medians of their own (slowest rank each), so they need not",
        "add up to the step. CPU: the busiest rank's process CPU time (user + system, every",
        "thread, gloo's included) per step, median; a step whose CPU equals its time kept its",
        "core busy throughout. Kernel and communication: rank 0, one profiled step.",
        "",
    ]
    for world in sorted({row["cp"] for row in attention}):
        row = next(row for row in attention if row["cp"] == world)
        lines.append(f"- Baselines in the cp {world} processes: {SDPA} {row['sdpa_ms']:.1f} ms, "
                     f"{LOCAL} {row['local_ms']:.1f} ms (medians).")
    lines += [
        "",
        "| strategy | cp | layout | tokens per rank | step ms | min ms | forward ms | "
        f"backward ms | CPU ms | kernel ms | comm ms | vs {SDPA} | vs {LOCAL} |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: |",
    ]
    for row in attention:
        lines.append(f"| {row['strategy']} | {row['cp']} | {row['layout']} | "
                     f"{row['local_tokens']} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | "
                     f"{row['forward_ms']:.1f} | {row['backward_ms']:.1f} | "
                     f"{row['cpu_ms']:.1f} | {row['kernel_ms']:.1f} | {row['comm_ms']:.1f} | "
                     f"{row['vs_sdpa']:.2f}x | {row['vs_local']:.2f}x |")
    lines += ["", "All-to-all (scatter heads, gather sequence), float32, head_dim "
              f"{HEAD_DIM_A2A}, same bytes per rank in each group of rows, median of "
              f"{config['a2a_iters']} rounds. Each round runs the three cases in turn (each",
              f"after {config['settle']} untimed run(s) of its own); \"vs aligned\" is the median "
              "of the per-round ratios to the aligned case.", "",
              "| cp | case | local shape (rank 0) | MB per rank | ms | min ms | GB/s | "
              "vs aligned |",
              "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in exchanges:
        lines.append(f"| {row['cp']} | {row['case']} | {row['local_shape']} | "
                     f"{row['megabytes_per_rank']:.3f} | {row['median_ms']:.2f} | "
                     f"{row['min_ms']:.2f} | {row['gb_per_s']:.2f} | "
                     f"{row['vs_aligned']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.a2a_tokens % 3 != 0:
        raise SystemExit(f"--a2a-tokens {args.a2a_tokens} must be a multiple of 3 so the "
                         f"unaligned case (3 heads) carries the same bytes as 8 heads")
    config = {key: value for key, value in vars(args).items() if key != "out"}
    config.update(cpu_count=os.cpu_count(), torch=torch.__version__,
                  python=platform.python_version())
    attention, exchanges = [], []
    for world in [1, *args.cp]:
        print(f"cp {world}: spawning {world} process(es)...", flush=True)
        result = spawn_ranks(_worker, world, args)
        attention += result["attention"]
        exchanges += result["all_to_all"]
    table = _markdown(config, attention, exchanges)
    paths = write_results(args.out, "cp", {"config": config, "attention": attention,
                                           "all_to_all": exchanges}, table)
    print(table)
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
