"""The emulated half of ``moe_overlap.py``: a toy mixture-of-experts module whose layers
only sleep (``SleepMoE``) run by the executor on two processes with an emulated network
latency, beside what the runtime model and the simulator predict for the same pieces
(``emulated_rows``)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from meshpipe.runtime.substeps import Exchange, run_steps

# ------------------------------------------------------------------------ arguments


class _Sleep(torch.autograd.Function):
    """A compute piece of known cost: forward sleeps ``forward_s``, backward ``backward_s``."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepMoE(nn.Module):
    """``layers`` x (piece, dispatch, piece, combine), then a final piece; sleep-timed."""

    def __init__(self, layers: int, dim: int, forward_s: float, backward_s: float, group):
        super().__init__()
        self.layers = layers
        self.scale = nn.Parameter(torch.ones(2 * layers + 1, dim))
        self.forward_s, self.backward_s = forward_s, backward_s
        self.group = group

    def _piece(self, x, index: int):
        return _Sleep.apply(x * self.scale[index], self.forward_s, self.backward_s)

    def _exchange(self, x):
        """All-to-all of equal halves between the ranks (its own reverse), or a copy."""
        if self.group is None:
            return x.clone()
        from meshpipe.comm.collectives import exchange_rows

        world = torch.distributed.get_world_size(self.group)
        rows = [x.size(0) // world] * world
        return exchange_rows(x, rows, rows, self.group)

    def forward_steps(self, x):
        for layer in range(self.layers):
            x = self._piece(x, 2 * layer)
            x, _ = yield Exchange(send=x, communicate=self._exchange,
                                  communicate_backward=self._exchange, name=f"dispatch{layer}")
            x = self._piece(x, 2 * layer + 1)
            x, _ = yield Exchange(send=x, communicate=self._exchange,
                                  communicate_backward=self._exchange, name=f"combine{layer}")
        return self._piece(x, 2 * self.layers)

    def forward(self, x):
        return run_steps(self.forward_steps(x))


def _mean_square(output, target):
    return ((output - target) ** 2).mean()


def _where_time_went(events: list, microbatches: int, combined: bool) -> dict:
    """From one step's trace: compute pieces (run -> yield), exposed waits (wait ->
    received) split by lone actions vs OVERLAPs, and each exchange's post -> received."""
    open_run: dict[str, float] = {}
    posted: dict[str, float] = {}
    waiting: dict[str, float] = {}
    compute = exposed_alone = exposed_overlap = 0.0
    latencies = []
    for t, event, label in events:
        if event == "run":
            open_run[label] = t
        elif event == "yield":
            compute += t - open_run.pop(label)
        elif event == "post":
            posted[label] = t
        elif event == "wait":
            waiting[label] = t
        elif event == "received":
            latencies.append(t - posted.pop(label))
            waited = t - waiting.pop(label)
            action = label.split(":")[0]  # "F0,3" / "B0,3"
            kind, microbatch = action[0], int(action.split(",")[1])
            alone = not combined or (kind == "F" and microbatch == 0) or (
                kind == "B" and microbatch == microbatches - 1)
            if alone:
                exposed_alone += waited
            else:
                exposed_overlap += waited
    return {"compute_s": compute, "exposed_alone_s": exposed_alone,
            "exposed_overlap_s": exposed_overlap, "exchanges": len(latencies),
            "post_to_received_median_s": statistics.median(latencies) if latencies else 0.0}


def _emulated_worker(rank: int, world_size: int, settings: dict) -> list[dict]:
    import torch.distributed as dist

    from meshpipe.comm.p2p import P2PTransport
    from meshpipe.runtime import Executor, Stage
    from meshpipe.runtime.substeps import comm_worker, trace_events
    from meshpipe.schedules import build

    m = settings["microbatches"]
    exchange_group = dist.new_group(list(range(world_size))) if settings["all_to_all"] else None
    barrier_group = dist.new_group(list(range(world_size)))
    transport = P2PTransport()  # pp 1: no pipeline message is sent, but the executor wants one
    forward_s = settings["compute_s"]
    module = SleepMoE(settings["layers"], settings["dim"], forward_s,
                      forward_s * settings["backward_factor"], exchange_group)
    generator = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(settings["rows"], settings["dim"], generator=generator)
              for _ in range(m)]
    targets = [torch.randn(settings["rows"], settings["dim"], generator=generator)
               for _ in range(m)]
    executors = {}
    for name in ("1f1b", "combined-1f1b"):
        stage = Stage(module, 0, 1, loss_fn=_mean_square)
        executors[name] = Executor(build(name, 1, m), {0: stage}, pp_rank=0,
                                   pipeline_ranks=[rank], transport=transport)
    worker = comm_worker()
    results = []
    for latency in settings["latencies"]:
        worker.latency_s = latency
        runs = {name: [] for name in executors}
        for step in range(settings["steps"]):
            # Alternate which schedule goes first, so drifting load hits both alike.
            order = list(executors) if step % 2 == 0 else list(reversed(executors))
            for name in order:
                module.zero_grad(set_to_none=True)
                dist.barrier(group=barrier_group)
                with trace_events() as events:
                    start = time.perf_counter()
                    executors[name].step(inputs, targets)
                    seconds = time.perf_counter() - start
                runs[name].append({"seconds": seconds, **_where_time_went(
                    list(events), m, combined=name == "combined-1f1b")})
        results.append({"latency_s": latency, "runs": runs})
    worker.latency_s = 0.0
    return results


