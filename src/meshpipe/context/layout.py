"""Which tokens every rank of a context-parallel group holds.

Before a context-parallel attention moves any activation, the ranks of the group exchange
their local sequence length, the shapes they were given and their ``positions`` /
``doc_ids`` (small int64 tensors). Every rank then knows the mask of every block, and a
rank whose shapes disagree with its peers' makes *every* rank raise the same clear error
instead of one rank hanging in a mismatched send. Positions that are one run of
consecutive indices on every rank (a contiguous split) travel as their first index in that
first exchange, which saves a second one.

A layout is gathered once for the ``positions`` / ``doc_ids`` tensor objects and the shapes
it was gathered for (``derived``): every layer of a microbatch, and every microbatch of a
run whose positions tensor is reused, shares it, instead of an exchange and a host
synchronisation in every layer. The ranks of a group hold the same microbatch, so they
change those tensors and shapes together, and gather together. (Without ``positions``
every call gathers: the shapes alone would let one rank skip an exchange that its peers,
given other lengths, make.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from meshpipe.comm import ops

from .derived import derived
from .interface import AttentionError, check_attention_inputs


@dataclass(frozen=True)
class GroupLayout:
    """The tokens of each rank of a group, in group-rank order."""

    sizes: list[int]
    positions: list[Tensor]
    doc_ids: list[Tensor] | None

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def gathered_positions(self) -> Tensor:
        """Positions of the group's whole sequence, rank 0's tokens first (one tensor, made
        at the first call)."""
        return self._gathered_positions

    def gathered_doc_ids(self) -> Tensor | None:
        return self._gathered_doc_ids

    @cached_property
    def _gathered_positions(self) -> Tensor:
        return torch.cat(self.positions)

    @cached_property
    def _gathered_doc_ids(self) -> Tensor | None:
        return None if self.doc_ids is None else torch.cat(self.doc_ids)


def _all_gather_equal(tensor: Tensor, group: dist.ProcessGroup | None) -> list[Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    ops.all_gather(parts, tensor, group=group)
    return parts


def _all_gather_ragged(tensor: Tensor, sizes: list[int],
                       group: dist.ProcessGroup | None) -> list[Tensor]:
    """All-gather 1-D tensors of different lengths (padded in transit: they are tiny metadata)."""
    padded = torch.zeros(max(sizes), dtype=torch.int64, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    return [part[:size] for part, size in zip(_all_gather_equal(padded, group), sizes)]


def _run_start(positions: Tensor) -> int:
    """The first of ``positions`` if they are consecutive increasing indices from a
    non-negative start (0 when there are none), else -1."""
    if positions.numel() == 0:
        return 0
    start = int(positions[0])
    run = torch.arange(start, start + positions.numel(), device=positions.device)
    return start if start >= 0 and torch.equal(positions.to(torch.int64), run) else -1


def gather_layout(positions: Tensor | None, doc_ids: Tensor | None, seq_local: int,
                  signature: dict[str, int], group: dist.ProcessGroup | None,
                  where: str, device: torch.device) -> GroupLayout:
    """Exchange every rank's tokens and check that ``signature`` (named sizes) agrees across ranks.

    ``positions=None`` means the group holds one sequence split contiguously in rank order,
    so rank ``i``'s tokens are the global indices following those of ranks ``0..i-1``.
    """
    run_start = None if positions is None else _run_start(positions)
    # Per rank: its length, and the first position of its run (-1: not a run); then what
    # every rank must agree on.
    names = ["has positions", "has doc_ids", *signature]
    values = [seq_local, -1 if run_start is None else run_start,
              positions is not None, doc_ids is not None, *signature.values()]
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    table = torch.stack(_all_gather_equal(mine, group)).tolist()
    for column, name in enumerate(names, start=2):
        column_values = [row[column] for row in table]
        if len(set(column_values)) > 1:
            raise AttentionError(
                f"{where}: ranks of the context-parallel group disagree on {name}: "
                f"{column_values} (by group rank); every rank must pass the same shapes and "
                f"the same optional inputs")
    sizes = [row[0] for row in table]
    if positions is None:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
    else:
        starts = [row[1] for row in table]
    if min(starts) >= 0:
        all_positions = [torch.arange(start, start + size, device=device)
                         for start, size in zip(starts, sizes)]
    else:
        all_positions = _all_gather_ragged(positions.to(torch.int64), sizes, group)
    all_doc_ids = None if doc_ids is None else _all_gather_ragged(doc_ids.to(torch.int64), sizes,
                                                                  group)
    return GroupLayout(sizes=sizes, positions=all_positions, doc_ids=all_doc_ids)


def attention_layout(name: str, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None,
                     doc_ids: Tensor | None, causal: bool, group: dist.ProcessGroup | None
                     ) -> tuple[GroupLayout, str]:
    """Check a context-parallel attention call and gather the group's token layout.

    Returns the layout and the ``where`` prefix (``name`` and this rank) for error messages.
    """
    where = f"{name} (rank {dist.get_rank()})"
    check_attention_inputs(q, k, v, positions, doc_ids, where)
    batch, seq_local, heads_q, head_dim = q.shape
    signature = {"batch": batch, "query heads": heads_q, "key/value heads": k.shape[2],
                 "head_dim": head_dim, "causal": causal}

    def gather() -> GroupLayout:
        return gather_layout(positions, doc_ids, seq_local, signature, group, where, q.device)
    if positions is None:
        return gather(), where
    key = ("group layout", id(group), dist.get_world_size(group), dist.get_rank(group),
           q.device, *signature.values())
    return derived(key, (positions, doc_ids), gather), where
