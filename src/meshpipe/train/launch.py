"""Starting the processes of a run: N local CPU processes, or the ones torchrun started.

``launch(fn, world_size, *args)`` runs ``fn(*args)`` on every rank with the default process
group initialised. Locally it spawns ``world_size`` processes (gloo, CPU, one thread each);
under ``torchrun`` (RANK/WORLD_SIZE in the environment) it runs in the current process with
NCCL when CUDA is present. A rank that raises stops the whole run: the other processes are
terminated and ``LaunchError`` names the rank that failed first with its traceback (other
ranks typically fail next with "connection closed" errors; those are listed after it).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.multiprocessing.spawn import ProcessException

from meshpipe.runtime.executor import PeerFailedError

PROCESS_GROUP_TIMEOUT_S = 60.0
# What gloo says on the ranks left behind when a peer's process exits.
_PEER_GONE_SIGNS = ("Connection closed by peer", "Connection reset by peer")


class LaunchError(RuntimeError):
    """A rank of a local run failed; ``rank`` is the first one that did."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def device_for_this_rank() -> torch.device:
    """Under torchrun, CUDA device LOCAL_RANK where CUDA exists; otherwise the CPU.

    Local runs are CPU processes by design (one per rank, any count), also on a machine
    with GPUs: use torchrun to place one rank per GPU.
    """
    if under_torchrun() and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def launch(fn: Callable[..., Any], world_size: int, *args: Any, threads_per_process: int = 1,
           timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> None:
    """Run ``fn(*args)`` on ``world_size`` ranks (see the module docstring)."""
    if under_torchrun():
        launched = int(os.environ["WORLD_SIZE"])
        if launched != world_size:
            raise LaunchError(f"torchrun started {launched} processes but this run needs "
                              f"{world_size}; pass --nproc-per-node/--nnodes that multiply to "
                              f"{world_size}", rank=int(os.environ["RANK"]))
        _run_rank(int(os.environ["RANK"]), fn, args, None, world_size, threads_per_process,
                  timeout_s)
        return
    with tempfile.TemporaryDirectory(prefix="meshpipe-launch-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        error_dir = Path(tmp)
        try:
            torch_mp.start_processes(
                _run_rank, args=(fn, args, init_method, world_size, threads_per_process,
                                 timeout_s, error_dir),
                nprocs=world_size, join=True, start_method="spawn")
        except ProcessException as error:
            raise _first_failure(error_dir, error) from None


def _is_consequence(error: BaseException) -> bool:
    """Whether ``error`` only reports that another rank failed first."""
    return isinstance(error, PeerFailedError) or any(
        sign in str(error) for sign in _PEER_GONE_SIGNS)


def _first_failure(error_dir: Path, error: ProcessException) -> LaunchError:
    """The earliest failure that is not a consequence of another rank's (torch only reports
    the first process it noticed; a neighbour stopped by the failure may record first)."""
    records = sorted((json.loads(p.read_text()) for p in error_dir.glob("error-*.json")),
                     key=lambda r: r["time"])
    if not records:
        return LaunchError(f"rank {error.error_index} exited abnormally: {error.msg}",
                           error.error_index)
    causes = [r for r in records if not r["consequence"]]
    first = (causes or records)[0]
    later = [r for r in records if r is not first]
    message = f"rank {first['rank']} failed:\n{first['traceback']}"
    if later:
        message += ("then ranks " + ", ".join(str(r["rank"]) for r in later)
                    + " failed in consequence (first lines: "
                    + "; ".join(r["traceback"].strip().splitlines()[-1][:160] for r in later) + ")")
    return LaunchError(message, first["rank"])


def _run_rank(rank: int, fn: Callable[..., Any], args: tuple, init_method: str | None,
              world_size: int, threads: int, timeout_s: float,
              error_dir: Path | None = None) -> None:
    torch.set_num_threads(threads)
    device = device_for_this_rank()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method or "env://",
                            rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(*args)
    except BaseException as error:
        # Recorded before the group is torn down, which is what makes the other ranks fail.
        if error_dir is not None:
            record = {"rank": rank, "time": time.time(), "traceback": traceback.format_exc(),
                      "consequence": _is_consequence(error)}
            (error_dir / f"error-{rank}.json").write_text(json.dumps(record))
        raise
    finally:
        dist.destroy_process_group()