def _co_scheduled(pieces: int, first_s: float, second_s: float, latency: float) -> float:
    """``co_schedule`` of two tasks of ``pieces`` pieces each (the first one, a backward,
    starts), each waiting for its own previous exchange: the makespan, without overhead."""
    now, ready = 0.0, [0.0, 0.0]
    for piece in range(pieces):
        for task, cost in enumerate((first_s, second_s)):
            now = max(now, ready[task]) + cost
            if piece < pieces - 1:
                ready[task] = now + latency
    return now


def runtime_model(schedule: str, m: int, layers: int, forward_s: float, backward_s: float,
                  latency: float) -> float:
    pieces = 2 * layers + 1
    alone_f = pieces * forward_s + (pieces - 1) * latency
    alone_b = pieces * backward_s + (pieces - 1) * latency
    if schedule == "1f1b":
        return m * (alone_f + alone_b)
    return alone_f + (m - 1) * _co_scheduled(pieces, backward_s, forward_s, latency) + alone_b


def simulated(schedule: str, m: int, layers: int, forward_s: float, backward_s: float,
              latency: float) -> float:
    from meshpipe.schedules import build
    from meshpipe.schedules import CostModel, simulate

    pieces = 2 * layers + 1
    costs = CostModel(forward=pieces * forward_s, backward=pieces * backward_s,
                      a2a=2 * layers * latency)
    return simulate(build(schedule, 1, m), costs).makespan


def emulated_rows(args: argparse.Namespace) -> list[dict]:
    from meshpipe.testing import run_distributed

    c = args.compute_ms / 1000
    backward_s = c * args.backward_factor
    m, layers = args.microbatches, args.layers
    rows = []
    for exchange in args.exchanges:
        if exchange not in ("clone", "all-to-all"):
            raise SystemExit(f"--exchanges: unknown mode {exchange!r} (clone, all-to-all)")
        settings = {"microbatches": m, "layers": layers, "compute_s": c,
                    "backward_factor": args.backward_factor, "rows": args.rows,
                    "dim": args.dim, "all_to_all": exchange == "all-to-all",
                    "steps": args.emulated_steps,
                    "latencies": [factor * c for factor in args.latency_factors]}
        per_rank = run_distributed(2, _emulated_worker, settings, timeout=1200)
        for index, factor in enumerate(args.latency_factors):
            row = _emulated_row(per_rank, index, exchange, factor, c, backward_s, m, layers)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                   if not k.endswith("steps_ms")}, flush=True)
            rows.append(row)
    return rows


def _emulated_row(per_rank: list, index: int, exchange: str, factor: float, c: float,
                  backward_s: float, m: int, layers: int) -> dict:
    latency = factor * c
    row = {"exchange": exchange, "latency_ms": 1000 * latency, "latency_over_compute": factor}
    for name, key in (("1f1b", "sequential"), ("combined-1f1b", "combined")):
        runs = [per_rank[rank][index]["runs"][name] for rank in range(2)]
        # A step lasts as long as its slower rank (they meet at every all-to-all).
        seconds = [max(r[step]["seconds"] for r in runs) for step in range(len(runs[0]))]
        row[f"{key}_ms"] = 1000 * statistics.median(seconds[1:])
        row[f"{key}_steps_ms"] = [1000 * s for s in seconds]
        # Where rank 0's time went, per step (median over the steps after the first).
        rank0 = runs[0][1:]
        for step in rank0:
            step["other_s"] = (step["seconds"] - step["compute_s"] - step["exposed_alone_s"]
                               - step["exposed_overlap_s"])
            step["exposed_s"] = step["exposed_alone_s"] + step["exposed_overlap_s"]
        for field in ("compute_s", "exposed_s", "exposed_alone_s", "exposed_overlap_s",
                      "other_s", "post_to_received_median_s"):
            row[f"{key}_rank0_{field.removesuffix('_s')}_ms"] = 1000 * statistics.median(
                step[field] for step in rank0)
        row["exchanges_per_step"] = rank0[0]["exchanges"]
        row[f"{key}_runtime_model_ms"] = 1000 * runtime_model(name, m, layers, c, backward_s,
                                                              latency)
        row[f"{key}_simulated_ms"] = 1000 * simulated(name, m, layers, c, backward_s, latency)
    row["total_wait_ms"] = row["exchanges_per_step"] * row["latency_ms"]
    row["combined_over_sequential"] = row["combined_ms"] / row["sequential_ms"]
    for source, suffix in (("", ""), ("runtime_model_", "_runtime_model"),
                           ("simulated_", "_simulated")):
        row["hidden_share" + suffix] = (
            (row[f"sequential_{source}ms"] - row[f"combined_{source}ms"]) / row["total_wait_ms"]
            if latency > 0 else None)
    exposed = row["sequential_rank0_exposed_ms"]
    row["hidden_share_trace"] = (1 - row["combined_rank0_exposed_ms"] / exposed
                                 if latency > 0 and exposed > 0 else None)
    return row


# -------------------------------------------------------------------------- output
