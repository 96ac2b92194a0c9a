"""The one executor: runs this rank's lowered action list for one training (or inference) step.

Every schedule (GPipe, 1F1B, interleaved, zero-bubble, DualPipeV, combined 1F1B, ...) reaches
the runtime as data: a lowered ``Schedule`` whose list for this rank says which stage computes
what, and when messages are posted. The executor keeps no notion of "warmup" or "steady
state"; it dispatches each action to a handler:

- ``RECV_F`` / ``RECV_B`` post a receive and park its handle until the consuming compute;
- ``F`` / ``B`` / ``I`` / ``W`` run the stage, waiting on the parked handle (or taking the
  local hand-over from a neighbouring stage on this rank);
- ``SEND_F`` / ``SEND_B`` post a send; a sent forward output's storage is released at once
  (the transport sends from its own packed copy, and the autograd graph stays usable: the
  memory of activations in flight is not held twice);
- ``OVERLAP`` co-schedules its forward half and its backward half: both messages
  are taken first, then the sub-steps of the two alternate, so each exchange one of them
  posts (an expert-parallel all-to-all) travels while the other computes. A module without
  sub-steps runs F then B, with a one-time notice that nothing is overlapped. The optional
  ``OverlapHooks`` run before and after each half.

When an action fails, the rank tells every pipeline peer it still owes messages: each
owed send is posted as a small *stop notice* on the channel the real message would have
taken, so a peer waiting for it raises :class:`PeerFailedError` (naming the rank that failed
first and why) at once instead of waiting out its receive timeout, and passes the notice on
to its own peers. Notices must outlive the error: a process that exits on it would close its
connections before the peers read them, so the transport is kept alive until each peer took
its first notice (a few seconds at most). A peer that finds the connection closed anyway
raises PeerFailedError naming the rank that closed it. A peer that never receives (a dead
process) is still bounded by the receive timeout.

One module because it is the one executor: every action's handler reads and writes the
same per-step state (the inboxes, outboxes and sends posted that a failure turns into stop
notices), which is what makes one generic loop run every schedule.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from meshpipe.comm.errors import P2PConnectionError
from meshpipe.comm.transport import Transport, is_stop_notice, stop_notice, stopped_by
from meshpipe.runtime import activity
from meshpipe.runtime.hooks import OverlapHooks, StageHooks, stage_moments
from meshpipe.runtime.stage import Stage, Task
from meshpipe.runtime.substeps import co_schedule, drain
from meshpipe.schedules.actions import Action, Kind
from meshpipe.schedules.lowering import lower
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.timeline import TimedAction
from meshpipe.schedules.validation import validate


class ExecutorError(RuntimeError):
    """An action failed; the message names the rank, the action, its stage and microbatch."""


class PeerFailedError(ExecutorError):
    """A pipeline peer stopped its step, so a message this rank waits for will never come.

    ``peer`` is the global rank whose stop notice arrived, ``failed_rank`` the global rank
    whose own error started the stop (the same, or further along the pipeline), ``reason``
    that error's message.
    """

    def __init__(self, message: str, *, peer: int, failed_rank: int, reason: str):
        super().__init__(message)
        self.peer = peer
        self.failed_rank = failed_rank
        self.reason = reason


# A rank stopped by a peer waits at most this long (and at most its receive timeout) for its
# own stop notices to be received before raising.
_STOP_NOTICE_DELIVERY_S = 5.0
# The rank whose error started a stop keeps its process this long after its notices were
# taken: torchrun's agent terminates every rank as soon as one exits, which could cut off a
# stopped peer's report of the failure (each rank prints the first failure's line).
_REPORT_GRACE_S = 2.0
_STOP_REASON_CHARS = 2000


@dataclass
class _StepState:
    """What one step creates and drops at its end: its arguments, the messages taken and
    owed, the sends posted so far (a failure owes the rest a stop notice), the result."""

    inputs: Sequence[Any] | None
    targets: Sequence[Any] | None
    loss_scales: list[float]
    forward_inbox: dict[tuple[int, int], Any] = field(default_factory=dict)
    backward_inbox: dict[tuple[int, int], Any] = field(default_factory=dict)
    outbox_forward: dict[tuple[int, int], Any] = field(default_factory=dict)
    outbox_backward: dict[tuple[int, int], Any] = field(default_factory=dict)
    sends_posted: int = 0
    result: StepResult = field(default_factory=lambda: StepResult())
    t0: float = field(default_factory=time.perf_counter)
    losses: list[Any] = field(default_factory=list)  # the last stage's loss tensors

    def __post_init__(self) -> None:
        self.result.origin = self.t0

    def read_losses(self) -> None:
        """The microbatches' losses into the result as numbers, read at the step's end in
        one read: reading each as it is computed would make the host wait for the device's
        forward before it queues the backward, microbatch after microbatch."""
        if not self.losses:
            self.result.losses = []
            return
        together = torch.stack([loss.reshape(()).double() for loss in self.losses])
        self.result.losses = together.tolist()

    @classmethod
    def idle(cls) -> _StepState:
        """Between steps: nothing held."""
        return cls(None, None, [])


@dataclass
class _PendingReceive:
    """A posted receive parked until the compute that consumes it."""

    handle: Any
    peer: int
    label: str


class _PeerStopped(Exception):
    """Raised by ``_take`` when a stop notice arrived instead of the awaited message."""

    def __init__(self, peer: int, label: str, failed_rank: int, reason: str):
        cause = ("which failed" if peer == failed_rank else
                 f"which stopped its step because global rank {failed_rank} failed")
        super().__init__(f"waiting for {label!r} from global rank {peer}, {cause}: {reason}")
        self.peer = peer
        self.failed_rank = failed_rank
        self.reason = reason


def _await_stop_notices(first_notices: dict[int, Any], skip: set[int], patience: float,
                        linger: float = 0.0) -> None:
    """Wait, up to ``patience`` seconds in all, until the peers other than ``skip`` took their
    first stop notice (the handles keep the transport, and so the connections, alive), then
    ``linger`` seconds more if one did. A wait that runs out closes that connection (gloo):
    the peer then finds it closed."""
    deadline = time.monotonic() + patience
    taken = False
    for peer, handle in first_notices.items():
        if peer in skip:
            continue
        try:
            handle.wait(max(deadline - time.monotonic(), 0.001))
            taken = True
        except Exception:  # noqa: BLE001 - the peer is gone or not listening
            continue
    if taken:
        time.sleep(linger)


class _Message(NamedTuple):
    """One pipeline message as both ends name it.

    ``channel`` is the stream it belongs to (direction and sending stage): the transport
    sizes a posted receive by the previous message of the same channel, so a send, its
    receive and a stop notice standing in for it must all name the same channel.
    """

    sender: int
    receiver: int
    label: str
    channel: tuple[str, int]


def _message_of(action: Action) -> _Message:
    """The message a SEND or RECV action moves."""
    is_send = action.kind in (Kind.SEND_F, Kind.SEND_B)
    sender, receiver = ((action.stage, action.peer) if is_send
                        else (action.peer, action.stage))
    direction = "forward" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "backward"
    return _Message(sender, receiver, f"stage {sender} -> {receiver}, microbatch "
                    f"{action.microbatch}, {direction}", (direction, sender))


class _Planned(NamedTuple):
    """One action of this rank's list: its text (for activity marks and errors), the call
    that runs it (a SEND or RECV with its message and global peer rank bound), and whether
    the transport's queued operations are issued after it."""

    action: Action
    text: str
    run: Callable[[], None]
    flush: bool


