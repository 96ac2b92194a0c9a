"""Round-trip latency of one pipeline message between two processes: meshpipe vs plain gloo.

    .venv/bin/python benchmarks/p2p_latency.py                 # 16 KB, 256 KB, 6 MB
    .venv/bin/python benchmarks/p2p_latency.py --sizes 16384 --iters 500

Two gloo CPU processes (``torch.set_num_threads(1)``) bounce one float32 tensor back and
forth. A round trip is: rank 0 sends, rank 1 receives and sends it back, rank 0 receives;
each one is timed on rank 0, back to back, after warm-up round trips (meshpipe's first
message on a link carries its layout; the timed ones reuse it). Three ways:

- ``meshpipe``: ``P2PTransport.post_recv``, ``post_send`` and ``wait`` with labels, the
  way the executor uses them (rank 0 posts its receive before it sends);
- ``gloo 1 op``: a plain ``isend`` / ``irecv`` of the tensor into a buffer allocated
  beforehand: the floor for any transport that knows the shape in advance (what
  ``torch.distributed.pipelining`` does with static shapes);
- ``gloo header+payload``: a 48-byte header receive, then the payload receive posted
  once the header is in: the floor for a transport that learns the size from a header.

Prints a table of the median and 10th percentile (ms) per size and way, and writes
``<out>/p2p_latency.json`` (default ``benchmarks/results``). A benchmark prints and records
times; it never asserts them. On a shared machine read the medians with the recorded load
average in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshpipe.comm.p2p import P2PTransport

DEFAULT_SIZES = (16 << 10, 256 << 10, 6 << 20)
HEADER_NBYTES = 48
WAYS = ("meshpipe", "gloo 1 op", "gloo header+payload")
PROCESS_GROUP_TIMEOUT = timedelta(minutes=5)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="message sizes in bytes (multiples of 4: float32 tensors)")
    parser.add_argument("--iters", type=int, default=300,
                        help="timed round trips per size and way (a tenth of it for sizes "
                             "of 1 MB and more, at least 20)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed round trips first")
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


def meshpipe_round_trip(rank: int, tensor: torch.Tensor, group: dist.ProcessGroup
                        ) -> RoundTrip:
    transport = P2PTransport(group)
    peer = 1 - rank

    def round_trip() -> None:
        incoming = transport.post_recv(peer, label="bounce")
        if rank == 0:
            transport.post_send(tensor, peer, label="bounce")
            incoming.wait()
        else:
            transport.post_send(incoming.wait(), peer, label="bounce")
        transport.wait_sends()

    return round_trip


def gloo_round_trip(rank: int, tensor: torch.Tensor, group: dist.ProcessGroup) -> RoundTrip:
    peer = 1 - rank
    buffer = torch.empty_like(tensor)

    def round_trip() -> None:
        if rank == 0:
            send = dist.isend(tensor, peer, group=group)
            dist.irecv(buffer, peer, group=group).wait()
        else:
            dist.irecv(buffer, peer, group=group).wait()
            send = dist.isend(buffer, peer, group=group)
        send.wait()

    return round_trip


def header_then_payload_round_trip(rank: int, tensor: torch.Tensor,
                                   group: dist.ProcessGroup) -> RoundTrip:
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


FACTORIES: dict[str, Callable[[int, torch.Tensor, dist.ProcessGroup], RoundTrip]] = {
    "meshpipe": meshpipe_round_trip,
    "gloo 1 op": gloo_round_trip,
    "gloo header+payload": header_then_payload_round_trip,
}


def measure(rank: int, way: str, size: int, args: argparse.Namespace) -> list[float]:
    """Round-trip times in ms on rank 0 (rank 1 returns an empty list).

    Each measurement has a group of its own, so no way can take another's messages.
    """
    tensor = torch.randn(size // 4)
    group = dist.new_group([0, 1], timeout=PROCESS_GROUP_TIMEOUT)
    round_trip = FACTORIES[way](rank, tensor, group)
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


def _worker(rank: int, init_file: str, result_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        rows = []
        for size in args.sizes:
            for way in WAYS:
                times = measure(rank, way, size, args)
                if rank == 0:
                    row = summarise(size, way, times)
                    rows.append(row)
                    print(f"{size:>9} B  {way:<20} median {row['median_ms']:.3f} ms  "
                          f"p10 {row['p10_ms']:.3f} ms", flush=True)
        if rank == 0:
            Path(result_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def summarise(size: int, way: str, times: list[float]) -> dict:
    ordered = sorted(times)
    return {"bytes": size, "way": way, "iters": len(times),
            "median_ms": round(statistics.median(ordered), 4),
            "p10_ms": round(ordered[len(ordered) // 10], 4),
            "min_ms": round(ordered[0], 4)}


def table(rows: list[dict]) -> str:
    lines = ["| bytes | " + " | ".join(f"{way} median / p10 ms" for way in WAYS) + " |",
             "| ---: |" + " ---: |" * len(WAYS)]
    for size in sorted({row["bytes"] for row in rows}):
        cells = [str(size)]
        for way in WAYS:
            row = next(r for r in rows if r["bytes"] == size and r["way"] == way)
            cells.append(f"{row['median_ms']:.3f} / {row['p10_ms']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = {"sizes": args.sizes, "iters": args.iters, "warmup": args.warmup,
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "python": platform.python_version(), "load_average_before": load_average()}
    with tempfile.TemporaryDirectory(prefix="meshpipe-p2p-bench-") as scratch:
        init_file, result_file = os.path.join(scratch, "init"), os.path.join(scratch, "result")
        mp.spawn(_worker, args=(init_file, result_file, args), nprocs=2, join=True)
        rows = json.loads(Path(result_file).read_text())
    config["load_average_after"] = load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "p2p_latency.json"
    path.write_text(json.dumps({"config": config, "results": rows}, indent=2) + "\n")
    print(table(rows))
    print(f"load average before {config['load_average_before']}, after "
          f"{config['load_average_after']}; wrote {path}")


if __name__ == "__main__":
    main()
