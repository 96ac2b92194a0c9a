"""Gradients reduced in flat buckets, and the optimizer states sharded over the replicas of
each weight (ZeRO-1/2, Megatron's distributed optimizer; the levels are
``schedules.ranking.ZERO_LEVELS``, beside their memory model).

A ``Bucket`` holds parameters of one stage, one dtype and one replica group (the ranks that
hold the same weights and sum their gradients) laid end to end in a flat buffer padded to a
multiple of the group size. Each rank of the group *owns* one contiguous shard of it.

- ``zero=0``: the bucket's gradients are all-reduced and every rank keeps them whole.
- ``zero=1``: they are reduce-scattered: a rank keeps the sum of its own shard only, and its
  optimizer holds the moments of that shard only (``update_parameters``: one view per piece
  of a parameter inside the shard, sharing the parameter's storage, so the update writes
  the rank's own slice of the weights in place); after the update, ``start_gather``
  all-gathers the shards into every rank's weights.
- ``zero=2``: as 1, and the whole gradients are freed as soon as the bucket is reduced.
- With ``twins`` (``--dtype bf16``: the parameters are float32 masters of the bfloat16
  weights the model computes with), a sharded bucket holds the masters' values of its own
  shard only and the masters none (Megatron's distributed optimizer): the update writes
  that shard, and the all-gather sends it in bfloat16 straight into the twins; a
  checkpoint gathers the whole values (``OptimizerMoments.value_of``).

``start`` only starts the bucket's collectives (asynchronously), so the pipeline can start
a stage's buckets as soon as its gradients are final and go on with its remaining work;
``finish`` waits and hands out the results. A parameter that no rank of the group had a
gradient for keeps ``.grad = None`` (and its pieces too), so AdamW skips it exactly as it
would with one replica. Bucketing and sharding change no value: the sums are those of one
all-reduce and the update is element-wise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from meshpipe.comm import ops

# A bucket's gradients in bytes before a new one starts: large enough that a collective
# is not latency-bound, small enough that reductions start while the backward runs on.
BUCKET_BYTES = 32 * 2**20
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
_ALONE = ("a bucket without other replicas: nothing to reduce",)


@dataclass(frozen=True)
class Piece:
    """The part of ``param`` (elements ``start`` to ``start + length`` of it flattened) that
    lies in this rank's shard, at ``offset`` of the shard."""

    param: torch.nn.Parameter
    start: int
    length: int
    offset: int


