"""The GPU check: a short ``--check`` training run of every key layout on the GPUs there are.

    make gpu-check                                  # pytest -m gpu, then this, then gpu_bench
    python benchmarks/gpu_check.py                  # every layout, 3 steps each
    python benchmarks/gpu_check.py --only pp2-1f1b cp-ring2 --jobs 1
    python benchmarks/gpu_check.py --cpu-rehearsal  # the same harness on CPU processes

Each layout runs ``meshpipe train <layout> --check --steps 3``. ``--check`` compares step 1
(loss and every gradient) with a one-process run of the same model on the CPU; the table
shows that verdict, the loss and largest gradient differences and the median step time read
from the run's ``metrics.json``. How a layout runs depends on the GPUs:

- **nccl**: a layout of at most as many ranks as GPUs runs under ``torchrun --standalone``,
  one process per GPU with NCCL, as on a cluster;
- **shared**: a layout of several ranks also runs with the local launcher on ranks that
  share the GPUs over gloo (``--device cuda --backend gloo``: compute on the GPU, messages
  and collectives through host memory), so that one GPU checks every layout's CUDA path.

So one GPU runs the one-rank layouts on NCCL and the others shared; N GPUs add NCCL runs of
the layouts of up to N ranks. Runs go ``--jobs`` at a time (their step times then share the
machine; ``--jobs 1`` for clean times). A failing run is recorded with the lines that
explain it and the others still run.

Among the layouts are ``--zero`` 0, 1 and 2 at dp 2, and Hugging Face decoders (``--model``:
Qwen3, Gemma 3 with sliding-window layers, Phi-3, Mixtral with ``--ep 2``) and
vision-language models from tiny random checkpoints the check writes itself (``made_input``:
nothing is downloaded). A closing line for each way they ran compares the bytes a rank's
optimizer state takes under ``--zero 1`` and ``2`` with ``--zero 0`` (``metrics.json``'s
``memory``: read from the CUDA allocator; on a CPU rehearsal, the state tensors' sizes).

Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md`` (default ``benchmarks/results``);
a ``--cpu-rehearsal`` (the one-rank layouts under torchrun, the others local, all on CPU
processes with gloo) writes nothing unless ``--out`` is given. Exit status 1 if any run
failed, 0 otherwise (also when there is no CUDA device: then nothing runs).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import re
import statistics
import string
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from harness import RESULTS, publish
from meshpipe.train.run.arguments import add_arguments, from_arguments

TESTS = Path(__file__).resolve().parent.parent / "tests"
COMMON = ["--no-progress", "--eval-every", "0", "--timeline-step", "0"]
# The shipped corpus, whose paragraphs are the documents that --pack packs.
CORPUS = str(resources.files("meshpipe.train").joinpath("data/shakespeare.txt"))
PACKED = ("--data", CORPUS, "--pack", "--seq-len", "128")
VISION = ("--data", "{shapes}", "--seq-len", "128")
# The transformers architecture of each decoder placeholder (``made_input``).
DECODERS = {"qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3", "mixtral": "mixtral"}
VISION_MODELS = ("qwen2_vl", "llava")
ZERO_LAYOUTS = {level: f"dp2-zero{level}-bf16" for level in (0, 1, 2)}


@dataclass(frozen=True)
class Layout:
    name: str
    args: tuple[str, ...]
    note: str = ""

    @property
    def ranks(self) -> int:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return from_arguments(parser.parse_args(list(self.args))).world_size


@dataclass(frozen=True)
class Run:
    """One layout run one way: ``"nccl"`` (torchrun, a GPU per rank) or ``"shared"`` (the
    local launcher, ranks sharing the GPUs over gloo)."""

    layout: Layout
    how: str


LAYOUTS = [
    # One rank.
    Layout("pp1-1f1b", ("--pp", "1"), "device placement, no p2p"),
    Layout("pp1-bf16", ("--pp", "1", "--dtype", "bf16"),
           "bf16 weights with fp32 masters, CUDA autocast"),
    Layout("pp1-moe4-combined-1f1b", ("--pp", "1", "--moe-experts", "4", "--moe-top-k", "2",
                                      "--schedule", "combined-1f1b"),
           "expert exchanges on the comm thread's CUDA stream"),
    # Pipeline parallelism (on NCCL: payloads, gloo headers, a reverse group per direction).
    Layout("pp2-1f1b", ("--pp", "2", "--schedule", "1f1b")),
    Layout("pp2-vpp2-interleaved", ("--pp", "2", "--vpp", "2", "--schedule", "interleaved")),
    Layout("pp2-vpp2-zb-v", ("--pp", "2", "--vpp", "2", "--schedule", "zb-v")),
    Layout("pp2-batched-p2p", ("--pp", "2", "--p2p", "batched"),
           "batch_isend_irecv"),
    Layout("pp2-bf16", ("--pp", "2", "--dtype", "bf16", "--joint-projections", "on",
                        "--grad-accumulation-fusion", "on"),
           "CUDA's eager defaults spelled out, so that a CPU rehearsal runs them too"),
    # Context, data, tensor and expert parallelism.
    Layout("cp-ring2", ("--pp", "1", "--cp-ring", "2")),
    Layout("cp-ulysses2", ("--pp", "1", "--cp-ulysses", "2")),
    Layout("dp2", ("--pp", "1", "--dp", "2")),
    Layout("tp2", ("--pp", "1", "--tp", "2")),
    Layout("tp2-sequence-parallel", ("--pp", "1", "--tp", "2", "--sequence-parallel")),
    Layout("ep2-dp2-combined-1f1b", ("--pp", "1", "--dp", "2", "--moe-experts", "4", "--ep",
                                     "2", "--schedule", "combined-1f1b")),
    # A layer's experts as grouped products (torch._grouped_mm: bf16 on CUDA).
    Layout("pp1-moe4-bf16-grouped", ("--pp", "1", "--moe-experts", "4", "--moe-top-k", "2",
                                     "--dtype", "bf16", "--grouped-experts", "on",
                                     "--grad-accumulation-fusion", "on"),
           "each projection's gradient added into the experts' masters at once"),
    Layout("ep2-dp2-bf16-grouped-combined", ("--pp", "1", "--dp", "2", "--moe-experts", "4",
                                             "--ep", "2", "--moe-top-k", "2", "--dtype", "bf16",
                                             "--grouped-experts", "on", "--schedule",
                                             "combined-1f1b")),
    Layout("ep2-dp2-tp2-sp-bf16-grouped-top4", ("--pp", "1", "--dp", "2", "--tp", "2",
                                                "--sequence-parallel", "--moe-experts", "4",
                                                "--ep", "2", "--moe-top-k", "4", "--dtype",
                                                "bf16", "--grouped-experts", "on",
                                                "--schedule", "combined-1f1b"),
           "each expert's width split over tp, the sequence gathered to route; every token to "
           "all 4 experts, as tp's bf16 attention moves near-tie picks of top 2"),
    Layout("pp2-dualpipe-v-moe4-bf16-grouped", ("--pp", "2", "--schedule", "dualpipe-v",
                                                "--moe-experts", "4", "--moe-top-k", "2",
                                                "--dtype", "bf16", "--grouped-experts", "on"),
           "a split backward: each half runs its own grouped products (joint ones too)"),
    # ZeRO in bf16: float32 masters and moments whole on each rank, or sharded over dp.
    Layout(ZERO_LAYOUTS[0], ("--pp", "1", "--dp", "2", "--zero", "0", "--dtype", "bf16"),
           "optimizer state whole on each rank"),
    Layout(ZERO_LAYOUTS[1], ("--pp", "1", "--dp", "2", "--zero", "1", "--dtype", "bf16"),
           "moments and masters sharded, shards all-gathered in bf16"),
    Layout(ZERO_LAYOUTS[2], ("--pp", "1", "--dp", "2", "--zero", "2", "--dtype", "bf16"),
           "as --zero 1, the reduced gradients sharded too"),
    Layout("pp2-stage-tp-2,1", ("--pp", "2", "--stage-tp", "2,1"),
           "VTP: stages of different tp sizes"),
    Layout("pp2-cp-ring2", ("--pp", "2", "--cp-ring", "2"), "the demo layout"),
    Layout("pp2-tp2", ("--pp", "2", "--tp", "2")),
    # Ring attention's tiles and packed documents in half precision.
    Layout("cp-ring2-bf16", ("--pp", "1", "--cp-ring", "2", "--dtype", "bf16"),
           "ring tiles on the flash kernel in bf16"),
    Layout("packed-cp-ring2-bf16", ("--pp", "1", "--cp-ring", "2", "--dtype", "bf16", *PACKED),
           "packed documents: one variable-length call per ring step"),
    Layout("packed-hybrid2x2-fp16", ("--pp", "1", "--cp-ring", "2", "--cp-ulysses", "2",
                                     "--dtype", "fp16", *PACKED)),
    Layout("packed-cp-ulysses2-bf16", ("--pp", "1", "--cp-ulysses", "2", "--dtype", "bf16",
                                       "--heads", "8", "--kv-heads", "4", *PACKED),
           "Ulysses in two head groups around the variable-length kernel"),
    Layout("packed-pp1-bf16", ("--pp", "1", "--dtype", "bf16", *PACKED),
           "a pack as one variable-length flash call per layer"),
    # torch.compile (inductor) of each block; under ZB-V only the weightless pieces.
    Layout("pp1-bf16-compile", ("--pp", "1", "--dtype", "bf16", "--compile", "--chunk-graphs",
                                "on"),
           "the chunk one graph, each block a nested region with its SDPA call inside"),
    Layout("pp2-bf16-compile-blocks", ("--pp", "2", "--dtype", "bf16", "--compile",
                                       "--chunk-graphs", "off"),
           "a block one graph, its SDPA call inside"),
    Layout("packed-pp1-bf16-compile", ("--pp", "1", "--dtype", "bf16", "--compile", *PACKED),
           "a block one graph, the variable-length call inside"),
    Layout("pp2-vpp2-zb-v-compile", ("--pp", "2", "--vpp", "2", "--schedule", "zb-v",
                                     "--compile")),
    # Hugging Face decoders (tiny random checkpoints, made on the spot: ``made_input``).
    Layout("hf-qwen3-pp2", ("--pp", "2", "--model", "{qwen3}"), "per-head q/k norms"),
    Layout("hf-qwen3-pp2-bf16-compile", ("--pp", "2", "--model", "{qwen3}", "--dtype", "bf16",
                                         "--compile", "--chunk-graphs", "on"),
           "each stage's layers one graph of nested layer regions"),
    Layout("hf-gemma3-window-pp2-bf16", ("--pp", "2", "--model", "{gemma3}", "--seq-len", "64",
                                         "--dtype", "bf16"),
           "sliding window of 6 (variable-length flash) and full layers, tied head"),
    Layout("hf-phi3-pp2-tp2", ("--pp", "2", "--tp", "2", "--model", "{phi3}"),
           "fused q/k/v and gate/up projections split over tp"),
    Layout("hf-mixtral-dp2-ep2", ("--pp", "1", "--dp", "2", "--ep", "2", "--model", "{mixtral}"),
           "4 experts a layer over 2 ranks (fp32: bf16 moves near-tie picks, docs/limits.md)"),
    # Vision-language models (tiny random ones, made on the spot: ``made_input``).
    Layout("vl-qwen2-vl-pp2", ("--pp", "2", "--model", "{qwen2_vl}", *VISION),
           "the tower on stage 0, each microbatch at its own length"),
    Layout("vl-qwen2-vl-pp2-bf16", ("--pp", "2", "--model", "{qwen2_vl}", "--dtype", "bf16",
                                    *VISION)),
    Layout("vl-qwen2-vl-pp2-tp2-sp", ("--pp", "2", "--tp", "2", "--sequence-parallel",
                                      "--model", "{qwen2_vl}", *VISION),
           "the image features placed over the whole sequence, then sequence-sharded"),
    Layout("vl-llava-pp2-packed", ("--pp", "2", "--model", "{llava}", "--pack", *VISION),
           "CLIP tower, samples packed whole"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="layouts: " + ", ".join(l.name for l in LAYOUTS))
    parser.add_argument("--steps", type=int, default=3, help="training steps per layout")
    parser.add_argument("--only", nargs="+", metavar="LAYOUT", help="run these layouts only")
    parser.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="runs at a time (default: a quarter of the cores, at most 4)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where gpu_check.json/.md go (default {RESULTS}; a CPU "
                             "rehearsal writes nothing unless given)")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run the harness on CPU processes (gloo) to try it without a GPU; "
                             "its figures are not GPU results")
    parser.add_argument("--max-ranks", type=int, default=4,
                        help="CPU rehearsal: largest layout run (default 4)")
    args = parser.parse_args(argv)
    unknown = set(args.only or []) - {l.name for l in LAYOUTS}
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(sorted(unknown))}; choose from "
                     + ", ".join(l.name for l in LAYOUTS))
    return args


def planned_runs(layouts: list[Layout], gpus: int) -> list[Run]:
    """Each layout on NCCL where it has a GPU per rank, and shared where it has several
    ranks (see the module docstring); ``gpus`` 1 for the CPU rehearsal's same structure."""
    runs = []
    for layout in layouts:
        if layout.ranks <= gpus:
            runs.append(Run(layout, "nccl"))
        if layout.ranks > 1:
            runs.append(Run(layout, "shared"))
    return runs


