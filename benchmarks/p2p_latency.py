"""Round-trip latency of one pipeline message between two processes: meshpipe vs plain gloo.

    .venv/bin/python benchmarks/p2p_latency.py                 # 16 KB, 256 KB, 6 MB
    .venv/bin/python benchmarks/p2p_latency.py --sizes 16384 --iters 500
    .venv/bin/python benchmarks/p2p_latency.py --modes batched

Two gloo CPU processes (``torch.set_num_threads(1)``) bounce one float32 tensor back and
forth. A round trip is: rank 0 sends, rank 1 receives and sends it back, rank 0 receives;
each one is timed on rank 0, back to back, after warm-up round trips (meshpipe's first
message on a link carries its layout; the timed ones reuse it). The ways, each in the
modes of ``--modes``:

- ``meshpipe``: ``P2PTransport.post_recv``, ``post_send`` and ``wait`` with labels, the
  way the executor uses them (rank 0 posts its receive before it sends). Mode ``async``
  posts each operation at once; mode ``batched`` (``P2PTransport(mode="batched")``) queues
  them and issues rank 0's receive and send in one ``batch_isend_irecv`` at ``flush``, as
  the executor does after a run of SEND/RECV actions;
- ``gloo 1 op``: a plain ``isend`` / ``irecv`` of the tensor into a buffer allocated
  beforehand: the floor for any transport that knows the shape in advance (what
  ``torch.distributed.pipelining`` does with static shapes); in mode ``batched`` rank 0's
  receive and send go through one ``batch_isend_irecv``;
- ``gloo header+payload`` (async only): a 48-byte header receive, then the payload receive
  posted once the header is in: the floor for a transport that learns the size from a
  header.

On gloo ``batch_isend_irecv`` posts its operations one by one (gloo does not coalesce), so
batched mode can only add Python overhead here; the grouped launch it exists for is NCCL's.

Prints a table of the median and 10th percentile (ms) per size and way, and writes
``<out>/p2p_latency.json`` and ``<out>/p2p_latency.md`` (default ``benchmarks/results``).
A benchmark prints and records times; it never asserts them. On a shared machine read the
medians with the recorded load average in mind.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from harness import (PROCESS_GROUP_TIMEOUT, join_ranks, load_average, report, spawn_ranks,
                     write_results)
from meshpipe.comm.p2p import MODES, P2PTransport

DEFAULT_SIZES = (16 << 10, 256 << 10, 6 << 20)
HEADER_NBYTES = 48
WAYS = ("meshpipe", "gloo 1 op", "gloo header+payload")
# The modes each way runs in (header+payload is a floor with no batched counterpart).
WAY_MODES = {"meshpipe": MODES, "gloo 1 op": MODES, "gloo header+payload": ("async",)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="message sizes in bytes (multiples of 4: float32 tensors)")
    parser.add_argument("--iters", type=int, default=300,
                        help="timed round trips per size and way (a tenth of it for sizes "
                             "of 1 MB and more, at least 20)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed round trips first")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="transport modes to measure (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if any(size <= 0 or size % 4 for size in args.sizes):
        parser.error("--sizes must be positive multiples of 4 bytes")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be at least 1 and --warmup at least 0")
    return args


def iterations(size: int, iters: int) -> int:
    return max(20, iters // 10) if size >= 1 << 20 else iters


# A round trip as seen by one rank: returns nothing; rank 0's wall time around it is timed.
RoundTrip = Callable[[], None]


def meshpipe_round_trip(rank: int, tensor: torch.Tensor, group: dist.ProcessGroup,
                        mode: str) -> RoundTrip:
    transport = P2PTransport(group, mode=mode)
    peer = 1 - rank

    def round_trip() -> None:
        incoming = transport.post_recv(peer, label="bounce")
        if rank == 0:
            transport.post_send(tensor, peer, label="bounce")
            transport.flush()  # batched: receive and send in one call; async: nothing
            incoming.wait()
        else:
            transport.post_send(incoming.wait(), peer, label="bounce")
            transport.flush()
        transport.wait_sends()

    return round_trip


def gloo_round_trip(rank: int, tensor: torch.Tensor, group: dist.ProcessGroup,
                    mode: str) -> RoundTrip:
    peer = 1 - rank
    buffer = torch.empty_like(tensor)

    def batched_exchange() -> None:
        ops = [dist.P2POp(dist.irecv, buffer, peer, group=group),
               dist.P2POp(dist.isend, tensor, peer, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def round_trip() -> None:
        if rank == 0:
            if mode == "batched":
                batched_exchange()
                return
            send = dist.isend(tensor, peer, group=group)
            dist.irecv(buffer, peer, group=group).wait()
        else:
            dist.irecv(buffer, peer, group=group).wait()
            send = dist.isend(buffer, peer, group=group)
        send.wait()

    return round_trip


def header_then_payload_round_trip(rank: int, tensor: torch.Tensor,
                                   group: dist.ProcessGroup, mode: str) -> RoundTrip:
    peer = 1 - rank
    header = torch.zeros(HEADER_NBYTES, dtype=torch.uint8)

    def receive() -> torch.Tensor:
        incoming = torch.empty(HEADER_NBYTES, dtype=torch.uint8)
        dist.irecv(incoming, peer, group=group).wait()
        payload = torch.empty_like(tensor)
        dist.irecv(payload, peer, group=group).wait()
        return payload

    def send(payload: torch.Tensor) -> list:
        return [dist.isend(header, peer, group=group), dist.isend(payload, peer, group=group)]

    def round_trip() -> None:
        if rank == 0:
            sends = send(tensor)
            receive()
        else:
            sends = send(receive())
        for work in sends:
            work.wait()

    return round_trip


FACTORIES: dict[str, Callable[[int, torch.Tensor, dist.ProcessGroup, str], RoundTrip]] = {
    "meshpipe": meshpipe_round_trip,
    "gloo 1 op": gloo_round_trip,
    "gloo header+payload": header_then_payload_round_trip,
}


def ways_and_modes(modes: list[str]) -> list[tuple[str, str]]:
    """Every (way, mode) pair to measure, in table order."""
    return [(way, mode) for way in WAYS for mode in WAY_MODES[way] if mode in modes]


def measure(rank: int, way: str, mode: str, size: int, args: argparse.Namespace
            ) -> list[float]:
    """Round-trip times in ms on rank 0 (rank 1 returns an empty list).

    Each measurement has a group of its own, so no way can take another's messages.
    """
    tensor = torch.randn(size // 4)
    group = dist.new_group([0, 1], timeout=PROCESS_GROUP_TIMEOUT)
    round_trip = FACTORIES[way](rank, tensor, group, mode)
    for _ in range(args.warmup):
        round_trip()
    dist.barrier()
    times = []
    for _ in range(iterations(size, args.iters)):
        started = time.perf_counter()
        round_trip()
        times.append((time.perf_counter() - started) * 1e3)
    dist.barrier()
    return times if rank == 0 else []


def _worker(rank: int, world: int, init_file: str, result_file: str,
            args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    join_ranks(rank, world, init_file)
    try:
        rows = []
        for size in args.sizes:
            for way, mode in ways_and_modes(args.modes):
                times = measure(rank, way, mode, size, args)
                if rank == 0:
                    row = summarise(size, way, mode, times)
                    rows.append(row)
                    print(f"{size:>9} B  {way:<20} {mode:<8} median {row['median_ms']:.3f} "
                          f"ms  p10 {row['p10_ms']:.3f} ms", flush=True)
        if rank == 0:
            report(result_file, rows)
    finally:
        dist.destroy_process_group()


def summarise(size: int, way: str, mode: str, times: list[float]) -> dict:
    ordered = sorted(times)
    return {"bytes": size, "way": way, "mode": mode, "iters": len(times),
            "median_ms": round(statistics.median(ordered), 4),
            "p10_ms": round(ordered[len(ordered) // 10], 4),
            "min_ms": round(ordered[0], 4)}


def table(rows: list[dict]) -> str:
    """Markdown table: one row per size, one column per (way, mode), median / p10 in ms."""
    columns = [(way, mode) for way in WAYS for mode in WAY_MODES[way]
               if any(r["way"] == way and r["mode"] == mode for r in rows)]
    lines = ["| bytes | " + " | ".join(f"{way} {mode} median / p10 ms"
                                       for way, mode in columns) + " |",
             "| ---: |" + " ---: |" * len(columns)]
    for size in sorted({row["bytes"] for row in rows}):
        cells = [str(size)]
        for way, mode in columns:
            row = next(r for r in rows
                       if r["bytes"] == size and r["way"] == way and r["mode"] == mode)
            cells.append(f"{row['median_ms']:.3f} / {row['p10_ms']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = {"sizes": args.sizes, "iters": args.iters, "warmup": args.warmup,
              "modes": args.modes,
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "python": platform.python_version(), "load_average_before": load_average()}
    rows = spawn_ranks(_worker, 2, args)
    config["load_average_after"] = load_average()
    markdown = table(rows)
    note = (f"2 gloo CPU processes, {config['cpu_count']} CPUs, torch {config['torch']}; "
            f"load average before {config['load_average_before']}, after "
            f"{config['load_average_after']}. Round-trip times; batched mode issues rank 0's "
            "receive and send in one batch_isend_irecv (gloo posts them one by one).")
    path, _ = write_results(args.out, "p2p_latency", {"config": config, "results": rows},
                            "# P2P round-trip latency\n\n" + markdown + "\n\n" + note + "\n")
    print(markdown)
    print(f"load average before {config['load_average_before']}, after "
          f"{config['load_average_after']}; wrote {path} and p2p_latency.md")


if __name__ == "__main__":
    main()
