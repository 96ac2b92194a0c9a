"""A mixture's per-source metrics (``--data a:0.7 --data b:0.3``): each source's share of
the step's counted targets and its own loss, over the whole job.

Each microbatch's targets come with each target's source (``SourcedTargets``); the last
stage splits its loss sum by source at the cost of the one loss (``grouped_loss_sums``),
and the sums and counts travel in the step's loss all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshpipe.models.loss import grouped_loss_sums
from meshpipe.parallel import vocab_parallel_cross_entropy
from meshpipe.train.data.sampling import IGNORE_INDEX


@dataclass(frozen=True)
class SourcedTargets:
    """A microbatch's targets and, for each, the index of the source it came from."""

    ids: torch.Tensor
    sources: torch.Tensor


class SourceLosses:
    """The step's loss sum and counted targets per source on this rank."""

    def __init__(self, names: list[str], device: torch.device):
        self.names = names
        self.sums = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.counts = torch.zeros_like(self.sums)

    def reset(self) -> None:
        self.sums.zero_()
        self.counts.zero_()

    def loss_sum(self, logits: torch.Tensor, targets: SourcedTargets, tp_group) -> torch.Tensor:
        """The microbatch's loss sum (``logits``: this rank's vocabulary slice under tensor
        parallelism), its per-source parts recorded."""
        count = len(self.names)
        if tp_group is not None:
            per_token = vocab_parallel_cross_entropy(logits, targets.ids, tp_group)
            sums = per_token.new_zeros(count).index_add(0, targets.sources.reshape(-1),
                                                        per_token.reshape(-1))
        else:
            sums = grouped_loss_sums(logits, targets.ids, targets.sources, count)
        self.add(sums, targets)
        return sums.sum()

    def add(self, sums: torch.Tensor, targets: SourcedTargets) -> None:
        """One microbatch's loss sums per source (this rank's targets)."""
        counted = (targets.ids != IGNORE_INDEX).reshape(-1).to(torch.float64)
        self.sums += sums.detach().to(torch.float64)
        self.counts.index_add_(0, targets.sources.reshape(-1), counted)

    def values(self) -> torch.Tensor:
        """What to add to the step's loss all-reduce."""
        return torch.cat([self.sums, self.counts])

    def metrics(self, reduced: list[float], prefix: str) -> dict[str, float | None]:
        """``<prefix>share_<name>`` (of the counted targets) and ``<prefix>loss_<name>``
        (mean over the source's targets; None without any) from the reduced ``values``."""
        count = len(self.names)
        sums, counts = reduced[:count], reduced[count:]
        total = sum(counts) or 1.0
        record: dict[str, float | None] = {}
        for name, loss_sum, counted in zip(self.names, sums, counts):
            record[f"{prefix}share_{name}"] = counted / total
            record[f"{prefix}loss_{name}"] = loss_sum / counted if counted else None
        return record
