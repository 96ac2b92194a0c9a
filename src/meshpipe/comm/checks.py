"""Shape checks of collectives, and the group helpers the collectives share.

A rank passing a shape its peers do not expect makes gloo abort the process (or NCCL hang).
With the environment variable ``MESHPIPE_CHECK_COLLECTIVES=1`` (``checks_enabled``) the
collectives exchange shapes first (``exchange_shapes``, one small all-gather) and every rank
raises the same ``CollectiveShapeError`` naming every rank's shape instead.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from meshpipe.comm import ops

CHECK_ENV = "MESHPIPE_CHECK_COLLECTIVES"
MAX_EXCHANGED_INTS = 32


class CollectiveShapeError(ValueError):
    """The ranks of a group passed shapes that do not fit one collective."""


def checks_enabled() -> bool:
    """Whether ``MESHPIPE_CHECK_COLLECTIVES`` asks for the shape checks."""
    return os.environ.get(CHECK_ENV, "0") not in ("", "0")


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group)


def normalize_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}: dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def exchange_ints(values: Sequence[int], group: dist.ProcessGroup | None, what: str,
                   device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (fewer than 32 ints), in group-rank order."""
    if len(values) >= MAX_EXCHANGED_INTS:
        raise ValueError(f"{what}: cannot check shapes of tensors with this many dims "
                         f"({len(values)} values to exchange)")
    mine = torch.zeros(MAX_EXCHANGED_INTS, dtype=torch.int64, device=device)
    mine[0] = len(values)
    mine[1:len(values) + 1] = torch.tensor(list(values), dtype=torch.int64, device=device)
    table = torch.empty(group_size(group) * MAX_EXCHANGED_INTS, dtype=torch.int64,
                        device=device)
    ops.all_gather_into(table, mine, group=group)
    rows = table.view(group_size(group), MAX_EXCHANGED_INTS).tolist()
    return [row[1:row[0] + 1] for row in rows]


def exchange_shapes(x: Tensor, group: dist.ProcessGroup | None, what: str) -> list[list[int]]:
    return exchange_ints(list(x.shape), group, what, x.device)


def require_same_except(shapes: list[list[int]], dim: int, what: str) -> None:
    """Every rank has the same shape except (possibly) along ``dim``."""
    masked = [shape[:dim] + shape[dim + 1:] if len(shape) > dim else shape for shape in shapes]
    if any(len(shape) != len(shapes[0]) for shape in shapes) or len(
            {tuple(shape) for shape in masked}) > 1:
        raise CollectiveShapeError(
            f"{what}: the ranks' shapes {shapes} (by group rank) must agree on every dim "
            f"except dim {dim}; pass tensors of matching shapes on every rank")


def require_sizes_along(shapes: list[list[int]], dim: int, expected: list[int],
                         what: str) -> None:
    found = [shape[dim] for shape in shapes]
    if found != expected:
        raise CollectiveShapeError(
            f"{what}: the ranks hold {found} elements along dim {dim} (by group rank) but "
            f"{expected} were expected; pass matching sizes on every rank")