# Stage module types already told that their OVERLAPs run F then B.
_NOTIFIED_WITHOUT_SUBSTEPS: set[str] = set()


@dataclass
class StepResult:
    """What one rank observed in one step.

    ``losses`` holds the unscaled loss of every microbatch when this rank holds the last stage
    (empty otherwise); ``outputs`` the last stage's outputs in forward-only mode; ``timeline``
    the measured start/end of every compute action (seconds since ``origin``, the
    ``time.perf_counter()`` at which the step began); ``peak_live_activations`` the most
    forwarded-but-not-yet-backwarded microbatches held.
    """

    losses: list[float] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    timeline: list[TimedAction] = field(default_factory=list)
    peak_live_activations: int = 0
    origin: float = 0.0

    @property
    def loss(self) -> float | None:
        """Mean loss over microbatches, or None on ranks without the last stage."""
        return sum(self.losses) / len(self.losses) if self.losses else None


class Executor:
    """Runs pipeline rank ``pp_rank``'s share of ``schedule`` over its ``stages``.

    ``pipeline_ranks[i]`` is the global rank of pipeline position ``i`` (Topology.pipeline_ranks).
    The schedule is lowered (if it is not already) and validated once, here, so a malformed
    schedule fails before any process waits on a message that will never come.
    ``recv_timeout`` (seconds) bounds every wait for a message (None: the transport's own
    timeout); a wait that runs out raises an ExecutorError naming the peer and the message.

    A failed step leaves messages in flight on the transport (stop notices, sends no peer
    took), so the executor refuses every later step; the failure path drops what the step
    held in its stages (``Stage.reset``), which a new executor can then reuse.
    """

    def __init__(self, schedule: Schedule, stages: Mapping[int, Stage], *, pp_rank: int,
                 pipeline_ranks: Sequence[int], transport: Transport,
                 recv_timeout: float | None = None, overlap_hooks: OverlapHooks | None = None,
                 stage_hooks: StageHooks | None = None):
        self.schedule = schedule if schedule.is_lowered else lower(schedule)
        validate(self.schedule)
        if not 0 <= pp_rank < self.schedule.num_ranks:
            raise ExecutorError(f"pipeline rank {pp_rank} is outside 0.."
                                f"{self.schedule.num_ranks - 1} of a schedule of "
                                f"{self.schedule.num_ranks} ranks")
        if len(pipeline_ranks) != self.schedule.num_ranks:
            raise ExecutorError(f"{len(pipeline_ranks)} pipeline ranks given for a schedule of "
                                f"{self.schedule.num_ranks} ranks")
        self._check_stages(stages, pp_rank)
        self.stages = dict(stages)
        self.pp_rank = pp_rank
        self.pipeline_ranks = list(pipeline_ranks)
        self.transport = transport
        self.recv_timeout = recv_timeout
        self.overlap_hooks = overlap_hooks or OverlapHooks()
        self.stage_hooks = stage_hooks or StageHooks()
        self.actions = self.schedule.ranks[pp_rank]
        self._first_forward_at, self._last_backward_at = stage_moments(self.actions)
        self._failure: str | None = None
        self._now = _StepState.idle()  # what the step in progress holds
        self._computes: dict[Kind, Callable[[Action], None]] = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.I: self._backward,
            Kind.W: self._backward_weight,
            Kind.OVERLAP: self._overlap,
        }
        self._comms: dict[Kind, Callable[[Action, _Message, int], None]] = {
            Kind.SEND_F: self._send_forward,
            Kind.SEND_B: self._send_backward,
            Kind.RECV_F: self._recv_forward,
            Kind.RECV_B: self._recv_backward,
        }
        self._plan = [self._planned(index, action) for index, action in enumerate(self.actions)]

    def _planned(self, index: int, action: Action) -> _Planned:
        """What running ``action`` (at ``index`` of this rank's list) takes, worked out here
        once rather than in every step, where it would sit between the actions."""
        text = str(action)
        if not action.kind.is_comm:
            return _Planned(action, text, partial(self._computes[action.kind], action), False)
        message = _message_of(action)
        is_send = action.kind in (Kind.SEND_F, Kind.SEND_B)
        peer = self._global_rank_of_stage(message.receiver if is_send else message.sender)
        last_of_run = index + 1 == len(self.actions) or not self.actions[index + 1].kind.is_comm
        # A transport that queues posted operations (P2PTransport(mode="batched")) issues
        # them in flush(): once after each run of consecutive SEND/RECV actions.
        return _Planned(action, text, partial(self._comms[action.kind], action, message, peer),
                        last_of_run)

    def _check_stages(self, stages: Mapping[int, Stage], pp_rank: int) -> None:
        """The given stages are exactly the ones the schedule places here, built for it."""
        schedule = self.schedule
        where = f"pipeline rank {pp_rank} (schedule {schedule.name or 'unnamed'})"
        expected = set(schedule.stages_of(pp_rank))
        if set(stages) != expected:
            raise ExecutorError(f"{where}: given stages {sorted(stages)} but the schedule "
                                f"places stages {sorted(expected)} here; pass "
                                f"{{stage index: Stage}} for exactly those")
        for index, stage in stages.items():
            if not isinstance(stage, Stage):
                raise TypeError(f"{where}: stages[{index}] is a {type(stage).__name__}, not a "
                                f"meshpipe Stage; wrap the chunk: Stage(module, {index}, "
                                f"{schedule.num_stages}, ...)")
            if (stage.index, stage.num_stages) != (index, schedule.num_stages):
                raise ExecutorError(f"{where}: stages[{index}] was built as stage {stage.index} "
                                    f"of {stage.num_stages}, but the schedule needs stage "
                                    f"{index} of {schedule.num_stages}; build it with "
                                    f"Stage(module, {index}, {schedule.num_stages}, ...)")
        last = stages.get(schedule.num_stages - 1)
        if last is not None and last.loss_fn is None and not schedule.forward_only:
            raise ExecutorError(f"{where}: stage {last.index} is the last stage of a training "
                                "schedule but has no loss_fn, so there is nothing to "
                                "backpropagate; give it Stage(..., loss_fn=...) or build the "
                                "schedule with forward_only=True")

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stages

    def step(self, inputs: Sequence[Any] | None = None, targets: Sequence[Any] | None = None,
             *, loss_scales: Sequence[float] | None = None) -> StepResult:
        """Run every action of this rank once.

        ``inputs[m]`` is microbatch ``m``'s message for stage 0 (needed where stage 0 lives),
        ``targets[m]`` its target for the loss (needed where the last stage lives; a
        forward-only schedule given no targets returns the outputs without losses).
        ``loss_scales[m]`` multiplies microbatch ``m``'s loss before its backward (default
        ``1/num_microbatches``, so the gradients are those of the mean loss).

        If the step fails, its error is raised and every later call raises an ExecutorError.
        """
        self._refuse_after_failure()
        try:
            self._check_step_arguments(inputs, targets, loss_scales)
            self._now = _StepState(inputs, targets, list(
                loss_scales if loss_scales is not None
                else [1.0 / self.num_microbatches] * self.num_microbatches))
            hooks = self.stage_hooks
            for index, planned in enumerate(self._plan):
                self._at_stage_moment(hooks.before_first_forward, self._first_forward_at, index,
                                      "before its first forward")
                self._run(index, planned)
                self._at_stage_moment(hooks.after_last_backward, self._last_backward_at, index,
                                      "after its last backward")
            self._wait_for_sends()
            self._now.read_losses()
        except Exception as error:
            stopped = self._peer_gone(error)
            self._fail(stopped or error)
            if stopped is None:
                raise
            raise stopped from error
        finally:
            result, self._now = self._now.result, _StepState.idle()
        return result

    def _at_stage_moment(self, hook: Callable[[int], None] | None,
                         moments: dict[int, list[int]], index: int, when: str) -> None:
        """Run ``hook`` for the stages whose moment is at action ``index``."""
        if hook is None:
            return
        for stage in moments.get(index, ()):
            try:
                hook(stage)
            except Exception as error:
                raise ExecutorError(f"{self._where()}: the stage hook of stage {stage} {when} "
                                    f"failed: {error}") from error

    def _peer_gone(self, error: Exception) -> PeerFailedError | None:
        """``error`` as a PeerFailedError where it only says that a peer closed its connection.

        A rank that fails or is stopped waits a few seconds for its peers to take its stop
        notices, then may exit (or destroy its process group); a peer that reaches the notice
        only later finds the connection closed. The peer that closed it failed or was stopped,
        so this rank reports it as the failed rank, and passes the stop on with its notices.
        """
        if isinstance(error, PeerFailedError):
            return None
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, P2PConnectionError):
            cause = cause.__cause__
        if cause is None or cause.peer is None:
            return None
        peer = cause.peer
        reason = (f"global rank {peer} closed its connection before its stop notice reached "
                  f"global rank {self.pipeline_ranks[self.pp_rank]}: it failed, or was "
                  "stopped by another rank's failure, and exited or destroyed its process "
                  f"group; see global rank {peer}'s error for the cause")
        return PeerFailedError(f"{error} ({reason})", peer=peer, failed_rank=peer,
                               reason=reason)

    def _fail(self, error: Exception) -> None:
        """Stop the peers, drop what the stages hold for this step, refuse later steps."""
        self._failure = f"{type(error).__name__}: {error}"[:_STOP_REASON_CHARS]
        for stage in self.stages.values():
            stage.reset()
        self._stop_peers(error)

    def _refuse_after_failure(self) -> None:
        if self._failure is None:
            return
        raise ExecutorError(
            f"{self._where()}: a previous step of this executor failed, so its transport "
            "still holds messages of that step and cannot be reused; build a new "
            "P2PTransport over a new process group (dist.new_group) and a new Executor (the "
            f"stages were reset and can be reused; zero their gradients). The step failed "
            f"with {self._failure}")

    def _run(self, index: int, planned: _Planned) -> None:
        """Run one action; any failure becomes an error naming where it happened."""
        action = planned.action
        try:
            with activity.doing(planned.text, stage=action.stage, microbatch=action.microbatch,
                                action=planned.text):
                planned.run()
                if planned.flush:
                    self.transport.flush()
        except _PeerStopped as stop:
            raise PeerFailedError(self._describe(index, action) + f": {stop}", peer=stop.peer,
                                  failed_rank=stop.failed_rank, reason=stop.reason) from None
        except Exception as error:
            raise ExecutorError(self._describe(index, action) + f": {error}") from error

    def _wait_for_sends(self) -> None:
        try:
            with activity.waiting("the peers to take this step's sends"):
                self.transport.wait_sends(self.recv_timeout)
        except Exception as error:
            raise ExecutorError(f"{self._where()} at the end of the step, waiting for its "
                                f"sends to be received: {error}") from error

    def _stop_peers(self, error: Exception) -> None:
        """Post a stop notice in place of every message this step still owed its peers.

        Each peer still running must take the first notice owed to it before this process
        drops the transport (exits, or frees its process group): a notice cut off that way
        reaches the peer as a closed connection. The rank whose own error started the stop
        raises at once, so that its error is the first one reported (launchers name the first
        rank that failed), and waits for its notices in a background thread, which holds the
        transport and which the interpreter waits for at exit. A rank stopped by a notice
        waits before raising, except for the ranks the stop came from. The wait is short
        (``_stop_notice_patience``); notices still in flight after it stay posted as long as
        the transport lives.
        """
        if isinstance(error, PeerFailedError):
            notice = stop_notice(error.failed_rank, error.reason)
            _await_stop_notices(self._post_stop_notices(notice),
                                skip={error.peer, error.failed_rank},
                                patience=self._stop_notice_patience())
            return
        notice = stop_notice(self.pipeline_ranks[self.pp_rank], self._failure)
        first_notices = self._post_stop_notices(notice)
        if first_notices:
            threading.Thread(target=_await_stop_notices, name="meshpipe-stop-notices",
                             args=(first_notices, set(), self._stop_notice_patience(),
                                   _REPORT_GRACE_S),
                             daemon=False).start()

    def _post_stop_notices(self, notice: dict) -> dict[int, Any]:
        """Post ``notice`` for every owed send; the handle of the first one to each peer."""
        first_notices: dict[int, Any] = {}
        unreachable: set[int] = set()
        for message in self._owed_sends():
            peer = self._global_rank_of_stage(message.receiver)
            if peer in unreachable:
                continue
            try:
                # No label: a notice stands in for whatever message the peer awaits next on
                # the channel, and a label check must not turn it into a MessageMismatchError
                # where the two ranks disagree on the order (the very error being reported).
                handle = self.transport.post_send(notice, peer, label="",
                                                  channel=message.channel)
            except Exception:  # noqa: BLE001 - best effort: the error being raised matters
                unreachable.add(peer)
                continue
            first_notices.setdefault(peer, handle)
        try:
            self.transport.flush()
        except Exception:  # noqa: BLE001 - best effort, as above
            pass
        return first_notices

    def _stop_notice_patience(self) -> float:
        """How long to wait for the peers to take the stop notices: a few seconds, at most
        the receive timeout."""
        return min(_STOP_NOTICE_DELIVERY_S,
                   self.recv_timeout or self.transport.timeout or _STOP_NOTICE_DELIVERY_S)

    def _owed_sends(self) -> list[_Message]:
        """Every message of this step not sent yet, in order."""
        sends = [a for a in self.actions if a.kind in (Kind.SEND_F, Kind.SEND_B)]
        return [_message_of(a) for a in sends[self._now.sends_posted:]]

    def _where(self) -> str:
        return f"pipeline rank {self.pp_rank} (global rank {self.pipeline_ranks[self.pp_rank]})"

    def _describe(self, index: int, action: Action) -> str:
        parts = ", ".join(f"stage {p.stage} microbatch {p.microbatch}" for p in action.computations)
        return f"{self._where()} action #{index} {action} ({parts})"

    def _check_step_arguments(self, inputs, targets, loss_scales) -> None:
        m = self.num_microbatches
        if self.holds_first_stage and (inputs is None or len(inputs) != m):
            got = "none" if inputs is None else len(inputs)
            raise ExecutorError(f"{self._where()} holds stage 0 and needs inputs for {m} "
                                f"microbatches, got {got}; pass step(inputs=[one message per "
                                "microbatch], ...) on this rank")
        forward_only = self.schedule.forward_only
        last = self.stages.get(self.schedule.num_stages - 1)
        wants_loss = last is not None and last.computes_loss(
            targets, keep_for_backward=not forward_only)
        if wants_loss and (targets is None or len(targets) != m):
            got = "none" if targets is None else len(targets)
            raise ExecutorError(f"{self._where()} holds the last stage "
                                f"{self.schedule.num_stages - 1} and needs targets for {m} "
                                f"microbatches to compute the loss, got {got}; pass "
                                "step(..., targets=[one target per microbatch]) on this rank")
        missing = ([i for i, target in enumerate(targets) if target is None]
                   if wants_loss and forward_only else [])
        if missing:
            raise ExecutorError(f"{self._where()}: a forward-only step given targets has none "
                                f"for microbatches {missing}, so its mean loss would leave "
                                "them out; pass a target for every microbatch, or "
                                "targets=None for outputs without losses")
        if loss_scales is not None and len(loss_scales) != m:
            raise ExecutorError(f"{self._where()}: {len(loss_scales)} loss scales given for "
                                f"{m} microbatches")

    def _global_rank_of_stage(self, stage: int) -> int:
        return self.pipeline_ranks[self.schedule.placement[stage]]

    def _is_local(self, stage: int) -> bool:
        return self.schedule.placement[stage] == self.pp_rank

    def _take(self, inbox: dict, key: tuple[int, int], what: str) -> Any:
        """A received message: wait on its receive, or take a local hand-over."""
        if key not in inbox:
            raise RuntimeError(f"no {what} for stage {key[0]} microbatch {key[1]} was "
                               "received or handed over before it was needed")
        item = inbox.pop(key)
        if not isinstance(item, _PendingReceive):
            return item
        with activity.waiting(f"{what} of stage {key[0]} microbatch {key[1]}", peer=item.peer,
                              label=item.label):
            message = item.handle.wait(self.recv_timeout)
        if is_stop_notice(message):
            raise _PeerStopped(item.peer, item.label, *stopped_by(message))
        return message

    def _timed(self, action: Action, compute: Callable[[], Any]) -> Any:
        start = time.perf_counter() - self._now.t0
        value = compute()
        end = time.perf_counter() - self._now.t0
        self._now.result.timeline.append(TimedAction(self.pp_rank, action, start, end))
        live = sum(stage.live_microbatches for stage in self.stages.values())
        self._now.result.peak_live_activations = max(self._now.result.peak_live_activations, live)
        return value

    def _forward(self, action: Action) -> None:
        message = self._forward_message(action)
        self._timed(action, lambda: drain(self._forward_task(action, message)))

    def _forward_message(self, action: Action) -> Any:
        s, m = action.stage, action.microbatch
        return (self._now.inputs[m] if s == 0
                else self._take(self._now.forward_inbox, (s, m), "forward input"))

    def _forward_task(self, action: Action, message: Any) -> Task:
        """The forward of ``action`` on ``message``, yielding while its exchanges travel; its
        output goes on to the next stage (or its loss and output into the result)."""
        s, m = action.stage, action.microbatch
        stage = self.stages[s]
        forward_only = self.schedule.forward_only
        target = self._now.targets[m] if stage.is_last and self._now.targets is not None else None
        output = yield from stage.forward_steps(
            m, message, target=target, loss_scale=self._now.loss_scales[m],
            keep_for_backward=not forward_only)
        if stage.is_last:
            if stage.computes_loss(target, keep_for_backward=not forward_only):
                output, loss = output
                self._now.losses.append(loss)
            if forward_only:
                self._now.result.outputs.append(output)
        elif self._is_local(s + 1):
            self._now.forward_inbox[(s + 1, m)] = output
        else:
            self._now.outbox_forward[(s, m)] = output

    def _output_grads(self, s: int, m: int) -> Any:
        if self.stages[s].is_last:
            return None
        return self._take(self._now.backward_inbox, (s, m), "output gradient")

    def _deliver_input_grads(self, s: int, m: int, grads: Any) -> None:
        if s == 0:
            return
        if self._is_local(s - 1):
            self._now.backward_inbox[(s - 1, m)] = grads
        else:
            self._now.outbox_backward[(s, m)] = grads

    def _backward(self, action: Action) -> None:
        """A full backward (B) or its input-gradient half (I): both pass gradients on."""
        grads = self._output_grads(action.stage, action.microbatch)
        self._timed(action, lambda: drain(self._backward_task(action, grads)))

    def _backward_task(self, action: Action, grads: Any) -> Task:
        s, m = action.stage, action.microbatch
        stage = self.stages[s]
        run = stage.backward_steps if action.kind is Kind.B else stage.backward_input_steps
        input_grads = yield from run(m, grads)
        self._deliver_input_grads(s, m, input_grads)

    def _backward_weight(self, action: Action) -> None:
        self._timed(action, lambda: self.stages[action.stage].backward_weight(action.microbatch))

    def _overlap(self, action: Action) -> None:
        """Take both halves' messages, then alternate their sub-steps, backward first: the
        backward's first exchange (the last layer's reverse combine) travels while the
        forward's first piece computes, and so on layer by layer."""
        forward, backward = action.parts
        self._notice_without_substeps(forward, backward)
        hooks = self.overlap_hooks
        message = self._forward_message(forward)
        grads = self._output_grads(backward.stage, backward.microbatch)
        for hook, part in ((hooks.pre_forward, forward), (hooks.pre_backward, backward)):
            if hook is not None:
                hook(part)
        self._timed(action, lambda: co_schedule([self._backward_task(backward, grads),
                                                 self._forward_task(forward, message)]))
        for hook, part in ((hooks.post_forward, forward), (hooks.post_backward, backward)):
            if hook is not None:
                hook(part)

    def _notice_without_substeps(self, *parts: Action) -> None:
        for part in parts:
            stage = self.stages[part.stage]
            kind = type(stage.module).__name__
            if stage.has_substeps or kind in _NOTIFIED_WITHOUT_SUBSTEPS:
                continue
            _NOTIFIED_WITHOUT_SUBSTEPS.add(kind)
            warnings.warn(f"{self._where()}: the {kind} of stage {part.stage} has no "
                          "forward_steps, so OVERLAP actions run its forward and backward one "
                          "after the other and hide no communication; expose its exchanges "
                          "(meshpipe.runtime.substeps) to overlap them", stacklevel=3)

    def _send_forward(self, action: Action, message: _Message, peer: int) -> None:
        self._post_send(action, message, peer, self._now.outbox_forward)
        if not self.schedule.forward_only:
            self.stages[action.stage].release_output(action.microbatch)

    def _send_backward(self, action: Action, message: _Message, peer: int) -> None:
        self._post_send(action, message, peer, self._now.outbox_backward)

    def _post_send(self, action: Action, message: _Message, peer: int, outbox: dict) -> None:
        self.transport.post_send(outbox.pop((action.stage, action.microbatch)), peer,
                                 label=message.label, channel=message.channel)
        self._now.sends_posted += 1

    def _recv_forward(self, action: Action, message: _Message, peer: int) -> None:
        self._now.forward_inbox[(action.stage, action.microbatch)] = self._post_recv(message, peer)

    def _recv_backward(self, action: Action, message: _Message, peer: int) -> None:
        self._now.backward_inbox[(action.stage, action.microbatch)] = self._post_recv(message, peer)

    def _post_recv(self, message: _Message, peer: int) -> _PendingReceive:
        handle = self.transport.post_recv(peer, label=message.label, channel=message.channel)
        return _PendingReceive(handle, peer, message.label)
