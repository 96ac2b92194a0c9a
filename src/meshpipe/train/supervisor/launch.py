"""Starting and supervising the processes of a run: N local processes, or torchrun's.

``launch(fn, world_size, *args, devices=plan)`` runs ``fn(*args)`` on every rank with the
default process group initialised on the plan's backend, each rank on its device
(``meshpipe.train.run.devices``: CPU by default). Under ``torchrun`` (RANK/WORLD_SIZE in the
environment) it runs in the current process, and torchrun's own failure handling stops the
job; each rank judges its own hangs.

Locally it spawns ``world_size`` processes (one thread each; CPU ranks keep freed memory
for the next step, ``runtime.host_memory``, and with enough cores run on cores of their
own, ``runtime.host_cores``) and supervises them:

- a rank that raises, exits or is killed stops the whole job at once (every process is
  terminated, whatever group it was waiting in), and ``LaunchError`` names the rank that
  failed first, where (step, stage, microbatch, action) and why, in one line; tracebacks go
  to ``log_dir`` when given;
- every rank reports what it is doing (``meshpipe.runtime.activity``); when one has not
  moved for longer than ``hang_timeout`` the launcher prints who waits on whom, ending at
  the hanging rank, the dead one, a stopped one (where it was last seen, and when) or a
  cycle, and stops the job; SIGUSR1 prints the same picture without stopping;
- SIGINT or SIGTERM stops every rank within seconds (``Interrupted``, exit status 128 +
  signal); with ``checkpoint_on_signal`` the ranks first finish their step and save;
- workers end themselves if the launcher dies, so no process is left behind.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from meshpipe.comm import strict
from meshpipe.process_exit import exit_process, under_torchrun
from meshpipe.runtime import activity
from meshpipe.runtime.executor import PeerFailedError
from meshpipe.runtime.host_cores import bind_to_own_cores
from meshpipe.runtime.host_memory import keep_freed_memory
from meshpipe.train.run.devices import DevicePlan, local_rank, local_ranks, plan_devices
from meshpipe.train.supervisor.diagnosis import failure_report, hang_report, read_statuses

PROCESS_GROUP_TIMEOUT_S = 60.0
DEFAULT_HANG_TIMEOUT_S = 30.0
# How long terminated workers get before they are killed.
TERMINATE_GRACE_S = 3.0
POLL_S = 0.1
# A rank's error in the one line of a failure is cut (at a clause) past this length.
CAUSE_CHARS = 600
# How long a recorded consequence (a stop notice) waits for the record of its cause.
CAUSE_GRACE_S = 3.0
# What gloo says on the ranks left behind when a peer's process exits.
_PEER_GONE_SIGNS = ("Connection closed by peer", "Connection reset by peer")


class LaunchError(RuntimeError):
    """A rank failed; ``rank`` is the first one that did. ``str()`` is one line;
    ``details`` holds the tracebacks and, for a hang, the picture of who waits on whom."""

    def __init__(self, message: str, rank: int, details: str = ""):
        super().__init__(message)
        self.rank = rank
        self.details = details


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run; ``exit_code`` follows the shell's convention."""

    def __init__(self, signum: int, saved: bool):
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}" + (" after saving a checkpoint" if saved else ""))
        self.signum = signum
        self.saved = saved
        self.exit_code = 128 + signum


@dataclass(frozen=True)
class Supervision:
    """How the launcher watches the ranks."""

    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S
    log_dir: Path | None = None
    checkpoint_on_signal: bool = False


def reports_for_the_job() -> bool:
    """Whether this process speaks for the whole job (prints, writes the results): a local
    run's launcher, or rank 0 of a torchrun job (every rank runs the command there)."""
    return not under_torchrun() or int(os.environ["RANK"]) == 0


def device_for_this_rank() -> torch.device:
    """The tuner's device: its local measuring ranks are CPU processes; under torchrun the
    job's own devices, placed as training places them (``meshpipe.train.run.devices``)."""
    if not under_torchrun():
        return torch.device("cpu")
    devices = plan_devices("auto", "auto", local_ranks(int(os.environ["WORLD_SIZE"])))
    return devices.device(local_rank(int(os.environ["RANK"])))