def placeholders(args: tuple[str, ...]) -> set[str]:
    """The ``{name}`` placeholders of a layout's arguments."""
    return {field for arg in args for _, field, _, _ in string.Formatter().parse(arg) if field}


@functools.lru_cache(maxsize=None)
def made_input(name: str) -> str:
    """What the placeholder ``{name}`` stands for, made once in a temporary directory as the
    tests make it (nothing is downloaded): a tiny random decoder of ``DECODERS`` (Gemma 3's
    with sliding-window and full layers, ``hf_models.GEMMA3``), a vision-language model of
    ``VISION_MODELS``, or ``shapes``, the shapes corpus."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from hf_models import save_tiny_model, save_tiny_vision_model

    from meshpipe.train.data.shapes import write_shapes_corpus

    where = Path(tempfile.mkdtemp(prefix=f"meshpipe-gpu-check-{name}-")) / name
    if name == "shapes":
        return str(write_shapes_corpus(where, 64))
    if name in VISION_MODELS:
        return str(save_tiny_vision_model(where, name))
    return str(save_tiny_model(where, DECODERS[name]))


def _filled(args: tuple[str, ...]) -> list[str]:
    """A layout's arguments with ``{name}`` placeholders made real (``made_input``)."""
    made = {name: made_input(name) for name in placeholders(args)}
    return [arg.format(**made) for arg in args]


