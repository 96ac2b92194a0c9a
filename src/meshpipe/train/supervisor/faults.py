"""Fault injection: rehearse a failure of one rank of a real training run.

``MESHPIPE_FAULT="kind=hang,at=forward,rank=1,step=2,microbatch=0" meshpipe train ...``
makes global rank 1 hang in the forward of microbatch 0 of step 2 (steps count from 1, as
metrics.jsonl and checkpoint names do).
The fault-injection tests and ``benchmarks/faults.py`` use it to show that every fault
stops the job with one line naming the rank; users can use it to check their own setup
(a cluster's launcher, a job script) the same way.

``once=1`` fires the fault once per job: a job restarted by ``--max-restarts`` (or torchrun's)
runs on without it, which rehearses a recovery; without it the fault fires again after every
restart, which rehearses a crash loop. (The first firing leaves ``FIRED_FILE`` in the
out-dir; a new job removes it.)

kinds: ``raise`` (an exception), ``oom`` (the allocator's out-of-memory error, as a too large
microbatch gets on a GPU), ``exit`` (os._exit without a word), ``kill`` (SIGKILL to
itself, as the out-of-memory killer does), ``hang`` (sleeps for an hour), ``stop`` (SIGSTOP
to itself: the whole process frozen, its threads too, as a debugger or a stalled node
leaves it), ``nan`` (the
loss becomes NaN; ``at=loss`` only), ``mismatch`` (the stage sends a tensor one feature narrower
than the next stage takes; ``at=forward`` only).
places (``at``): ``forward``, ``backward``, ``loss`` (on a rank holding the last stage),
``step`` (the start of a step, before the step's first collective), ``save`` (inside a
checkpoint save, after this rank wrote its part and before the save completes).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from meshpipe.runtime import activity

ENVIRONMENT_VARIABLE = "MESHPIPE_FAULT"
KINDS = ("raise", "oom", "exit", "kill", "hang", "stop", "nan", "mismatch")
PLACES = ("forward", "backward", "loss", "step", "save")
HANG_S = 3600.0
EXIT_STATUS = 7
FIRED_FILE = ".meshpipe-fault-fired"


class InjectedFault(RuntimeError):
    """The exception of ``kind=raise``."""


@dataclass(frozen=True)
class Fault:
    kind: str
    at: str
    rank: int
    step: int
    microbatch: int | None = None
    once: bool = False
    fired_file: str = ""  # with ``once``: written when the fault fires

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: unknown kind {self.kind!r}; choose one "
                             f"of {', '.join(KINDS)}")
        if self.at not in PLACES:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: unknown place at={self.at!r}; choose "
                             f"one of {', '.join(PLACES)}")
        if self.kind == "nan" and self.at != "loss":
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: kind=nan needs at=loss")
        if self.kind == "mismatch" and self.at != "forward":
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: kind=mismatch needs at=forward")
        if self.step < 1:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: step={self.step}: steps count from 1")

    def due(self, step: int) -> bool:
        """Whether the fault fires now (this rank, ``step``, the microbatch being run)."""
        if step != self.step:
            return False
        return self.microbatch is None or activity.snapshot().get(
            "microbatch") == self.microbatch

    def fire(self) -> None:
        """Fail the way ``kind`` says (``nan`` and ``mismatch`` change values instead).
        The moment goes to this rank's stderr (its log), to time how fast the job stops."""
        announce(self)
        if self.kind == "raise":
            raise InjectedFault(f"injected fault at {self.at} of step {self.step}")
        if self.kind == "oom":
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected at "
                f"{self.at} of step {self.step}). GPU 0 has a total capacity of 79.1 GiB")
        if self.kind == "exit":
            os._exit(EXIT_STATUS)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            time.sleep(HANG_S)
        if self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)


def announce(fault: Fault) -> None:
    """Say when the fault fired (to this rank's log); with ``once``, mark it fired."""
    if fault.once and fault.fired_file:
        Path(fault.fired_file).write_text(f"{fault.kind} at {fault.at} of step {fault.step}\n")
    os.write(2, f"meshpipe: injected fault fired at {time.time():.3f} ({fault.kind} at "
                f"{fault.at} of step {fault.step})\n".encode())


REQUIRED_KEYS = ("kind", "at", "rank", "step")
NUMBER_KEYS = ("rank", "step", "microbatch", "once")
EXAMPLE = "kind=hang,at=forward,rank=1,step=2"


