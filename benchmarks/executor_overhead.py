"""How close the executor gets to the simulator, on stages that only sleep.

    .venv/bin/python benchmarks/executor_overhead.py                 # defaults, about 5 min
    .venv/bin/python benchmarks/executor_overhead.py --steps 9 --forward-ms 10
    .venv/bin/python benchmarks/executor_overhead.py --schedules 1f1b zb-v --libraries meshpipe

Every stage is a module that does nothing but sleep: its forward sleeps F ms, the
input-gradient half of its backward I ms and the weight-gradient half W ms (defaults
20/20/20; with ``--vpp`` or a V schedule a rank holds several stages and each sleeps its
share, F/v, I/v, W/v). Activations are ``[1, 16]`` float tensors. Sleeping stages take the
time the cost model says they take and leave the CPU free, so 4 processes on a 2-core
machine do not contend: what the step takes beyond the simulated makespan is what the
pipeline runtime adds (dispatch and bookkeeping between actions, message latency beyond
the measured cost of one message, waits), plus what the machine adds to any code that runs
right after a sleep (see the probes below).

The module: ``out = SleepGrad(x, I) + SleepGrad(weight, W)`` after a forward that sleeps F.
``SleepGrad`` is the identity whose backward sleeps. The add is the only node that reaches
both the stage input and the weight, which is exactly what both libraries' split backward
calls the frontier ("intermediate" in torch): the input-gradient pass (I,
``autograd.grad`` toward the stage input) runs the add and the input-side SleepGrad (I ms);
the weight pass (W) restarts at the add and runs only the weight-side SleepGrad (W ms); a
full backward B runs both (I + W ms). Stage 0 has no input that requires grad, so neither
library can run anything in its I: meshpipe's ``SplitBackward`` finds no input side (every
leaf is a weight) and torch skips stage 0's input pass and runs a full backward in W. The
module of stage 0 therefore adds a zero bias to its input, so that its input-side sleep
still exists and runs in W (B and W of stage 0 both sleep I + W). The simulated figure uses
those per-stage costs (stage 0: I = 0, W = I + W); for every schedule here the uniform cost
model (I on stage 0 too) gives the same makespan, since stage 0's I and W are adjacent on
its rank and its I sends nothing (both figures are recorded).

Sleeps: plain ``time.sleep`` (each process sets its timer slack to 1 ns first); they end a
median 0.05-0.07 ms late on this VM, which the analysis counts separately ("late wake-ups").
``--spin-ms X`` sleeps until X ms before the deadline and polls the clock from there: exact
pauses, but the ranks poll in lockstep on 2 cores and it did not make the steps faster.

Message cost ``c`` (the simulator's ``comm``): ranks 0 and 1 play ping-pong with the same
``[1, 16]`` float32 tensor (``dist.isend``/``dist.irecv`` then ``wait``, gloo, its own
group), ``--pingpong`` round trips after 20 warm-up ones; c = median round trip / 2. The
same ping-pong through meshpipe's ``P2PTransport`` is recorded beside it. Two probes say
what a pipeline step sees instead of a tight loop: the one-way time of that message when
the sender slept 20 ms before sending and the receiver was blocked in its wait (raw gloo
and P2PTransport; both ends read the one clock), and the time of a sleeping stage's
forward + backward code with zero-length pauses back to back and right after a 20 ms
sleep. On this shared 2-core VM, code that runs after its process idled runs several
times slower than the same code run back to back, and every action and message of a
sleeping pipeline runs after such an idle period.

Timing: each step of each library starts at a barrier; each rank reads ``perf_counter``
(CLOCK_MONOTONIC, one clock for every process of the machine) just before and after its
``step`` call. The step time is the span from the earliest start to the latest end over the
ranks (what a simulated makespan is: from when the first rank may start until the last
finishes); the slowest rank's own step time is recorded beside it. ``--warmup`` untimed
steps of each runner, then ``--steps`` timed steps taking the runners in turn (in reverse
order on even steps); the median is reported. Gradients are set to None between steps,
outside the timing; there is no optimizer.

Where the time goes: meshpipe's ``StepResult.timeline`` gives every compute action's start
and end (shifted onto the shared clock with the executor's own step origin); torch's
``PipelineStage.forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``
are wrapped per instance to record the same. meshpipe's transport is wrapped per instance
too, recording the time spent posting sends and receives and blocked in receive waits. For
the median step of each, the critical path of the measured timeline is walked back from the
last action: each action is bound by whichever of its rank's previous action and its input
messages ended last (a remote input counted c later), so the measured span splits exactly
into: the first action's start-up, the actions' own durations (the cost-model part and any
excess), gaps after a local predecessor (dispatch/bookkeeping between two actions of one
rank), message hops (from the end of the producing action on another rank to the start of
the consumer: the sender's bookkeeping and send, the transfer, the receiver's wait and
bookkeeping; c of each hop is in the simulation already) and the tail after the last action.
Also: the simulation of the same order with each stage's median measured action durations
(``fit_costs``, comm c), which separates longer actions from gaps; and, per library,
``--empty-steps`` steps of the same pipeline with every pause skipped: the runtime's own
CPU time per step (4 processes share 2 cores there, so it is CPU, not latency).

torch.distributed.pipelining runs the same modules in the same processes on its own gloo
group: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
with one stage per rank (its ZB1P order is ZB-H1's), ScheduleZBVZeroBubble,
ScheduleDualPipeV, and ScheduleInterleavedZeroBubble with ``--vpp`` stages per rank (a
torch-only row; meshpipe has no interleaved zero-bubble builder). combined-1f1b has no torch
counterpart. torch's own compute order (``pipeline_order`` of its multi-stage schedules;
for GPipe and 1F1B the order its ranks ran in the first timed step) is simulated too:
``torch / simulated`` divides by meshpipe's simulated figure, and the notes say whether
torch's order is the same (where it is not, its own simulated makespan is given as well).

Two floors run meshpipe's order beside the libraries, with no pipeline runtime at all
(``hand_runner``): every receive a bare gloo ``irecv`` posted when the step starts, every
send a bare ``isend`` right after its action, nothing else between actions. "hand" runs
the same sleeping modules with plain autograd: nothing runs beside the stages' own code,
so ``hand / simulated`` is the least a runtime running these stages can expect here.
"bare" runs only the pauses, at exactly the simulated costs: what it takes beyond the
simulation is the machine's own (late wake-ups, message latency after idling).

Writes ``<out>/executor_overhead.json`` and ``<out>/executor_overhead.md`` (default
``benchmarks/results``). A benchmark prints and records; it never asserts.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import gc
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from common import load_average
from meshpipe.comm.p2p import P2PTransport
from meshpipe.runtime.executor import Executor
from meshpipe.runtime.stage import Stage
from meshpipe.schedules import (Action, CostModel, Kind, Schedule, Timeline, build, fit_costs,
                                simulate)

WIDTH = 16
LIBRARIES = ("meshpipe", "torch", "hand", "bare")
PROCESS_GROUP_TIMEOUT = timedelta(minutes=5)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--vpp", type=int, default=2,
                        help="stages per rank of interleaved, combined-1f1b and interleaved-zb "
                             "(zb-v and dualpipe-v always hold 2)")
    parser.add_argument("--forward-ms", type=float, default=20.0,
                        help="F: one rank's forward of one microbatch")
    parser.add_argument("--input-grad-ms", type=float, default=20.0,
                        help="I: one rank's input-gradient backward of one microbatch")
    parser.add_argument("--weight-grad-ms", type=float, default=20.0,
                        help="W: one rank's weight-gradient backward of one microbatch")
    parser.add_argument("--spin-ms", type=float, default=0.0,
                        help="poll the clock for the last this-many ms of each pause instead "
                             "of sleeping through it (0: plain time.sleep)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per library")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per library")
    parser.add_argument("--empty-steps", type=int, default=9,
                        help="timed steps per library with every pause skipped (empty "
                             "stages), after one untimed one")
    parser.add_argument("--pingpong", type=int, default=200,
                        help="round trips measuring one message's cost")
    parser.add_argument("--schedules", nargs="+", choices=list(CASE_BY_LABEL),
                        default=list(CASE_BY_LABEL))
    parser.add_argument("--libraries", nargs="+", choices=list(LIBRARIES),
                        default=list(LIBRARIES),
                        help="the runners: the two libraries and the two floors (hand, bare)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--raw", type=Path, default=None, metavar="PATH",
                        help="also write every step's raw records (all ranks) to PATH")
    parser.add_argument("--from-raw", type=Path, default=None, metavar="PATH",
                        help="run nothing: analyse the raw records --raw wrote (with the "
                             "same flags) and write the report")
    args = parser.parse_args(argv)
    if args.pp < 2:
        parser.error("--pp must be at least 2")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if min(args.forward_ms, args.input_grad_ms, args.weight_grad_ms, args.spin_ms) < 0:
        parser.error("times must be >= 0")
    return args


# --------------------------------------------------------------------------- the stages


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


# ----------------------------------------------------------------------- cost models


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


# ------------------------------------------------------------------ message cost (c)


def measure_message_cost(args: argparse.Namespace, group: dist.ProcessGroup) -> dict[str, Any]:
    """Half the median round trip of a [1, 16] float32 tensor between ranks 0 and 1: raw
    gloo isend/irecv, and meshpipe's P2PTransport. Other ranks wait at the barrier."""
    rank = dist.get_rank()
    result: dict[str, Any] = {}
    if rank in (0, 1):
        peer = 1 - rank
        message = torch.randn(1, WIDTH)
        buffer = torch.empty(1, WIDTH)
        rtts = []
        for n in range(PINGPONG_WARMUP + args.pingpong):
            start = clock()
            if rank == 0:
                dist.isend(message, peer, group=group).wait()
                dist.irecv(buffer, peer, group=group).wait()
            else:
                dist.irecv(buffer, peer, group=group).wait()
                dist.isend(message, peer, group=group).wait()
            if n >= PINGPONG_WARMUP:
                rtts.append(clock() - start)
        transport = P2PTransport(group)
        transport_rtts = []
        for n in range(PINGPONG_WARMUP + args.pingpong):
            start = clock()
            if rank == 0:
                transport.post_send(message, peer, channel="ping")
                transport.post_recv(peer, channel="pong").wait()
            else:
                transport.post_recv(peer, channel="ping").wait()
                transport.post_send(message, peer, channel="pong")
            if n >= PINGPONG_WARMUP:
                transport_rtts.append(clock() - start)
        transport.wait_sends()
        result = {"raw_rtt_ms": ms_summary(rtts), "transport_rtt_ms": ms_summary(transport_rtts)}
    dist.barrier()
    return result


