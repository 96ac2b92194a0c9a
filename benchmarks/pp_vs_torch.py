"""Pipeline step time: meshpipe's Executor vs torch.distributed.pipelining, same everything else.

    .venv/bin/python benchmarks/pp_vs_torch.py            # defaults; a few minutes on 2 cores
    .venv/bin/python benchmarks/pp_vs_torch.py --quick    # smoke run: tiny model, 2 steps
    .venv/bin/python benchmarks/pp_vs_torch.py --schedules 1F1B ZB-V --iters 10

For each schedule (GPipe, 1F1B, Interleaved1F1B, ZB-V, DualPipeV) at ``--pp`` ranks and
``--microbatches`` microbatches, every rank builds two identical copies of the reference
transformer (same config, same seeded init, float32), cuts both into the same stages (the
same layers on each stage, the same stage -> rank placement: loop for GPipe/1F1B/interleaved,
V for ZB-V/DualPipeV), wraps one copy's stages in meshpipe ``Stage`` + ``Executor`` and the
other's in torch ``PipelineStage`` + the torch schedule class, and feeds both the same
microbatches of random tokens. Both run in the same processes (gloo on CPU,
``torch.set_num_threads(1)``), each library on its own process group so that neither can
receive the other's messages.

What is timed: one step, i.e. forward + backward of every microbatch including the loss on
the last stage (torch: ``schedule.step(..., return_outputs=False)``; meshpipe:
``executor.step(...)``), from a barrier to the slowest rank's end. Gradients are set to None
before every step in both (outside the timing); no optimizer runs. The first step of each
library is a parity check: per-microbatch losses and every parameter gradient of the two
libraries are compared with ``torch.testing.assert_close`` (the largest differences are
printed and recorded) so that we know both time the same computation. Then ``--warmup``
steps of each are run untimed and ``--iters`` timed steps alternate between the two libraries
(torch first on even iterations, meshpipe first on odd ones) so that drifting machine load
hits both alike. The ratio is the median over iterations of meshpipe's step / torch's step
in the same iteration (the two ran back to back), so that load that drifts between
iterations cancels; the ratio of the two medians is recorded beside it. Inputs: torch's
``step`` takes the whole batch and splits it into microbatches itself (a view per
microbatch); meshpipe takes the list of those same views.

Shapes for torch: its stages get explicit example inputs and outputs (``input_args`` /
``output_args``: int64 tokens ``[mb, seq]`` into stage 0, float32 hidden ``[mb, seq, dim]``
between stages, float32 logits ``[mb, seq, vocab]`` out of the last), so torch runs in its
static-metadata mode. meshpipe declares nothing: its first message on each link carries the
layout, later ones reuse the cached layout. Both libraries see the same modules: each chunk
of ``meshpipe.models.split`` wrapped so that it passes one hidden tensor (torch stages carry
tensors only; meshpipe could also carry the chunk's ``(hidden, None, None)``).

Writes ``<out>/pp_vs_torch.json`` and ``<out>/pp_vs_torch.md`` (default
``benchmarks/results``; ``--quick`` writes ``pp_vs_torch.quick.*`` instead, leaving the real
figures alone). A benchmark prints and records times; it never asserts them.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import platform
import pstats
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                          ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from harness import (PROCESS_GROUP_TIMEOUT, join_ranks, load_average, paired_ratios, report,
                     spawn_ranks, write_results)
from meshpipe.comm.p2p import P2PTransport
from meshpipe.models import Transformer, TransformerConfig, causal_lm_loss, split
from meshpipe.runtime.executor import Executor
from meshpipe.runtime.stage import Stage
from meshpipe.schedules import build

LIBRARIES = ("torch", "meshpipe")
PROFILE_LINES = 25
# Collective timeout of the benchmark processes: a failure ends the run instead of hanging it.


@dataclass(frozen=True)
class Case:
    """One schedule under both names: meshpipe's builder and torch's class."""

    label: str
    meshpipe_name: str
    torch_class: type
    stages_per_rank: int
    placement_style: str  # torch's name for the stage -> rank mapping

    @property
    def torch_takes_stage_list(self) -> bool:
        return self.stages_per_rank > 1


CASES = (
    Case("GPipe", "gpipe", ScheduleGPipe, 1, "loop"),
    Case("1F1B", "1f1b", Schedule1F1B, 1, "loop"),
    Case("Interleaved1F1B", "interleaved", ScheduleInterleaved1F1B, 2, "loop"),
    Case("ZB-V", "zb-v", ScheduleZBVZeroBubble, 2, "v"),
    Case("DualPipeV", "dualpipe-v", ScheduleDualPipeV, 2, "v"),
)
CASE_BY_LABEL = {case.label: case for case in CASES}

QUICK = {"dim": 64, "layers": 8, "heads": 4, "kv_heads": 2, "seq": 32, "microbatch_size": 2,
         "warmup": 1, "iters": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16,
                        help="transformer layers of the whole model, spread evenly over the "
                             "pp (GPipe, 1F1B) or 2*pp (the others) stages")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per library, "
                        "after the parity-check step")
    parser.add_argument("--iters", type=int, default=12, help="timed steps per library")
    parser.add_argument("--schedules", nargs="+", choices=list(CASE_BY_LABEL),
                        default=list(CASE_BY_LABEL))
    parser.add_argument("--profile-rank", type=int, default=None, metavar="RANK",
                        help="cProfile both libraries' timed steps on this rank and write the "
                             "top functions to <out>/pp_vs_torch.profile.<schedule>.rank<RANK>"
                             ".txt (profiling slows that rank: read its times as perturbed)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run with small defaults: " +
                        ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)  # explicit flags still win
    args = parser.parse_args(argv)
    for case in (CASE_BY_LABEL[label] for label in args.schedules):
        stages = args.pp * case.stages_per_rank
        if args.layers % stages:
            parser.error(f"--layers {args.layers} must divide evenly over the {stages} stages "
                         f"of {case.label} (pp {args.pp} x {case.stages_per_rank})")
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.pp < 2:
        parser.error("--pp must be at least 2: a pipeline needs two ranks")
    if args.profile_rank is not None and not 0 <= args.profile_rank < args.pp:
        parser.error(f"--profile-rank {args.profile_rank} is not a rank of 0..{args.pp - 1}")
    return args


# ------------------------------------------------------------------------ model and data


class HiddenOnly(nn.Module):
    """A model chunk speaking single tensors: tokens or hidden in, hidden or logits out."""

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: Tensor) -> Tensor:
        out = self.chunk(x)
        return out if self.chunk.is_last else out[0]


def model_config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                             n_heads=args.heads, n_kv_heads=args.kv_heads,
                             max_seq_len=args.seq, init_seed=1234)


def chunks_of(args: argparse.Namespace, num_stages: int,
              stage_ids: list[int]) -> dict[int, nn.Module]:
    """This rank's stages of a freshly built (identically initialised) model."""
    chunks = split(Transformer(model_config(args)), num_stages)
    return {s: HiddenOnly(chunks[s]) for s in stage_ids}


