"""The ``meshpipe`` command line: a thin argparse layer over the library.

``meshpipe schedule show`` builds, validates, simulates and draws one schedule;
``meshpipe schedule compare`` tabulates every schedule under one cost model;
``meshpipe train`` trains the reference transformer or a Hugging Face decoder (every flag is
a TrainConfig field, and ``--config run.toml`` gives them as a file); ``meshpipe export``
writes a checkpoint as a directory transformers loads; ``meshpipe tune`` measures the
model on this machine and ranks the layouts of a world size by predicted step time;
``meshpipe plot`` draws a run's loss.png from its metrics.jsonl; ``meshpipe demo`` runs the
project's showcase. Bad input prints one line and exits 2; a failed training run (a rank
raised, or --check found a difference) exits 1.

One module because it is one command line: each command is a few lines of glue over the
library, sharing the parser, its one-line errors (``CommandLineError``, ``_write``) and the
exit statuses, and ``meshpipe demo`` runs several of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import NoReturn, TextIO

from meshpipe.process_exit import exit_process
from meshpipe.schedules.builders import SCHEDULES, build
from meshpipe.schedules.builders import schedule_spec
from meshpipe.schedules.compare import Comparison, compare
from meshpipe.schedules.lowering import lower
from meshpipe.schedules.placement import PLACEMENTS
from meshpipe.schedules.render import comparison_table, to_png, to_text, write_chrome_trace
from meshpipe.schedules.costs import (RECOMPUTE_MODES, BackwardCostMismatch, CostModel,
                                      recompute_compute_fraction, recompute_memory_fraction)
from meshpipe.schedules.simulator import simulate
from meshpipe.schedules.validation import validate
from meshpipe.train.config import HF_FAMILIES, TrainConfig
from meshpipe.train.run.arguments import add_arguments as add_train_arguments
from meshpipe.train.run.arguments import from_arguments as train_config_from_arguments
from meshpipe.train.run.devices import plan_devices

USAGE_ERROR = 2


class CommandLineError(Exception):
    """Bad input on the command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(f"{self.prog}: error: {message} (see --help)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite cost >= 0, got {text}")
    return value


def _add_sizes(parser: argparse.ArgumentParser, *, vpp_default: int | None,
               vpp_help: str) -> None:
    parser.add_argument("--pp", type=_positive_int, required=True,
                        help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=_positive_int, required=True,
                        help="microbatches per step")
    parser.add_argument("--vpp", type=_positive_int, default=vpp_default, help=vpp_help)
    parser.add_argument("--forward-only", action="store_true",
                        help="the inference variant: forwards only")


def _add_costs(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cost model", "Times for one rank's share of the model (1/pp of it); a schedule with "
        "v stages per rank runs each stage at 1/v of them.")
    group.add_argument("--f", type=_cost, default=1.0, help="forward (default 1)")
    group.add_argument("--b", type=_cost, default=None,
                       help="full backward B; always --i plus --w, so that schedules with "
                       "split backwards compare fairly (default: their sum)")
    group.add_argument("--i", type=_cost, default=None,
                       help="input-gradient backward I (default: --b minus --w if both are "
                       "given, half of --b if only --b is, else 1)")
    group.add_argument("--w", type=_cost, default=None,
                       help="weight-gradient backward W (default: --b minus --i if both are "
                       "given, half of --b if only --b is, else 1)")
    group.add_argument("--comm", type=_cost, default=0.0,
                       help="latency of one message between ranks (default 0)")
    group.add_argument("--a2a", type=_cost, default=0.0,
                       help="expert-parallel all-to-all time of one forward (dispatch + "
                       "combine of every MoE layer); F, B and I each wait for it, W does "
                       "not, and an F+B overlap hides each all-to-all behind the other's "
                       "compute (default 0: a dense model)")
    recompute = parser.add_argument_group(
        "activation recomputation", "What the costs above become when backward recomputes "
        "activations: B and I pay for the recomputed forward, and fewer activations are "
        "kept (Korthikanti et al. 2022's per-layer estimate at these sizes).")
    recompute.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                           help="none; selective (the attention core only); full (each "
                           "transformer block) (default none)")
    recompute.add_argument("--seq-len", type=_positive_int, default=64,
                           help="tokens per sequence, sizing --recompute (default 64)")
    recompute.add_argument("--dim", type=_positive_int, default=64,
                           help="model width, sizing --recompute (default 64)")
    recompute.add_argument("--heads", type=_positive_int, default=4,
                           help="attention heads, sizing --recompute (default 4)")


