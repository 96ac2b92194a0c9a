"""A chaos run: ranks killed and frozen at random moments under --max-restarts, and the end
compared bit for bit with an uninterrupted run.

    .venv/bin/python benchmarks/chaos.py                       # 20 faults, ~8 min on 2 cores
    .venv/bin/python benchmarks/chaos.py --faults 4 --every 8  # a quick look
    .venv/bin/python benchmarks/chaos.py --every 60 --checkpoint-async --name chaos_async

The job: ``meshpipe train`` of a small model over pp 2 (2 CPU processes), a checkpoint every
``--checkpoint-every`` steps, ``--hang-timeout 5``, ``--max-restarts 1000``. First it runs
uninterrupted (its step rate sets ``--steps`` so that the faults fall all through the chaos
run). Then the same job runs while, after an exponentially distributed wait of mean
``--every`` seconds, a random rank process gets SIGKILL or SIGSTOP (a frozen rank, found by the
hang timeout); every fourth fault waits for a checkpoint being written and kills a rank
during it; one fault is an exception raised inside a forward (``MESHPIPE_FAULT``, once).
A fault waits until the job trains again after the one before (see ``inject``).

Recorded per fault: its kind, the seconds from the fault to the launcher's restart line
(detection and stopping every rank) and from that line to the next new step in
metrics.jsonl (the restart to its first step). Recorded for the run: goodput (the seconds of
the steps that count, from metrics.jsonl, over the chaos run's wall time), the same
estimated at one fault a minute (each fault's measured cost, detection + restart + the steps
redone since the last checkpoint, taken out of 60 s), and whether every tensor of the last
checkpoint and every step loss equal the uninterrupted run's. Results go to
benchmarks/results/chaos.json and chaos.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = ["--layers", "4", "--dim", "64", "--heads", "4", "--seq-len", "64",
         "--microbatches", "4", "--microbatch-size", "2", "--eval-every", "0",
         "--timeline-step", "0", "--no-progress", "--hang-timeout", "5", "--pp", "2",
         "--keep-checkpoints", "2"]


def command(out: Path, steps: int, checkpoint_every: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "meshpipe", "train", *MODEL, "--steps", str(steps),
            "--checkpoint-every", str(checkpoint_every), "--out-dir", str(out), *extra]


def step_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            records.append(record)
    return records


def workers(launcher: int) -> list[int]:
    """The rank processes the launcher started (its spawned children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and "spawn_main" in line and "resource_tracker" not in line:
            found.append(int(entry.name))
    return found


def saving(out: Path) -> bool:
    """Whether a checkpoint is being written (a partial directory under checkpoint/)."""
    root = out / "checkpoint"
    return root.is_dir() and any(".partial" in path.name for path in root.iterdir())


class Watched:
    """The chaos run's process, its stdout lines timestamped and metrics.jsonl watched."""

    def __init__(self, argv: list[str], out: Path, env: dict):
        self.out = out
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env)
        self.lines: list[tuple[float, str]] = []
        self.step_times: list[tuple[float, int]] = []  # (when seen, steps in the file)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch_steps, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def _watch_steps(self) -> None:
        seen = -1
        while self.process.poll() is None:
            count = len(step_records(self.out))
            if count != seen:
                self.step_times.append((time.time(), count))
                seen = count
            time.sleep(0.05)

    def restart_after(self, moment: float) -> float | None:
        return next((when for when, line in self.lines
                     if when >= moment and "meshpipe: restart" in line), None)

    def step_after(self, moment: float) -> float | None:
        """When metrics.jsonl first gained a step after ``moment`` (a restarted run first
        cuts it back to its checkpoint's step)."""
        for (_, earlier), (when, count) in zip(self.step_times, self.step_times[1:]):
            if when >= moment and count > earlier:
                return when
        return None