def make_batch(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """Tokens and next-token targets ``[microbatches * microbatch_size, seq]``, on every rank."""
    generator = torch.Generator().manual_seed(99)
    rows = args.microbatches * args.microbatch_size
    tokens = torch.randint(0, args.vocab, (rows, args.seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def example_io(args: argparse.Namespace, stage: int, num_stages: int) -> tuple[Tensor, Tensor]:
    """Example input and output of a stage for one microbatch (torch's static shapes).

    Float examples must require grad: torch derives the gradient buffers it receives and
    sends from them, and posts no gradient transfer for an example that does not.
    """
    mb, seq = args.microbatch_size, args.seq
    hidden = torch.empty(mb, seq, args.dim, requires_grad=True)
    first_input = torch.zeros(mb, seq, dtype=torch.int64)
    last_output = torch.empty(mb, seq, args.vocab, requires_grad=True)
    return (first_input if stage == 0 else hidden,
            last_output if stage == num_stages - 1 else hidden)


# ------------------------------------------------------------------------ the two runners


@dataclass
class Runner:
    """One library's pipeline on this rank: ``step()`` runs one step and returns its losses."""

    modules: dict[int, nn.Module]
    step: Callable[[], list[float]]

    def zero_grad(self) -> None:
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def gradients(self) -> dict[str, Tensor | None]:
        return {f"stage {s} {name}": p.grad for s, module in self.modules.items()
                for name, p in module.named_parameters()}


def torch_runner(case: Case, args: argparse.Namespace, stage_ids: list[int], num_stages: int,
                 group: dist.ProcessGroup, tokens: Tensor, targets: Tensor) -> Runner:
    modules = chunks_of(args, num_stages, stage_ids)
    stages = []
    for s in stage_ids:
        example_in, example_out = example_io(args, s, num_stages)
        stages.append(PipelineStage(modules[s], s, num_stages, torch.device("cpu"),
                                    input_args=example_in, output_args=example_out,
                                    group=group))
    schedule = case.torch_class(stages if case.torch_takes_stage_list else stages[0],
                                n_microbatches=args.microbatches, loss_fn=causal_lm_loss,
                                scale_grads=True)
    inputs = (tokens,) if 0 in stage_ids else ()
    target = targets if num_stages - 1 in stage_ids else None

    def step() -> list[float]:
        losses: list[Tensor] = []
        schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        return [loss.detach().item() for loss in losses]

    return Runner(modules, step)


def meshpipe_runner(case: Case, args: argparse.Namespace, stage_ids: list[int], num_stages: int,
                    group: dist.ProcessGroup, tokens: Tensor, targets: Tensor) -> Runner:
    modules = chunks_of(args, num_stages, stage_ids)
    schedule = build(case.meshpipe_name, args.pp, args.microbatches,
                     stages_per_rank=case.stages_per_rank)
    last = num_stages - 1
    stages = {s: Stage(modules[s], s, num_stages, loss_fn=causal_lm_loss if s == last else None)
              for s in stage_ids}
    executor = Executor(schedule, stages, pp_rank=dist.get_rank(),
                        pipeline_ranks=list(range(args.pp)), transport=P2PTransport(group))
    inputs = list(tokens.split(args.microbatch_size)) if 0 in stage_ids else None
    target = list(targets.split(args.microbatch_size)) if last in stage_ids else None

    def step() -> list[float]:
        return executor.step(inputs, target).losses

    return Runner(modules, step)


# ------------------------------------------------------------------------------ per rank


def check_placement(case: Case, args: argparse.Namespace) -> list[int]:
    """This rank's stages, after checking that meshpipe and torch place every stage alike."""
    schedule = build(case.meshpipe_name, args.pp, args.microbatches,
                     stages_per_rank=case.stages_per_rank)
    theirs = generate_stage_to_rank_mapping(args.pp, schedule.num_stages,
                                            style=case.placement_style)
    ours = dict(enumerate(schedule.placement))
    if ours != theirs:
        raise RuntimeError(f"{case.label}: meshpipe places stages {ours} but torch {theirs}; "
                           "the comparison would not be like for like")
    return sorted(schedule.stages_of(dist.get_rank()))


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def parity(runners: dict[str, Runner]) -> dict[str, float]:
    """Run one step of each library from zero grads; compare losses and gradients."""
    losses = {}
    for name, runner in runners.items():
        runner.zero_grad()
        losses[name] = torch.tensor(runner.step())
    grads = {name: runner.gradients() for name, runner in runners.items()}
    problem = ""
    missing = [f"{name}: {key}" for name in LIBRARIES
               for key, grad in grads[name].items() if grad is None]
    if missing:
        problem = f"rank {dist.get_rank()}: parameters without a gradient: {missing}"
    else:
        try:
            torch.testing.assert_close(losses["meshpipe"], losses["torch"])
            torch.testing.assert_close(grads["meshpipe"], grads["torch"])
        except AssertionError as error:
            problem = f"rank {dist.get_rank()}: {error}"
    loss_diff = (losses["meshpipe"] - losses["torch"]).abs().max().item() \
        if losses["torch"].numel() and losses["torch"].shape == losses["meshpipe"].shape else 0.0
    grad_diff = 0.0 if missing else max(
        (grads["meshpipe"][k] - g).abs().max().item() for k, g in grads["torch"].items())
    failed = max_over_ranks(1.0 if problem else 0.0)
    if problem:
        raise AssertionError(f"meshpipe and torch disagree: {problem}")
    if failed:
        raise AssertionError("meshpipe and torch disagree on another rank (see its error)")
    mean_loss = losses["torch"].mean().item() if losses["torch"].numel() else float("-inf")
    return {"max_loss_diff": max_over_ranks(loss_diff),
            "max_grad_diff": max_over_ranks(grad_diff),
            "loss": max_over_ranks(mean_loss)}


def timed_step(runner: Runner, profiler: cProfile.Profile | None = None) -> float:
    """Seconds of one step, the slowest rank's (ranks start together at a barrier)."""
    runner.zero_grad()
    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    runner.step()
    if profiler is not None:
        profiler.disable()
    return max_over_ranks(time.perf_counter() - start)


def profile_report(case: Case, profilers: dict[str, cProfile.Profile], steps: int) -> str:
    """The functions where each library spent the most time of its timed steps on this rank."""
    parts = []
    for name, profiler in profilers.items():
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(PROFILE_LINES)
        parts.append(f"===== {case.label}, {name}, rank {dist.get_rank()}, {steps} timed "
                     f"steps (sorted by own time) =====\n{text.getvalue()}")
    return "\n".join(parts)


def bench_case(case: Case, args: argparse.Namespace,
               groups: dict[str, dist.ProcessGroup]) -> dict[str, Any]:
    stage_ids = check_placement(case, args)
    num_stages = args.pp * case.stages_per_rank
    tokens, targets = make_batch(args)
    makers = {"torch": torch_runner, "meshpipe": meshpipe_runner}
    runners = {name: makers[name](case, args, stage_ids, num_stages, groups[name], tokens,
                                  targets) for name in LIBRARIES}
    check = parity(runners)
    for runner in runners.values():
        for _ in range(args.warmup):
            timed_step(runner)
    times: dict[str, list[float]] = {name: [] for name in LIBRARIES}
    profiling = args.profile_rank == dist.get_rank()
    profilers = {name: cProfile.Profile() for name in LIBRARIES} if profiling else {}
    for iteration in range(args.iters):
        order = LIBRARIES if iteration % 2 == 0 else LIBRARIES[::-1]
        for name in order:
            times[name].append(timed_step(runners[name], profilers.get(name)))
    if profiling:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"pp_vs_torch.profile.{case.label}.rank{dist.get_rank()}.txt"
        path.write_text(profile_report(case, profilers, args.iters))
    pair_ratios = paired_ratios(times["meshpipe"], times["torch"])
    ratio_q1, ratio_q3 = quartiles(pair_ratios)
    return {"schedule": case.label, "stages": num_stages,
            "layers_per_stage": args.layers // num_stages, **check,
            **{name: summary(times[name]) for name in LIBRARIES},
            "ratio": statistics.median(pair_ratios), "pair_ratios": pair_ratios,
            "ratio_q1": ratio_q1, "ratio_q3": ratio_q3,
            "ratio_of_medians": (statistics.median(times["meshpipe"])
                                 / statistics.median(times["torch"]))}


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles (both the value itself when there is one)."""
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def summary(times: list[float]) -> dict[str, Any]:
    ms = sorted(1e3 * t for t in times)
    q1, q3 = quartiles(ms)
    return {"median_ms": statistics.median(ms), "q1_ms": q1, "q3_ms": q3, "min_ms": ms[0],
            "max_ms": ms[-1], "times_ms": ms}


def _worker(rank: int, world: int, init_file: str, result_file: str,
            args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    join_ranks(rank, world, init_file)
    try:
        groups = {name: dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
                  for name in LIBRARIES}
        rows = []
        for label in args.schedules:
            row = bench_case(CASE_BY_LABEL[label], args, groups)
            rows.append(row)
            if rank == 0:
                print(progress_line(row), flush=True)
        if rank == 0:
            report(result_file, rows)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- driver


def progress_line(row: dict[str, Any]) -> str:
    return (f"{row['schedule']:>16}: torch {row['torch']['median_ms']:8.1f} ms, meshpipe "
            f"{row['meshpipe']['median_ms']:8.1f} ms, ratio {row['ratio']:.3f}; parity: loss "
            f"diff {row['max_loss_diff']:.1e}, grad diff {row['max_grad_diff']:.1e}")


def markdown(config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# meshpipe vs torch.distributed.pipelining",
        "",
        f"One training step (forward + backward of {config['microbatches']} microbatches of "
        f"{config['microbatch_size']} x {config['seq']} tokens, loss on the last stage, no "
        f"optimizer) of a {config['layers']}-layer transformer (dim {config['dim']}, "
        f"{config['heads']} heads / {config['kv_heads']} kv heads, vocab {config['vocab']}, "
        f"float32) on pp {config['pp']} gloo CPU processes with 1 thread each, "
        f"{config['cpu_count']} cores, torch {config['torch']}. Times: slowest rank, "
        f"{config['iters']} timed steps per library after {config['warmup']} warm-up steps, "
        "alternating libraries. Ratio: median over iterations of meshpipe's step / torch's "
        "step in the same iteration (below 1: meshpipe faster), with its IQR and the ratio "
        "of the two medians. Parity: largest |difference| of per-microbatch losses and of "
        "parameter gradients between the two libraries on the first step.",
        "",
        "| schedule | stages | layers/stage | torch median ms | torch IQR | torch min-max "
        "| meshpipe median ms | meshpipe IQR | meshpipe min-max | ratio | ratio IQR "
        "| ratio of medians | loss diff | grad diff |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for row in rows:
        cells = [row["schedule"], str(row["stages"]), str(row["layers_per_stage"])]
        for name in LIBRARIES:
            s = row[name]
            cells += [f"{s['median_ms']:.1f}", f"{s['q1_ms']:.1f}-{s['q3_ms']:.1f}",
                      f"{s['min_ms']:.1f}-{s['max_ms']:.1f}"]
        cells += [f"{row['ratio']:.3f}", f"{row['ratio_q1']:.3f}-{row['ratio_q3']:.3f}",
                  f"{row['ratio_of_medians']:.3f}", f"{row['max_loss_diff']:.1e}",
                  f"{row['max_grad_diff']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    if config.get("load_average"):
        lines += ["", f"Load average (1, 5, 15 min) before: {config['load_average']['before']}, "
                      f"after: {config['load_average']['after']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = {key: value for key, value in vars(args).items() if key != "out"}
    config.update(cpu_count=os.cpu_count(), torch=torch.__version__,
                  python=platform.python_version())
    before = load_average()
    print(f"spawning {args.pp} processes; load average {before}", flush=True)
    started = time.perf_counter()
    rows = spawn_ranks(_worker, args.pp, args)
    config["load_average"] = {"before": before, "after": load_average()}
    config["wall_s"] = round(time.perf_counter() - started, 1)
    table = markdown(config, rows)
    json_path, md_path = write_results(
        args.out, "pp_vs_torch.quick" if args.quick else "pp_vs_torch",
        {"config": config, "results": rows}, table)
    print(table)
    print(f"wrote {json_path} and {md_path} ({config['wall_s']} s)")


if __name__ == "__main__":
    main()
