"""The sub-step protocol: a forward cut at its communications, so that combined 1F1B can run
one microbatch's compute while another microbatch's communication travels.

A module opts in with ``forward_steps(*args)``: a generator that computes what ``forward``
computes but, where it would communicate, yields an :class:`Exchange` and receives
``(received, kept)`` back::

    def forward_steps(self, x):
        tokens, gates = self.route(x)
        received, (x, gates) = yield Exchange(send=tokens, keep=(x, gates),
                                              communicate=dispatch,
                                              communicate_backward=undispatch)
        return x + self.combine(self.experts(received), gates)

    def forward(self, x):
        return run_steps(self.forward_steps(x))

Rules of the protocol:

- ``communicate(send) -> received`` performs the exchange (blocking), ``communicate_backward
  (grads of received) -> grads of send`` its reverse for the gradients. Both get detached
  tensors and may run on the communication thread (:class:`CommWorker`), so they touch no
  autograd state and no module state that the compute changes.
- Every float tensor that the code after a yield uses from before it travels in ``send`` or
  ``keep``: the runtime cuts the autograd graph at each yield (the received and kept values
  are fresh leaves) and joins the pieces in backward itself, so a float tensor captured
  across a yield would lose its gradient. Integer tensors and Python values may be captured.
- Every rank of the communication group must yield the same exchanges in the same order.

``run_steps`` drives the generator in one go, each exchange differentiable (a plain forward,
used outside pipelines and for inference). ``Stage`` drives it piece by piece in training:
between two pieces the exchange is posted on the communication thread, and an ``OVERLAP``
action alternates the pieces of one microbatch's forward with those of another's backward
(:func:`co_schedule`), so each exchange travels while the other microbatch computes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["CommWorker", "Exchange", "InFlight", "co_schedule", "comm_worker", "drain",
           "record_event", "resume_within", "run_steps", "trace_events"]


@dataclass
class Exchange:
    """A communication between two sub-steps of a forward (see the module docstring)."""

    send: Any
    communicate: Callable[[Any], Any]
    communicate_backward: Callable[[Any], Any]
    keep: Any = None
    name: str = "exchange"


# ------------------------------------------------------------------------------ one go


class _Call:
    """What the autograd function of one exchange remembers between forward and backward."""

    def __init__(self, exchange: Exchange, send_spec):
        self.exchange = exchange
        self.send_spec = send_spec
        self.received_spec = None


class _Communicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *send_leaves: Tensor) -> tuple[Tensor, ...]:
        received = call.exchange.communicate(tree_unflatten(list(send_leaves), call.send_spec))
        leaves, call.received_spec = tree_flatten(received)
        ctx.call = call
        ctx.mark_non_differentiable(*[t for t in leaves if not t.is_floating_point()])
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        call = ctx.call
        send_grads = call.exchange.communicate_backward(
            tree_unflatten(list(grads), call.received_spec))
        return (None, *tree_flatten(send_grads)[0])


def communicate_with_autograd(exchange: Exchange) -> Any:
    """``exchange.communicate(exchange.send)``, differentiable through its reverse."""
    leaves, spec = tree_flatten(exchange.send)
    call = _Call(exchange, spec)
    received = _Communicate.apply(call, *leaves)
    return tree_unflatten(list(received), call.received_spec)


def run_steps(steps: Generator[Exchange, Any, Any]) -> Any:
    """Run a ``forward_steps`` generator to its end, each exchange performed at once (with
    autograd); returns what the generator returns."""
    try:
        exchange = next(steps)
        while True:
            exchange = steps.send((communicate_with_autograd(exchange), exchange.keep))
    except StopIteration as done:
        return done.value


def resume_within(steps: Generator, context: Callable[[], contextlib.AbstractContextManager]
                  ) -> Generator:
    """``steps``, each of its pieces run inside a fresh ``context()`` (autocast, grad mode):
    thread-wide state entered inside a generator would leak into whatever runs while it is
    suspended."""
    value = None
    while True:
        try:
            with context():
                item = steps.send(value)
        except StopIteration as done:
            return done.value
        value = yield item


def drain(task: Generator) -> Any:
    """Run a task (a generator yielding while its communication is in flight) to its end."""
    try:
        while True:
            next(task)
    except StopIteration as done:
        return done.value


def co_schedule(tasks: list[Generator]) -> list[Any]:
    """Run tasks turn by turn: each runs until it has posted a communication (it yields),
    then the next one computes while that communication travels. Returns their results."""
    results: list[Any] = [None] * len(tasks)
    active = list(range(len(tasks)))
    while active:
        for index in list(active):
            try:
                next(tasks[index])
            except StopIteration as done:
                results[index] = done.value
                active.remove(index)
    return results


# ---------------------------------------------------------------------- the comm thread


class InFlight:
    """A posted communication; ``wait()`` returns its result (re-raising its error)."""

    def __init__(self, future: Future, ready_at: float, label: str, done_event: Any = None):
        self._future = future
        self._ready_at = ready_at
        self._done_event = done_event
        self.label = label

    def wait(self) -> Any:
        record_event("wait", self.label)
        result = self._future.result()
        delay = self._ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if self._done_event is not None:
            torch.cuda.current_stream().wait_event(self._done_event)
        record_event("received", self.label)
        return result


def _on_cuda(values: Any) -> bool:
    return any(isinstance(t, Tensor) and t.is_cuda for t in tree_flatten(values)[0])


class CommWorker:
    """One background thread that runs posted communications in order, as a communication
    stream does on a GPU (where it also runs them on a CUDA stream of their own).

    ``latency_s`` emulates a slow network for benchmarks: a communication's result is
    available no earlier than ``latency_s`` after it was posted; the waiting uses no CPU and
    does not delay the communications behind it.
    """

    def __init__(self, latency_s: float = 0.0):
        self.latency_s = latency_s
        self._pool: ThreadPoolExecutor | None = None
        self._stream = None

    def post(self, label: str, fn: Callable[[Any], Any], values: Any) -> InFlight:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshpipe-comm")
        record_event("post", label)
        posted = time.perf_counter()
        if _on_cuda(values):
            return self._post_on_stream(label, fn, values, posted)
        future = self._pool.submit(self._run, label, fn, values)
        return InFlight(future, posted + self.latency_s, label)

    def _post_on_stream(self, label: str, fn, values, posted: float) -> InFlight:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        produced = torch.cuda.Event()
        produced.record()
        done = torch.cuda.Event()

        def run() -> Any:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(produced)
                result = self._run(label, fn, values)
                done.record(self._stream)
            return result

        return InFlight(self._pool.submit(run), posted + self.latency_s, label, done)

    @staticmethod
    def _run(label: str, fn: Callable[[Any], Any], values: Any) -> Any:
        result = fn(values)
        record_event("complete", label)
        return result


# Benchmarks emulate a slow network in every process of a run with this variable (seconds).
LATENCY_ENV = "MESHPIPE_EMULATED_COMM_LATENCY_S"
_WORKER = CommWorker(float(os.environ.get(LATENCY_ENV, "0") or 0))


def comm_worker() -> CommWorker:
    """This process's communication thread (shared by its stages)."""
    return _WORKER


# ----------------------------------------------------------------------------- tracing

_trace: list[tuple[float, str, str]] | None = None
_trace_lock = threading.Lock()


def record_event(event: str, label: str) -> None:
    """Add an event to the trace if one is being recorded (see ``trace_events``)."""
    if _trace is not None:
        with _trace_lock:
            _trace.append((time.perf_counter(), event, label))


@contextlib.contextmanager
def trace_events() -> Iterator[list[tuple[float, str, str]]]:
    """Record ``(time, event, label)`` of every communication (post, complete, wait,
    received) and every compute piece of a staged forward or backward (run, yield) while
    inside; labels name the stage action, e.g. ``"F1,3"`` (stage 1, microbatch 3)."""
    global _trace
    events: list[tuple[float, str, str]] = []
    _trace = events
    try:
        yield events
    finally:
        _trace = None