def launch(fn: Callable[..., Any], world_size: int, *args: Any, threads_per_process: int = 1,
           timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
           supervision: Supervision | None = None, devices: DevicePlan | None = None) -> None:
    """Run ``fn(*args)`` on ``world_size`` ranks (see the module docstring)."""
    supervision = supervision or Supervision()
    devices = devices or DevicePlan.cpu(world_size)
    if under_torchrun():
        _launch_under_torchrun(fn, world_size, args, threads_per_process, timeout_s, supervision,
                               devices)
        return
    with tempfile.TemporaryDirectory(prefix="meshpipe-launch-") as tmp:
        control = Path(tmp)
        context = multiprocessing.get_context("spawn")
        rank_args = (fn, args, f"file://{control / 'rendezvous'}", world_size,
                     threads_per_process, timeout_s, supervision, devices, control,
                     os.getpid())
        processes = [context.Process(target=_run_rank, args=(rank, *rank_args),
                                     name=f"meshpipe-rank-{rank}") for rank in range(world_size)]
        with _SignalCatcher() as signals:
            for process in processes:
                process.start()
            try:
                _supervise(processes, control, supervision, signals)
            finally:
                _stop_all(processes)


def _launch_under_torchrun(fn, world_size, args, threads, timeout_s,
                           supervision: Supervision, devices: DevicePlan) -> None:
    launched = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if launched != world_size:
        raise LaunchError(f"torchrun started {launched} processes but this run needs "
                          f"{world_size}; pass --nproc-per-node/--nnodes that multiply to "
                          f"{world_size}", rank=rank)
    if supervision.checkpoint_on_signal:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _request_stop_then_default)
    try:
        _run_rank(rank, fn, args, None, world_size, threads, timeout_s, supervision, devices,
                  None, None)
    except BaseException as error:
        record = _failure_record(rank, error, supervision.log_dir)
        _append_to_log(_rank_log(supervision.log_dir, rank), record["traceback"])
        raise LaunchError(failure_report([record], {}, world_size)[0], rank,
                          record["traceback"]) from None


def _request_stop_then_default(signum: int, frame: Any) -> None:
    """First signal: finish the step and save; a second one acts as usual."""
    activity.request_stop()
    signal.signal(signum, signal.SIG_DFL)


class _SignalCatcher:
    """SIGINT/SIGTERM/SIGUSR1 in the launcher, recorded for the supervision loop."""

    def __init__(self) -> None:
        self.stops: list[int] = []
        self.dump_requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_SignalCatcher":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                self._previous[signum] = signal.signal(signum, self._catch)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _catch(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGUSR1:
            self.dump_requested = True
        else:
            self.stops.append(signum)


def _supervise(processes: list, control: Path, supervision: Supervision,
               signals: _SignalCatcher) -> None:
    """Watch the ranks until all finished; raise on a failure, a hang or a signal."""
    world_size = len(processes)
    stop_posted = False
    first_consequence = None
    deaths: dict[int, tuple[float, int]] = {}  # rank -> (when noticed, exit code)
    while True:
        codes = [process.exitcode for process in processes]
        now = time.time()
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in deaths:
                deaths[rank] = (now, code)
        records = _error_records(control)
        silent_deaths = set(deaths) - {r["reported_by"] for r in records}
        if records and not silent_deaths and all(r["consequence"] for r in records):
            # A peer's stop notice can be recorded before the error that caused it: give
            # the failing rank a moment to record its own before stopping everyone.
            first_consequence = first_consequence or now
            if now - first_consequence < CAUSE_GRACE_S:
                time.sleep(POLL_S)
                continue
        if records or deaths:
            _stop_all(processes)
            records = _error_records(control)
            statuses = read_statuses(control, world_size)
            died = _unrecorded(deaths, records, statuses, control)
            line, rank, details = failure_report(records, died, world_size,
                                                 supervision.log_dir)
            _keep_log(supervision.log_dir, "failure.txt", details + "\n" + line)
            raise LaunchError(line, rank, details)
        if signals.stops:
            if not supervision.checkpoint_on_signal or len(signals.stops) > 1:
                _stop_all(processes)
                raise Interrupted(signals.stops[0], saved=False)
            if not stop_posted:
                (control / "stop-request").touch()
                stop_posted = True
        if all(code == 0 for code in codes):
            if signals.stops:
                raise Interrupted(signals.stops[0], saved=True)
            return
        statuses = read_statuses(control, world_size)
        hang = hang_report(statuses, now, supervision.hang_timeout, codes)
        if hang is not None:
            picture, line, rank = hang
            print(picture, file=sys.stderr, flush=True)
            _stop_all(processes)
            line += _flight_recorder_note(supervision.log_dir)
            _keep_log(supervision.log_dir, "hang.txt", picture + "\n" + line)
            raise LaunchError(line, rank, picture)
        if signals.dump_requested:
            signals.dump_requested = False
            print(hang_report(statuses, now, supervision.hang_timeout, codes, always=True)[0],
                  file=sys.stderr, flush=True)
        time.sleep(POLL_S)


