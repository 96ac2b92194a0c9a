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
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from harness import load_average, spawn_ranks, write_results
from overhead_analysis import analyse
from overhead_runners import worker
from overhead_stages import CASE_BY_LABEL, IDLE_S, LIBRARIES, WIDTH


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
        raw = spawn_ranks(worker, args.pp, args)
        config["load_average"] = {"before": before, "after": load_average()}
        config["wall_s"] = round(time.perf_counter() - started, 1)
        config["timer_slack_set"] = raw["timer_slack_set"]
        if args.raw is not None:
            args.raw.write_text(json.dumps({**raw, "config": config}))
    analysis = analyse(args, raw)
    table = markdown(config, raw["message_cost"], analysis)
    json_path, md_path = write_results(
        args.out, "executor_overhead",
        {"config": config, "message_cost": raw["message_cost"], **analysis}, table)
    print(table)
    print(f"wrote {json_path} and {md_path} ({config['wall_s']} s)")


if __name__ == "__main__":
    main()