def parse(text: str) -> Fault:
    """The fault ``text`` (``MESHPIPE_FAULT``'s value) describes; a one-line ValueError that
    shows the expected form for anything else."""
    fields: dict[str, Any] = {}
    for item in text.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not value:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: {item.strip()!r} in {text!r} is not "
                             f"key=value; write it as {EXAMPLE!r}")
        if key not in REQUIRED_KEYS + NUMBER_KEYS:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: unknown key {key!r} in {text!r}; use "
                             "kind, at, rank, step, microbatch and once")
        if key in NUMBER_KEYS:
            if not value.isdigit():
                raise ValueError(f"{ENVIRONMENT_VARIABLE}: {key}={value} in {text!r} is not a "
                                 "number; give a whole number (steps count from 1)")
            value = int(value)
        fields[key] = value
    missing = [key for key in REQUIRED_KEYS if key not in fields]
    if missing:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}: {text!r} lacks {', '.join(missing)}; give "
                         f"all of kind, at, rank and step, as in {EXAMPLE!r}")
    if fields.get("once", 0) not in (0, 1):
        raise ValueError(f"{ENVIRONMENT_VARIABLE}: once={fields['once']} in {text!r}: give "
                         "once=1 (fire once per job) or leave it out (fire at every restart)")
    fields["once"] = bool(fields.get("once", 0))
    return Fault(**fields)


def _requested() -> Fault | None:
    """The fault ``MESHPIPE_FAULT`` describes, None where it is unset."""
    text = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    return parse(text) if text else None


def check_environment(world_size: int) -> None:
    """Before any process starts: ``MESHPIPE_FAULT``, if set, names a fault a rank of this
    run can fire (a one-line ValueError otherwise)."""
    fault = _requested()
    if fault is not None and fault.rank >= world_size:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}: rank={fault.rank} is not a rank of this run "
                         f"of {world_size} processes; give a rank below {world_size}")


def from_environment(rank: int, out_dir: str | Path) -> Fault | None:
    """The fault ``MESHPIPE_FAULT`` asks of global rank ``rank`` in the job writing to
    ``out_dir`` (None: none, another rank's, or a ``once`` fault that fired already)."""
    fault = _requested()
    if fault is None or fault.rank != rank:
        return None
    fired = Path(out_dir) / FIRED_FILE
    if fault.once and fired.exists():
        return None
    return dataclasses.replace(fault, fired_file=str(fired))


def forget_fired(out_dir: str | Path) -> None:
    """At the start of a job (not at a torchrun restart of it): a ``once`` fault may fire
    again."""
    fired = Path(out_dir) / FIRED_FILE
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and fired.is_file():
        fired.unlink()


def install(fault: Fault, stages: dict, current_step: Callable[[], int]) -> None:
    """Put ``fault`` into this rank's stages (``at`` forward, backward or loss); the step and
    save places are fired by the trainer through ``fault.due``/``fault.fire``."""
    if fault.at in ("step", "save"):
        return
    if fault.at == "loss":
        last = [stage for stage in stages.values() if stage.loss_fn is not None]
        if not last:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: at=loss needs a rank holding the last "
                             f"stage; rank {fault.rank} holds stages {sorted(stages)}")
        last[0].loss_fn = _faulty_loss(last[0].loss_fn, fault, current_step)
        return
    stage = stages[min(stages)]
    if fault.kind == "mismatch":
        _send_a_narrower_tensor(stage.module, fault, current_step)
        return
    stage.forward_steps = _faulty_forward(stage.forward_steps, fault, current_step)


def _send_a_narrower_tensor(module: torch.nn.Module, fault: Fault,
                            current_step: Callable[[], int]) -> None:
    """The chunk's own output loses the last feature of its first tensor, as a chunk
    built with another width on one side of a pipeline would send."""
    def wrong(output: Any) -> Any:
        if not fault.due(current_step()):
            return output
        announce(fault)
        if isinstance(output, tuple):
            return (output[0][..., :-1], *output[1:])
        return output[..., :-1]

    if callable(getattr(module, "forward_steps", None)):
        original = module.forward_steps

        def forward_steps(*args: Any) -> Any:
            return wrong((yield from original(*args)))
        module.forward_steps = forward_steps
    else:
        module.register_forward_hook(lambda _module, _args, output: wrong(output))


def _faulty_loss(loss_fn: Callable, fault: Fault, current_step: Callable[[], int]) -> Callable:
    def loss(output: Any, targets: Any) -> torch.Tensor:
        value = loss_fn(output, targets)
        if fault.due(current_step()):
            if fault.kind == "nan":
                announce(fault)
                return value * float("nan")
            fault.fire()
        return value
    return loss


def _faulty_forward(forward_steps: Callable, fault: Fault,
                    current_step: Callable[[], int]) -> Callable:
    """The stage's forward task with the fault: before the forward runs, or on the
    gradient of its output (in backward)."""
    def faulty(microbatch: int, message: Any, **options: Any) -> Any:
        due = fault.due(current_step())
        if due and fault.at == "forward" and fault.kind != "mismatch":
            fault.fire()
        output = yield from forward_steps(microbatch, message, **options)
        if due and fault.at == "backward":
            tensor = output[0] if isinstance(output, tuple) else output
            tensor.register_hook(lambda grad: fault.fire())
        return output
    return faulty
