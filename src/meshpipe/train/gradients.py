"""A rank's gradients after a step's backward: reduced over the ranks that share each weight,
measured (the global norm), clipped, and checked for inf/NaN before any reduction mixes them.

Which group a gradient is summed over follows from the layout: expert weights over the
ranks holding the same experts (averaged over data parallelism), the other weights over
data x context parallelism (averaged over data parallelism), sequence-parallel weights over
their tensor-parallel group, and a weight tied across pipeline stages (the embedding and the
head) over the ranks holding a copy. The global norm counts every weight once: a shard on
every rank, a replicated weight on tp rank 0, a tied weight on its first holder, experts
summed over the expert-parallel ranks.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from meshpipe.comm import ops
from meshpipe.models.moe import is_expert_param
from meshpipe.parallel import is_sequence_parallel_param, shard_dim
from meshpipe.runtime import all_reduce_gradients
from meshpipe.topology import Topology, new_groups
from meshpipe.train.config import TrainConfig

NamedParameters = Sequence[tuple[str, torch.nn.Parameter]]


class Gradients:
    """The gradients of ``parameters`` (this rank's, once each) in the run's ``topology``.

    ``tied`` are the tied weights held by this rank and other pipeline ranks, each with the
    group of the ranks holding a copy (``tied_groups``)."""

    def __init__(self, config: TrainConfig, topology: Topology, parameters: NamedParameters,
                 tied: list[tuple[torch.nn.Parameter, Any]], device: torch.device):
        self.config = config
        self.topology = topology
        self.parameters = list(parameters)
        self.tied = tied
        self.device = device
        self.tp_group = topology.tp_group if topology.tp_size > 1 else None
        # Tied weights held on several ranks: only the group's first rank counts in the norm.
        self._tied_copies = {id(p) for p, group in tied if dist.get_rank(group) != 0}

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.parameters]

    def reduce(self) -> None:
        """Sum (or average) every gradient over the ranks that share its weight."""
        params = self.params
        config = self.config
        if config.ep > 1:
            all_reduce_gradients([p for p in params if is_expert_param(p)],
                                 self.topology.expert_dp_group, scale=1.0 / config.dp)
            params = [p for p in params if not is_expert_param(p)]
        if config.dp * config.layout.cp > 1:
            all_reduce_gradients(params, self.topology.dp_cp_group, scale=1.0 / config.dp)
        if self.tp_group is not None and config.sequence_parallel:
            all_reduce_gradients([p for p in params if is_sequence_parallel_param(p)],
                                 self.tp_group)
        for param, group in self.tied:
            all_reduce_gradients([param], group)

    def norm(self) -> float:
        """The global gradient norm over the whole model (each weight counted once)."""
        def sum_of_squares(experts: bool) -> torch.Tensor:
            squares = [p.grad.detach().double().pow(2).sum() for p in self.params
                       if p.grad is not None and self._counts_in_norm(p)
                       and is_expert_param(p) == experts]
            return (torch.stack(squares).sum() if squares
                    else torch.zeros((), dtype=torch.float64, device=self.device)).reshape(1)

        total = sum_of_squares(experts=False)
        if self.config.ep > 1:
            experts = sum_of_squares(experts=True)
            ops.all_reduce(experts, group=self.topology.ep_group)
            total += experts
        else:
            total += sum_of_squares(experts=True)
        ops.all_reduce(total, group=self.topology.model_group)
        return math.sqrt(total.item())

    def _counts_in_norm(self, param: torch.nn.Parameter) -> bool:
        if id(param) in self._tied_copies:
            return False
        return shard_dim(param) is not None or self.topology.tp_rank == 0

    def clip(self, norm: float) -> None:
        """Scale the gradients down to ``--grad-clip`` where the norm is above it."""
        limit = self.config.grad_clip
        if limit > 0 and norm > limit:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(limit / (norm + 1e-6))

    def all_finite(self) -> bool:
        """Whether this rank's own gradients are finite (before the reductions mix every
        rank's in, so a report can say where a NaN came from)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return True
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))


def tied_groups(shared_parameters, chunks: dict[int, torch.nn.Module], held_stages,
                placement: Sequence[int], config: TrainConfig,
                rank: int) -> list[tuple[torch.nn.Parameter, Any]]:
    """For each tied parameter split over pipeline ranks: this rank's copy and the group of
    the ranks holding a copy (created collectively, for every pipeline)."""
    mine = []
    layout = config.layout
    for shared in shared_parameters:
        positions = sorted({placement[stage] for stage in shared.stages})
        if len(positions) < 2:
            continue
        holders = []
        for pipeline in layout.group_ranks(["pp"]):
            at = {layout.coords(r)["pp"]: r for r in pipeline}
            if all(p in at for p in positions):
                holders.append([at[p] for p in positions])
        group = new_groups(holders, rank)
        if group is not None:
            stage, name = next((s, n) for s, n in shared.locations if s in held_stages)
            mine.append((chunks[stage].get_parameter(name), group))
    return mine
