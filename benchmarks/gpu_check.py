"""The GPU check: a short ``--check`` training run under torchrun with NCCL for each key layout.

    make gpu-check                                  # installs, runs pytest -m gpu, then this
    python benchmarks/gpu_check.py                  # every layout, 3 steps each
    python benchmarks/gpu_check.py --only pp2-1f1b cp-ring2
    python benchmarks/gpu_check.py --cpu-rehearsal  # the same harness on CPU (gloo), no GPU

Each layout runs as ``python -m torch.distributed.run --standalone --nproc-per-node N -m
meshpipe train <layout> --check --steps 3 ...``: one process per GPU, CUDA device LOCAL_RANK,
NCCL (``meshpipe.train.launch``). ``--check`` compares step 0 (loss and every gradient) with a
one-process run of the same model; the table shows that verdict, the loss and largest
gradient differences, and the median step time read from the run's ``metrics.json``.
A layout that needs more ranks than there are GPUs is skipped and listed as such: NCCL
refuses two ranks of one communicator on the same device ("Duplicate GPU detected"). On one
GPU the one-rank layouts still run the trainer's CUDA path (NCCL group, autocast on CUDA,
the communication thread's CUDA stream for the experts' exchanges). A failing run is
recorded with the last lines of its output and the check goes on.

Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md`` (default ``benchmarks/results``);
a ``--cpu-rehearsal`` writes nothing unless ``--out`` is given. Exit status 1 if any run
failed, 0 otherwise (also when there is no CUDA device: then nothing runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from meshpipe.train.config import add_arguments, from_arguments

RESULTS = Path(__file__).parent / "results"
COMMON = ["--no-progress", "--eval-every", "0", "--timeline-step", "0"]
NCCL_ONE_RANK_PER_GPU = ("NCCL refuses two ranks of one communicator on the same GPU "
                         "(ncclInvalidUsage: Duplicate GPU detected)")


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


LAYOUTS = [
    # One rank: runs on a single GPU.
    Layout("pp1-1f1b", ("--pp", "1"), "one rank: device placement, NCCL group, no p2p"),
    Layout("pp1-bf16", ("--pp", "1", "--dtype", "bf16"), "one rank: CUDA autocast"),
    Layout("pp1-moe4-combined-1f1b", ("--pp", "1", "--moe-experts", "4", "--moe-top-k", "2",
                                      "--schedule", "combined-1f1b"),
           "one rank: expert exchanges on the comm thread's CUDA stream"),
    # Pipeline parallelism: NCCL payloads, gloo headers, a reverse group per direction.
    Layout("pp2-1f1b", ("--pp", "2", "--schedule", "1f1b")),
    Layout("pp2-vpp2-interleaved", ("--pp", "2", "--vpp", "2", "--schedule", "interleaved")),
    Layout("pp2-vpp2-zb-v", ("--pp", "2", "--vpp", "2", "--schedule", "zb-v")),
    Layout("pp2-batched-p2p", ("--pp", "2", "--p2p", "batched"),
           "batch_isend_irecv on NCCL"),
    Layout("pp2-bf16", ("--pp", "2", "--dtype", "bf16")),
    # Context, data, tensor and expert parallelism.
    Layout("cp-ring2", ("--pp", "1", "--cp-ring", "2")),
    Layout("cp-ulysses2", ("--pp", "1", "--cp-ulysses", "2")),
    Layout("dp2", ("--pp", "1", "--dp", "2")),
    Layout("tp2", ("--pp", "1", "--tp", "2")),
    Layout("tp2-sequence-parallel", ("--pp", "1", "--tp", "2", "--sequence-parallel")),
    Layout("ep2-dp2-combined-1f1b", ("--pp", "1", "--dp", "2", "--moe-experts", "4", "--ep",
                                     "2", "--schedule", "combined-1f1b")),
    Layout("pp2-stage-tp-2,1", ("--pp", "2", "--stage-tp", "2,1"),
           "VTP: stages of different tp sizes"),
    Layout("pp2-cp-ring2", ("--pp", "2", "--cp-ring", "2"), "the demo layout"),
    Layout("pp2-tp2", ("--pp", "2", "--tp", "2")),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="layouts: " + ", ".join(l.name for l in LAYOUTS))
    parser.add_argument("--steps", type=int, default=3, help="training steps per layout")
    parser.add_argument("--only", nargs="+", metavar="LAYOUT", help="run these layouts only")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one layout's run may take")
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


def run_layout(layout: Layout, steps: int, timeout: float, env: dict[str, str]) -> dict:
    """One torchrun job; its parity verdict and median step time."""
    row = {"layout": layout.name, "ranks": layout.ranks, "args": " ".join(layout.args),
           "status": "FAIL", "loss_difference": None, "max_grad_difference": None,
           "median_step_seconds": None, "note": layout.note}
    with tempfile.TemporaryDirectory(prefix="meshpipe-gpu-check-") as out_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(layout.ranks), "-m", "meshpipe", "train",
                   *layout.args, "--check", "--steps", str(steps), *COMMON,
                   "--out-dir", out_dir]
        row["command"] = " ".join(command[1:])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                  env=env)
        except subprocess.TimeoutExpired:
            row["note"] = f"timed out after {timeout:.0f} s"
            return row
        metrics_file = Path(out_dir) / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
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
    """What explains a failed run: the --check verdict and each rank's error line (torch
    prefixes a rank's uncaught traceback with ``[rankN]:``); failing those, the last lines
    before torchrun's own report."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("--check") or (
        re.match(r"\[rank\d+\]:\S", line.replace(": ", ":", 1)) and "Traceback" not in line)]
    if errors:
        return errors[-keep:]
    report = next((i for i, line in enumerate(lines) if "torch/distributed/run.py" in line
                   or "torch.distributed.elastic" in line), len(lines))
    return [line for line in lines[:max(report - 1, 0)]
            if not line.startswith(("W", "*"))][-keep:]


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def to_markdown(result: dict) -> str:
    lines = [f"# GPU check: {result['device']}", "",
             f"torch {result['torch']}, CUDA {result['cuda']}, NCCL {result['nccl']}, "
             f"{result['gpus']} GPU(s), {result['steps']} steps per layout, --check against "
             f"one process on the CPU.", "",
             "| layout | ranks | parity | loss abs diff | max grad abs diff | median step s "
             "| note |", "|---|---:|---|---:|---:|---:|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['layout']} | {row['ranks']} | {row['status']} | "
                     f"{_figure(row['loss_difference'], '.1e')} | "
                     f"{_figure(row['max_grad_difference'], '.1e')} | "
                     f"{_figure(row['median_step_seconds'], '.4f')} | {row['note']} |")
    failed = [row for row in result["rows"] if row["status"] == "FAIL"]
    for row in failed:
        lines += ["", f"FAIL {row['layout']}: `{row.get('command', '')}`", "```",
                  *row.get("output_tail", []), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    if args.cpu_rehearsal:
        env["CUDA_VISIBLE_DEVICES"] = ""
        slots, device = args.max_ranks, f"CPU rehearsal on {platform.processor() or 'cpu'} (gloo)"
        skip_reason = f"needs {{ranks}} ranks, the rehearsal runs up to --max-ranks {slots}"
    elif not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__} (built for CUDA "
              f"{torch.version.cuda}): nothing to check")
        return 0
    else:
        slots, device = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        skip_reason = f"needs {{ranks}} GPUs, {slots} present: {NCCL_ONE_RANK_PER_GPU}"
    layouts = [l for l in LAYOUTS if not args.only or l.name in args.only]
    nccl = (".".join(map(str, torch.cuda.nccl.version()))
            if torch.cuda.is_available() and not args.cpu_rehearsal else "-")
    result = {"device": device, "gpus": 0 if args.cpu_rehearsal else slots,
              "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
              "steps": args.steps, "rows": []}
    for layout in layouts:
        if layout.ranks > slots:
            row = {"layout": layout.name, "ranks": layout.ranks, "args": " ".join(layout.args),
                   "status": "SKIP", "loss_difference": None, "max_grad_difference": None,
                   "median_step_seconds": None,
                   "note": skip_reason.format(ranks=layout.ranks)}
        else:
            print(f"gpu_check: {layout.name} on {layout.ranks} rank(s) ...", flush=True)
            row = run_layout(layout, args.steps, args.timeout, env)
        result["rows"].append(row)
    table = to_markdown(result)
    print(table)
    out = args.out or (None if args.cpu_rehearsal else RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "gpu_check.md").write_text(table)
        print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    ran = [row for row in result["rows"] if row["status"] != "SKIP"]
    failed = [row["layout"] for row in ran if row["status"] == "FAIL"]
    skipped = len(result["rows"]) - len(ran)
    print(f"gpu_check: {len(ran) - len(failed)} passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "") + f", {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
