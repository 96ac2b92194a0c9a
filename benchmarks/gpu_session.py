"""A lent GPU's session in one command: what waits for a GPU (docs/gpu.md), in order, within
a time budget, every result written where the machine hands it back.

    python benchmarks/gpu_session.py --out "$OUT"                    # on the GPU machine
    python benchmarks/gpu_session.py --out "$OUT" --items bench-modes bench-pack
    python benchmarks/gpu_session.py --out /tmp/s --cpu-rehearsal    # tiny sizes, on CPU

A lent machine gives a session 15 minutes of device time and at most 10 a command, and
keeps only what a command left under ``$OUT``; a command cut at its limit hands back no
table it meant to write at its end. So this runs the items below one after another as
processes of their own, each writing its results into a folder of ``--out`` and its whole
output into ``<out>/<item>.log`` as it goes (``gpu_check`` and ``gpu_bench`` print each
run's and each round's figures as they finish). An item starts only if the budget has the
time it is expected to take left (the first item always starts), and is stopped (its
process group) when the budget is spent. Before and after every item ``<out>/session.md``
(and ``.json``) says what ran, how long it took, its exit status, what was stopped or not
started, and the command that runs what is left.

``--budget-s`` (default 540) leaves a 600-second command the time to write and return.
``--cpu-rehearsal`` runs the same items on this CPU at tiny sizes (the GPU tests skip):
that checks the commands, not the GPU. Exit status 1 if an item failed or was stopped,
0 otherwise (items not started for lack of time are only reported).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
SOURCES = ROOT / "src"

# The tiny sizes of a CPU rehearsal: a 64-wide 2-layer model, 2 microbatches of 64 tokens.
TINY_TRAIN = ("--cpu-rehearsal", "--dim", "64", "--layers", "2", "--model-heads", "4",
              "--kv-heads", "2", "--seq-len", "64", "--pack-len", "64", "--documents", "4",
              "--iters", "2", "--warmup", "1", "--rounds", "1")
BENCH_TRAIN = ("benchmarks/gpu_bench.py", "--parts", "train", "--no-hf")
MODES = ("eager", "eager-apart", "eager-unfused", "compile", "compile-blocks")
PROFILED = ("eager", "pack", "compile", "pack-compile")
TINY_CHECK = ("--cpu-rehearsal", "--jobs", "2", "--only", "pp1-1f1b", "pp2-1f1b",
              "dp2-zero1-bf16", "pp1-moe4-bf16-grouped")


@dataclass(frozen=True)
class Item:
    """One command of the session. ``argv`` follows the python, run in the repository's
    root; ``{out}`` in it is the item's own results folder. ``expected_s``: about how long it
    takes on an H100 or H200, a planning figure (``session.md`` records what it took)."""

    name: str
    what: str
    argv: tuple[str, ...]
    expected_s: float
    rehearsal_argv: tuple[str, ...] | None = None  # None: ``argv``


ITEMS = (
    Item("gpu-tests", "pytest -m gpu: the CUDA paths' values against the CPU and the math "
         "kernels (grouped experts, packs inside a compiled block, fused accumulation, ...)",
         ("-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
          "--junitxml", "{out}/junit.xml", "tests/test_gpu.py"),
         expected_s=90),
    Item("gpu-check", "gpu_check: every layout's --check run (zero, --model and "
         "vision-language layouts among them)",
         ("benchmarks/gpu_check.py", "--jobs", "8", "--out", "{out}"),
         expected_s=300,
         rehearsal_argv=("benchmarks/gpu_check.py", *TINY_CHECK, "--out", "{out}")),
    Item("moe-layer", "moe_layer: grouped experts against a dense SwiGLU of the same active "
         "width (goal: at least 0.6x its TFLOP/s), and a tp 2 rank's share",
         ("benchmarks/moe_layer.py", "--out", "{out}"),
         expected_s=80,
         rehearsal_argv=("benchmarks/moe_layer.py", "--cpu-rehearsal", "--tokens", "64",
                         "--iters", "1", "--rounds", "1", "--out", "{out}")),
    Item("bench-modes", "gpu_bench at 8 x 1 in isolated rounds: the modes that decide the "
         "auto flags, and the compiled row (goal: 40 % MFU)",
         (*BENCH_TRAIN, "--data", "random", "--modes", *MODES, "--out", "{out}"),
         expected_s=300,
         rehearsal_argv=(*BENCH_TRAIN, "--data", "random", "--modes", *MODES,
                         "--microbatches", "2", *TINY_TRAIN, "--out", "{out}")),
    Item("bench-pack", "gpu_bench at 4 x 2: --pack against the unpacked step, eager and "
         "compiled (goal: at most 1.10x)",
         (*BENCH_TRAIN, "--modes", "eager", "compile", "--data", "random", "pack",
          "--microbatch-size", "2", "--microbatches", "4", "--out", "{out}"),
         expected_s=240,
         rehearsal_argv=(*BENCH_TRAIN, "--modes", "eager", "compile", "--data", "random",
                         "pack", "--microbatches", "2", *TINY_TRAIN, "--out", "{out}")),
    Item("profile-pack", "step_profile at 4 x 2, packed and not, eager and compiled: where a "
         "pack's step spends what the unpacked one does not",
         ("benchmarks/step_profile.py", "--variants", *PROFILED, "--microbatch-size", "2",
          "--microbatches", "4", "--out", "{out}"),
         expected_s=150,
         rehearsal_argv=("benchmarks/step_profile.py", "--variants", *PROFILED,
                         "--microbatches", "2", *TINY_TRAIN, "--profiled-steps", "1",
                         "--out", "{out}")),
)
ITEM_NAMES = tuple(item.name for item in ITEMS)


@dataclass
class Outcome:
    """What became of one item: ``"passed"``, ``"failed"`` (exit status ``returncode``),
    ``"stopped"`` (the budget ran out while it ran), ``"not started"``, or ``"running"``
    (in a session's record while it runs)."""

    name: str
    status: str
    seconds: float = 0.0
    returncode: int | None = None
    command: str = ""
    why: str = ""
    results: str = ""
    log: str = ""


@dataclass
class Session:
    out: Path
    budget_s: float
    rehearsal: bool
    machine: dict
    started: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="items, in order: " + ", ".join(ITEM_NAMES))
    parser.add_argument("--out", type=Path, default=_default_out(),
                        help="where every result, log and session.md go (default: $OUT "
                             "where set, else benchmarks/results/gpu_session)")
    parser.add_argument("--items", nargs="+", choices=ITEM_NAMES, default=list(ITEM_NAMES),
                        metavar="ITEM", help="run these items only, in the session's order")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for the whole session: an item starts only with the "
                             "time it takes left (the first always), and is stopped when the "
                             "budget is spent")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="the same items on this CPU at tiny sizes: checks the commands, "
                             "not the GPU")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")
    return args


