"""The probes of ``executor_overhead.py``: what one message costs (ping-pong, raw gloo and
through ``P2PTransport``), the one-way time of a message whose sender slept and whose
receiver was blocked in its wait, and the time of a sleeping stage's code run back to back
and right after an idle period."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from overhead_stages import (IDLE_ROUNDS, IDLE_S, PINGPONG_WARMUP, WIDTH, Pauses, SleepStage,
                             clock, ms_summary)
from meshpipe.comm.p2p import P2PTransport


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
