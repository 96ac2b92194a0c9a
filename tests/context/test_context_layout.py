"""The token layout of a context-parallel group (``context.layout.gather_layout``): every
rank learns every rank's positions, in one all-gather when each rank's positions are one
run of consecutive indices, in two otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshpipe.context.layout import gather_layout
from meshpipe.testing import run_distributed

# Per case, each rank's positions (None: the group holds one sequence split in rank order).
CASES = {
    "contiguous split": ([0, 1, 2], [3, 4, 5, 6]),
    "runs out of rank order": ([10, 11, 12], [0, 1]),
    "no positions": (None, None),
    "a run and an empty rank": ([0, 1, 2, 3], []),
    "zigzag": ([0, 1, 6, 7], [2, 3, 4, 5]),
    "one rank not a run": ([0, 1, 2], [5, 3, 4]),
}


def _layouts(rank: int, world: int) -> dict[str, tuple[list[list[int]], int]]:
    calls = []
    original = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_gather = counting
    try:
        seen = {}
        for name, per_rank in CASES.items():
            mine = per_rank[rank]
            positions = None if mine is None else torch.tensor(mine, dtype=torch.int64)
            seq_local = (3, 4)[rank] if mine is None else len(mine)
            before = len(calls)
            layout = gather_layout(positions, None, seq_local, {"batch": 1}, None,
                                   f"test (rank {rank})", torch.device("cpu"))
            seen[name] = ([p.tolist() for p in layout.positions], len(calls) - before)
        return seen
    finally:
        dist.all_gather = original


@pytest.mark.distributed
def test_runs_travel_in_the_first_exchange_and_other_positions_in_a_second():
    per_rank = run_distributed(2, _layouts)
    expected_calls = {"contiguous split": 1, "runs out of rank order": 1, "no positions": 1,
                      "a run and an empty rank": 1, "zigzag": 2, "one rank not a run": 2}
    for name, per_rank_positions in CASES.items():
        want = ([[0, 1, 2], [3, 4, 5, 6]] if per_rank_positions[0] is None
                else [list(p) for p in per_rank_positions])
        for rank, seen in enumerate(per_rank):
            assert seen[name] == (want, expected_calls[name]), (rank, name)