def _costs(args: argparse.Namespace) -> CostModel:
    """The costs given by --f/--b/--i/--w/--comm/--a2a, before recomputation."""
    try:
        return CostModel(forward=args.f, backward=args.b, backward_input=args.i,
                         backward_weight=args.w, comm=args.comm, a2a=args.a2a)
    except BackwardCostMismatch as error:
        raise CommandLineError(f"meshpipe: error: {error.describe('--b', '--i', '--w')}"
                               ) from None


def _recomputed(costs: CostModel, args: argparse.Namespace) -> CostModel:
    """``costs`` under --recompute, with activation memory reported (1 = one microbatch's
    activations without recomputation)."""
    if costs.activation_bytes is None:
        costs = replace(costs, activation_bytes=1.0)
    return costs.with_recompute(args.recompute, seq_len=args.seq_len, dim=args.dim,
                                heads=args.heads)


def _recompute_description(args: argparse.Namespace) -> str:
    """What --recompute does at these sizes, in a few words ('' for none)."""
    if args.recompute == "none":
        return ""
    compute = recompute_compute_fraction(args.recompute, args.seq_len, args.dim)
    memory = recompute_memory_fraction(args.recompute, args.seq_len, args.dim, args.heads)
    passes = "B, I and W" if args.recompute == "full" else "B and I"
    return (f"recompute {args.recompute} (seq-len {args.seq_len}, dim {args.dim}, heads "
            f"{args.heads}): {passes} re-run {100 * compute:.3g}% of F, "
            f"{100 * memory:.3g}% of activations kept")


def _a2a_cost(costs: CostModel) -> str:
    """The all-to-all cost for a costs heading: ' a2a=...' when there is one, else ''."""
    return f" a2a={costs.a2a:g}" if costs.a2a else ""


def _recompute_document(args: argparse.Namespace) -> dict[str, object]:
    """--recompute and what it means at these sizes, for the JSON comparison."""
    return {"mode": args.recompute, "seq_len": args.seq_len, "dim": args.dim,
            "heads": args.heads,
            "compute_fraction": recompute_compute_fraction(args.recompute, args.seq_len,
                                                           args.dim),
            "memory_fraction": recompute_memory_fraction(args.recompute, args.seq_len,
                                                         args.dim, args.heads)}


