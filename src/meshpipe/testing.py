"""Distributed test harness: a persistent pool of gloo worker processes per world size.

Starting processes costs seconds (torch import + rendezvous), so a test session keeps one
pool per world size alive and sends each test's function to every rank::

    from meshpipe.testing import run_distributed

    def _body(rank, world_size, scale):          # module level: it is pickled by reference
        import torch.distributed as dist
        t = torch.ones(2) * rank
        dist.all_reduce(t)
        return t

    results = run_distributed(4, _body, scale=2)   # one value per rank, in rank order

``fn`` is called as ``fn(rank, world_size, *args, **kwargs)`` on every rank with the
default process group already initialised (gloo, CPU, ``torch.set_num_threads(1)``).
If any rank raises, ``DistributedTestError`` carries the failing rank's traceback. If the
call outlives ``timeout``, the error names the ranks still running. After either, the
pool is torn down (its process group may hold unmatched messages or be wedged) and the
next call starts a fresh one. A test that expects an error cheaply catches it inside
``fn`` and returns what it saw, which keeps the pool alive.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 120.0
# How long the other ranks get to finish once one rank has raised.
_GRACE_AFTER_ERROR_S = 10.0
# Collective timeout inside workers; the parent's timeout normally fires first.
_WORKER_PG_TIMEOUT_S = 300.0


class DistributedTestError(AssertionError):
    """A rank raised, died, or the call timed out. ``failures`` maps rank -> traceback text."""

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = failures or {}


def _worker_main(rank: int, world_size: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from .runtime.host_memory import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()
    os.environ["MESHPIPE_TEST_WORKER"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            timeout=timedelta(seconds=_WORKER_PG_TIMEOUT_S))
    results.put((None, rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, sys_path, payload = task
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(rank, world_size, *args, **kwargs)
            results.put((task_id, rank, "ok", pickle.dumps(value)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            results.put((task_id, rank, "error", traceback.format_exc()))
            continue
        _destroy_groups_of_the_task()
    dist.destroy_process_group()


# Groups a test keeps for its later calls in the same worker (``keep_across_calls``).
_KEPT_GROUPS: list[Any] = []


def keep_across_calls(*groups: Any) -> None:
    """Keep these process groups alive after the call that created them returns (a test that
    caches its groups in the worker for its later calls). Every other group a call creates is
    destroyed when it returns."""
    _KEPT_GROUPS.extend(groups)


def _destroy_groups_of_the_task() -> None:
    """Destroy the process groups a call created: each gloo group keeps threads of its own,
    and a pooled worker that kept them all would run a test session with thousands of them
    (most of its time then goes to the kernel). Every rank first waits for the others to
    finish the call (after its result went back, so that a rank that hangs is the one the
    pool names): no rank closes a group's connections while another may still be
    connecting to them or using them. (A suspected cause of a "Connection closed by peer"
    in ``new_group``, seen once in the suite and not reproduced in 300 calls that each
    made five groups on four ranks.)"""
    import torch.distributed as dist

    dist.barrier()
    kept = {id(group) for group in _KEPT_GROUPS}
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD and id(group) not in kept:
            dist.destroy_process_group(group)


class WorkerPool:
    """``world_size`` spawned processes sharing one gloo default process group."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._processes: list[mp.process.BaseProcess] = []
        self._task_queues: list[Any] = []
        self._results: Any = None
        self._next_task = 0
        self._init_file = ""

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def start(self) -> None:
        context = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="meshpipe-pool-")
        os.close(fd)
        os.unlink(self._init_file)
        self._results = context.Queue()
        self._task_queues = [context.Queue() for _ in range(self.world_size)]
        self._processes = [
            context.Process(target=_worker_main, daemon=True,
                            args=(rank, self.world_size, self._init_file,
                                  self._task_queues[rank], self._results),
                            name=f"meshpipe-worker-{self.world_size}-{rank}")
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()
        ready: set[int] = set()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(ready) < self.world_size:
            message = self._get_result(deadline)
            if message is None:
                self.close()
                raise DistributedTestError(
                    f"worker pool of {self.world_size} did not start within "
                    f"{_START_TIMEOUT_S:.0f} s; ranks ready: {sorted(ready)}")
            ready.add(message[1])

    def _get_result(self, deadline: float) -> tuple | None:
        """Next message from any worker, or None at the deadline or when a worker died."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                return self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if not self.alive:
                    return None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order."""
        if not self.alive:
            self.close()
            self.start()
        self._next_task += 1
        task_id = self._next_task
        payload = pickle.dumps((fn, args, kwargs))
        for task_queue in self._task_queues:
            task_queue.put((task_id, list(sys.path), payload))

        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(failures) < self.world_size:
            message = self._get_result(deadline)
            if message is None:
                break
            message_task, rank, status, body = message
            if message_task != task_id:
                continue
            if status == "ok":
                values[rank] = pickle.loads(body)
            else:
                failures[rank] = body
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)

        if len(values) == self.world_size:
            return [values[rank] for rank in range(self.world_size)]
        self._raise_failure(fn, timeout, values, failures)

    def _raise_failure(self, fn: Callable[..., Any], timeout: float, values: dict[int, Any],
                       failures: dict[int, str]) -> None:
        dead = [rank for rank, p in enumerate(self._processes) if not p.is_alive()]
        running = [rank for rank in range(self.world_size)
                   if rank not in values and rank not in failures and rank not in dead]
        self.close()
        name = getattr(fn, "__qualname__", repr(fn))
        lines = [f"{name} on {self.world_size} ranks:"]
        if failures:
            lines.append(f"ranks {sorted(failures)} raised")
        if dead:
            lines.append(f"ranks {dead} died")
        if running:
            reason = "after the first failure" if failures else f"after {timeout:.0f} s timeout"
            lines.append(f"ranks {running} still running {reason}")
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} traceback ---\n{failures[rank]}")
        raise DistributedTestError("\n".join(lines), failures)

    def close(self) -> None:
        for task_queue in self._task_queues:
            try:
                task_queue.put(None)
            except (OSError, ValueError):
                pass
        started = [process for process in self._processes if process.pid is not None]
        deadline = time.monotonic() + 2.0
        for process in started:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in started:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._processes = []
        self._task_queues = []
        if self._init_file and os.path.exists(self._init_file):
            os.unlink(self._init_file)


_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """The session's pool for ``world_size`` ranks, started on first use."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any,
                    timeout: float = DEFAULT_TIMEOUT_S, strict: bool = False,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on a pooled group of ``world_size`` ranks;
    ``strict``: with every operation in NCCL's order (``meshpipe.comm.strict``)."""
    if strict:
        return get_pool(world_size).run(_strictly, fn, *args, timeout=timeout, **kwargs)
    return get_pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


def _strictly(rank: int, world_size: int, fn: Callable[..., Any], *args: Any,
              **kwargs: Any) -> Any:
    """``fn`` under the strict communication mode."""
    from meshpipe.comm import strict

    with strict.installed():
        return fn(rank, world_size, *args, **kwargs)


def shutdown_pools() -> None:
    """Stop every pool's workers (called at interpreter exit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_pools)