def command(run: Run, steps: int, out_dir: str, rehearsal: bool) -> list[str]:
    train = [*_filled(run.layout.args), "--check", "--steps", str(steps), *COMMON, "--out-dir",
             out_dir, "--device", "cpu" if rehearsal else "cuda"]
    if run.how == "nccl":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(run.layout.ranks), "-m", "meshpipe", "train", *train]
    return [sys.executable, "-m", "meshpipe", "train", *train, "--backend", "gloo"]


def progress_line(row: dict) -> str:
    """A finished run's line, with its figures: a run's record if the check is stopped
    before it writes its table."""
    figures = [f"{label} {row[key]:.1e}" for label, key in (
        ("loss diff", "loss_difference"), ("max grad diff", "max_grad_difference"))
        if row[key] is not None]
    if row["median_step_seconds"] is not None:
        figures.append(f"step {row['median_step_seconds']:.4f} s")
    if row["status"] != "PASS":
        figures.append(row["note"])
    return (f"gpu_check: {row['status']} {row['layout']} ({row['how']}, {row['ranks']} "
            f"rank(s))" + (": " + ", ".join(figures) if figures else ""))


def run_layout(run: Run, steps: int, timeout: float, rehearsal: bool) -> dict:
    """One training run; its parity verdict and median step time."""
    layout = run.layout
    row = {"layout": layout.name, "ranks": layout.ranks, "how": run.how,
           "args": " ".join(layout.args), "status": "FAIL", "loss_difference": None,
           "max_grad_difference": None, "median_step_seconds": None, "note": layout.note}
    with tempfile.TemporaryDirectory(prefix="meshpipe-gpu-check-") as out_dir:
        argv = command(run, steps, out_dir, rehearsal)
        row["command"] = " ".join(argv[1:])
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            row["note"] = f"timed out after {timeout:.0f} s"
            return row
        metrics_file = Path(out_dir) / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
        row["memory"] = metrics.get("memory")
    check = metrics.get("check") or {}
    if check:
        row["loss_difference"] = check["loss_difference"]
        row["max_grad_difference"] = check["max_grad_difference"]
    history = metrics.get("history") or []
    if history:
        row["median_step_seconds"] = statistics.median(h["step_seconds"] for h in history)
    if done.returncode == 0 and check.get("passed"):
        row["status"] = "PASS"
        return row
    if check and not check.get("passed"):
        why = f"{len(check['mismatched'])} gradients differ (worst {check['worst_parameter']})"
    else:
        why = f"exit status {done.returncode}"
    row["note"] = why
    row["output_tail"] = failure_lines(done.stdout + done.stderr)
    return row