def _default_out() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else \
        BENCHMARKS / "results" / "gpu_session"


def machine_facts(rehearsal: bool) -> dict:
    """What the session ran on: the GPU, torch, CUDA and Python."""
    cuda = torch.cuda.is_available() and not rehearsal
    return {"device": torch.cuda.get_device_name(0) if cuda
            else f"CPU rehearsal on {platform.processor() or 'cpu'} (not a GPU result)",
            "gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def _argv(item: Item, rehearsal: bool) -> tuple[str, ...]:
    return item.rehearsal_argv if rehearsal and item.rehearsal_argv else item.argv


def run_item(item: Item, session: Session) -> Outcome:
    """Run ``item`` if the budget allows, its output into ``<out>/<item>.log`` as it goes;
    stop its whole process group when the budget is spent. Its outcome joins the session's
    before it starts, as ``"running"``: the record of an item whose session was killed."""
    results = session.out / item.name
    argv = [sys.executable, *(a.replace("{out}", str(results)) for a in
                              _argv(item, session.rehearsal))]
    outcome = Outcome(item.name, "not started", command=" ".join(["python", *argv[1:]]),
                      results=str(results.relative_to(session.out)))
    left = session.left_s()
    first = all(o.status == "not started" for o in session.outcomes)
    session.outcomes.append(outcome)
    if left < item.expected_s and not first:
        outcome.why = (f"{max(0.0, left):.0f} s of the budget left, it takes about "
                       f"{item.expected_s:.0f}")
        return outcome
    outcome.status = "running"
    write(session)
    results.mkdir(parents=True, exist_ok=True)
    log = session.out / f"{item.name}.log"
    outcome.log = log.name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(SOURCES), os.environ.get("PYTHONPATH")])), "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log, "w") as sink:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            outcome.returncode = process.wait(timeout=left)
        except subprocess.TimeoutExpired:
            _stop(process)
            outcome.status = "stopped"
            outcome.why = (f"the budget ran out after {time.monotonic() - start:.0f} s; "
                           f"what it finished is in its log")
    outcome.seconds = time.monotonic() - start
    if outcome.status == "running":
        outcome.status = "passed" if outcome.returncode == 0 else "failed"
        if outcome.returncode != 0:
            outcome.why = f"exit status {outcome.returncode}: see {log.name}"
    return outcome


