"""What the benchmark scripts share (run as ``python benchmarks/NAME.py``, which puts this
directory on the import path): the machine's load, ratios timed round by round, spawning the
ranks of a measurement and collecting what rank 0 measured, and writing a result as JSON
beside its markdown table. A benchmark records times; it never asserts them.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT = timedelta(minutes=5)
RESULTS = Path(__file__).parent / "results"


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (None where the OS has none): a
    benchmark records them before and after, since other processes skew its timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def paired_ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Round by round, one case's time over another's timed in the same round: load that
    drifts between rounds slows both sides of a ratio, where it would move the two cases'
    own medians apart."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def spawn_ranks(worker: Callable[..., None], world_size: int, *args: Any) -> Any:
    """Run ``worker(rank, world_size, init_file, result_file, *args)`` on ``world_size``
    spawned processes; what rank 0 wrote with ``report`` (JSON)."""
    with tempfile.TemporaryDirectory(prefix="meshpipe-bench-") as scratch:
        init_file, result_file = os.path.join(scratch, "init"), os.path.join(scratch, "result")
        mp.spawn(worker, args=(world_size, init_file, result_file, *args), nprocs=world_size,
                 join=True)
        return json.loads(Path(result_file).read_text())


def join_ranks(rank: int, world_size: int, init_file: str) -> None:
    """This spawned rank's default process group (gloo), in a ``spawn_ranks`` worker."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT)


def report(result_file: str, result: Any) -> None:
    """Rank 0's measurement, for ``spawn_ranks`` to return."""
    Path(result_file).write_text(json.dumps(result))


def publish(name: str, result: Any, table: str, out: Path | None, rehearsal: bool) -> None:
    """Print a GPU benchmark's ``table`` and write it with ``result`` into ``out``, by default
    ``benchmarks/results``; a CPU rehearsal's figures only where ``out`` is given."""
    print(table)
    out = out or (None if rehearsal else RESULTS)
    if out is not None:
        json_path, md_path = write_results(out, name, result, table)
        print(f"wrote {json_path} and {md_path}")


def write_results(out: Path, name: str, result: Any, table: str) -> tuple[Path, Path]:
    """``<out>/<name>.json`` (the result) and ``<out>/<name>.md`` (its table); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(table)
    return json_path, md_path