def measure_idle_latency(args: argparse.Namespace, group: dist.ProcessGroup) -> dict[str, Any]:
    """One-way time of the same message when both ends have idled ``IDLE_S`` (as in a
    pipeline, where a receiver blocks in its wait while the sender computes): rank 0
    sleeps, reads the clock and sends; rank 1, blocked in its wait, reads the clock when
    the wait returns (one clock for both processes). Raw gloo and P2PTransport."""
    rank = dist.get_rank()
    sent: dict[str, list[float]] = {"raw": [], "transport": []}
    received: dict[str, list[float]] = {"raw": [], "transport": []}
    if rank in (0, 1):
        peer = 1 - rank
        message, buffer = torch.randn(1, WIDTH), torch.empty(1, WIDTH)
        transport = P2PTransport(group)
        for mode in ("raw", "transport"):
            for _ in range(IDLE_ROUNDS):
                if rank == 0:
                    time.sleep(IDLE_S)
                    sent[mode].append(clock())
                    if mode == "raw":
                        dist.isend(message, peer, group=group).wait()
                    else:
                        transport.post_send(message, peer, channel="idle")
                else:
                    if mode == "raw":
                        dist.irecv(buffer, peer, group=group).wait()
                    else:
                        transport.post_recv(peer, channel="idle").wait()
                    received[mode].append(clock())
        transport.wait_sends()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sent, received))
    if rank != 0:
        return {}
    (sent, _), (_, received) = gathered[0], gathered[1]
    return {mode: ms_summary([b - a for a, b in zip(sent[mode], received[mode])][2:])
            for mode in sent}


def measure_idle_code(pauses: Pauses) -> dict[str, Any]:
    """The same small piece of stage code (a sleeping stage's forward and full backward with
    zero-length pauses: autograd, the add, the clones) timed back to back and right after an
    ``IDLE_S`` sleep: on a shared VM, code that runs after an idle period runs slower."""
    module = SleepStage(1, 0.0, 0.0, 0.0, pauses)
    x = torch.randn(1, WIDTH, requires_grad=True)
    times: dict[str, list[float]] = {"back to back": [], "after idle": []}
    for mode in times:
        for n in range(IDLE_ROUNDS + 5):
            if mode == "after idle":
                time.sleep(IDLE_S)
            start = clock()
            module(x).sum().backward()
            if n >= 5:
                times[mode].append(clock() - start)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {mode: ms_summary([t for ranks in gathered for t in ranks[mode]]) for mode in times}