def _stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End ``process`` and everything it started (its own process group): SIGTERM, then
    SIGKILL after ``grace_s``."""
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def to_markdown(session: Session) -> str:
    machine = session.machine
    lines = [f"# GPU session: {machine['device']}", "",
             f"{machine['date']}; torch {machine['torch']}, CUDA {machine['cuda']}, Python "
             f"{machine['python']}; budget {session.budget_s:.0f} s "
             f"(`benchmarks/gpu_session.py`).", "",
             "| item | status | seconds | results | why |", "|---|---|---:|---|---|"]
    for o in session.outcomes:
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} | "
                     f"{o.results if o.status != 'not started' else '-'} | {o.why} |")
    left = [o.name for o in session.outcomes if o.status not in ("passed", "failed")]
    if left:
        lines += ["", "Left to run: `python benchmarks/gpu_session.py --out \"$OUT\" --items "
                      + " ".join(left) + "`"]
    lines += ["", "Commands:", ""] + [f"- {o.name}: `{o.command}`" for o in session.outcomes]
    return "\n".join(lines) + "\n"


def write(session: Session) -> None:
    """``<out>/session.md`` and ``session.json``, rewritten after every item."""
    session.out.mkdir(parents=True, exist_ok=True)
    (session.out / "session.md").write_text(to_markdown(session))
    (session.out / "session.json").write_text(json.dumps(
        {"machine": session.machine, "budget_s": session.budget_s,
         "rehearsal": session.rehearsal,
         "items": [vars(o) for o in session.outcomes]}, indent=2) + "\n")


def run_session(items: list[Item], session: Session) -> int:
    for item in items:
        print(f"gpu_session: {item.name}: {item.what}", flush=True)
        outcome = run_item(item, session)
        write(session)
        print(f"gpu_session: {item.name} {outcome.status} in {outcome.seconds:.0f} s"
              + (f" ({outcome.why})" if outcome.why else "")
              + f"; {max(0.0, session.left_s()):.0f} s of the budget left", flush=True)
    print(to_markdown(session))
    return 1 if any(o.status in ("failed", "stopped") for o in session.outcomes) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu_rehearsal and not torch.cuda.is_available():
        print(f"gpu_session: no CUDA device visible to torch {torch.__version__}: nothing to "
              "run (--cpu-rehearsal tries the commands on this CPU)")
        return 0
    session = Session(args.out, args.budget_s, args.cpu_rehearsal,
                      machine_facts(args.cpu_rehearsal))
    return run_session([item for item in ITEMS if item.name in args.items], session)


if __name__ == "__main__":
    sys.exit(main())