def _parser() -> _Parser:
    parser = _Parser(prog="meshpipe", description="Pipeline-, context-, tensor-, data- and "
                     "expert-parallel training for PyTorch: schedules as data, one executor.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    schedule = commands.add_parser("schedule", help="build, simulate and draw schedules")
    schedule_commands = schedule.add_subparsers(dest="schedule_command", required=True,
                                                metavar="SUBCOMMAND")
    show = schedule_commands.add_parser(
        "show", help="one schedule: text grid, bubble, makespan, peak activations")
    show.add_argument("name", choices=SCHEDULES, metavar="NAME",
                      help=f"one of: {', '.join(SCHEDULES)}")
    _add_sizes(show, vpp_default=None, vpp_help="stages per rank (default 2 for interleaved "
               "and combined-1f1b, else 1; gpipe / 1f1b take any)")
    show.add_argument("--placement", choices=PLACEMENTS,
                      help="stage placement for gpipe / 1f1b (default: the schedule's own)")
    show.add_argument("--lowered", action="store_true",
                      help="insert SEND/RECV actions (shown in --csv and --trace)")
    show.add_argument("--png", type=Path, help="write a picture here")
    show.add_argument("--trace", type=Path, help="write a Chrome trace (Perfetto) here")
    show.add_argument("--csv", type=Path, help="write the schedule's CSV form here")
    _add_costs(show)
    show.set_defaults(handler=_show)

    comparison = schedule_commands.add_parser(
        "compare", help="every schedule's bubble, makespan and peak activations")
    _add_sizes(comparison, vpp_default=2,
               vpp_help="virtual stages per rank of interleaved and combined-1f1b (default 2)")
    comparison.add_argument("--json", type=Path, help="write the comparison as JSON here")
    _add_costs(comparison)
    comparison.set_defaults(handler=_compare)

    train = commands.add_parser(
        "train", help="train the reference transformer or a Hugging Face decoder (--model) on "
        "the shipped corpus or your text (--data)",
        description=f"Train the reference transformer, or a Hugging Face {HF_FAMILIES} "
        "directory (--model), with any pipeline schedule and parallel layout, on the shipped "
        "corpus or your own text (--data): one local process per rank (on the "
        "GPUs where there are, else on the CPU: --device, --backend), or the processes "
        "torchrun started. Every flag is a field of meshpipe.train.config.TrainConfig; "
        "--config run.toml gives them as a TOML file, and the flags given on the command line "
        "override it.")
    add_train_arguments(train)
    train.set_defaults(handler=_train)

    export = commands.add_parser(
        "export", help="write a checkpoint as a directory transformers loads",
        description="Write a checkpoint as a Hugging Face directory (config.json + "
        "safetensors) that transformers.AutoModelForCausalLM.from_pretrained loads: a --model "
        "run in its own architecture and names, a reference-transformer run as a Llama.")
    export.add_argument("--checkpoint", type=Path, required=True,
                        help="a checkpoint directory (<out-dir>/checkpoint/step-NNNNNN), or a "
                        "run's out-dir or checkpoint root (its newest complete checkpoint)")
    export.add_argument("--out", type=Path, required=True, help="directory to write")
    export.add_argument("--model", default=None,
                        help="the Hugging Face model directory the run trained (default: the "
                        "one its checkpoint records)")
    export.set_defaults(handler=_export)

    _add_tune_parser(commands)
    _add_plan_parser(commands)

    plot = commands.add_parser(
        "plot", help="draw a run's loss, learning rate and gradient norm into loss.png",
        description="Draw OUT-DIR/metrics.jsonl (training and validation loss, learning "
        "rate and gradient norm against the step) into OUT-DIR/loss.png: any run, also one "
        "that failed or still runs. Every run draws it at its end.")
    plot.add_argument("out_dir", type=Path, metavar="OUT-DIR", help="a run's --out-dir")
    plot.set_defaults(handler=_plot)

    demo = commands.add_parser("demo", help="the showcase: train PP=2 x CP=2 on 4 processes, "
                               "then compare the schedules and draw one")
    demo.add_argument("--out", type=Path, default=Path("out"),
                      help="directory for metrics and pictures (default: out)")
    demo.add_argument("--steps", type=_positive_int, default=DEMO_CONFIG.steps,
                      help=f"training steps (default {DEMO_CONFIG.steps})")
    demo.set_defaults(handler=_demo)
    return parser


# TrainConfig fields that are the layout `meshpipe tune` chooses, not input to it.
_TUNED_FIELDS = ("pp", "vpp", "dp", "cp_ulysses", "cp_ring", "schedule", "placement")


def _memory_size(text: str) -> int:
    from meshpipe.schedules.ranking import TuneError, parse_bytes

    try:
        return parse_bytes(text)
    except TuneError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_tune_parser(commands) -> None:
    tune = commands.add_parser(
        "tune", help="measure the model on this machine, then rank the layouts of a world "
        "size by predicted step time and peak memory",
        description="Measure the reference transformer in a short run on --world-size local "
        "processes, fit a cost model (F, I, W per layer, messages, all-reduce, optimizer, "
        "activation and parameter memory), then simulate every layout (pp, vpp, dp, Ulysses "
        "cp, microbatches, schedule) of that world size and print the fastest that fit "
        "--memory-budget. The model and batch flags are meshpipe train's (and --config); "
        "--write saves the pick for meshpipe train --config.")
    tune.add_argument("--world-size", type=_positive_int, required=True,
                      help="processes (ranks) to lay out")
    tune.add_argument("--memory-budget", type=_memory_size, default=None,
                      help="memory per rank: bytes or a size such as 2GB or 512MiB (default: "
                      "no limit)")
    _add_ranking_arguments(tune)
    add_train_arguments(tune)
    tune.set_defaults(handler=_tune)


def _add_ranking_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``meshpipe tune`` and ``plan`` share: the batch to lay out, how many layouts to
    print, where to save the pick."""
    parser.add_argument("--top", type=_positive_int, default=10,
                        help="layouts to print (default 10)")
    parser.add_argument("--global-batch", type=_positive_int, default=None,
                        help="sequences per step (default: dp x microbatches x "
                        "microbatch-size of the train flags)")
    parser.add_argument("--write", type=Path, metavar="RUN.toml",
                        help="save the fastest layout as a TOML file for meshpipe train "
                        "--config")


def _refuse_layout_flags(args: argparse.Namespace, command: str, fields: Sequence[str]) -> None:
    """``meshpipe tune`` and ``plan`` choose the layout: a layout flag given is an error."""
    chosen = [f"--{name.replace('_', '-')}" for name in fields if hasattr(args, name)]
    if chosen:
        raise CommandLineError(f"meshpipe {command}: error: {command} chooses the layout: "
                               f"drop {', '.join(chosen)}")


def _write_pick(path: Path, config: TrainConfig, out: TextIO) -> None:
    """The chosen layout as a TOML file for ``meshpipe train --config``."""
    from meshpipe.train.run.toml_config import to_toml

    _write(path, lambda: to_toml(config))
    out.write(f"\nwrote {path}: meshpipe train --config {path}\n")


def _add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="predict and rank the layouts of a model on a cluster of GPUs, from a "
        "description (nothing runs)",
        description="Search every layout (tp within a node, pp, vpp, cp ring or Ulysses, dp, "
        "ep, --zero, microbatches, schedule, recompute) of --gpus GPUs of --cluster for the "
        "model (--model DIR: only its config.json is read; or the reference model's flags) at "
        "--seq-len and --global-batch, predict each one's step, MFU, bubble, exposed "
        "communication and memory per GPU, and print the fastest that fit (docs/planning.md). "
        "--write saves the pick for meshpipe train --config.")
    plan.add_argument("--gpus", type=_positive_int, required=True, help="GPUs to lay out")
    plan.add_argument("--cluster", default="h100",
                      help="h100, h200, a100 (nodes of 8) or a TOML file describing one "
                      "(default h100)")
    _add_ranking_arguments(plan)
    plan.add_argument("--efficiency-from", type=Path, metavar="GPU_BENCH.json",
                      help="fit the GPU's efficiency to a step benchmarks/gpu_bench.py measured "
                      "on one of its GPUs (default: the curve measured on an H100)")
    add_train_arguments(plan)
    plan.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace, out: TextIO) -> int:
    """Plan, print the table; the pick as TOML with --write."""
    from meshpipe.schedules.cluster import cluster_named, describe
    from meshpipe.schedules.plan_space import PlanRequest
    from meshpipe.schedules.planner import plan, table
    from meshpipe.train.tune.planning import (PLANNED_FIELDS, config_for_layout,
                                              efficiency_from_gpu_bench, model_shape,
                                              runnable_by_meshpipe)
    from meshpipe.train.tune.tuner import global_batch_of

    _refuse_layout_flags(args, "plan", PLANNED_FIELDS)
    config = train_config_from_arguments(args)
    model, cluster = model_shape(config), cluster_named(args.cluster)
    batch = args.global_batch or global_batch_of(config)
    started = time.perf_counter()
    # Selective recomputation re-runs the reference model's attention core only.
    recompute = ("none", "full") if config.model else RECOMPUTE_MODES
    request = PlanRequest(model, cluster, args.gpus, config.seq_len, batch,
                          recompute=recompute)
    if args.efficiency_from:
        request, fitted = efficiency_from_gpu_bench(args.efficiency_from, request)
        out.write(fitted + "\n")
    result = plan(request, args.top, runnable_by_meshpipe(config, model))
    out.write(f"{model.name}: {model.parameters() / 1e9:.2f}B parameters "
              f"({model.active_parameters() / 1e9:.2f}B active), seq-len {config.seq_len}, "
              f"global batch {batch} on {args.gpus} GPUs of {describe(cluster)}\n"
              f"{result.layouts} layouts, {result.too_large} too large for a GPU, "
              f"{result.refused} refused by meshpipe train's checks, {result.simulated} "
              f"schedules simulated in {time.perf_counter() - started:.1f} s\n\n")
    out.write(table(result.predictions, args.top))
    if args.write:
        _write_pick(args.write, config_for_layout(result.predictions[0].layout, config), out)
    return 0


def _tune(args: argparse.Namespace, out: TextIO) -> int:
    """Tune, print the table; exit status 1 if the measuring run failed."""
    from meshpipe.schedules.ranking import table
    from meshpipe.train.supervisor.launch import LaunchError, reports_for_the_job
    from meshpipe.train.tune.measure import config_for
    from meshpipe.train.tune.tuner import tune

    _refuse_layout_flags(args, "tune", _TUNED_FIELDS)
    config = train_config_from_arguments(args)
    try:
        result = tune(config, args.world_size, args.memory_budget, args.global_batch)
    except LaunchError as error:
        print(f"meshpipe: the measuring run failed: {error}", file=sys.stderr)
        return 1
    if not reports_for_the_job():
        return 0
    measured = result.measurement
    out.write(f"measured {measured.layout.describe()} on {args.world_size} processes: step "
              f"{1000 * measured.step_s:.1f} ms, pipeline {1000 * measured.pipeline_s:.1f} ms; "
              f"{len(result.predictions)} layouts fit"
              f"{'' if args.memory_budget is None else ' the budget'}\n\n")
    out.write(table(result.predictions, args.top))
    if args.write:
        _write_pick(args.write, config_for(result.predictions[0].layout, config), out)
    return 0


def _show(args: argparse.Namespace, out: TextIO) -> None:
    virtual = args.vpp or schedule_spec(args.name).native_stages_per_rank(2)
    schedule = build(args.name, args.pp, args.microbatches, stages_per_rank=virtual,
                     placement=args.placement, forward_only=args.forward_only)
    if args.lowered:
        schedule = lower(schedule)
    validate(schedule)
    simulation = simulate(schedule, _recomputed(_costs(args), args).for_stages_of(schedule))
    out.write(to_text(simulation))
    out.write(f"bubble per rank: "
              f"{' '.join(f'{100 * r:.1f}%' for r in simulation.bubble_ratios)}\n")
    out.write(f"peak live activations per rank: "
              f"{' '.join(str(p) for p in simulation.peak_activations)}\n")
    out.write(f"peak activation memory per rank: "
              f"{' '.join(f'{m:.3g}' for m in simulation.peak_activation_bytes)} (1 = one "
              f"microbatch's activations on one rank's share without recomputation)\n")
    if args.a2a:
        out.write(f"expert-parallel all-to-all a2a={args.a2a:g} (one rank's share): F, B and I "
                  f"wait for it; an F+B overlap hides it behind the other half's compute\n")
    if args.recompute != "none":
        out.write(_recompute_description(args) + "\n")
    if args.csv:
        _write(args.csv, schedule.to_csv)
        out.write(f"wrote {args.csv}\n")
    if args.png:
        _write(args.png, lambda path: to_png(simulation, path), path_argument=True)
        out.write(f"wrote {args.png}\n")
    if args.trace:
        _write(args.trace, lambda path: write_chrome_trace(simulation, path),
               path_argument=True)
        out.write(f"wrote {args.trace}\n")


def _compare(args: argparse.Namespace, out: TextIO) -> None:
    costs = _costs(args)
    rows = _print_comparison(out, args.pp, args.microbatches, args.vpp, costs,
                             forward_only=args.forward_only,
                             simulated=_recomputed(costs, args),
                             recompute=_recompute_description(args))
    if args.json:
        document = {"num_ranks": args.pp, "num_microbatches": args.microbatches,
                    "stages_per_rank": args.vpp, "forward_only": args.forward_only,
                    "costs": asdict(costs), "recompute": _recompute_document(args),
                    "schedules": [r.as_dict() for r in rows]}
        _write(args.json, lambda: json.dumps(document, indent=2) + "\n")
        out.write(f"wrote {args.json}\n")


_COMPARISON_NOTE = ("\nCosts are per rank's share of the model (1/pp of it); a schedule with v "
                    "stages per rank runs each stage at 1/v of them. Peak live activations counts "
                    "(stage, microbatch) pairs; peak activation memory is in units of one "
                    "microbatch's activations on one rank's share without recomputation.\n")


def _print_comparison(out: TextIO, pp: int, microbatches: int, vpp: int, costs: CostModel,
                      forward_only: bool = False, simulated: CostModel | None = None,
                      recompute: str = "") -> list[Comparison]:
    """Compare every schedule, write the heading, table and note; return the rows.

    The heading shows ``costs``; the schedules run ``simulated`` (default: ``costs``), which
    ``recompute`` describes when they differ."""
    rows = compare(pp, microbatches, stages_per_rank=vpp,
                   costs=costs if simulated is None else simulated, forward_only=forward_only)
    out.write(f"pp={pp}, microbatches={microbatches}, vpp={vpp}; costs F={costs.forward:g} "
              f"B={costs.backward:g} I={costs.backward_input:g} W={costs.backward_weight:g} "
              f"comm={costs.comm:g}{_a2a_cost(costs)}{'; ' + recompute if recompute else ''}"
              f"\n\n")
    out.write(comparison_table(rows))
    out.write(_COMPARISON_NOTE)
    return rows


def run_demo(out_dir: Path, out: TextIO) -> None:
    """The showcase: compare every schedule at pp=4, m=8 and draw the one with the
    smallest bubble into ``out_dir/schedule.png``."""
    rows = _print_comparison(out, 4, 8, 2, CostModel())
    best = min((r for r in rows if r.simulation is not None),
               key=lambda r: r.simulation.bubble_ratio)
    path = out_dir / "schedule.png"
    _write(path, lambda target: to_png(best.simulation, target),
           path_argument=True)
    out.write(f"\nwrote {path}: {best.name}, the smallest bubble "
              f"({100 * best.simulation.bubble_ratio:.1f}%)\n")


def _train(args: argparse.Namespace, out: TextIO) -> int:
    return _train_and_report(train_config_from_arguments(args))


def _train_and_report(config: TrainConfig) -> int:
    """Train; exit status 1 if a rank failed or the --check parity comparison failed, 3 if
    --max-restarts stopped a crash loop, 128 + the signal's number if a signal stopped it. A failure is one line (the tracebacks are in
    the out-dir's logs)."""
    # Imported here: torch loads in seconds, and the schedule commands do not need it.
    from meshpipe.train.supervisor.launch import Interrupted, LaunchError
    from meshpipe.train.supervisor.restarts import CrashLoop
    from meshpipe.train.loop.trainer import run as run_training

    try:
        metrics = run_training(config)
    except CrashLoop as loop:
        print(f"{_below_the_bar(config)}meshpipe: training stopped: {loop}"
              f"{_loss_so_far(config)}", file=sys.stderr)
        return loop.exit_code
    except LaunchError as error:
        print(f"{_below_the_bar(config)}meshpipe: training failed: {error}"
              f"{_loss_so_far(config)}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(f"{_below_the_bar(config)}meshpipe: training {stop}; {_how_to_go_on(config)}"
              f"{_loss_so_far(config)}", file=sys.stderr)
        return stop.exit_code
    check = (metrics or {}).get("check")
    return 1 if check and not check["passed"] else 0


def _below_the_bar(config: TrainConfig) -> str:
    """A line break where rank 0's progress bar may stand unfinished on the terminal (a
    stopped rank does not end its line), so that the one line of the failure starts a line."""
    return "\n" if config.progress and sys.stderr.isatty() else ""


def _how_to_go_on(config: TrainConfig) -> str:
    """``--resume`` where the run saved a checkpoint to resume from, else how to save one."""
    from meshpipe.train.checkpoints.resume import checkpoint_root
    from meshpipe.train.checkpoints.store import newest

    saved = newest(checkpoint_root(config))
    if saved is not None:
        return f"resume with --resume (from {saved.directory.name})"
    return ("no checkpoint was saved, so a new run starts from step 1 (--checkpoint-every N "
            "saves during a run, --checkpoint-on-signal when it is stopped)")


def _loss_so_far(config: TrainConfig) -> str:
    """Draw the steps a failed or stopped run took (they tell where it went wrong): the
    end of its one-line report; '' where it took none, the picture cannot be written (the
    failure matters more) or another rank reports."""
    from meshpipe.train.supervisor.launch import reports_for_the_job
    from meshpipe.train.outputs.plots import plot_run

    if not reports_for_the_job():
        return ""
    try:
        return f"; the loss so far in {plot_run(config.out_dir)}"
    except (ValueError, OSError):
        return ""


def _plot(args: argparse.Namespace, out: TextIO) -> int:
    from meshpipe.train.outputs.plots import plot_run

    try:
        path = plot_run(args.out_dir)
    except OSError as error:
        raise CommandLineError(f"meshpipe plot: error: cannot draw {args.out_dir}: {error}"
                               ) from None
    out.write(f"wrote {path}\n")
    return 0


def _export(args: argparse.Namespace, out: TextIO) -> int:
    from meshpipe.train.checkpoints import store as checkpoint
    from meshpipe.train.run import sources
    saved = checkpoint.find(args.checkpoint)
    model = saved.config.get("model", "") if args.model is None else args.model
    exported = sources.export(saved.directory, args.out, model)
    out.write(f"exported step {saved.step} of {saved.directory} to {exported}\n")
    return 0


DEMO_CONFIG = TrainConfig(pp=2, cp_ring=2, schedule="1f1b", microbatches=4, microbatch_size=4,
                          seq_len=128, dim=128, layers=4, heads=4, kv_heads=2, steps=80,
                          lr=3e-3, min_lr=3e-4, warmup_steps=8, eval_every=20, check=True,
                          timeline_step=5)


def _demo(args: argparse.Namespace, out: TextIO) -> int:
    config = replace(DEMO_CONFIG, out_dir=str(args.out / "train"), steps=args.steps,
                     timeline_step=min(DEMO_CONFIG.timeline_step, args.steps))
    devices = plan_devices(config.device, config.backend, config.world_size)
    where = f"processes on {devices.gpus} GPU(s)" if devices.on_gpu else "CPU processes"
    out.write(f"Training the reference transformer on the shipped Shakespeare corpus: pp "
              f"{config.pp} x cp ring {config.cp_ring} = {config.world_size} {where}, "
              f"schedule {config.schedule}, {config.steps} steps.\n")
    out.flush()
    status = _train_and_report(config)
    if status:
        return status
    out.write(f"measured timeline of step {config.timeline_step}: "
              f"{Path(config.out_dir) / 'timeline.png'}\n\n")
    run_demo(args.out, out)
    return 0


def _write(path: Path, produce, *, path_argument: bool = False) -> None:
    """Write a file (creating its directory); an unwritable path is a command-line error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path_argument:
            produce(path)
        else:
            path.write_text(produce(), encoding="utf-8")
    except OSError as error:
        raise CommandLineError(f"cannot write {path}: {error.strerror or error}") from None


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 for bad input)."""
    out = sys.stdout if out is None else out
    try:
        args = _parser().parse_args(argv)
        return args.handler(args, out) or 0
    except (CommandLineError, ValueError) as error:
        message = " ".join(str(error).split())
        prefix = "" if isinstance(error, CommandLineError) else "meshpipe: error: "
        print(f"{prefix}{message}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        # The reader went away (`meshpipe schedule compare ... | head`): not an error.
        # Point stdout at devnull so the interpreter's final flush does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def entry() -> NoReturn:
    """The ``meshpipe`` command: ``main``'s exit status, without the interpreter's teardown
    (``meshpipe.process_exit``)."""
    exit_process(main())


if __name__ == "__main__":
    entry()
