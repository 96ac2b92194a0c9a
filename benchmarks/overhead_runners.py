"""The runners ``executor_overhead.py`` compares, each stepping the same sleeping stages
in the same processes: meshpipe's executor, torch.distributed.pipelining, and the two floors
(``hand``: meshpipe's order with plain autograd and no runtime; ``bare``: only the pauses,
messages posted as early as possible); and each rank's worker, which runs the probes
(``overhead_probes``) and every case."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness import PROCESS_GROUP_TIMEOUT, join_ranks, report
from overhead_probes import measure_idle_code, measure_idle_latency, measure_message_cost
from overhead_stages import (CASE_BY_LABEL, LIBRARIES, WIDTH, Case, Pauses, action_cost, clock,
                             cost_models, dependencies, loss_fn, make_batch, make_modules,
                             set_timer_slack)
from meshpipe.comm.p2p import P2PTransport
from meshpipe.runtime.executor import Executor
from meshpipe.runtime.stage import Stage
from meshpipe.schedules import Action, Kind, Schedule, build


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

    receives = [[need for need in dependencies(action, last)
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


def worker(rank: int, world: int, init_file: str, result_file: str,
            args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*has no forward_steps.*")
    slack = set_timer_slack()
    join_ranks(rank, world, init_file)
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
            report(result_file, {"message_cost": message_cost, "timer_slack_set": slack,
                                 "rows": rows})
    finally:
        dist.destroy_process_group()