def ms_summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * s for s in seconds)
    return {"median": statistics.median(ms), "p10": ms[len(ms) // 10],
            "p90": ms[(9 * len(ms)) // 10], "min": ms[0], "max": ms[-1], "n": len(ms)}


# -------------------------------------------------------------------------- runners


@dataclass
class Runner:
    """One library's pipeline on this rank; ``step()`` returns this rank's timed actions
    as ``(action text, start, end)`` on the shared clock (seconds)."""

    modules: dict[int, nn.Module]
    step: Callable[[], list[tuple[str, float, float]]]
    comm_log: list[tuple[str, float, float, str]]
    counters: Callable[[], dict[str, int]] | None = None  # the transport's, for the last step

    def zero_grad(self) -> None:
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)


def instrument_transport(transport: P2PTransport,
                         log: list[tuple[str, float, float, str]]) -> None:
    """Record (what, start, end, message label) of every post_send, post_recv, receive wait
    and end-of-step wait_sends, and ("recv_posted", t, t, label) when the receive is really
    posted on gloo: inside post_recv, or later inside a wait when the transport had to defer
    it (instance attributes wrapping the transport's own methods; the runtime is untouched)."""
    post_send, post_recv, wait_sends = (transport.post_send, transport.post_recv,
                                        transport.wait_sends)
    post_steady_recv = transport._post_steady_recv

    def timed_post_send(*a, **k):
        start = clock()
        handle = post_send(*a, **k)
        log.append(("post_send", start, clock(), k.get("label", "")))
        return handle

    def timed_post_recv(*a, **k):
        label = k.get("label", "")
        start = clock()
        handle = post_recv(*a, **k)
        log.append(("post_recv", start, clock(), label))
        wait = handle.wait

        def timed_wait(*wa, **wk):
            begin = clock()
            message = wait(*wa, **wk)
            log.append(("recv_wait", begin, clock(), label))
            return message

        handle.wait = timed_wait
        return handle

    def timed_post_steady_recv(inbox, incoming, queue):
        post_steady_recv(inbox, incoming, queue)
        now = clock()
        log.append(("recv_posted", now, now, incoming.label))

    def timed_wait_sends(*a, **k):
        start = clock()
        wait_sends(*a, **k)
        log.append(("wait_sends", start, clock(), ""))

    transport.post_send = timed_post_send
    transport.post_recv = timed_post_recv
    transport._post_steady_recv = timed_post_steady_recv
    transport.wait_sends = timed_wait_sends


def meshpipe_runner(case: Case, args: argparse.Namespace, schedule: Schedule,
                    stage_ids: list[int], num_stages: int, group: dist.ProcessGroup,
                    batch: tuple[Tensor, Tensor], pauses: Pauses) -> Runner:
    modules = make_modules(args, case.vpp(args), stage_ids, pauses)
    last = num_stages - 1
    stages = {s: Stage(modules[s], s, num_stages, loss_fn=loss_fn if s == last else None)
              for s in stage_ids}
    transport = P2PTransport(group)
    comm_log: list[tuple[str, float, float, str]] = []
    instrument_transport(transport, comm_log)
    executor = Executor(schedule, stages, pp_rank=dist.get_rank(),
                        pipeline_ranks=list(range(args.pp)), transport=transport)
    inputs = list(batch[0].split(1)) if 0 in stage_ids else None
    targets = list(batch[1].split(1)) if last in stage_ids else None

    def step() -> list[tuple[str, float, float]]:
        transport.stats.reset()
        result = executor.step(inputs, targets)
        origin = result.origin  # the executor's own step origin on perf_counter's clock
        return [(str(t.action), origin + t.start, origin + t.end) for t in result.timeline]

    return Runner(modules, step, comm_log, lambda: dataclasses.asdict(transport.stats))


def hand_runner(case: Case, args: argparse.Namespace, schedule: Schedule,
                stage_ids: list[int], num_stages: int, group: dist.ProcessGroup,
                batch: tuple[Tensor, Tensor], pauses: Pauses, with_modules: bool) -> Runner:
    """meshpipe's compute order on this rank with no pipeline runtime, as a floor.

    Every receive is a bare gloo ``irecv`` posted when the step starts, every send a bare
    ``isend`` right after its action; nothing else runs between actions. "hand"
    (``with_modules``) runs the stages' sleeping modules with plain autograd: the forward
    (and the loss on the last stage), ``torch.autograd.backward`` toward the stage input
    for I, toward the weights for W, toward both for B. "bare" runs only each action's
    pauses, of exactly the simulation's "effective" costs, and sends zeros: what it takes
    beyond the simulation is the machine's own (late wake-ups, message latency after
    idling); "hand" adds the modules' own code."""
    vpp = case.vpp(args)
    costs = cost_models(args, num_stages, vpp, 0.0)["effective"]
    modules = make_modules(args, vpp, stage_ids, pauses) if with_modules else {}
    weights = {s: list(module.parameters()) for s, module in modules.items()}
    rank, last = dist.get_rank(), num_stages - 1
    placement = schedule.placement
    actions = schedule.ranks[rank]
    zeros = torch.zeros(1, WIDTH)

    def tag(token: str, stage: int, microbatch: int) -> int:
        return (("F", "G").index(token) * num_stages + stage) * args.microbatches + microbatch

    def consumer(part: Action) -> tuple[str, int] | None:
        """Where the output of ``part`` goes: (token, stage), or None."""
        if part.kind is Kind.F and part.stage < last:
            return "F", part.stage + 1
        if part.kind in (Kind.B, Kind.I) and part.stage > 0:
            return "G", part.stage - 1
        return None

    receives = [[need for need in _dependencies(action, last)
                 if need[0] in ("F", "G") and placement[need[1]] != rank]
                for action in actions]
    saved: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (stage, mb): input, output
    grads: dict[tuple[int, int], Tensor | None] = {}  # (stage, mb): output gradient
    arrived: dict[tuple[str, int, int], Tensor] = {}  # token, producer stage, mb: message

    def pauses_only(part: Action) -> Tensor:
        pauses(part.kind.name, action_cost(part, costs) / 1e3)
        return zeros

    def modules_by_hand(part: Action) -> Tensor:
        s, m = part.stage, part.microbatch
        if part.kind is Kind.F:
            x = batch[0][m:m + 1] if s == 0 else arrived.pop(("F", s - 1, m)).requires_grad_()
            out = modules[s](x)
            saved[s, m] = x, (loss_fn(out, batch[1][m:m + 1]) if s == last else out)
            return out.detach()
        x, out = saved[s, m]
        if part.kind is not Kind.W:
            grads[s, m] = None if s == last else arrived.pop(("G", s + 1, m))
        # I and B reach the stage input (stage 0's needs no gradient), W and B the weights.
        toward = [] if part.kind is Kind.W or s == 0 else [x]
        if part.kind is not Kind.I:
            toward = [*toward, *weights[s]]
        if toward:
            torch.autograd.backward(out, grads[s, m], inputs=toward,
                                    retain_graph=part.kind is Kind.I)
        if part.kind is not Kind.I:
            del saved[s, m], grads[s, m]
        return x.grad if x.grad is not None else zeros

    run = modules_by_hand if with_modules else pauses_only  # a part's work; what it sends on

    def post(need: tuple[str, int, int]) -> tuple[Any, Tensor]:
        buffer = torch.empty(1, WIDTH)
        return dist.irecv(buffer, placement[need[1]], group=group, tag=tag(*need)), buffer

    def step() -> list[tuple[str, float, float]]:
        arrived.clear()
        posted = {need: post(need) for needs in receives for need in needs}
        outgoing, timeline = [], []
        for action, needs in zip(actions, receives):
            for need in needs:
                work, buffer = posted.pop(need)
                work.wait()
                arrived[need] = buffer
            start = clock()
            produced = [(part, run(part)) for part in action.computations]
            timeline.append((str(action), start, clock()))
            for part, message in produced:
                target = consumer(part)
                if target is None:
                    continue
                token, stage = target
                if placement[stage] == rank:
                    arrived[token, part.stage, part.microbatch] = message
                else:
                    outgoing.append((dist.isend(message, placement[stage], group=group,
                                                tag=tag(token, part.stage, part.microbatch)),
                                     message))
        for work, _ in outgoing:
            work.wait()
        return timeline

    return Runner(modules, step, [])


def torch_schedule_class(name: str) -> type | None:
    import torch.distributed.pipelining as pipelining
    return getattr(pipelining, name, None)


def instrument_torch_stage(stage: Any, log: list[tuple[str, float, float]]) -> None:
    """Record every compute call of a torch PipelineStage as (action text, start, end)."""
    index = stage.stage_index
    forward, backward, weight = (stage.forward_one_chunk, stage.backward_one_chunk,
                                 stage.backward_weight_one_chunk)

    def timed(call, kind_of):
        def run(chunk, *a, **k):
            start = clock()
            out = call(chunk, *a, **k)
            log.append((f"{index}{kind_of(k)}{chunk}", start, clock()))
            return out
        return run

    stage.forward_one_chunk = timed(forward, lambda k: "F")
    stage.backward_one_chunk = timed(backward,
                                     lambda k: "B" if k.get("full_backward", True) else "I")
    stage.backward_weight_one_chunk = timed(weight, lambda k: "W")


def torch_runner(case: Case, args: argparse.Namespace, stage_ids: list[int], num_stages: int,
                 group: dist.ProcessGroup, batch: tuple[Tensor, Tensor],
                 pauses: Pauses) -> tuple[Runner, list[str]]:
    """The runner, and torch's compute order as CSV rows (one per rank)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    schedule_class = torch_schedule_class(case.torch_class)
    vpp = case.vpp(args)
    modules = make_modules(args, vpp, stage_ids, pauses)
    log: list[tuple[str, float, float]] = []
    stages = []
    for s in stage_ids:
        example_in = (torch.empty(1, WIDTH) if s == 0
                      else torch.empty(1, WIDTH, requires_grad=True))
        example_out = torch.empty(1, WIDTH, requires_grad=True)
        stage = PipelineStage(modules[s], s, num_stages, torch.device("cpu"),
                              input_args=example_in, output_args=example_out, group=group)
        instrument_torch_stage(stage, log)
        stages.append(stage)
    single = issubclass(schedule_class, PipelineScheduleSingle)
    schedule = schedule_class(stages[0] if single else stages,
                              n_microbatches=args.microbatches, loss_fn=loss_fn,
                              scale_grads=True)
    inputs = (batch[0],) if 0 in stage_ids else ()
    target = batch[1] if num_stages - 1 in stage_ids else None

    def step() -> list[tuple[str, float, float]]:
        log.clear()
        schedule.step(*inputs, target=target, losses=[], return_outputs=False)
        return list(log)

    return Runner(modules, step, []), None if single else torch_order_rows(schedule)


def torch_order_rows(schedule: Any) -> list[str] | None:
    """The compute actions of a multi-stage torch schedule per rank (``pipeline_order``, the
    order its runtime lowers and runs), as CSV rows; None if unreadable. Single-stage
    schedules (GPipe, 1F1B) keep no such order (their ``_get_pipeline_order`` is a drawing
    aid that is not what runs: at pp 4 its 1F1B order has the last rank skip F0), so their
    order is read off the measured timeline instead."""
    try:
        order = schedule.pipeline_order
        return [",".join(str(a) for a in order[rank] if a is not None and a.is_compute_op)
                for rank in range(len(order))]
    except Exception:  # noqa: BLE001 - informational only
        return None


# ------------------------------------------------------------------------- per rank


def stages_here(case: Case, args: argparse.Namespace,
                schedule: Schedule | None) -> tuple[list[int], int]:
    """This rank's stages and the number of stages (after checking that meshpipe's
    ``schedule``, where there is one, and torch place stages alike)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    num_stages = args.pp * case.vpp(args)
    theirs = generate_stage_to_rank_mapping(args.pp, num_stages, style=case.placement_style)
    if schedule is not None:
        ours = dict(enumerate(schedule.placement))
        if ours != theirs:
            raise RuntimeError(f"{case.label}: meshpipe places stages {ours} but torch "
                               f"{theirs}")
    rank = dist.get_rank()
    return sorted(s for s, r in theirs.items() if r == rank), num_stages


def run_step(runner: Runner, pauses: Pauses) -> list[dict[str, Any]]:
    """One step from a barrier; every rank's record (gathered on every rank)."""
    runner.zero_grad()
    runner.comm_log.clear()
    pauses.log.clear()
    gc.collect()
    dist.barrier()
    start = clock()
    timeline = runner.step()
    end = clock()
    record = {"rank": dist.get_rank(), "start": start, "end": end, "timeline": timeline,
              "comm": list(runner.comm_log), "pauses": list(pauses.log),
              "counters": runner.counters() if runner.counters is not None else {}}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    return gathered


def agreed(ok: bool) -> bool:
    """True if every rank says ``ok``."""
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def bench_case(case: Case, args: argparse.Namespace, groups: dict[str, dist.ProcessGroup],
               pauses: Pauses) -> dict[str, Any]:
    schedule = (build(case.meshpipe_name, args.pp, args.microbatches,
                      stages_per_rank=case.vpp(args))
                if case.meshpipe_name is not None else None)
    stage_ids, num_stages = stages_here(case, args, schedule)
    batch = make_batch(args)
    row: dict[str, Any] = {"schedule": case.label, "meshpipe_name": case.meshpipe_name,
                           "vpp": case.vpp(args), "stages": num_stages,
                           "torch_class": case.torch_class, "torch_note": case.torch_note,
                           "skipped": {}}
    runners: dict[str, Runner] = {}
    if "meshpipe" in args.libraries:
        if schedule is None:
            row["skipped"]["meshpipe"] = "no meshpipe builder for this schedule"
        else:
            runners["meshpipe"] = meshpipe_runner(case, args, schedule, stage_ids, num_stages,
                                                  groups["meshpipe"], batch, pauses)
    for name in ("hand", "bare"):
        if name not in args.libraries:
            continue
        if schedule is None:
            row["skipped"][name] = "it runs meshpipe's order, and there is none"
        else:
            runners[name] = hand_runner(case, args, schedule, stage_ids, num_stages,
                                        groups[name], batch, pauses,
                                        with_modules=name == "hand")
    if "torch" in args.libraries:
        if case.torch_class is None:
            row["skipped"]["torch"] = "torch.distributed.pipelining has no such schedule"
        elif torch_schedule_class(case.torch_class) is None:
            row["skipped"]["torch"] = f"{case.torch_class} is not in torch {torch.__version__}"
        else:
            error = None
            try:
                runner, order = torch_runner(case, args, stage_ids, num_stages,
                                             groups["torch"], batch, pauses)
            except Exception as exc:  # noqa: BLE001 - recorded as the reason it is skipped
                error = f"{type(exc).__name__}: {exc}"
            if agreed(error is None):
                runners["torch"] = runner
                row["torch_order_csv"] = order
                row["torch_order_source"] = ("pipeline_order" if order is not None
                                             else "measured")
            else:
                row["skipped"]["torch"] = error or "failed on another rank"
    for name, runner in runners.items():
        for _ in range(args.warmup):
            run_step(runner, pauses)
    steps: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in runners}
    names = [name for name in LIBRARIES if name in runners]
    for iteration in range(args.steps):
        order = names if iteration % 2 else names[::-1]  # reversed on even steps
        for name in order:
            steps[name].append(run_step(runners[name], pauses))
    row["steps"] = steps
    # The same steps with every pause skipped: what each runtime costs per step on its own
    # (4 processes on 2 cores then contend: read it as CPU per step, not latency).
    pauses.enabled = False
    empty: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in runners}
    try:
        for name in names:
            run_step(runners[name], pauses)
        for iteration in range(args.empty_steps):
            for name in (names if iteration % 2 else names[::-1]):
                empty[name].append(run_step(runners[name], pauses))
    finally:
        pauses.enabled = True
    row["empty_steps"] = empty
    if "torch" in steps and row.get("torch_order_csv") is None and steps["torch"]:
        row["torch_order_csv"] = executed_order(steps["torch"][0])
    return row