def _unrecorded(deaths: dict[int, tuple[float, int]], records: list[dict],
                statuses: dict[int, dict], control: Path) -> dict[int, dict]:
    """Ranks that ended abnormally without recording an error (killed, os._exit): when,
    how, and their last reported activity."""
    recorded = {r["reported_by"] for r in records}
    return {rank: {"time": when, "exit_code": code, "status": statuses.get(rank),
                   "where": activity.read_where(control / f"where-{rank}")}
            for rank, (when, code) in deaths.items()
            if rank not in recorded}


def _error_records(control: Path) -> list[dict]:
    records = []
    for path in control.glob("error-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being written; read on the next poll
    return records


def _stop_all(processes: list) -> None:
    """Terminate every live rank, kill those that do not end within the grace time."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _keep_log(log_dir: Path | None, name: str, text: str) -> None:
    if log_dir is None:
        return
    # The report is printed anyway: a full disk must not hide it behind an OSError.
    with contextlib.suppress(OSError):
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / name).write_text(text + "\n")


def _is_consequence(error: BaseException) -> bool:
    """Whether ``error`` only reports that another rank failed first."""
    return isinstance(error, PeerFailedError) or any(
        sign in str(error) for sign in _PEER_GONE_SIGNS)


def shortened_cause(cause: str, limit: int = CAUSE_CHARS) -> str:
    """``cause`` whole, or past ``limit`` characters cut after its last clause that fits (a
    word where no clause ends early enough) and marked ``[...]``: the rank's log has it all."""
    if len(cause) <= limit:
        return cause
    end = max(cause.rfind("; ", 0, limit), cause.rfind(". ", 0, limit))
    if end < limit // 2:
        end = cause.rfind(" ", 0, limit)
    return cause[:end if end > 0 else limit].rstrip(" ;,.") + " [...]"


def _root_cause(error: BaseException) -> BaseException:
    """The innermost explicitly chained cause: the error a wrapper was raised for."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _failure_record(rank: int, error: BaseException, log_dir: Path | None) -> dict:
    """What the launcher reports of this rank's error. An error that knows better which
    rank and place to blame says so (``blamed_rank``, ``where``: a NaN every rank detects)."""
    where = getattr(error, "where", None) or activity.describe(
        activity.first_failure() or activity.snapshot())
    blamed, cause = getattr(error, "blamed_rank", rank), activity.one_line(_root_cause(error))
    if isinstance(error, PeerFailedError):  # a stop notice says who failed first, and why
        blamed, cause, where = error.failed_rank, error.reason, None
    log = _rank_log(log_dir, rank)
    return {"rank": blamed, "reported_by": rank, "time": time.time(),
            "traceback": traceback.format_exc(), "consequence": _is_consequence(error),
            "cause": shortened_cause(cause), "where": where, "log": str(log) if log else None}


def _append_to_log(log: Path | None, text: str) -> None:
    if log is not None:
        with open(log, "a", encoding="utf-8") as stream:
            stream.write(text)


def _rank_log(log_dir: Path | None, rank: int) -> Path | None:
    return Path(log_dir) / f"rank-{rank}.log" if log_dir is not None else None


def _send_output_to_log(log: Path, keep_terminal: bool) -> None:
    """Everything this rank writes to stderr (C++ warnings too) and Python warnings go to
    its log; with ``keep_terminal`` Python's own stderr (a progress bar, the one-line report
    of a failure) still reaches the terminal."""
    log.parent.mkdir(parents=True, exist_ok=True)
    stream = open(log, "a", buffering=1, encoding="utf-8")
    terminal = os.dup(2)
    os.dup2(stream.fileno(), 2)
    sys.stderr = os.fdopen(terminal, "w", buffering=1) if keep_terminal else stream
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: (
        stream.write(warnings.formatwarning(message, category, filename, lineno, line)))


def _take_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()


# NCCL's flight recorder: each rank keeps its last collectives, and its watchdog (the process
# group's timeout) writes them to a file before tearing the rank down.
FLIGHT_RECORDER_ENTRIES = "2000"
NCCL_TRACE_PREFIX = "nccl-trace-rank-"


def nccl_flight_recorder(log_dir: Path | None) -> dict[str, str]:
    """torch's ``TORCH_NCCL_*`` settings that record each rank's collectives and dump them
    under ``log_dir`` (as ``nccl-trace-rank-<rank>``) when the watchdog times out; a user's
    own settings win (they are defaults)."""
    settings = {"TORCH_NCCL_TRACE_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES,
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if log_dir is not None:
        settings["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(log_dir) / NCCL_TRACE_PREFIX)
    return settings


def _flight_recorder_note(log_dir: Path | None) -> str:
    """Where NCCL's watchdog dumped the ranks' collectives, when it did."""
    dumps = sorted(Path(log_dir).glob(f"{NCCL_TRACE_PREFIX}*")) if log_dir is not None else []
    return (f"; NCCL's flight recorder wrote {len(dumps)} rank(s)' collectives to "
            f"{Path(log_dir) / NCCL_TRACE_PREFIX}*" if dumps else "")


def _run_rank(rank: int, fn: Callable[..., Any], args: tuple, init_method: str | None,
              world_size: int, threads: int, timeout_s: float, supervision: Supervision,
              devices: DevicePlan, control: Path | None, launcher_pid: int | None) -> None:
    activity.reset()
    if control is not None:
        if not devices.on_gpu:
            bind_to_own_cores(rank, world_size, threads)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which decides
    torch.set_num_threads(threads)
    log = _rank_log(supervision.log_dir, rank)
    if log is not None:
        # Under torchrun each rank reports its own failure in one line on the terminal.
        _send_output_to_log(log, keep_terminal=rank == 0 or control is None)
    reporter = activity.Reporter(rank, control, supervision.hang_timeout,
                                 parent_pid=launcher_pid, judge_hangs=control is None).start()
    try:
        # Until every rank has started (its device set up; imports take seconds on a busy
        # machine): not a hang before the process group's own timeout, which ends a
        # rendezvous with its error.
        with activity.doing("rendezvous", limit=timeout_s):
            _take_device(devices.device(local_rank(rank)))
            if devices.backend == "nccl":
                for name, value in nccl_flight_recorder(supervision.log_dir).items():
                    os.environ.setdefault(name, value)
            dist.init_process_group(devices.backend, init_method=init_method or "env://",
                                    rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        with strict.installed() if strict.requested() else contextlib.nullcontext():
            fn(*args)
    except BaseException as error:
        if control is None:
            raise
        record = _failure_record(rank, error, supervision.log_dir)
        _append_to_log(log, record["traceback"])
        temporary = control / f"error-{rank}.tmp"
        temporary.write_text(json.dumps(record))
        os.replace(temporary, control / f"error-{rank}.json")
        # No clean-up: the launcher stops every rank now, and tearing down groups whose
        # peers are stuck could itself hang.
        sys.stderr.flush()
        os._exit(1)
    reporter.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    if control is not None:  # a process of our own: its teardown would only delay the job
        exit_process(0)
