"""The analysis of ``executor_overhead.py``'s measured steps: the critical path of a step's
timeline split into start-up, actions, gaps between a rank's actions, message hops and tail;
gap, transport, action and pause statistics; the simulation of the measured order at the
measured costs (``replay``); and ``analyse``, which turns the raw records into the report's
figures."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any


from overhead_stages import action_cost, cost_models, dependencies, ms_summary
from meshpipe.schedules import (Action, CostModel, Kind, Schedule, Timeline, build, fit_costs,
                                simulate)


def _parse(text: str) -> Action:
    return Action.parse(text)


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
        for token in dependencies(timed.action, last_stage):
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
            remote_ends = [end for token in dependencies(action, num_stages - 1)
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