def failure_lines(output: str, keep: int = 12) -> list[str]:
    """What explains a failed run: the --check verdict, each rank's error line (torch
    prefixes a torchrun rank's uncaught traceback with ``[rankN]:``) and the launcher's one
    line (``meshpipe: ...``); failing those, the last lines before torchrun's own report."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("--check", "meshpipe:")) or (
        re.match(r"\[rank\d+\]:\S", line.replace(": ", ":", 1)) and "Traceback" not in line)]
    if errors:
        return errors[-keep:]
    report = next((i for i, line in enumerate(lines) if "torch/distributed/run.py" in line
                   or "torch.distributed.elastic" in line), len(lines))
    return [line for line in lines[:max(report - 1, 0)]
            if not line.startswith(("W", "*"))][-keep:]


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HOW = {"nccl": "nccl, a GPU per rank (torchrun)", "shared": "gloo, ranks share the GPU(s)"}
REHEARSED = {"nccl": "torchrun, CPU (gloo)", "shared": "local launcher, CPU (gloo)"}


def pipeline_throughput(rows: list[dict]) -> list[str]:
    """pp 2 on NCCL (a GPU per stage) against pp 1, where both ran on NCCL: the steps'
    sequences per second and their ratio (2 would be a pipeline without a bubble or a
    message cost)."""
    step = {row["layout"]: row["median_step_seconds"] for row in rows
            if row["how"] == "nccl" and row["status"] == "PASS"}
    if not (step.get("pp1-1f1b") and step.get("pp2-1f1b")):
        return []
    return ["", f"Pipeline throughput on NCCL: pp 2 (1F1B, a GPU per stage) steps in "
                f"{step['pp2-1f1b']:.4f} s against {step['pp1-1f1b']:.4f} s for pp 1 with the "
                f"same batch: {step['pp1-1f1b'] / step['pp2-1f1b']:.2f}x."]


def state_bytes(records: list[dict]) -> tuple[list[int], str]:
    """Each rank's optimizer-state bytes (``metrics.json``'s ``memory`` records) and where
    they were read: the allocator on CUDA, else the state tensors."""
    if all(record["optimizer_state_allocator_bytes"] is not None for record in records):
        return [record["optimizer_state_allocator_bytes"] for record in records], "allocator"
    return [record["optimizer_state_bytes"] for record in records], "state tensors"


def optimizer_state_comparison(rows: list[dict], how: dict[str, str]) -> list[str]:
    """Each rank's optimizer state under --zero 1 and 2 against --zero 0 (``ZERO_LAYOUTS``),
    for each way they ran; the ratio is of the largest rank's (0.5 is the whole state
    sharded over dp 2)."""
    lines = []
    for way, label in how.items():
        states = {row["layout"]: row.get("memory") for row in rows if row["how"] == way}
        if not all(states.get(name) for name in ZERO_LAYOUTS.values()):
            continue
        measured = {level: state_bytes(states[name]) for level, name in ZERO_LAYOUTS.items()}
        whole = max(measured[0][0])
        parts = [f"--zero {level} " + " / ".join(f"{size / 2**20:.3f}" for size in per_rank)
                 + " MiB" + (f" ({max(per_rank) / whole:.2f}x)" if level else "")
                 for level, (per_rank, _) in measured.items()]
        sources = " and ".join(sorted({source for _, source in measured.values()}))
        lines += ["", f"Optimizer state per rank at dp 2, bf16 ({label}; read from the "
                      f"{sources}): " + "; ".join(parts) + "."]
    return lines


def to_markdown(result: dict) -> str:
    lines = [f"# GPU check: {result['device']}", "",
             f"torch {result['torch']}, CUDA {result['cuda']}, NCCL {result['nccl']}, "
             f"{result['gpus']} GPU(s), {result['steps']} steps per run, --check against "
             f"one process on the CPU; {result['jobs']} run(s) at a time (step times share "
             "the machine).", "",
             "| layout | ranks | how | parity | loss abs diff | max grad abs diff | "
             "median step s | note |", "|---|---:|---|---|---:|---:|---:|---|"]
    how = HOW if result["gpus"] else REHEARSED
    for row in result["rows"]:
        lines.append(f"| {row['layout']} | {row['ranks']} | {how[row['how']]} | "
                     f"{row['status']} | {_figure(row['loss_difference'], '.1e')} | "
                     f"{_figure(row['max_grad_difference'], '.1e')} | "
                     f"{_figure(row['median_step_seconds'], '.4f')} | {row['note']} |")
    lines += pipeline_throughput(result["rows"])
    lines += optimizer_state_comparison(result["rows"], how)
    for row in result["rows"]:
        if row["status"] == "FAIL":
            lines += ["", f"FAIL {row['layout']} ({row['how']}): `{row.get('command', '')}`",
                      "```", *row.get("output_tail", []), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layouts = [l for l in LAYOUTS if not args.only or l.name in args.only]
    if importlib.util.find_spec("transformers") is None:
        print("gpu_check: transformers is not installed: the --model layouts are left out "
              "(pip install 'meshpipe[hf]')")
        layouts = [l for l in layouts if not placeholders(l.args)]
    if args.cpu_rehearsal:
        gpus, device = 0, f"CPU rehearsal on {platform.processor() or 'cpu'} (gloo)"
        layouts = [l for l in layouts if l.ranks <= args.max_ranks]
        runs = planned_runs(layouts, 1)  # the structure of one GPU, on CPU processes
    elif not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__}: nothing to "
              "check")
        return 0
    else:
        gpus, device = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        runs = planned_runs(layouts, gpus)
    nccl = (".".join(map(str, torch.cuda.nccl.version()))
            if torch.cuda.is_available() and not args.cpu_rehearsal else "-")
    print(f"gpu_check: {len(runs)} runs of {len(layouts)} layouts, {args.jobs} at a time",
          flush=True)
    for layout in layouts:  # the tiny checkpoints, made before the runs' threads start
        _filled(layout.args)

    def one(run: Run) -> dict:
        row = run_layout(run, args.steps, args.timeout, args.cpu_rehearsal)
        print(progress_line(row), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(one, runs))
    result = {"device": device, "gpus": gpus, "torch": torch.__version__,
              "cuda": torch.version.cuda, "nccl": nccl, "steps": args.steps,
              "jobs": args.jobs, "rows": rows}
    publish("gpu_check", result, to_markdown(result), args.out, args.cpu_rehearsal)
    failed = [f"{row['layout']} ({row['how']})" for row in rows if row["status"] == "FAIL"]
    print(f"gpu_check: {len(rows) - len(failed)} passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
