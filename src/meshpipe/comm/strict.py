"""The strict communication mode: NCCL's order of execution, on gloo, for tests.

NCCL runs a communicator's operations one after another in the order they were posted: a
pair of ranks' point-to-point operations on one stream (torch gives each pair of a process
group a communicator of its own), a group's collectives on another; a receive holds its
stream until the peer's matching send runs, a send until the peer's receive does; a grouped
call (``batch_isend_irecv``) runs its operations together. gloo runs whatever has arrived,
so code whose posting order would deadlock on NCCL passes on CPU processes. Under this mode
(``installed``; ``MESHPIPE_STRICT_COMM=1`` for ``meshpipe train``) every such operation
goes to the queue of its pair or of its group's collectives, and one thread per queue
executes them in posting order, each to its end (a send until its receive was reached), so
the CPU run deadlocks where NCCL would. A queue that waits longer than ``timeout_s`` on one
operation fails it with ``StrictOrderError``: the rank, the group's ranks, the operation and
what it waits for, in one line. Groups that stay gloo beside NCCL on GPU runs (``host_group``:
a transport's header group, the background checkpoint writer's) keep gloo's behaviour.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

ENVIRONMENT_VARIABLE = "MESHPIPE_STRICT_COMM"
DEFAULT_TIMEOUT_S = 20.0
# torch's newer names (``all_gather_single``) are what the older ones call: where they exist
# they are replaced, and the older ones reach the queue through them (replacing both would
# queue one inside the other).
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "all_to_all",
               "reduce", "gather", "scatter", "barrier",
               *(new if hasattr(c10d, new) else old for old, new in (
                   ("all_gather_into_tensor", "all_gather_single"),
                   ("reduce_scatter_tensor", "reduce_scatter_single"))))
PATCHED = ("isend", "irecv", "batch_isend_irecv", *COLLECTIVES)


class StrictOrderError(RuntimeError):
    """An operation that NCCL's order would leave waiting for ever."""


_ACTIVE: list["StrictMode"] = []
# Groups that are gloo on GPU runs too (a transport's header group, the background
# checkpoint writer's): gloo keeps no posting order there, so neither does the strict mode.
_HOST_GROUPS: set[int] = set()


def host_group(group: Any) -> Any:
    """Mark ``group`` as one that stays gloo beside NCCL (returned, for chaining)."""
    if group is not None:
        _HOST_GROUPS.add(id(group))
    return group


def requested() -> bool:
    return os.environ.get(ENVIRONMENT_VARIABLE, "") not in ("", "0")


def active() -> bool:
    """Whether the strict mode is installed in this process now."""
    return bool(_ACTIVE)


class StrictWork:
    """The handle of a queued operation: ``wait`` until its queue executed it."""

    def __init__(self, what: str):
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"timed out waiting for {self.what} (strict mode)")
        if self._error is not None:
            raise self._error
        return True


class _Queue(threading.Thread):
    """One NCCL stream's worth of operations, executed in posting order."""

    def __init__(self, name: str):
        super().__init__(name=f"strict-{name}", daemon=True)
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            work, execute = self.items.get()
            if work is None:  # the mode was uninstalled
                return
            try:
                execute()
                work.finish()
            except BaseException as error:  # noqa: BLE001 - handed to the waiter
                work.finish(error)


