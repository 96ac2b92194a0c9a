"""A rank's gradients after a step's backward: reduced over the ranks that share each weight,
measured (the global norm), clipped, and checked for inf/NaN before any reduction mixes them.

Which group a gradient is summed over follows from the layout: expert weights over the
ranks holding the same experts (averaged over data parallelism), the other weights over
data x context parallelism (averaged over data parallelism), weights whose gradients are
partial over their tensor-parallel group (sequence-parallel norms, per-head norms) over it,
and a weight tied across pipeline stages (the embedding and the head) over the ranks
holding a copy. The global norm counts every weight once: a shard on every rank, a
replicated weight on tp rank 0, a tied weight on its first holder, experts summed over the
expert-parallel ranks.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from meshpipe.comm import ops
from meshpipe.models.moe import is_expert_param
from meshpipe.parallel import is_sequence_parallel_param, shard_dim
from meshpipe.parallel.zero import Bucket, buckets_of
from meshpipe.runtime import all_reduce_gradients
from meshpipe.topology import Topology, new_groups
from meshpipe.train.config import TrainConfig

NamedParameters = Sequence[tuple[str, torch.nn.Parameter]]


class Gradients:
    """The gradients of ``parameters`` (this rank's, once each) in the run's ``topology``,
    in buckets per stage (``parallel.zero``): ``--zero 0`` all-reduces them, 1 and 2
    reduce-scatter them and shard the optimizer states over the replicas (and, where
    ``twin_of`` gives the bfloat16 weight of each float32 master, the masters' values).

    ``stage_params`` maps each stage on this rank to its parameters; ``tied`` are the tied
    weights held by this rank and other pipeline ranks, each with the group of the ranks
    holding a copy (``tied_groups``). A stage's buckets can start reducing as soon as its
    last backward of the step is done (``stage_done``); buckets that need a sum over another
    group first (tied weights, sequence-parallel norms, a weight of two local stages) start
    in ``reduce``, after the pipeline step."""

    def __init__(self, config: TrainConfig, topology: Topology, parameters: NamedParameters,
                 tied: list[tuple[torch.nn.Parameter, Any]], device: torch.device,
                 stage_params: dict[int, list[torch.nn.Parameter]],
                 twin_of: Callable[[torch.nn.Parameter], torch.nn.Parameter] | None = None,
                 lr_scale_of: Callable[[str], float] = lambda name: 1.0):
        self.config = config
        self.topology = topology
        self.parameters = list(parameters)
        self._lr_scale = {id(param): lr_scale_of(name) for name, param in self.parameters}
        self.tied = tied
        self.device = device
        self.tp_group = topology.tp_group if topology.tp_size > 1 else None
        # Tied weights held on several ranks: only the group's first rank counts in the norm.
        self._tied_copies = {id(p) for p, group in tied if dist.get_rank(group) != 0}
        self._tied_group = {id(p): group for p, group in tied}
        self._twin_of = twin_of
        self.buckets = self._buckets(stage_params)
        bucketed = {id(p) for bucket in self.buckets for p in bucket.params}
        self._unbucketed = [p for p in self.params if id(p) not in bucketed]
        self._whole = False

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.parameters]

    @property
    def update_params(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: each bucket's shard pieces (or its parameters whole),
        and the parameters that take no gradient."""
        return [p for bucket in self.buckets for p in bucket.update_parameters] + \
            self._unbucketed

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: ``update_params`` by learning-rate factor
        (``lr_scale``; a bucket holds weights of one factor, so its shard pieces do too)."""
        groups: dict[float, list[torch.nn.Parameter]] = {}
        for bucket in self.buckets:
            groups.setdefault(self._lr_scale[id(bucket.params[0])], []).extend(
                bucket.update_parameters)
        for param in self._unbucketed:
            groups.setdefault(self._lr_scale[id(param)], []).append(param)
        return [{"params": params, "lr_scale": scale} for scale, params in groups.items()]

    @property
    def sharded(self) -> bool:
        return any(bucket.sharded for bucket in self.buckets)

    def _replicas(self, param: torch.nn.Parameter) -> tuple[Any, bool]:
        """The group a gradient is summed over (None: no other replica) and whether it is an
        expert weight with a group of its own."""
        config = self.config
        if config.ep > 1 and is_expert_param(param):
            return self.topology.expert_dp_group, True
        return (self.topology.dp_cp_group if config.dp * config.layout.cp > 1 else None), False

    def _needs_first(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s gradient is summed over another group before its replicas'."""
        return id(param) in self._tied_group or (
            self.tp_group is not None and is_sequence_parallel_param(param))

    def _buckets(self, stage_params: dict[int, list[torch.nn.Parameter]]) -> list[Bucket]:
        """Buckets per stage, replica group and whether they wait for ``reduce``."""
        seen: dict[int, int] = {}
        for stage, params in stage_params.items():
            for param in params:
                seen[id(param)] = seen.get(id(param), 0) + 1
        buckets: list[Bucket] = []
        placed: set[int] = set()
        for stage, params in stage_params.items():
            runs: dict[tuple[bool, bool, float], list[torch.nn.Parameter]] = {}
            for param in params:
                if not param.requires_grad or id(param) in placed:
                    continue
                placed.add(id(param))
                deferred = self._needs_first(param) or seen[id(param)] > 1
                key = (self._replicas(param)[1], deferred, self._lr_scale[id(param)])
                runs.setdefault(key, []).append(param)
            for (_, deferred, _), run in runs.items():
                group = self._replicas(run[0])[0]
                before = (lambda run=run: self._sum_first(run)) if deferred else None
                buckets += buckets_of(run, group, scale=1.0 / self.config.dp,
                                      zero=self.config.zero, stage=stage, deferred=deferred,
                                      before=before, twin_of=self._twin_of)
        return buckets

    def _sum_first(self, params: list[torch.nn.Parameter]) -> None:
        """The sums a deferred bucket's gradients take before their replicas': over the tp
        ranks (weights whose gradients are partial there: sequence-parallel norms, per-head
        norms) and over the holders of a tied weight."""
        if self.tp_group is not None:
            all_reduce_gradients([p for p in params if is_sequence_parallel_param(p)],
                                 self.tp_group)
        for param in params:
            if id(param) in self._tied_group:
                all_reduce_gradients([param], self._tied_group[id(param)])

    def stage_done(self, stage: int) -> None:
        """Start reducing the buckets of ``stage`` (its gradients of the step are final)."""
        for bucket in self.buckets:
            if bucket.stage == stage and not bucket.deferred and not bucket.started:
                bucket.start()

    def reduce(self, *, whole: bool = False) -> None:
        """Sum (or average) every gradient over the ranks that share its weight. ``whole``
        keeps whole gradients even under --zero 1/2 (the --check step)."""
        self._whole = whole or not self.sharded
        for bucket in self.buckets:
            if whole and bucket.started:
                raise RuntimeError("reduce(whole=True) after a stage's buckets started: run "
                                   "the --check step without stage hooks")
            if not bucket.started:
                bucket.start(whole=whole)
        for bucket in self.buckets:
            bucket.finish()

    @property
    def held(self) -> list[torch.nn.Parameter]:
        """The tensors whose ``.grad`` hold this rank's reduced gradients: the shard pieces
        after a sharded reduction, else the parameters."""
        return self.params if self._whole else self.update_params

    def norm(self) -> float:
        """The global gradient norm over the whole model (each weight counted once).

        Each gradient's norm comes from one ``_foreach_norm`` over all of them (a few kernels
        a step, where a norm per tensor launched four for each and copied it to float64);
        their squares are summed in float64."""
        # [expert?, from a shard?]: shards are summed over their replicas first.
        grads: dict[tuple[bool, bool], list[torch.Tensor]] = {
            (e, s): [] for e in (False, True) for s in (False, True)}
        if self._whole:
            for param in self.params:
                self._add_grad(grads, param, param.grad, from_shard=False)
        else:
            for bucket in self.buckets:
                self._add_bucket_grads(grads, bucket)
        sums = {key: _sum_of_squares(found, self.device) for key, found in grads.items()}
        if not self._whole:
            for expert in (False, True):
                if any(b.sharded and self._replicas(b.params[0])[1] == expert
                       for b in self.buckets):
                    group = (self.topology.expert_dp_group if expert
                             else self.topology.dp_cp_group)
                    ops.all_reduce(sums[expert, True], group=group)
        total = sums[False, False] + sums[False, True]
        experts = sums[True, False] + sums[True, True]
        if self.config.ep > 1:
            ops.all_reduce(experts, group=self.topology.ep_group)
        total += experts
        ops.all_reduce(total, group=self.topology.model_group)
        return math.sqrt(total.item())

    def _add_bucket_grads(self, grads: dict, bucket: Bucket) -> None:
        if not bucket.sharded:
            for param in bucket.params:
                self._add_grad(grads, param, param.grad, from_shard=False)
            return
        for piece, view in zip(bucket.pieces, bucket.piece_params):
            self._add_grad(grads, piece.param, view.grad, from_shard=True)

    def _add_grad(self, grads: dict, param: torch.nn.Parameter, grad: torch.Tensor | None,
                  *, from_shard: bool) -> None:
        if grad is None or not self._counts_in_norm(param):
            return
        expert = self.config.ep > 1 and is_expert_param(param)
        grads[expert, from_shard].append(grad)

    def _counts_in_norm(self, param: torch.nn.Parameter) -> bool:
        if id(param) in self._tied_copies:
            return False
        return shard_dim(param) is not None or self.topology.tp_rank == 0

    def clip(self, norm: float) -> None:
        """Scale the gradients down to ``--grad-clip`` where the norm is above it (one
        ``_foreach_mul_``)."""
        limit = self.config.grad_clip
        if limit > 0 and norm > limit:
            grads = [p.grad for p in self.held if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, limit / (norm + 1e-6))

    def start_gathers(self) -> None:
        """After the optimizer updated the shards: start all-gathering the weights."""
        for bucket in self.buckets:
            bucket.start_gather()

    def weights_of(self, stage: int) -> None:
        """Wait for ``stage``'s gathered weights (before its first forward)."""
        for bucket in self.buckets:
            if bucket.stage == stage:
                bucket.finish_gather()

    def all_weights(self) -> None:
        """Wait for every gathered weight (before an evaluation, a save, the end)."""
        for bucket in self.buckets:
            bucket.finish_gather()

    def zero(self) -> None:
        """Drop every gradient: the parameters' and the shard pieces'."""
        for param in self.params + self.update_params:
            param.grad = None

    def all_finite(self) -> torch.Tensor:
        """Whether this rank's own gradients are finite (before the reductions mix every
        rank's in, so a report can say where a NaN came from), as a bool tensor on the
        device: read only when a step turns out non-finite, since reading it would make the
        host wait for the device every step."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.ones((), dtype=torch.bool, device=self.device)
        return torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squared norms of ``grads`` in float64, shape ``[1]`` (zero if none)."""
    if not grads:
        return torch.zeros(1, dtype=torch.float64, device=device)
    with torch.no_grad():
        norms = torch.stack(torch._foreach_norm(grads)).double()
        return norms.pow(2).sum().reshape(1)


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
