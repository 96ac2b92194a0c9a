"""What this rank is doing right now: the raw material of hang diagnosis and failure reports.

Code marks what it runs with ``doing(what, ...)`` (a step, an action, a collective, a save)
and what it waits for with ``waiting(what, peer=..., peers=...)``. The entries nest; the
innermost one is this rank's current activity, and ``snapshot()`` describes it together with
the step, stage and microbatch of the entries around it and how long nothing has changed.

A process that runs under a launcher starts a ``Reporter``: a thread that writes the
snapshot to a status file every interval, changed or not (the launcher reads every rank's
file to draw who waits on whom, and a file that stops being rewritten shows a frozen
process), notices a stop request, and ends the process if its launcher is gone. Where no
launcher watches (torchrun), the reporter judges a hang itself.

Marking costs a list append and pop; without a reporter nothing else happens.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

# A waiting rank gives the rank it waits on this much longer to notice its own hang first
# (under torchrun, where each rank judges itself, so the stuck rank is the one that reports).
WAITING_GRACE_S = 5.0
HANG_EXIT_CODE = 3


@dataclass
class _Entry:
    what: str
    waiting: bool
    limit: float | None
    fields: dict[str, Any] = field(default_factory=dict)


# The fields that say where in the training a rank is (written through at once, below).
WHERE_FIELDS = ("step", "stage", "microbatch", "action")
# How often a reporter rewrites its rank's status.
REPORT_INTERVAL_S = 0.2
# The where-file: a header (the length of the current record, and which of the two slots
# holds it) and two slots. A record goes to the slot not in use, then the header points at
# it: neither a reader nor a rank frozen mid-write ever leaves half a record to read.
WHERE_BYTES = 1024
_HEADER_BYTES = 4
_SLOT_BYTES = (WHERE_BYTES - _HEADER_BYTES) // 2

_stack: list[_Entry] = []
# Where this rank is, kept current in a small memory-mapped file the launcher reads after a
# death or when the rank stops reporting (the status file is only written every interval:
# too late for a rank killed or frozen mid-step).
_where_map: mmap.mmap | None = None
_where_slot = 0
_changed_at = time.time()
_first_failure: dict[str, Any] | None = None
_stop_requested = threading.Event()


def _push(entry: _Entry) -> None:
    global _changed_at
    _stack.append(entry)
    _changed_at = time.time()
    if _where_map is not None and entry.fields.keys() & WHERE_FIELDS:
        _write_where()


def _write_where() -> None:
    """Write where this rank is, and since when, to the slot not in use, then switch."""
    global _where_slot
    record = {key: value for entry in _stack for key, value in entry.fields.items()
              if key in WHERE_FIELDS}
    record["written_at"] = _changed_at
    data = json.dumps(record, default=str).encode()
    if len(data) > _SLOT_BYTES:  # an unusually long action name: keep the numbers
        data = json.dumps({k: v for k, v in record.items() if isinstance(v, (int, float))}
                          ).encode()
    _where_slot = 1 - _where_slot
    start = _HEADER_BYTES + _where_slot * _SLOT_BYTES
    _where_map[start:start + len(data)] = data
    _where_map[0:_HEADER_BYTES] = len(data).to_bytes(2, "little") + bytes((_where_slot, 0))


def read_where_record(path: Path) -> dict[str, Any] | None:
    """What a rank last wrote to its where-file: the step, stage, microbatch and action it
    was in and when it got there (``written_at``); None if it wrote none."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if len(data) != WHERE_BYTES or data[2] > 1:
        return None
    length, start = int.from_bytes(data[:2], "little"), _HEADER_BYTES + data[2] * _SLOT_BYTES
    try:
        return json.loads(data[start:start + length]) if length else None
    except ValueError:
        return None


def read_where(path: Path) -> str | None:
    """The place a rank last wrote to its where-file (None if it wrote none)."""
    record = read_where_record(path)
    return describe(record) if record is not None else None


def _pop(entry: _Entry, failed: BaseException | None) -> None:
    global _changed_at, _first_failure
    if failed is not None and _first_failure is None:
        _first_failure = {**snapshot(), "error": one_line(failed)}
    if _stack and _stack[-1] is entry:
        _stack.pop()
    elif entry in _stack:
        _stack.remove(entry)
    _changed_at = time.time()
    if _where_map is not None and entry.fields.keys() & WHERE_FIELDS:
        _write_where()


@contextmanager
def _marked(entry: _Entry) -> Iterator[None]:
    _push(entry)
    try:
        yield
    except BaseException as error:
        _pop(entry, error)
        raise
    _pop(entry, None)


def doing(what: str, *, limit: float | None = None, **fields: Any):
    """Mark running ``what``. ``limit`` lets it (and everything inside) last that many
    seconds before it counts as a hang (default: the reporter's hang timeout). ``fields``
    (step, stage, microbatch, action, ...) go into the snapshot."""
    return _marked(_Entry(what, False, limit, fields))


def waiting(what: str, *, peer: int | None = None, peers: list[int] | None = None,
            label: str | None = None, limit: float | None = None):
    """Mark waiting for ``what`` from global rank ``peer`` (or the ranks ``peers`` of a
    collective)."""
    fields = {k: v for k, v in (("peer", peer), ("peers", peers), ("label", label))
              if v is not None}
    return _marked(_Entry(what, True, limit, fields))


def snapshot() -> dict[str, Any]:
    """The current activity: its description, whether it waits, on whom, the step, stage
    and microbatch it belongs to, since when nothing changed, and the longest limit set."""
    entries = list(_stack)
    state: dict[str, Any] = {"since": _changed_at, "waiting": False, "what": "idle",
                             "limit": None}
    limits = [e.limit for e in entries if e.limit is not None]
    if limits:
        state["limit"] = max(limits)
    for entry in entries:
        state.update(entry.fields)
    if entries:
        state["what"] = entries[-1].what
        state["waiting"] = entries[-1].waiting
        state["path"] = " > ".join(e.what for e in entries)
    return state


