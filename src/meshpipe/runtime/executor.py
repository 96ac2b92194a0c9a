"""The one executor: runs this rank's lowered action list for one training (or inference) step.

Every schedule (GPipe, 1F1B, interleaved, zero-bubble, DualPipeV, combined 1F1B, ...) reaches
the runtime as data: a lowered ``Schedule`` whose list for this rank says which stage computes
what, and when messages are posted. The executor keeps no notion of "warmup" or "steady
state"; it dispatches each action to a handler:

- ``RECV_F`` / ``RECV_B`` post a receive and park its handle until the consuming compute;
- ``F`` / ``B`` / ``I`` / ``W`` run the stage, waiting on the parked handle (or taking the
  local hand-over from a neighbouring stage on this rank);
- ``SEND_F`` / ``SEND_B`` post a send; a sent forward output's storage is released at once
  (seed 003's deallocation: the transport keeps its own reference until the send completes,
  and the autograd graph stays usable);
- ``OVERLAP`` runs its forward half, then its backward half.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from meshpipe.comm.p2p import P2PTransport
from meshpipe.runtime.stage import Stage
from meshpipe.schedules.actions import Action, Kind, Schedule
from meshpipe.schedules.lowering import lower
from meshpipe.schedules.simulate import TimedAction
from meshpipe.schedules.validation import validate


class ExecutorError(RuntimeError):
    """An action failed; the message names the rank, the action, its stage and microbatch."""


@dataclass
class StepResult:
    """What one rank observed in one step.

    ``losses`` holds the unscaled loss of every microbatch when this rank holds the last stage
    (empty otherwise); ``outputs`` the last stage's outputs in forward-only mode; ``timeline``
    the measured start/end of every compute action (seconds since the step began);
    ``peak_live_activations`` the most forwarded-but-not-yet-backwarded microbatches held.
    """

    losses: list[float] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    timeline: list[TimedAction] = field(default_factory=list)
    peak_live_activations: int = 0

    @property
    def loss(self) -> float | None:
        """Mean loss over microbatches, or None on ranks without the last stage."""
        return sum(self.losses) / len(self.losses) if self.losses else None


class Executor:
    """Runs pipeline rank ``pp_rank``'s share of ``schedule`` over its ``stages``.

    ``pipeline_ranks[i]`` is the global rank of pipeline position ``i`` (Topology.pipeline_ranks).
    The schedule is lowered (if it is not already) and validated once, here, so a malformed
    schedule fails before any process waits on a message that will never come.
    """

    def __init__(self, schedule: Schedule, stages: Mapping[int, Stage], *, pp_rank: int,
                 pipeline_ranks: Sequence[int], transport: P2PTransport,
                 recv_timeout: float | None = None):
        self.schedule = schedule if schedule.is_lowered else lower(schedule)
        validate(self.schedule)
        expected = set(self.schedule.stages_of(pp_rank))
        if set(stages) != expected:
            raise ExecutorError(f"pipeline rank {pp_rank}: given stages {sorted(stages)} but "
                                f"the schedule places stages {sorted(expected)} here")
        if len(pipeline_ranks) != self.schedule.num_ranks:
            raise ExecutorError(f"{len(pipeline_ranks)} pipeline ranks given for a schedule of "
                                f"{self.schedule.num_ranks} ranks")
        self.stages = dict(stages)
        self.pp_rank = pp_rank
        self.pipeline_ranks = list(pipeline_ranks)
        self.transport = transport
        self.recv_timeout = recv_timeout
        self.actions = self.schedule.ranks[pp_rank]
        self._handlers: dict[Kind, Callable[[Action], None]] = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.I: self._backward_input,
            Kind.W: self._backward_weight,
            Kind.OVERLAP: self._overlap,
            Kind.SEND_F: self._send_forward,
            Kind.SEND_B: self._send_backward,
            Kind.RECV_F: self._recv_forward,
            Kind.RECV_B: self._recv_backward,
        }

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last_stage(self) -> bool:
        return self.schedule.num_stages - 1 in self.stages

    def step(self, inputs: Sequence[Any] | None = None, targets: Sequence[Any] | None = None,
             *, loss_scales: Sequence[float] | None = None) -> StepResult:
        """Run every action of this rank once.

        ``inputs[m]`` is microbatch ``m``'s message for stage 0 (needed where stage 0 lives),
        ``targets[m]`` its target for the loss (needed where the last stage lives, unless the
        schedule is forward-only and no loss is wanted). ``loss_scales[m]`` multiplies
        microbatch ``m``'s loss before its backward (default ``1/num_microbatches``, so the
        gradients are those of the mean loss).
        """
        self._check_step_arguments(inputs, targets, loss_scales)
        self._inputs = inputs
        self._targets = targets
        self._loss_scales = loss_scales or [1.0 / self.num_microbatches] * self.num_microbatches
        self._forward_inbox: dict[tuple[int, int], Any] = {}
        self._backward_inbox: dict[tuple[int, int], Any] = {}
        self._outbox_forward: dict[tuple[int, int], Any] = {}
        self._outbox_backward: dict[tuple[int, int], Any] = {}
        self._result = StepResult()
        self._t0 = time.perf_counter()
        for index, action in enumerate(self.actions):
            try:
                self._handlers[action.kind](action)
            except ExecutorError:
                raise
            except Exception as error:
                raise ExecutorError(self._describe(index, action) + f": {error}") from error
        self.transport.wait_sends(self.recv_timeout)
        result = self._result
        self._inputs = self._targets = None
        return result

    def _describe(self, index: int, action: Action) -> str:
        parts = ", ".join(f"stage {p.stage} microbatch {p.microbatch}" for p in action.computations)
        return (f"pipeline rank {self.pp_rank} (global rank {self.pipeline_ranks[self.pp_rank]}) "
                f"action #{index} {action} ({parts})")

    def _check_step_arguments(self, inputs, targets, loss_scales) -> None:
        m = self.num_microbatches
        if self.holds_first_stage and (inputs is None or len(inputs) != m):
            got = "none" if inputs is None else len(inputs)
            raise ExecutorError(f"pipeline rank {self.pp_rank} holds stage 0 and needs inputs "
                                f"for {m} microbatches, got {got}")
        needs_targets = self.holds_last_stage and not self.schedule.forward_only
        if needs_targets and (targets is None or len(targets) != m):
            got = "none" if targets is None else len(targets)
            raise ExecutorError(f"pipeline rank {self.pp_rank} holds the last stage and needs "
                                f"targets for {m} microbatches to compute the loss, got {got}")
        if loss_scales is not None and len(loss_scales) != m:
            raise ExecutorError(f"{len(loss_scales)} loss scales given for {m} microbatches")

    def _global_rank_of_stage(self, stage: int) -> int:
        return self.pipeline_ranks[self.schedule.placement[stage]]

    def _is_local(self, stage: int) -> bool:
        return self.schedule.placement[stage] == self.pp_rank

    def _take(self, inbox: dict, key: tuple[int, int], what: str) -> Any:
        """A received message: wait on its handle, or take a local hand-over."""
        if key not in inbox:
            raise ExecutorError(f"no {what} for stage {key[0]} microbatch {key[1]} was received "
                                f"or handed over before it was needed")
        item = inbox.pop(key)
        return item.wait(self.recv_timeout) if hasattr(item, "wait") else item

    def _timed(self, action: Action, compute: Callable[[], Any]) -> Any:
        start = time.perf_counter() - self._t0
        value = compute()
        end = time.perf_counter() - self._t0
        self._result.timeline.append(TimedAction(self.pp_rank, action, start, end))
        live = sum(stage.live_microbatches for stage in self.stages.values())
        self._result.peak_live_activations = max(self._result.peak_live_activations, live)
        return value

    def _forward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        stage = self.stages[s]
        message = (self._inputs[m] if s == 0
                   else self._take(self._forward_inbox, (s, m), "forward input"))
        forward_only = self.schedule.forward_only
        if stage.is_last:
            target = self._targets[m] if self._targets is not None else None
            output = self._timed(action, lambda: stage.forward(
                m, message, target=target, loss_scale=self._loss_scales[m],
                keep_for_backward=not forward_only))
            if stage.loss_fn is not None:
                output, loss = output
                self._result.losses.append(float(loss))
            if forward_only:
                self._result.outputs.append(output)
            return
        output = self._timed(action, lambda: stage.forward(m, message,
                                                           keep_for_backward=not forward_only))
        if self._is_local(s + 1):
            self._forward_inbox[(s + 1, m)] = output
        else:
            self._outbox_forward[(s, m)] = output

    def _output_grads(self, s: int, m: int) -> Any:
        if self.stages[s].is_last:
            return None
        return self._take(self._backward_inbox, (s, m), "output gradient")

    def _deliver_input_grads(self, s: int, m: int, grads: Any) -> None:
        if s == 0:
            return
        if self._is_local(s - 1):
            self._backward_inbox[(s - 1, m)] = grads
        else:
            self._outbox_backward[(s, m)] = grads

    def _backward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        grads = self._output_grads(s, m)
        input_grads = self._timed(action, lambda: self.stages[s].backward(m, grads))
        self._deliver_input_grads(s, m, input_grads)

    def _backward_input(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        grads = self._output_grads(s, m)
        input_grads = self._timed(action, lambda: self.stages[s].backward_input(m, grads))
        self._deliver_input_grads(s, m, input_grads)

    def _backward_weight(self, action: Action) -> None:
        self._timed(action, lambda: self.stages[action.stage].backward_weight(action.microbatch))

    def _overlap(self, action: Action) -> None:
        for part in action.parts:
            self._handlers[part.kind](part)

    def _send_forward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        self.transport.post_send(
            self._outbox_forward.pop((s, m)), self._global_rank_of_stage(s + 1),
            label=f"stage {s} -> {s + 1}, microbatch {m}, forward")
        if not self.schedule.forward_only:
            self.stages[s].release_output(m)

    def _send_backward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        self.transport.post_send(
            self._outbox_backward.pop((s, m)), self._global_rank_of_stage(s - 1),
            label=f"stage {s} -> {s - 1}, microbatch {m}, backward")

    def _recv_forward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        self._forward_inbox[(s, m)] = self.transport.post_recv(
            self._global_rank_of_stage(s - 1),
            label=f"stage {s - 1} -> {s}, microbatch {m}, forward")

    def _recv_backward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        self._backward_inbox[(s, m)] = self.transport.post_recv(
            self._global_rank_of_stage(s + 1),
            label=f"stage {s + 1} -> {s}, microbatch {m}, backward")