class Bucket:
    """Parameters of one stage, dtype and replica group, reduced together (module docstring).

    ``group`` None (or a group of one) means nothing to reduce; ``scale`` multiplies the sum
    (1/dp averages over data-parallel replicas); ``before`` runs on the whole gradients
    before they are reduced (extra sums over other groups: tied weights, sequence-parallel
    norms); ``deferred`` buckets start only when the step's reduction is asked for."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 *, scale: float, zero: int, stage: int, deferred: bool = False,
                 before: Callable[[], None] | None = None,
                 twins: Sequence[torch.nn.Parameter] | None = None):
        self.params = list(params)
        self.group = group
        self.scale = scale
        self.stage = stage
        self.deferred = deferred
        self.before = before
        self.size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        self.zero = zero if self.size > 1 else 0
        self.offsets = []
        numel = 0
        for param in self.params:
            if not param.is_contiguous():
                raise ValueError(f"a bucketed parameter must be contiguous (shape "
                                 f"{tuple(param.shape)}); call .contiguous() on the weights")
            self.offsets.append(numel)
            numel += param.numel()
        self.numel = numel
        self.shard_numel = -(-numel // self.size)
        self.pieces = self._pieces(rank * self.shard_numel) if self.zero else []
        # With twins (bf16 weights the model computes with, one per float32 master in
        # ``params``) a sharded bucket keeps the masters' values of its own shard only.
        self.twins = list(twins) if twins is not None and self.zero else None
        self._values = self._own_values() if self.twins is not None else None
        self.piece_params = [torch.nn.Parameter(
            self._values.narrow(0, piece.offset, piece.length) if self._values is not None
            else piece.param.detach().view(-1).narrow(0, piece.start, piece.length))
            for piece in self.pieces]
        # (the sum's handle, the counts' handle, the result, the counts, whether the result
        # is this rank's shard) while a reduction is under way
        self._reduction: tuple[Any, ...] | None = None
        self._gather: tuple[Any, torch.Tensor] | None = None

    def _pieces(self, begin: int) -> list[Piece]:
        end = begin + self.shard_numel
        pieces = []
        for param, offset in zip(self.params, self.offsets):
            first, last = max(begin, offset), min(end, offset + param.numel())
            if first < last:
                pieces.append(Piece(param, first - offset, last - first, first - begin))
        return pieces

    def _own_values(self) -> torch.Tensor:
        """This rank's shard of the parameters' values (float32 masters), padding zeroed."""
        param = self.params[0]
        values = torch.zeros(self.shard_numel, dtype=param.dtype, device=param.device)
        for piece in self.pieces:
            values.narrow(0, piece.offset, piece.length).copy_(
                piece.param.detach().view(-1).narrow(0, piece.start, piece.length))
        return values

    @property
    def sharded(self) -> bool:
        return self.zero > 0

    @property
    def owns_values(self) -> bool:
        """Whether the values of ``params`` live here, a shard per rank (``twins``): the
        parameters themselves then hold none (``MasterWeights.release``)."""
        return self._values is not None

    @property
    def update_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps for this bucket: the pieces of the rank's shard, or the
        parameters whole."""
        return self.piece_params if self.sharded else self.params

    @property
    def started(self) -> bool:
        return self._reduction is not None

    def start(self, *, whole: bool = False) -> None:
        """Start reducing the gradients; ``whole`` all-reduces them even when sharded (the
        --check step compares whole gradients)."""
        if self.before is not None:
            self.before()
        if self.size == 1:  # nothing to sum: finish only scales in place
            self._reduction = _ALONE
            return
        device = self.params[0].device
        had = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32,
                           device=device)
        flat = self._flat_gradients()
        counted = ops.all_reduce_started(had, group=self.group)
        if self.sharded and not whole:
            shard = torch.empty(self.shard_numel, dtype=flat.dtype, device=device)
            summed = ops.reduce_scatter_started(shard, flat, group=self.group)
            self._reduction = (summed, counted, shard, had, True)
        else:
            self._reduction = (ops.all_reduce_started(flat, group=self.group), counted, flat,
                               had, False)

    def _flat_gradients(self) -> torch.Tensor:
        """The gradients end to end (zeros where a parameter has none, then the padding),
        written once: one concatenation, not a zeroed buffer filled piece by piece."""
        dtype, device = self.params[0].dtype, self.params[0].device
        parts = [p.grad.reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=dtype, device=device) for p in self.params]
        padding = self.shard_numel * self.size - self.numel
        if padding:
            parts.append(torch.zeros(padding, dtype=dtype, device=device))
        return torch.cat(parts)

    def finish(self) -> None:
        """Wait for the reduction (starting it if nobody did) and hand out the gradients."""
        if self._reduction is None:
            self.start()
        if self._reduction is _ALONE:
            self._reduction = None
            for param in self.params:
                if param.grad is not None and self.scale != 1.0:
                    param.grad.mul_(self.scale)
            return
        summed, counted, result, had, is_shard = self._reduction
        self._reduction = None
        summed.wait()
        counted.wait()
        if self.scale != 1.0:
            result.mul_(self.scale)
        had_any = (had > 0).tolist()
        if not is_shard:
            self._hand_out_whole(result, had_any)
            return
        index = {id(param): i for i, param in enumerate(self.params)}
        for piece, view in zip(self.pieces, self.piece_params):
            view.grad = (result.narrow(0, piece.offset, piece.length)
                         if had_any[index[id(piece.param)]] else None)
        if self.zero == 2:
            for param in self.params:
                param.grad = None

    def _hand_out_whole(self, flat: torch.Tensor, had_any: list[bool]) -> None:
        for param, offset, had in zip(self.params, self.offsets, had_any):
            param.grad = flat[offset:offset + param.numel()].view_as(param) if had else None

    def start_gather(self) -> None:
        """After the optimizer updated this rank's shard: start all-gathering the shards
        (into the twins, in their dtype, where there are twins)."""
        if not self.sharded:
            return
        if self._values is not None:
            shard = self._values.to(self.twins[0].dtype)
        else:
            held = sum(piece.length for piece in self.pieces)
            shard = torch.cat([view.detach() for view in self.piece_params]
                              + [self.params[0].new_zeros(self.shard_numel - held)])
        whole = torch.empty(self.shard_numel * self.size, dtype=shard.dtype, device=shard.device)
        self._gather = (ops.all_gather_started(whole, shard, group=self.group), whole)

    def finish_gather(self) -> None:
        """Wait for the gathered weights and write every rank's shard into them."""
        if self._gather is None:
            return
        work, whole = self._gather
        self._gather = None
        work.wait()
        targets = self.twins if self.twins is not None else self.params
        with torch.no_grad():
            for target, offset in zip(targets, self.offsets):
                target.view(-1).copy_(whole[offset:offset + target.numel()])

    def whole_values(self) -> dict[int, torch.Tensor]:
        """Every parameter's value whole, gathered from the shards this bucket owns:
        ``id(param)`` -> tensor. A collective over the group."""
        whole = torch.empty(self.shard_numel * self.size, dtype=self._values.dtype,
                            device=self._values.device)
        ops.all_gather_into(whole, self._values, group=self.group)
        return {id(param): whole[offset:offset + param.numel()].view(param.shape).clone()
                for param, offset in zip(self.params, self.offsets)}

    def load_values(self, whole: dict[int, torch.Tensor]) -> None:
        """Set this rank's shard and the twins from whole per-parameter values."""
        with torch.no_grad():
            for piece in self.pieces:
                self._values.narrow(0, piece.offset, piece.length).copy_(
                    whole[id(piece.param)].reshape(-1).narrow(0, piece.start, piece.length))
            for param, twin in zip(self.params, self.twins):
                twin.copy_(whole[id(param)])

    def whole_moments(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """Every parameter's AdamW state, whole (gathered from the shards): ``id(param)`` ->
        {"step", "exp_avg", "exp_avg_sq"}. A collective over the group."""
        device, dtype = self.params[0].device, torch.float32
        flats = {}
        for key in ADAM_MOMENTS:
            shard = torch.zeros(self.shard_numel, dtype=self.params[0].dtype, device=device)
            for piece, view in zip(self.pieces, self.piece_params):
                state = optimizer.state.get(view)
                if state:
                    shard.narrow(0, piece.offset, piece.length).copy_(state[key])
            whole = torch.empty(self.shard_numel * self.size, dtype=shard.dtype, device=device)
            ops.all_gather_into(whole, shard, group=self.group)
            flats[key] = whole
        steps = torch.zeros(len(self.params), dtype=dtype, device=device)
        index = {id(param): i for i, param in enumerate(self.params)}
        for piece, view in zip(self.pieces, self.piece_params):
            state = optimizer.state.get(view)
            if state:
                steps[index[id(piece.param)]] = float(state["step"])
        ops.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.group)
        return {id(param): {"step": torch.tensor(steps[i].item(), device="cpu"),
                            **{key: flats[key][offset:offset + param.numel()]
                               .view_as(param).clone() for key in ADAM_MOMENTS}}
                for i, (param, offset) in enumerate(zip(self.params, self.offsets))}

    def load_moments(self, optimizer: torch.optim.Optimizer,
                     whole: dict[int, dict[str, Any]]) -> None:
        """Set the optimizer state of this rank's pieces from whole per-parameter states."""
        for piece, view in zip(self.pieces, self.piece_params):
            state = whole[id(piece.param)]
            optimizer.state[view] = {
                "step": state["step"].clone(),
                **{key: state[key].reshape(-1).narrow(0, piece.start, piece.length).clone()
                   for key in ADAM_MOMENTS}}


def adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    """``param``'s AdamW state in ``optimizer``, created empty (step 0, zero moments) if the
    optimizer has not stepped it yet; the step is where AdamW keeps it (on the parameter's
    device for the fused kernel, else on the host)."""
    state = optimizer.state[param]
    if not state:
        fused = any(group.get("fused") for group in optimizer.param_groups)
        state["step"] = torch.tensor(0.0, device=param.device if fused else "cpu")
        for key in ADAM_MOMENTS:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


class OptimizerMoments:
    """Every parameter's whole AdamW state, for a checkpoint: ``of(param)``; and its whole
    value, ``value_of(param)``.

    Unsharded parameters give their live state and data. With sharded buckets, saving
    gathers the whole states (and the values a bucket owns) of their parameters first (a
    collective), and loading gives zeroed whole tensors to read into, which ``loaded()`` then
    cuts into this rank's shard pieces (and the values' twins)."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: Sequence[Bucket] = (), *,
                 for_loading: bool = False):
        self.optimizer = optimizer
        self.sharded = [bucket for bucket in buckets if bucket.sharded]
        self._of_sharded = {id(p): p for bucket in self.sharded for p in bucket.params}
        self._owning = [bucket for bucket in self.sharded if bucket.owns_values]
        self._valued = {id(p) for bucket in self._owning for p in bucket.params}
        self.whole: dict[int, dict[str, Any]] = {}
        self.values: dict[int, torch.Tensor] = {}
        if not for_loading:
            for bucket in self.sharded:
                self.whole.update(bucket.whole_moments(optimizer))
            for bucket in self._owning:
                self.values.update(bucket.whole_values())

    def value_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        if id(param) not in self._valued:
            return param.data
        if id(param) not in self.values:
            self.values[id(param)] = torch.zeros(param.shape, dtype=param.dtype,
                                                 device=param.device)
        return self.values[id(param)]

    def of(self, param: torch.nn.Parameter) -> dict[str, Any]:
        if id(param) not in self._of_sharded:
            return adam_state(self.optimizer, param)
        if id(param) not in self.whole:
            self.whole[id(param)] = {"step": torch.tensor(0.0, device="cpu"),
                                     **{key: torch.zeros_like(param) for key in ADAM_MOMENTS}}
        return self.whole[id(param)]

    def loaded(self) -> None:
        """After a checkpoint filled the states ``of`` (and ``value_of``) gave: set the
        shards' from them."""
        for bucket in self.sharded:
            bucket.load_moments(self.optimizer, self.whole)
        for bucket in self._owning:
            bucket.load_values(self.values)


def buckets_of(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None, *,
               scale: float, zero: int, stage: int, deferred: bool = False,
               before: Callable[[], None] | None = None,
               bucket_bytes: int = BUCKET_BYTES,
               twin_of: Callable[[torch.nn.Parameter], torch.nn.Parameter] | None = None
               ) -> list[Bucket]:
    """``params`` (of one stage and group) cut into buckets of one dtype and about
    ``bucket_bytes`` each, in the order given; ``twin_of`` gives each one's twin (the
    weight the model computes with, when ``params`` are its float32 masters)."""
    by_dtype: dict[torch.dtype, list[list[torch.nn.Parameter]]] = {}
    for param in params:
        runs = by_dtype.setdefault(param.dtype, [[]])
        if runs[-1] and sum(p.numel() * p.element_size() for p in runs[-1]) >= bucket_bytes:
            runs.append([])
        runs[-1].append(param)
    return [Bucket(run, group, scale=scale, zero=zero, stage=stage, deferred=deferred,
                   before=before, twins=None if twin_of is None else [twin_of(p) for p in run])
            for runs in by_dtype.values() for run in runs if run]