def first_failure() -> dict[str, Any] | None:
    """The snapshot taken when the first exception left a marked activity, with its error."""
    return _first_failure


def reset() -> None:
    """Forget everything (a new run in this process)."""
    global _first_failure
    _stack.clear()
    _first_failure = None
    _stop_requested.clear()


def request_stop() -> None:
    """Ask the training loop to stop at the end of the current step (signal handlers)."""
    _stop_requested.set()


def stop_requested() -> bool:
    return _stop_requested.is_set()


def one_line(error: BaseException) -> str:
    """The error in one line; an out-of-memory error with the device's memory and what to
    try (``out_of_memory_line``)."""
    if is_out_of_memory(error):
        return out_of_memory_line(error)
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# What an out-of-memory error says to try, in the order people usually can.
MEMORY_ADVICE = ("try more pipeline stages (--pp, --vpp), --recompute full, a smaller "
                 "--microbatch-size (more --microbatches), or --zero 1/2")


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA allocator's ``OutOfMemoryError``, or the CPU allocator's failure."""
    out_of_memory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return isinstance(error, out_of_memory) or "can't allocate memory" in str(error)


def out_of_memory_line(error: BaseException) -> str:
    """The allocator's own first sentences (what it tried to allocate), the device's memory
    allocated, reserved and at its peak, and what to try."""
    sentences = " ".join(str(error).split()).split(". ")
    said = ". ".join(sentences[:2]).rstrip(".")
    memory = ""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gib = 2 ** 30
        device = torch.cuda.current_device()
        memory = (f" (GPU {device}: {torch.cuda.memory_allocated(device) / gib:.1f} GiB "
                  f"allocated, {torch.cuda.memory_reserved(device) / gib:.1f} GiB reserved, "
                  f"peak {torch.cuda.max_memory_allocated(device) / gib:.1f} GiB)")
    return f"out of memory: {said}{memory}; {MEMORY_ADVICE}"


def describe(state: dict[str, Any]) -> str:
    """Where a snapshot is, in words: "step 3, stage 1, microbatch 2, action B"."""
    parts = [f"{key} {state[key]}" for key in WHERE_FIELDS if state.get(key) is not None]
    return ", ".join(parts) if parts else state.get("what", "idle")


class Reporter:
    """Writes this rank's snapshot to ``status_dir/status-<rank>.json`` every ``interval_s``
    with the time it wrote it (``reported_at``): a heartbeat, so the launcher tells a frozen
    rank from one that is still where it reported.

    It also watches ``status_dir/stop-request`` (a stop asked by the launcher), ends the
    process when the launcher that started it is gone (``parent_pid``), and with
    ``judge_hangs`` ends it with a one-line report when this rank's activity outlives its
    limit (``hang_timeout`` by default).
    """

    def __init__(self, rank: int, status_dir: Path | None, hang_timeout: float, *,
                 parent_pid: int | None = None, judge_hangs: bool = False,
                 interval_s: float = REPORT_INTERVAL_S):
        self.rank = rank
        self.status_dir = Path(status_dir) if status_dir is not None else None
        self.hang_timeout = hang_timeout
        self.parent_pid = parent_pid
        self.judge_hangs = judge_hangs
        self.interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshpipe-activity",
                                        daemon=True)

    def start(self) -> "Reporter":
        global _where_map
        if self.status_dir is not None:
            path = self.status_dir / f"where-{self.rank}"
            path.write_bytes(bytes(WHERE_BYTES))
            with open(path, "r+b") as stream:
                _where_map = mmap.mmap(stream.fileno(), WHERE_BYTES)
            self._write_status()  # now: a rank may freeze before the first interval ends
        self._thread.start()
        return self

    def stop(self) -> None:
        global _where_map
        self._done.set()
        self._thread.join(timeout=2)
        if _where_map is not None:
            _where_map.close()
            _where_map = None

    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                os._exit(1)  # the launcher died: nobody would ever stop this rank
            if self.status_dir is not None:
                self._write_status()
                if (self.status_dir / "stop-request").exists():
                    request_stop()
            if self.judge_hangs:
                self._judge_hang()

    def _write_status(self) -> None:
        state = {"rank": self.rank, "pid": os.getpid(), "reported_at": time.time(),
                 **snapshot()}
        path = self.status_dir / f"status-{self.rank}.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(state, default=str))
        os.replace(temporary, path)

    def _judge_hang(self) -> None:
        state = snapshot()
        limit = state["limit"] or self.hang_timeout
        if state["waiting"]:
            limit += WAITING_GRACE_S
        age = time.time() - state["since"]
        if age > limit:
            print(f"meshpipe: rank {self.rank} hangs: {hang_line(state, age)}", file=sys.stderr,
                  flush=True)
            os._exit(HANG_EXIT_CODE)


def hang_line(state: dict[str, Any], age: float) -> str:
    """One rank's activity for a hang report: what it runs or waits for, and for how long."""
    where = describe(state)
    what = state.get("what", "idle")
    if state.get("waiting"):
        on = (f" from rank {state['peer']}" if "peer" in state
              else f" with ranks {_ranks(state['peers'])}" if "peers" in state else "")
        label = f" ({state['label']})" if state.get("label") else ""
        return f"waits {age:.0f} s for {what}{label}{on} [{where}]"
    return f"runs {what} for {age:.0f} s without finishing [{where}]"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
