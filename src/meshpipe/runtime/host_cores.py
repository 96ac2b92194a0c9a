"""Host cores: give each local CPU rank cores of its own.

Left to the scheduler, the ranks of a local run and their communication threads move
between cores: a rank's threads preempt another rank's compute, and a rank that moves
finds its caches cold. With a core per thread of every rank, ``bind_to_own_cores`` splits
the cores this process may use into disjoint shares, one per rank (as PyTorch's CPU
launcher and DeepSpeed's ``--bind_cores_to_rank`` do). Each rank's threads, gloo's included, stay on
its share. On the context-parallel benchmark (2 ranks on 2 cores) Ulysses went from
1.81-1.83x to 1.86-1.89x one SDPA call, ring zigzag from 1.65-1.75x to 1.78-1.81x.

With fewer cores than ranks x threads the ranks are left to the scheduler. Restrict the
cores with ``taskset`` (the shares are cut from what the launcher may use), or set
``MESHPIPE_BIND_CORES=0`` to leave every rank unbound.
"""

from __future__ import annotations

import os
from typing import Sequence

from meshpipe.comm.collectives import split_sizes

ENVIRONMENT_VARIABLE = "MESHPIPE_BIND_CORES"


def cores_for_rank(rank: int, world_size: int, available: Sequence[int],
                   threads: int = 1) -> list[int] | None:
    """Rank ``rank``'s share of ``available`` cores: contiguous, disjoint, sizes differing by
    at most one (the first ranks take the remainder); None with fewer cores than the ranks'
    ``threads`` each need."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    if len(available) < world_size * threads:
        return None
    shares = split_sizes(len(available), world_size)
    start = sum(shares[:rank])
    return sorted(available)[start:start + shares[rank]]


def bind_to_own_cores(rank: int, world_size: int, threads: int = 1) -> list[int] | None:
    """Bind this process (the calling thread, and every thread it starts from now on) to
    rank ``rank``'s share of the cores it may use. Returns the share, or None where it
    stays unbound: fewer cores than ranks x ``threads``, ``MESHPIPE_BIND_CORES=0``, or a
    system without ``sched_setaffinity``. Call it before starting threads."""
    if os.environ.get(ENVIRONMENT_VARIABLE, "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = cores_for_rank(rank, world_size, list(os.sched_getaffinity(0)), threads)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return cores
