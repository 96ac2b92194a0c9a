"""The fault-injection catalogue: each case runs ``meshpipe train`` in a child process with
one fault (``MESHPIPE_FAULT``), a signal, or bad input, and records how it ended.

Shared by tests/test_faults.py (which asserts on each outcome) and benchmarks/faults.py
(which prints the table of docs/when-something-goes-wrong.md).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# A tiny model: each run spends its time starting processes, not training.
TINY = ["--layers", "2", "--dim", "32", "--heads", "2", "--kv-heads", "1", "--seq-len", "16",
        "--microbatches", "2", "--microbatch-size", "1", "--eval-every", "0",
        "--timeline-step", "0", "--no-progress", "--hang-timeout", "5"]
PP2 = ["--pp", "2", "--steps", "3"]
TAG_VARIABLE = "MESHPIPE_FAULT_CASE_TAG"


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    fault: str | None = None
    status: int = 1                   # the exit status expected
    rank: int | None = None           # the rank the last line must name first
    says: str = ""                    # a regular expression the last line must match
    send_signal: int | None = None    # sent to the launcher once training is underway
    before: tuple[str, ...] | None = None  # a run to do first in the same out-dir (resume)


@dataclass
class Outcome:
    case: Case
    status: int
    seconds: float                    # from the fault (or signal, or start) to the exit
    last_line: str
    stderr: str
    leftovers: list[int] = field(default_factory=list)
    out_dir: Path | None = None

    @property
    def named_rank(self) -> int | None:
        match = re.search(r"\brank (\d+)", self.last_line)
        return int(match.group(1)) if match else None


CASES = [
    Case("rank raises in forward", (*PP2,), "kind=raise,at=forward,rank=1,step=2",
         rank=1, says=r"failed at step 2, stage 1, microbatch \d.*InjectedFault"),
    Case("rank raises in backward", (*PP2,), "kind=raise,at=backward,rank=0,step=2",
         rank=0, says=r"failed at step 2, stage 0.*InjectedFault"),
    Case("rank raises in the loss", (*PP2,), "kind=raise,at=loss,rank=1,step=1",
         rank=1, says=r"failed at step 1, stage 1.*InjectedFault"),
    Case("data-parallel peer raises (pp 2 x dp 2)", (*PP2, "--dp", "2"),
         "kind=raise,at=forward,rank=3,step=2", rank=3, says=r"InjectedFault"),
    Case("rank runs out of memory", (*PP2,), "kind=oom,at=forward,rank=1,step=2",
         rank=1, says=r"failed at step 2, stage 1, microbatch \d.*out of memory: CUDA out of "
                      r"memory\. Tried to allocate 2\.00 GiB .*--recompute full"),
    Case("rank exits", (*PP2,), "kind=exit,at=forward,rank=1,step=2",
         rank=1, says=r"exited with status 7 .*at step 2, stage 1"),
    Case("rank killed (SIGKILL)", (*PP2,), "kind=kill,at=forward,rank=0,step=2",
         rank=0, says=r"killed by SIGKILL.*step 2, stage 0"),
    Case("rank hangs in forward", (*PP2,), "kind=hang,at=forward,rank=1,step=2",
         rank=1, says=r"rank 1 hangs: runs .*step 2, stage 1.*rank 0 waits on it"),
    Case("rank hangs before a collective (dp 2)", ("--pp", "1", "--schedule", "none", "--dp",
                                                    "2", "--steps", "3"),
         "kind=hang,at=step,rank=1,step=2", rank=1, says=r"rank 1 hangs: runs step 2"),
    Case("stages disagree on the message", (*PP2,), "kind=mismatch,at=forward,rank=0,step=2",
         rank=1, says=r"failed at step 2, stage 1, microbatch 0.*\[31\]"),
    Case("non-finite loss", (*PP2,), "kind=nan,at=loss,rank=1,step=2",
         rank=1, says=r"NonFiniteError: step 2: the loss is nan.*rank 1"),
    Case("non-finite loss, skipped", (*PP2, "--skip-nonfinite", "1"),
         "kind=nan,at=loss,rank=1,step=2", status=0, says=r"^loss .* over 3 steps"),
    Case("kill during a checkpoint save", ("--pp", "2", "--steps", "4",
                                           "--checkpoint-every", "1"),
         "kind=kill,at=save,rank=1,step=3", rank=1,
         says=r"killed by SIGKILL.*step 3, action checkpoint save"),
    Case("SIGINT to the launcher", ("--pp", "2", "--steps", "100000"),
         send_signal=signal.SIGINT, status=130,
         says=r"stopped by SIGINT; no checkpoint was saved, so a new run starts from step 1"),
    Case("SIGTERM with --checkpoint-on-signal", ("--pp", "2", "--steps", "100000",
                                                 "--checkpoint-on-signal"),
         send_signal=signal.SIGTERM, status=143,
         says=r"stopped by SIGTERM after saving a checkpoint; resume with --resume \(from "
              r"step-\d{6}\)"),
    Case("launcher killed (SIGKILL)", ("--pp", "2", "--steps", "100000"),
         send_signal=signal.SIGKILL, status=-9),
    # Bad input: refused before any process starts.
    Case("sizes that do not divide", (*PP2, "--seq-len", "15", "--cp-ring", "2"), status=2,
         says=r"--seq-len 15 is not divisible"),
    Case("unknown schedule", (*PP2, "--schedule", "2f2b"), status=2,
         says=r"unknown schedule '2f2b'"),
    Case("out-dir is a file", (*PP2,), status=2, says=r"is a file"),
    Case("out-dir cannot be created", (*PP2,), status=2, says=r"is not writable"),
    Case("resume without a checkpoint", (*PP2, "--resume"), status=2,
         says=r"no complete checkpoint"),
    Case("resume with another model", ("--pp", "2", "--steps", "4", "--resume",
                                       "--tie-embeddings"),
         before=("--pp", "2", "--steps", "2"), status=2, says=r"tie_embeddings"),
    Case("resume past the last step", ("--pp", "2", "--steps", "2", "--resume"),
         before=("--pp", "2", "--steps", "2"), status=2, says=r"nothing to train"),
]


def out_dir_for(case: Case, workdir: Path) -> Path:
    """Where the case writes (a file, or a path under a file, for the out-dir cases)."""
    slug = re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-")
    out = workdir / slug
    if case.name == "out-dir is a file":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("not a directory")
    elif case.name == "out-dir cannot be created":
        blocker = workdir / f"{slug}-blocker"
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("a file where a directory should be")
        out = blocker / "run"
    return out


def command(args: tuple[str, ...], out: Path) -> list[str]:
    return [sys.executable, "-m", "meshpipe", "train", *TINY, *args, "--out-dir", str(out)]


def run_case(case: Case, workdir: Path, timeout: float = 240) -> Outcome:
    """Run ``case`` and describe how it ended."""
    out = out_dir_for(case, workdir)
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_VARIABLE: tag, "PYTHONUNBUFFERED": "1"}
    env.pop("MESHPIPE_FAULT", None)
    if case.before is not None:
        shutil.copytree(_before_run(case.before, env, timeout), out)
    if case.fault is not None:
        env["MESHPIPE_FAULT"] = case.fault
    start = time.time()
    process = subprocess.Popen(command(case.args, out), env=env, stderr=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    if case.send_signal is not None:
        wait_for_training(out / "metrics.jsonl", process, timeout)
        start = time.time()
        process.send_signal(case.send_signal)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    end = time.time()
    fired = _fault_time(out / "logs")
    lines = [line for line in (stderr + stdout).splitlines() if line.strip()]
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if case.status == 0:
        last = next((line for line in reversed(stdout.splitlines()) if line.strip()), "")
    return Outcome(case, process.returncode, end - (fired or start), last,
                   "\n".join(lines), _leftovers(tag), out)


def refused_in_process(case: Case, workdir: Path) -> Outcome:
    """A case of bad input (refused before any process starts, so no run to do first) run by
    ``meshpipe.cli.main`` in this process: the same status and last line as ``run_case``'s
    child process, without the seconds of starting one."""
    from meshpipe import cli

    out = out_dir_for(case, workdir)
    stderr = io.StringIO()
    start = time.time()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["train", *TINY, *case.args, "--out-dir", str(out)])
    lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
    return Outcome(case, status, time.time() - start, lines[-1] if lines else "",
                   "\n".join(lines), [], out)


_BEFORE_RUNS: dict[tuple[str, ...], Path] = {}
_BEFORE_RUNS_LOCK = threading.Lock()


def _before_run(args: tuple[str, ...], env: dict[str, str], timeout: float) -> Path:
    """The out-dir of a finished run of ``args``, made once per process for every case that
    starts from it (each case gets a copy; cases run on several threads wait for it)."""
    with _BEFORE_RUNS_LOCK:
        done = _BEFORE_RUNS.get(args)
        if done is None or not done.exists():
            scratch = tempfile.mkdtemp(prefix="meshpipe-fault-before-")
            atexit.register(shutil.rmtree, scratch, True)
            done = Path(scratch) / "run"
            subprocess.run(command(args, done), env=env, capture_output=True,
                           timeout=timeout, check=True)
            _BEFORE_RUNS[args] = done
    return done


def run_cases(cases: list[Case], workdir: Path, at_once: int = 2) -> dict[str, Outcome]:
    """Every case of ``cases`` (names unique), ``at_once`` at a time: a case spends most of
    its time starting processes or waiting out a hang timeout, so two share the cores."""
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = {case.name: pool.submit(run_case, case, workdir) for case in cases}
        return {name: future.result() for name, future in futures.items()}


def wait_for_training(metrics: Path, process: subprocess.Popen, timeout: float) -> None:
    """Until the first step's line is in metrics.jsonl (the workers are training)."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and metrics.read_text().strip():
            return
        time.sleep(0.1)
    raise RuntimeError(f"training did not start: {process.poll()=}")


def _fault_time(logs: Path) -> float | None:
    """When the injected fault fired (each firing writes its time to the rank's log)."""
    for log in logs.glob("rank-*.log") if logs.exists() else []:
        match = re.search(r"injected fault fired at ([0-9.]+)", log.read_text(errors="replace"))
        if match:
            return float(match.group(1))
    return None


def _leftovers(tag: str, grace_s: float = 2.0) -> list[int]:
    """Processes still alive whose environment carries this case's tag."""
    deadline = time.time() + grace_s
    while True:
        alive = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                state = (entry / "stat").read_text().split()[2]
            except OSError:
                continue
            if f"{TAG_VARIABLE}={tag}".encode() in environ and state != "Z":
                alive.append(int(entry.name))
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def describe(outcome: Outcome) -> dict:
    return {"case": outcome.case.name, "exit status": outcome.status,
            "seconds to stop": round(outcome.seconds, 1), "reported": outcome.last_line,
            "processes left": len(outcome.leftovers)}


def as_json(outcomes: list[Outcome]) -> str:
    return json.dumps([describe(o) for o in outcomes], indent=2)
