"""The sleeping pipeline ``executor_overhead.py`` times: its cases (each schedule by
meshpipe's and torch's names), stages whose forward and backward halves only sleep
(``SleepGrad``, ``SleepStage``, ``Pauses``), their data and the cost models that say what
each action should take."""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from meshpipe.schedules import Action, CostModel, Kind


WIDTH = 16


LIBRARIES = ("meshpipe", "torch", "hand", "bare")


PR_SET_TIMERSLACK = 29


PINGPONG_WARMUP = 20


IDLE_S = 0.02  # idle time before the "after idle" probes (one default F)


IDLE_ROUNDS = 30


clock = time.perf_counter


@dataclass(frozen=True)
class Case:
    """One schedule: meshpipe's builder name (None: torch only) and torch's class (None: none)."""

    label: str
    meshpipe_name: str | None
    stages_per_rank: int | None  # None: --vpp
    torch_class: str | None
    placement_style: str  # torch's name for the stage -> rank mapping
    torch_note: str = ""

    def vpp(self, args: argparse.Namespace) -> int:
        return args.vpp if self.stages_per_rank is None else self.stages_per_rank


CASES = (
    Case("gpipe", "gpipe", 1, "ScheduleGPipe", "loop"),
    Case("1f1b", "1f1b", 1, "Schedule1F1B", "loop"),
    Case("interleaved", "interleaved", None, "ScheduleInterleaved1F1B", "loop"),
    Case("zb-h1", "zb-h1", 1, "ScheduleInterleavedZeroBubble", "loop",
         "ScheduleInterleavedZeroBubble, 1 stage per rank"),
    Case("zb-v", "zb-v", 2, "ScheduleZBVZeroBubble", "v"),
    Case("dualpipe-v", "dualpipe-v", 2, "ScheduleDualPipeV", "v"),
    Case("combined-1f1b", "combined-1f1b", None, None, "loop"),
    Case("interleaved-zb", None, None, "ScheduleInterleavedZeroBubble", "loop",
         "torch only: ScheduleInterleavedZeroBubble, --vpp stages per rank"),
)


CASE_BY_LABEL = {case.label: case for case in CASES}


def set_timer_slack(nanoseconds: int = 1) -> bool:
    """Ask Linux to wake this process's sleeps as close to their deadline as it can."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, nanoseconds,
                                                       0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Pauses:
    """Pauses of the asked length (a plain sleep, or a sleep whose last ``spin_s`` polls
    the clock), each one recorded with when it really started and ended."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s
        self.enabled = True  # False: every pause is skipped (the empty-stage steps)
        self.log: list[tuple[str, float, float, float]] = []  # (kind, asked s, start, end)

    def __call__(self, kind: str, seconds: float) -> None:
        if seconds <= 0 or not self.enabled:
            return
        start = clock()
        deadline = start + seconds
        if self.spin_s <= 0:
            time.sleep(seconds)
        else:
            coarse = seconds - self.spin_s
            if coarse > 0:
                time.sleep(coarse)
            while clock() < deadline:
                pass
        self.log.append((kind, seconds, start, clock()))


class SleepGrad(torch.autograd.Function):
    """The identity, whose backward pauses ``seconds`` before passing the gradient on."""

    @staticmethod
    def forward(ctx, tensor: Tensor, seconds: float, pause: Callable[[float], None]) -> Tensor:
        ctx.seconds = seconds
        ctx.pause = pause
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.pause(ctx.seconds)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage that sleeps: forward ``forward_s``, input-gradient ``input_grad_s``,
    weight-gradient ``weight_grad_s`` (see the module doc for how the split sees it)."""

    def __init__(self, index: int, forward_s: float, input_grad_s: float, weight_grad_s: float,
                 pauses: Pauses) -> None:
        super().__init__()
        self.forward_s, self.input_grad_s, self.weight_grad_s = (forward_s, input_grad_s,
                                                                 weight_grad_s)
        self.pauses = pauses
        self.weight = nn.Parameter(torch.zeros(WIDTH))
        # Stage 0's input requires no grad: a zero bias gives its input side a node to sleep in.
        self.input_bias = nn.Parameter(torch.zeros(WIDTH)) if index == 0 else None

    def forward(self, x: Tensor) -> Tensor:
        self.pauses("F", self.forward_s)
        if self.input_bias is not None:
            x = x + self.input_bias
        return (SleepGrad.apply(x, self.input_grad_s, functools.partial(self.pauses, "I"))
                + SleepGrad.apply(self.weight, self.weight_grad_s,
                                  functools.partial(self.pauses, "W")))


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def stage_seconds(args: argparse.Namespace, vpp: int) -> tuple[float, float, float]:
    return (args.forward_ms / 1e3 / vpp, args.input_grad_ms / 1e3 / vpp,
            args.weight_grad_ms / 1e3 / vpp)


def make_modules(args: argparse.Namespace, vpp: int, stage_ids: list[int],
                 pauses: Pauses) -> dict[int, nn.Module]:
    f, i, w = stage_seconds(args, vpp)
    return {s: SleepStage(s, f, i, w, pauses) for s in stage_ids}


def make_batch(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(args.microbatches, WIDTH, generator=generator),
            torch.randn(args.microbatches, WIDTH, generator=generator))


def cost_models(args: argparse.Namespace, num_stages: int, vpp: int,
                comm_ms: float) -> dict[str, CostModel]:
    """Per-stage costs in ms: "effective" (what the sleeping modules do: stage 0's input
    half runs in its W) and "uniform" (I and W on every stage, the plain cost model)."""
    f, i, w = (args.forward_ms / vpp, args.input_grad_ms / vpp, args.weight_grad_ms / vpp)
    effective = CostModel(forward=f, backward_input=[0.0] + [i] * (num_stages - 1),
                          backward_weight=[i + w] + [w] * (num_stages - 1), comm=comm_ms)
    uniform = CostModel(forward=f, backward_input=i, backward_weight=w, comm=comm_ms)
    return {"effective": effective, "uniform": uniform}


def action_cost(action: Action, costs: CostModel) -> float:
    """The cost-model time of one compute action (ms)."""
    total = 0.0
    for part in action.computations:
        name = {Kind.F: "forward", Kind.B: "backward", Kind.I: "backward_input",
                Kind.W: "backward_weight"}[part.kind]
        value = getattr(costs, name)
        total += value if isinstance(value, float) else value[part.stage]
    return total


def ms_summary(seconds: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile, min and max of ``seconds``, in milliseconds."""
    ms = sorted(1e3 * s for s in seconds)
    return {"median": statistics.median(ms), "p10": ms[len(ms) // 10],
            "p90": ms[(9 * len(ms)) // 10], "min": ms[0], "max": ms[-1], "n": len(ms)}


def dependencies(action: Action, last_stage: int) -> list[tuple[str, int, int]]:
    """The tokens (kind, stage, microbatch) an action's inputs come from; "G" is the
    input-gradient output of a B or I, "I" an I itself (what a W needs)."""
    needs = []
    produced_here = {(("F" if p.kind is Kind.F else "G"), p.stage, p.microbatch)
                     for p in action.computations}
    for part in action.computations:
        s, m = part.stage, part.microbatch
        if part.kind is Kind.F:
            if s > 0:
                needs.append(("F", s - 1, m))
        elif part.kind in (Kind.B, Kind.I):
            needs.append(("F", s, m))
            if s < last_stage:
                needs.append(("G", s + 1, m))
        elif part.kind is Kind.W:
            needs.append(("I", s, m))
    return [n for n in needs if n not in produced_here]