class StrictMode:
    """The queues and the patched ``torch.distributed`` functions (``installed``)."""

    def __init__(self, timeout_s: float):
        self.timeout = timedelta(seconds=timeout_s)
        self.original = {name: getattr(c10d, name) for name in PATCHED}
        self._queues: dict[tuple, _Queue] = {}
        self._lock = threading.Lock()
        self.posted = {"p2p": 0, "collective": 0}  # operations queued, by kind

    # -- where an operation goes -------------------------------------------------------------

    def _queue(self, key: tuple) -> _Queue:
        with self._lock:
            if key not in self._queues:
                self._queues[key] = _Queue("-".join(map(str, key)))
            return self._queues[key]

    @staticmethod
    def _group(group: Any) -> Any:
        return group if group is not None else c10d._get_default_group()

    def _names(self, group: Any) -> str:
        ranks = dist.get_process_group_ranks(self._group(group))
        return f"group of ranks {ranks}"

    def close(self) -> None:
        """End the queues' threads once they executed what they hold."""
        with self._lock:
            for queue_ in self._queues.values():
                queue_.items.put((None, None))
            self._queues.clear()

    def _submit(self, key: tuple, what: str, execute: Callable[[], None]) -> StrictWork:
        work = StrictWork(what)
        with self._lock:
            self.posted[key[0]] += 1
        self._queue(key).items.put((work, execute))
        return work

    # -- point to point ----------------------------------------------------------------------

    def _pair(self, group: Any, peer: int) -> tuple:
        """The queue of this rank and ``peer`` in ``group`` (NCCL's communicator of the pair)."""
        me = dist.get_rank()
        return ("p2p", id(self._group(group)), min(me, peer), max(me, peer))

    def _peer(self, group: Any, peer: int | None, group_peer: int | None) -> int:
        if group_peer is not None:
            return dist.get_global_rank(self._group(group), group_peer)
        return peer

    def _finished(self, work: Any, what: str) -> None:
        """Wait for an operation gloo started, as NCCL's stream would: to its end."""
        try:
            work.wait(self.timeout)
        except RuntimeError as cause:
            raise StrictOrderError(
                f"strict communication mode: rank {dist.get_rank()} would deadlock on NCCL: "
                f"{what} did not complete in {self.timeout.total_seconds():.0f} s, the "
                "operations before it on its stream done (the peer has not reached the "
                f"matching one: it waits on something posted after this) ({cause})") from None

    def p2p(self, send: bool, tensor: Any, peer: int | None = None, group: Any = None,
            tag: int = 0, group_peer: int | None = None, **options: Any) -> StrictWork:
        call = self.original["isend" if send else "irecv"]
        peer = self._peer(group, peer, group_peer)
        if id(group) in _HOST_GROUPS:
            return call(tensor, peer, group=group, tag=tag)
        what = (f"{'send to' if send else 'receive from'} rank {peer} (tag {tag}, "
                f"{self._names(group)})")

        def execute() -> None:
            self._finished(call(tensor, peer, group=group, tag=tag), what)
        return self._submit(self._pair(group, peer), what, execute)

    def batch(self, operations: list) -> list[StrictWork]:
        """A grouped call: its operations start together once each of their pairs' queues
        reached it, and the unit ends when all of them did."""
        parts = []
        for op in operations:
            peer = self._peer(op.group, op.peer, getattr(op, "group_peer", None))
            send = op.op in (self.patched_isend, self.original["isend"])
            parts.append((send, op.tensor, peer, op.group, op.tag))
        keys = sorted({self._pair(group, peer) for _, _, peer, group, _ in parts})
        what = "a batch of " + ", ".join(
            f"{'send to' if send else 'receive from'} rank {peer}"
            for send, _, peer, _, _ in parts)
        arrived = threading.Barrier(len(keys))
        done = threading.Event()

        def execute() -> None:
            if arrived.wait() == 0:  # the last queue to arrive runs the unit
                try:
                    started = [self.original["isend" if send else "irecv"](
                        tensor, peer, group=group, tag=tag)
                        for send, tensor, peer, group, tag in parts]
                    for work in started:
                        self._finished(work, what)
                finally:
                    done.set()
            done.wait()
        works = {key: self._submit(key, what, execute) for key in keys}
        return [works[self._pair(group, peer)] for _, _, peer, group, _ in parts]

    # -- collectives -------------------------------------------------------------------------

    def collective(self, name: str, *args: Any, group: Any = None, async_op: bool = False,
                   **options: Any) -> Any:
        call = self.original[name]
        if id(group) in _HOST_GROUPS:
            return call(*args, group=group, async_op=async_op, **options)
        what = f"{name} over the {self._names(group)}"

        def execute() -> None:
            work = call(*args, group=group, async_op=True, **options)
            if work is not None:
                self._finished(work, what)
        work = self._submit(("collective", id(self._group(group))), what, execute)
        if async_op:
            return work
        work.wait()
        return None

    # -- installing --------------------------------------------------------------------------

    def patched_isend(self, tensor: Any, dst: int | None = None, group: Any = None,
                      tag: int = 0, group_dst: int | None = None) -> StrictWork:
        return self.p2p(True, tensor, dst, group, tag, group_dst)

    def patched_irecv(self, tensor: Any, src: int | None = None, group: Any = None,
                      tag: int = 0, group_src: int | None = None) -> StrictWork:
        return self.p2p(False, tensor, src, group, tag, group_src)

    def patches(self) -> dict[str, Callable]:
        patched: dict[str, Callable] = {"isend": self.patched_isend,
                                        "irecv": self.patched_irecv,
                                        "batch_isend_irecv": self.batch}
        for name in COLLECTIVES:
            patched[name] = (lambda *args, name=name, **kwargs:
                             self.collective(name, *args, **kwargs))
        return patched


@contextlib.contextmanager
def installed(timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[StrictMode]:
    """Run ``torch.distributed``'s point-to-point operations and collectives in NCCL's order
    while open (module docstring); the originals come back after."""
    mode = StrictMode(timeout_s)
    patches = mode.patches()
    for name, function in patches.items():
        setattr(c10d, name, function)
        setattr(dist, name, function)
    _ACTIVE.append(mode)
    try:
        yield mode
    finally:
        _ACTIVE.remove(mode)
        mode.close()
        for name, function in mode.original.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