def inject(watched: Watched, kind: str, rng: random.Random, after_step: int,
           timeout: float = 60) -> float | None:
    """Send ``kind`` to a random rank once the job trains past step ``after_step`` (a fault
    while a restarted job sets up would count as a restart without a step gained, and two
    of those in a row end the job as a crash loop); the moment it was sent (None: none)."""
    deadline = time.time() + timeout
    while time.time() < deadline and watched.process.poll() is None:
        if len(step_records(watched.out)) <= after_step or (
                kind == "kill during a save" and not saving(watched.out)):
            time.sleep(0.01)
            continue
        ranks = workers(watched.process.pid)
        if len(ranks) >= 2:
            os.kill(rng.choice(ranks), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
            return time.time()
        time.sleep(0.05)
    return None


def checkpoint_tensors(out: Path, step: int) -> dict:
    from meshpipe.train.checkpoints.store import read_tensors

    return read_tensors(out / "checkpoint" / f"step-{step:06d}")


def same_ending(chaos: Path, whole: Path, steps: int) -> tuple[bool, bool, int]:
    import torch

    ours, theirs = checkpoint_tensors(chaos, steps), checkpoint_tensors(whole, steps)
    tensors = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k])
                                                    for k in ours)
    losses = ([r["loss"] for r in step_records(chaos)] == [r["loss"]
                                                           for r in step_records(whole)])
    return tensors, losses, len(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--every", type=float, default=15.0, help="mean seconds between faults")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-async", action="store_true",
                        help="both runs write their checkpoints in the background")
    parser.add_argument("--name", default="chaos",
                        help="results/<name>.json and .md (default chaos)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    extra = ["--checkpoint-async"] if args.checkpoint_async else []
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="meshpipe-chaos-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MESHPIPE_FAULT", None)
    probe = work / "probe"
    subprocess.run(command(probe, 60, 0), check=True, env=env, capture_output=True)
    step_s = sum(r["step_seconds"] for r in step_records(probe)[10:]) / 50
    steps = int(args.faults * args.every * 0.8 / step_s) // args.checkpoint_every * \
        args.checkpoint_every
    whole = work / "whole"
    start = time.time()
    subprocess.run(command(whole, steps, args.checkpoint_every, *extra), check=True, env=env,
                   capture_output=True)
    whole_s = time.time() - start
    kinds = ["kill", "stop", "kill", "kill during a save"] * args.faults
    raised_at = rng.randint(steps // 4, steps // 2)
    chaos_env = {**env, "MESHPIPE_FAULT": f"kind=raise,at=forward,rank=1,step={raised_at},once=1"}
    chaos = work / "chaos"
    start = time.time()
    watched = Watched(command(chaos, steps, args.checkpoint_every, "--max-restarts", "1000",
                              *extra), chaos, chaos_env)
    faults = [{"kind": "exception (MESHPIPE_FAULT)", "at_step": raised_at}]
    while len(faults) < args.faults and watched.process.poll() is None:
        time.sleep(rng.expovariate(1 / args.every))
        kind = kinds[len(faults) - 1]
        before = len(step_records(chaos))
        moment = inject(watched, kind, rng, before)
        if moment is not None:
            faults.append({"kind": kind, "time": moment, "steps_before": before})
            watched.restart_after(moment)
    _, stderr = watched.process.communicate()
    chaos_s = time.time() - start
    for fault in faults[1:]:
        restarted = watched.restart_after(fault["time"])
        fault["to_restart_line_s"] = None if restarted is None else round(
            restarted - fault["time"], 2)
        first = None if restarted is None else watched.step_after(restarted)
        fault["restart_to_step_s"] = None if first is None else round(first - restarted, 2)
        del fault["time"]
    restart_lines = [line[:300] for _, line in watched.lines if "meshpipe: restart" in line]
    restarts = len(restart_lines)
    finished = (chaos / "checkpoint" / f"step-{steps:06d}" / ".metadata").exists()
    tensors, losses, count = same_ending(chaos, whole, steps) if finished else (False, False, 0)
    productive = sum(r["step_seconds"] for r in step_records(chaos))
    timed = [f for f in faults[1:] if f.get("to_restart_line_s") is not None
             and f.get("restart_to_step_s") is not None]
    redone = args.checkpoint_every / 2 * step_s  # on average half a checkpoint interval
    per_fault = (sum(f["to_restart_line_s"] + f["restart_to_step_s"] for f in timed)
                 / max(len(timed), 1)) + redone
    result = {"steps": steps, "step_s": round(step_s, 4), "faults": faults,
              "every_s": args.every, "checkpoint_async": args.checkpoint_async,
              "restarts": restarts, "exit_status": watched.process.returncode,
              "uninterrupted_s": round(whole_s, 1), "chaos_s": round(chaos_s, 1),
              "goodput": round(productive / chaos_s, 3),
              "cost_per_fault_s": round(per_fault, 2),
              "goodput_at_one_fault_a_minute": round(max(0.0, 1 - per_fault / 60), 3),
              "tensors_equal": tensors, "tensors": count, "losses_equal": losses,
              "restart_lines": restart_lines,
              "stderr_tail": stderr[-500:]}
    table = markdown(result)
    print(table)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / f"{args.name}.md").write_text(table)


def markdown(result: dict) -> str:
    def seconds(value):
        return "-" if value is None else f"{value:.1f}"

    lines = [f"A chaos run on {os.cpu_count()} CPU cores: pp 2, {result['steps']} steps of "
             f"{result['step_s'] * 1000:.0f} ms, a checkpoint every 20 steps"
             f"{' written in the background (--checkpoint-async)' if result['checkpoint_async'] else ''}, "
             f"{len(result['faults'])} faults about every {result['every_s']:.0f} s, "
             f"{result['restarts']} restarts, exit status {result['exit_status']}.", "",
             f"- last checkpoint equal to the uninterrupted run's: {result['tensors_equal']} "
             f"({result['tensors']} tensors); step losses equal: {result['losses_equal']}",
             f"- wall time {result['chaos_s']:.0f} s against {result['uninterrupted_s']:.0f} s "
             f"uninterrupted; goodput {result['goodput']:.0%} (steps that count over wall "
             "time, at this run's fault rate)",
             f"- cost of a fault {result['cost_per_fault_s']:.1f} s (to the restart line, "
             "restart to a new step, half a checkpoint interval redone): goodput at one fault "
             f"a minute {result['goodput_at_one_fault_a_minute']:.0%}", "",
             "| fault | kind | fault to restart line (s) | restart to next step (s) |",
             "|---|---|---|---|"]
    for index, fault in enumerate(result["faults"], start=1):
        if "at_step" in fault:
            lines.append(f"| {index} | {fault['kind']} at step {fault['at_step']} | - | - |")
            continue
        lines.append(f"| {index} | {fault['kind']} | {seconds(fault['to_restart_line_s'])} | "
                     f"{seconds(fault['restart_to_step_s'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