def executed_order(step: list[dict[str, Any]]) -> list[str]:
    """Each rank's compute actions in the order they ran in ``step``, as CSV rows."""
    by_rank = {record["rank"]: sorted(record["timeline"], key=lambda t: t[1]) for record in step}
    return [",".join(text for text, _, _ in by_rank[rank]) for rank in sorted(by_rank)]


def _worker(rank: int, world: int, init_file: str, result_file: str,
            args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*has no forward_steps.*")
    slack = set_timer_slack()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        groups = {name: dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
                  for name in (*LIBRARIES, "probe")}
        message_cost = measure_message_cost(args, groups["probe"])
        message_cost["after_idle_one_way_ms"] = measure_idle_latency(args, groups["probe"])
        pauses = Pauses(args.spin_ms / 1e3)
        message_cost["stage_code_ms"] = measure_idle_code(pauses)
        if rank == 0:
            print(f"message round trip: raw gloo {message_cost['raw_rtt_ms']['median']:.3f} ms, "
                  f"P2PTransport {message_cost['transport_rtt_ms']['median']:.3f} ms",
                  flush=True)
        rows = []
        for label in args.schedules:
            started = clock()
            rows.append(bench_case(CASE_BY_LABEL[label], args, groups, pauses))
            if rank == 0:
                print(f"{label}: {clock() - started:.1f} s", flush=True)
        if rank == 0:
            Path(result_file).write_text(json.dumps({"message_cost": message_cost,
                                                     "timer_slack_set": slack, "rows": rows}))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------- analysis


def _parse(text: str) -> Action:
    return Action.parse(text)


def _dependencies(action: Action, last_stage: int) -> list[tuple[str, int, int]]:
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


@dataclass
class _Timed:
    """One measured compute action (ms from the step's origin) and what happened inside."""

    action: Action
    start: float
    end: float
    asked: float  # the module's pauses inside it: the time they were asked to take
    late: float  # how much longer the pauses took than asked (late wake-ups)
    before: float  # from the action's start to its first pause (all of it if none)
    after: float  # from its last pause to its end
    between: float  # inside, between pauses (the autograd engine between I and W halves)


def _token(part: Action) -> str:
    return "F" if part.kind is Kind.F else "W" if part.kind is Kind.W else "G"


class _Step:
    """One measured step: per rank its timed actions and transport calls, in ms."""

    def __init__(self, step: list[dict[str, Any]]) -> None:
        self.origin = min(r["start"] for r in step)
        self.finish = 1e3 * (max(r["end"] for r in step) - self.origin)
        self.actions: dict[int, list[_Timed]] = {}
        self.comm: dict[int, list[tuple[str, float, float]]] = {}
        self.by_label: dict[tuple[int, str, str], tuple[float, float]] = {}
        self.producer: dict[tuple[str, int, int], tuple[int, int]] = {}
        for record in step:
            rank = record["rank"]
            pauses = sorted(((asked, self.ms(a), self.ms(b))
                             for _, asked, a, b in record["pauses"]), key=lambda p: p[1])
            self.comm[rank] = sorted(((what, self.ms(a), self.ms(b))
                                      for what, a, b, _ in record["comm"]
                                      if what != "recv_posted"), key=lambda c: c[1])
            for what, a, b, label in record["comm"]:
                if label:
                    self.by_label[(rank, what, label)] = (self.ms(a), self.ms(b))
            rows = []
            for index, (text, a, b) in enumerate(sorted(record["timeline"],
                                                        key=lambda t: t[1])):
                start, end = self.ms(a), self.ms(b)
                inside = [p for p in pauses if p[1] >= start - 1e-6 and p[2] <= end + 1e-6]
                took = sum(p[2] - p[1] for p in inside)
                before = inside[0][1] - start if inside else end - start
                after = end - inside[-1][2] if inside else 0.0
                rows.append(_Timed(_parse(text), start, end, 1e3 * sum(p[0] for p in inside),
                                   took - 1e3 * sum(p[0] for p in inside), before, after,
                                   max(0.0, end - start - took - before - after)))
                for part in rows[-1].action.computations:
                    self.producer[(_token(part), part.stage, part.microbatch)] = (rank, index)
                    if part.kind is Kind.I:
                        self.producer[("I", part.stage, part.microbatch)] = (rank, index)
            self.actions[rank] = rows

    def ms(self, t: float) -> float:
        return 1e3 * (t - self.origin)

    def at(self, key: tuple[int, int]) -> _Timed:
        return self.actions[key[0]][key[1]]

    def binding(self, key: tuple[int, int], last_stage: int, comm_ms: float
                ) -> tuple[tuple[int, int], bool] | None:
        """What ``key`` waited for last: its rank's previous action or an input's producer
        (a remote one counted ``comm_ms`` later); None for a rank's first action with no
        input from elsewhere."""
        rank, index = key
        timed = self.at(key)
        candidates = []
        if index > 0:
            candidates.append((self.actions[rank][index - 1].end, (rank, index - 1), False))
        for token in _dependencies(timed.action, last_stage):
            producer = self.producer.get(token)
            if producer is not None and producer[0] != rank:
                candidates.append((self.at(producer).end + comm_ms, producer, True))
        if not candidates:
            return None
        _, chosen, remote = max(candidates, key=lambda c: c[0])
        return chosen, remote

    def calls(self, rank: int, start: float, end: float) -> dict[str, float]:
        """Time in each transport call of ``rank`` within [start, end] (ms)."""
        spent: dict[str, float] = {}
        for what, a, b in self.comm.get(rank, ()):
            if a >= start - 1e-6 and b <= end + 1e-6:
                spent[what] = spent.get(what, 0.0) + (b - a)
        return spent


def _message_label(consumer: Action, producer: Action) -> str:
    """The label meshpipe's executor gives the message from ``producer`` to ``consumer``
    (``meshpipe.runtime.executor._message_of``)."""
    for part in consumer.computations:
        for other in producer.computations:
            if part.kind is Kind.F and other.kind is Kind.F and other.stage == part.stage - 1 \
                    and other.microbatch == part.microbatch:
                return (f"stage {other.stage} -> {part.stage}, microbatch {part.microbatch}, "
                        "forward")
            if (part.kind in (Kind.B, Kind.I) and other.kind in (Kind.B, Kind.I)
                    and other.stage == part.stage + 1 and other.microbatch == part.microbatch):
                return (f"stage {other.stage} -> {part.stage}, microbatch {part.microbatch}, "
                        "backward")
    return ""


def _add(totals: dict[str, float], key: str, value: float) -> None:
    totals[key] = totals.get(key, 0.0) + value


def critical_path(step: list[dict[str, Any]], num_stages: int, costs: CostModel,
                  comm_ms: float) -> dict[str, Any]:
    """Walk the measured step back from its last action (module doc); times in ms.

    Where transport calls were recorded (meshpipe), a local gap is split into the time in
    post_send, post_recv and receive waits and the rest (executor bookkeeping), and a hop
    into: the sender's delay (producer's end to the end of its post_send of the message),
    the transfer (to the end of the receiver's wait for it) and the receiver's delay (to
    the consumer's start)."""
    measured = _Step(step)
    last_stage = num_stages - 1
    current = max(((r, i) for r, rows in measured.actions.items() for i in range(len(rows))),
                  key=lambda key: measured.at(key).end)
    path: dict[str, Any] = {
        "span_ms": measured.finish, "tail_ms": measured.finish - measured.at(current).end,
        "head_ms": 0.0, "actions": 0, "cost": 0.0, "excess": 0.0, "late_wakeups": 0.0,
        "stage_code": 0.0, "local_gaps": 0, "local_gap_ms": 0.0, "local_gap_calls": {},
        "hops": 0, "hop_ms": 0.0, "hop_parts": {}, "late_receives": 0,
        "longest_local_gap": 0.0,
        "longest_hop": 0.0, "steps": []}
    while True:
        timed = measured.at(current)
        cost = action_cost(timed.action, costs)
        path["actions"] += 1
        path["cost"] += cost
        path["excess"] += (timed.end - timed.start) - cost
        path["late_wakeups"] += timed.late
        path["stage_code"] += timed.before + timed.after + timed.between
        found = measured.binding(current, last_stage, comm_ms)
        if found is None:
            path["head_ms"] = timed.start
            break
        key, remote = found
        producer = measured.at(key)
        gap = timed.start - producer.end
        path["steps"].append([str(timed.action), current[0], round(timed.start, 3),
                              "hop" if remote else "local", round(gap, 3)])
        if remote:
            path["hops"] += 1
            path["hop_ms"] += gap
            path["longest_hop"] = max(path["longest_hop"], gap)
            label = _message_label(timed.action, producer.action)
            sent = measured.by_label.get((key[0], "post_send", label))
            posted = measured.by_label.get((current[0], "recv_posted", label))
            got = measured.by_label.get((current[0], "recv_wait", label))
            if sent is not None and posted is not None and got is not None:
                parts = path["hop_parts"]
                ready = max(sent[1], posted[0])
                _add(parts, "sender", sent[1] - producer.end)
                _add(parts, "receive posted after the send", max(0.0, posted[0] - sent[1]))
                _add(parts, "receiver busy", max(0.0, got[0] - ready))
                _add(parts, "in wait", got[1] - max(got[0], ready))
                _add(parts, "after wait", timed.start - got[1])
                if posted[0] > sent[1]:
                    path["late_receives"] += 1
        else:
            path["local_gaps"] += 1
            path["local_gap_ms"] += gap
            path["longest_local_gap"] = max(path["longest_local_gap"], gap)
            if measured.comm.get(current[0]):
                spent = measured.calls(current[0], producer.end, timed.start)
                for what, value in spent.items():
                    _add(path["local_gap_calls"], what, value)
                _add(path["local_gap_calls"], "other", gap - sum(spent.values()))
        current = key
    path["steps"].reverse()
    path["hop_beyond_c_ms"] = path["hop_ms"] - path["hops"] * comm_ms
    return path


def inside_actions(step: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind, over every action of the step: the time before its first pause, after its
    last, between pauses, and the pauses' lateness (ms; medians and sums)."""
    measured = _Step(step)
    by_kind: dict[str, dict[str, list[float]]] = {}
    for rows in measured.actions.values():
        for timed in rows:
            slot = by_kind.setdefault(timed.action.kind.value, {})
            for name in ("before", "after", "between", "late"):
                slot.setdefault(name, []).append(getattr(timed, name))
    return {kind: {name: {"median": statistics.median(values), "sum": sum(values),
                          "n": len(values)} for name, values in parts.items()}
            for kind, parts in by_kind.items()}


def gap_breakdown(step: list[dict[str, Any]], num_stages: int, comm_ms: float
                  ) -> dict[str, Any]:
    """Over every action with a local binding predecessor (meshpipe's transport calls
    recorded): medians of the gap and of its parts."""
    measured = _Step(step)
    parts: dict[str, list[float]] = {}
    for rank, rows in measured.actions.items():
        if not measured.comm.get(rank):
            continue
        for index in range(1, len(rows)):
            found = measured.binding((rank, index), num_stages - 1, comm_ms)
            if found is None or found[1]:
                continue
            previous = measured.at(found[0])
            gap = rows[index].start - previous.end
            spent = measured.calls(rank, previous.end, rows[index].start)
            parts.setdefault("gap", []).append(gap)
            for what in ("post_send", "post_recv", "recv_wait"):
                parts.setdefault(what, []).append(spent.get(what, 0.0))
            parts.setdefault("other", []).append(gap - sum(spent.values()))
    return {name: quantiles(values) for name, values in parts.items()}


def gap_statistics(step: list[dict[str, Any]], num_stages: int, comm_ms: float
                   ) -> dict[str, Any]:
    """Over every action of every rank: the gap after its rank's previous action where that
    action, not a message, was the last thing it waited for (local), and the delay from a
    remote producer's end to the consumer's start where the message was (hop)."""
    producer_end: dict[tuple[str, int, int], tuple[int, float]] = {}
    per_rank = {}
    for record in step:
        rows = sorted(record["timeline"], key=lambda t: t[1])
        per_rank[record["rank"]] = [(_parse(text), 1e3 * s, 1e3 * e) for text, s, e in rows]
        for action, s, e in per_rank[record["rank"]]:
            for part in action.computations:
                kind = "F" if part.kind is Kind.F else "W" if part.kind is Kind.W else "G"
                producer_end[(kind, part.stage, part.microbatch)] = (record["rank"], e)
                if part.kind is Kind.I:
                    producer_end[("I", part.stage, part.microbatch)] = (record["rank"], e)
    local, hops = [], []
    for rank, rows in per_rank.items():
        for index, (action, start, _) in enumerate(rows):
            if index == 0:
                continue
            previous_end = rows[index - 1][2]
            remote_ends = [end for token in _dependencies(action, num_stages - 1)
                           for r, end in [producer_end.get(token, (rank, -1e18))] if r != rank]
            latest_remote = max(remote_ends, default=-1e18)
            if latest_remote + comm_ms > previous_end:
                hops.append(start - latest_remote)
            else:
                local.append(start - previous_end)
    return {"local_gap_ms": quantiles(local), "hop_ms": quantiles(hops)}


def quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    values = sorted(values)
    return {"median": statistics.median(values), "p90": values[(9 * len(values)) // 10],
            "max": values[-1], "n": len(values), "sum": sum(values)}


def transport_statistics(step: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step and rank (mean over ranks): time in post_send, post_recv, receive waits."""
    totals: dict[str, list[float]] = {}
    for record in step:
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for what, start, end, _ in record["comm"]:
            if what == "recv_posted":
                continue
            sums[what] = sums.get(what, 0.0) + 1e3 * (end - start)
            counts[what] = counts.get(what, 0) + 1
        for what, total in sums.items():
            totals.setdefault(what + "_ms", []).append(total)
            totals.setdefault(what + "_count", []).append(counts[what])
    result = {key: statistics.mean(values) for key, values in totals.items()}
    for name in ("recvs_posted", "recvs_deferred", "sends_posted", "layout_changes_sent"):
        result[name] = sum(record.get("counters", {}).get(name, 0) for record in step)
    return result


def action_durations(step: list[dict[str, Any]], costs: CostModel) -> dict[str, Any]:
    """Measured action duration minus its cost, per kind (ms): the time an action spends
    beyond its module's sleeps (the stage's bookkeeping, autograd, the loss)."""
    excess: dict[str, list[float]] = {}
    for record in step:
        for text, start, end in record["timeline"]:
            action = _parse(text)
            excess.setdefault(action.kind.value, []).append(
                1e3 * (end - start) - action_cost(action, costs))
    return {kind: quantiles(values) for kind, values in excess.items()}


def pause_statistics(steps: list[list[dict[str, Any]]]) -> dict[str, float] | None:
    late = [1e3 * (end - start - asked) for step in steps for record in step
            for _, asked, start, end in record["pauses"]]
    return quantiles(late)


def replay(schedule: Schedule | None, step: list[dict[str, Any]], num_stages: int,
           comm_ms: float) -> float | None:
    """Makespan of ``schedule`` simulated with the step's median action durations per stage
    and kind (``fit_costs``) and message cost c."""
    if schedule is None:
        return None
    records = [(r["rank"], text, 1e3 * s, 1e3 * e) for r in step for text, s, e in r["timeline"]]
    timeline = Timeline.from_records(records, num_ranks=len(step))
    fitted = fit_costs(timeline, num_stages)
    costs = CostModel(forward=fitted.forward, backward_input=fitted.backward_input,
                      backward_weight=fitted.backward_weight,
                      backward=None if fitted.backward_input is not None else fitted.backward,
                      overlap=fitted.overlap, comm=comm_ms)
    try:
        return simulate(schedule, costs).makespan
    except Exception:  # noqa: BLE001 - a timeline without some kind: no replay
        return None


def same_order(a: Schedule, b: Schedule) -> bool:
    return a.placement == b.placement and all(
        tuple(map(str, x)) == tuple(map(str, y)) for x, y in zip(a.ranks, b.ranks))


def analyse(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    rtt = raw["message_cost"]["raw_rtt_ms"]["median"]
    comm_ms = rtt / 2
    rows = []
    for row in raw["rows"]:
        vpp, num_stages = row["vpp"], row["stages"]
        costs = cost_models(args, num_stages, vpp, comm_ms)
        out = {key: row[key] for key in ("schedule", "meshpipe_name", "vpp", "stages",
                                         "torch_class", "torch_note", "skipped")}
        schedule = (build(row["meshpipe_name"], args.pp, args.microbatches,
                          stages_per_rank=vpp) if row["meshpipe_name"] else None)
        torch_schedule = None
        if row.get("torch_order_csv"):
            try:
                torch_schedule = Schedule.from_csv("\n".join(row["torch_order_csv"]),
                                                   name=row["torch_class"])
            except ValueError as error:
                out["torch_order_error"] = str(error)
        sims = {}
        for name, sched in (("meshpipe_order", schedule), ("torch_order", torch_schedule)):
            if sched is None:
                continue
            try:
                sims[name] = {kind: simulate(sched, model).makespan
                              for kind, model in costs.items()}
                sims[name]["free_comm"] = simulate(sched, CostModel(
                    forward=costs["effective"].forward,
                    backward_input=costs["effective"].backward_input,
                    backward_weight=costs["effective"].backward_weight)).makespan
            except ValueError as error:  # ScheduleError: an order that cannot be simulated
                out[f"{name}_error"] = str(error)
                if name == "torch_order":
                    torch_schedule = None
        out["simulated"] = sims
        if schedule is not None and torch_schedule is not None:
            out["torch_order_same"] = same_order(schedule, torch_schedule)
        if torch_schedule is not None:
            out["torch_order"] = str(torch_schedule)
        reference = sims.get("meshpipe_order", sims.get("torch_order", {})).get("effective")
        out["simulated_ms"] = reference
        for library, steps in row["steps"].items():
            spans = [1e3 * (max(r["end"] for r in s) - min(r["start"] for r in s))
                     for s in steps]
            slowest = [1e3 * max(r["end"] - r["start"] for r in s) for s in steps]
            ordered = sorted(range(len(spans)), key=spans.__getitem__)
            median_index = ordered[(len(ordered) - 1) // 2]
            step = steps[median_index]
            own = torch_schedule if library == "torch" else schedule
            own_sim = (sims.get("torch_order", {}) if library == "torch"
                       else sims["meshpipe_order"]).get("effective")
            result = {
                "span_ms": spans, "slowest_rank_ms": slowest,
                "median_ms": statistics.median(spans),
                "median_slowest_rank_ms": statistics.median(slowest),
                "ratio": statistics.median(spans) / reference if reference else None,
                "own_order_simulated_ms": own_sim,
                "ratio_own_order": statistics.median(spans) / own_sim if own_sim else None,
                "median_step_index": median_index,
                "critical_path": critical_path(step, num_stages, costs["effective"], comm_ms),
                "gaps": gap_statistics(step, num_stages, comm_ms),
                "inside_actions": inside_actions(step),
                "local_gap_parts": gap_breakdown(step, num_stages, comm_ms),
                "action_excess_ms": action_durations(step, costs["effective"]),
                "replay_ms": replay(own, step, num_stages, comm_ms),
                "pause_late_ms": pause_statistics(steps),
                "median_step_timeline": {
                    r["rank"]: [(text, round(1e3 * (s - min(x["start"] for x in step)), 3),
                                 round(1e3 * (e - min(x["start"] for x in step)), 3))
                                for text, s, e in sorted(r["timeline"], key=lambda t: t[1])]
                    for r in step},
            }
            if library == "meshpipe":
                result["transport"] = transport_statistics(step)
            empty = row.get("empty_steps", {}).get(library)
            if empty:
                result["empty_stage_span_ms"] = ms_summary(
                    [max(r["end"] for r in e) - min(r["start"] for r in e) for e in empty])
            out[library] = result
        rows.append(out)
    return {"comm_ms": comm_ms, "rows": rows}


# --------------------------------------------------------------------------- report


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def markdown(config: dict[str, Any], message_cost: dict[str, Any],
             analysis: dict[str, Any]) -> str:
    c = analysis["comm_ms"]
    raw_rtt, transport_rtt = message_cost["raw_rtt_ms"], message_cost["transport_rtt_ms"]
    idle = message_cost.get("after_idle_one_way_ms", {})
    code = message_cost.get("stage_code_ms", {})
    pauses = ("plain `time.sleep`" if config["spin_ms"] <= 0 else
              f"`time.sleep`, polling the clock for the last {config['spin_ms']:g} ms")
    lines = [
        "# Executor overhead on sleeping stages",
        "",
        f"pp {config['pp']}, {config['microbatches']} microbatches; every stage only sleeps "
        f"({pauses}): F = {config['forward_ms']:g} ms, I = {config['input_grad_ms']:g} ms, "
        f"W = {config['weight_grad_ms']:g} ms per rank's share (each of v stages on a rank "
        f"sleeps 1/v of it; stage 0's input half runs in its W, in every runner). "
        f"Activations [1, {WIDTH}] float32. Machine: {config['cpu_count']} CPU cores (a VM), "
        f"{config['pp']} gloo processes with one thread each, torch {config['torch']}; other "
        f"processes were running beside it (load average before "
        f"{config['load_average']['before']}, after {config['load_average']['after']}).",
        "",
        f"Message cost c = {c:.3f} ms: half the median round trip of a [1, {WIDTH}] float32 "
        f"tensor between ranks 0 and 1, gloo isend/irecv in a tight ping-pong "
        f"({raw_rtt['median']:.3f} ms round trip, p10-p90 {raw_rtt['p10']:.3f}-"
        f"{raw_rtt['p90']:.3f}); through meshpipe's P2PTransport the round trip is "
        f"{transport_rtt['median']:.3f} ms.",
        "",
        f"Step time: from the earliest rank's start to the latest rank's end of one step "
        f"(ranks start at a barrier; one clock for all processes), median of "
        f"{config['steps']} timed steps after {config['warmup']} warm-up steps, the runners "
        f"taking turns. Simulated: `simulate(schedule, CostModel(forward, backward_input, "
        f"backward_weight per stage, comm=c)).makespan` of meshpipe's order.",
        "",
        "Two floors run meshpipe's order with no pipeline runtime: every receive a bare gloo "
        "`irecv` posted when the step starts, every send a bare `isend` right after its "
        "action, nothing else between actions. **hand** runs the same sleeping modules with "
        "plain autograd (forward and loss; `torch.autograd.backward` toward the input for I, "
        "the weights for W, both for B): the least a runtime running these stages can "
        "expect here. **bare** runs only each action's pauses at the simulated costs: "
        "what it takes beyond the simulation is the machine's own (late wake-ups, message "
        "latency after idling).",
        "",
        "| schedule | simulated ms | "
        + " | ".join(f"{library} ms | {library} / simulated" for library in LIBRARIES) + " |",
        "| --- | ---: |" + " ---: | ---: |" * len(LIBRARIES),
    ]
    notes = []
    for row in analysis["rows"]:
        sim = row.get("simulated_ms")
        cells = [row["schedule"] + (f" (vpp {row['vpp']})" if row["vpp"] > 1 else ""),
                 fmt(sim)]
        for library in LIBRARIES:
            result = row.get(library)
            if result is None:
                cells += ["—", "—"]
                continue
            cell = fmt(result["ratio"], ".3f")
            if library == "torch" and row.get("torch_order_same") is False:
                cell += (f" (own order: sim {fmt(result['own_order_simulated_ms'])} ms, "
                         f"{fmt(result['ratio_own_order'], '.3f')})")
            cells += [fmt(result["median_ms"]), cell]
        lines.append("| " + " | ".join(cells) + " |")
        for library, reason in row["skipped"].items():
            notes.append(f"- {row['schedule']}, {library}: {reason}.")
        if "torch" in row:
            same = row.get("torch_order_same")
            text = row.get("torch_note") or row["torch_class"]
            if same is False:
                text += ("; its compute order differs from meshpipe's: its own order is "
                         "simulated as well")
            elif same:
                text += "; same compute order as meshpipe's"
            notes.append(f"- {row['schedule']}, torch: {text}.")
    lines += ["", *notes] if notes else []
    if idle and code:
        lines += [
            "",
            "This machine after idling (both read during the run, all ranks): a message's "
            f"one-way time when both ends idled {1e3 * IDLE_S:g} ms first (sender sleeps, "
            "receiver blocks in its wait) is "
            f"{idle['raw']['median']:.3f} ms with raw gloo and "
            f"{idle['transport']['median']:.3f} ms through P2PTransport (tight ping-pong: "
            f"{raw_rtt['median'] / 2:.3f} and {transport_rtt['median'] / 2:.3f}); a sleeping "
            "stage's forward + backward code with zero-length sleeps takes "
            f"{1e3 * code['back to back']['median']:.0f} µs back to back and "
            f"{1e3 * code['after idle']['median']:.0f} µs right after a "
            f"{1e3 * IDLE_S:g} ms sleep. Every action and every message of a pipeline step "
            "starts after such an idle period.",
        ]
    lines += [
        "",
        "## Where the time goes (median step; ms)",
        "",
        "Critical path of the measured step, walked back from its last action (module doc "
        "of `benchmarks/executor_overhead.py`): measured = head + path cost (the cost model's "
        "time of the actions on it) + late wake-ups (pauses ending after their deadline) + "
        "stage code (time inside actions outside the pauses: the stage's bookkeeping, "
        "autograd, the loss) + local gaps (between two actions of one rank, the earlier one "
        "binding) + message hops (producing action's end on another rank to the consumer's "
        "start; c each is in the simulation) + tail. Replay: the same order simulated with "
        "the step's median measured action durations per stage and kind, and c. Empty "
        "stages: the median step of the same pipeline with every pause skipped (each "
        "runtime's own CPU time per step, 4 processes sharing 2 cores).",
        "",
        "| schedule | library | simulated | measured | replay | path cost | late wake-ups "
        "| stage code (actions) | local gaps (n) | hops (n) | hops beyond c | head + tail "
        "| empty stages |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for row in analysis["rows"]:
        for library in LIBRARIES:
            result = row.get(library)
            if result is None:
                continue
            path = result["critical_path"]
            lines.append("| " + " | ".join([
                row["schedule"], library, fmt(result["own_order_simulated_ms"]),
                fmt(path["span_ms"]), fmt(result["replay_ms"]), fmt(path["cost"]),
                fmt(path["late_wakeups"]), f"{path['stage_code']:.1f} ({path['actions']})",
                f"{path['local_gap_ms']:.1f} ({path['local_gaps']})",
                f"{path['hop_ms']:.1f} ({path['hops']})", fmt(path["hop_beyond_c_ms"]),
                fmt(path["head_ms"] + path["tail_ms"]),
                fmt((result.get("empty_stage_span_ms") or {}).get("median"))]) + " |")
    lines += [
        "",
        "meshpipe's local gaps and hops on the critical path, split with the transport calls "
        "recorded on each rank: a local gap into time in `post_send`, `post_recv`, receive "
        "waits (a message that had already arrived) and the rest (the executor's dispatch "
        "and bookkeeping); a hop into the sender's part (producer's end to the return of its "
        "`post_send`), the time the receive was really posted on gloo after that (a receive "
        "the transport deferred until an earlier message from that peer was read), the "
        "receiver still busy with other work, the receiver blocked in its wait, and after "
        "the wait to the consumer's start. "
        "Medians over every local gap of the step (not only the critical path) in the last "
        "columns.",
        "",
        "| schedule | local gaps | post_send | post_recv | recv waits | other | hops "
        "| sender | receive posted after the send (n) | receiver busy | in wait | after wait "
        "| median gap | median post_send in a gap | receives deferred / posted (all ranks) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    for row in analysis["rows"]:
        result = row.get("meshpipe")
        if result is None:
            continue
        path = result["critical_path"]
        calls, hops = path["local_gap_calls"], path["hop_parts"]
        gap_parts = result.get("local_gap_parts") or {}
        lines.append("| " + " | ".join([
            row["schedule"], fmt(path["local_gap_ms"]),
            *(fmt(calls.get(k, 0.0)) for k in ("post_send", "post_recv", "recv_wait",
                                                "other")),
            fmt(path["hop_ms"]), fmt(hops.get("sender", 0.0)),
            f"{hops.get('receive posted after the send', 0.0):.1f} ({path['late_receives']})",
            *(fmt(hops.get(k, 0.0)) for k in ("receiver busy", "in wait", "after wait")),
            fmt((gap_parts.get("gap") or {}).get("median"), ".3f"),
            fmt((gap_parts.get("post_send") or {}).get("median"), ".3f"),
            f"{result['transport'].get('recvs_deferred', 0)} / "
            f"{result['transport'].get('recvs_posted', 0)}"]) + " |")
    lines += [
        "",
        "Inside actions (median over every action of the median step, ms): before the "
        "first pause / after the last / between the two pauses of a B, W (stage 0) or "
        "OVERLAP.",
        "",
        "| schedule | library | kind | before | after | between | late wake-up |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in analysis["rows"]:
        for library in LIBRARIES:
            result = row.get(library)
            if result is None:
                continue
            for kind, parts in result["inside_actions"].items():
                lines.append("| " + " | ".join([
                    row["schedule"], library, kind,
                    *(f"{parts[name]['median']:.3f}"
                      for name in ("before", "after", "between", "late"))]) + " |")
    late = [row[lib]["pause_late_ms"] for row in analysis["rows"] for lib in LIBRARIES
            if row.get(lib) and row[lib]["pause_late_ms"]]
    if late:
        lines += ["", f"Pauses ended a median "
                      f"{1e3 * statistics.median(q['median'] for q in late):.0f} µs after "
                      f"their deadline (worst {max(q['max'] for q in late):.2f} ms) over every "
                      "timed step."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = {key: value for key, value in vars(args).items()
              if key not in ("out", "raw", "from_raw")}
    config.update(cpu_count=os.cpu_count(), torch=torch.__version__,
                  python=platform.python_version(), machine=platform.machine())
    if args.from_raw is not None:
        raw = json.loads(args.from_raw.read_text())
        config.update(raw["config"])
    else:
        before = load_average()
        print(f"spawning {args.pp} processes; load average {before}", flush=True)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="meshpipe-overhead-") as scratch:
            init_file = os.path.join(scratch, "init")
            result_file = os.path.join(scratch, "result")
            mp.spawn(_worker, args=(args.pp, init_file, result_file, args), nprocs=args.pp,
                     join=True)
            raw = json.loads(Path(result_file).read_text())
        config["load_average"] = {"before": before, "after": load_average()}
        config["wall_s"] = round(time.perf_counter() - started, 1)
        config["timer_slack_set"] = raw["timer_slack_set"]
        if args.raw is not None:
            args.raw.write_text(json.dumps({**raw, "config": config}))
    analysis = analyse(args, raw)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "executor_overhead.json"
    md_path = args.out / "executor_overhead.md"
    json_path.write_text(json.dumps({"config": config, "message_cost": raw["message_cost"],
                                     **analysis}, indent=1) + "\n")
    table = markdown(config, raw["message_cost"], analysis)
    md_path.write_text(table)
    print(table)
    print(f"wrote {json_path} and {md_path} ({config['wall_s']} s)")


if __name__ == "__main__":
    main()
