"""Tensor-parallel layers: column/row-parallel linears, a vocab-parallel embedding and loss.

Each layer holds only this rank's shard of its weight, as a plain ``nn.Parameter`` tagged
with the dim it is split along (``shard_dim``), and communicates through the autograd
collectives of ``tp_comm``. Composed Megatron style (column then row), an MLP needs one
all-reduce forward and one backward; with ``sequence_parallel`` the activations between
blocks are sequence shards and the all-reduces become all-gather + reduce-scatter.

Parameters are created uninitialised (``torch.empty``): the caller initialises them or
builds the layer from a full one (``from_linear`` / ``from_embedding``), which is how a
TP model gets exactly the weights of its single-process twin.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from meshpipe.comm import ops

from .tp_comm import TensorParallelRegion, tp_rank_and_size

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "is_sequence_parallel_param", "mark_sequence_parallel", "shard", "shard_dim",
    "shard_linear", "unshard",
    "vocab_parallel_cross_entropy",
]

Group = dist.ProcessGroup | None
_SHARD_ATTR = "tp_shard_dim"
_SP_ATTR = "tp_sequence_parallel"
_PARTS_ATTR = "tp_shard_parts"


# ----------------------------------------------------------------------- parameter tags


def shard_dim(param: Tensor) -> int | None:
    """The dim along which ``param`` is split over the TP group (0: column-parallel weight,
    vocab embedding; 1: row-parallel weight), or ``None`` if every TP rank holds all of it."""
    return getattr(param, _SHARD_ATTR, None)


def shard_parts(param: Tensor) -> tuple[int, ...] | None:
    """The whole sizes of the parts of a fused weight (Phi-3's ``qkv_proj``: q, k and v rows)
    whose shard is each part's own shard, concatenated; None for a plain split."""
    return getattr(param, _PARTS_ATTR, None)


def mark_fused(param: Tensor, parts: tuple[int, ...]) -> Tensor:
    """Tag ``param`` as the shard of a fused weight made of ``parts`` (``shard_parts``)."""
    setattr(param, _PARTS_ATTR, tuple(parts))
    return param


def mark_sequence_parallel(param: Tensor) -> Tensor:
    """Tag a replicated parameter that is applied to a sequence shard (e.g. an RMSNorm weight
    under sequence parallelism): its gradient is partial and must be all-reduced over TP."""
    setattr(param, _SP_ATTR, True)
    return param


def is_sequence_parallel_param(param: Tensor) -> bool:
    """Whether ``param``'s gradient is partial under sequence parallelism, so that the trainer
    all-reduces (sums) it over the TP group before the optimizer step."""
    return bool(getattr(param, _SP_ATTR, False))


def _sharded_parameter(shape: tuple[int, ...], dim: int, device, dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    setattr(param, _SHARD_ATTR, dim)
    return param


def shard(tensor: Tensor, dim: int, group: Group) -> Tensor:
    """This rank's contiguous chunk of ``tensor`` along ``dim`` (a copy)."""
    rank, size = tp_rank_and_size(group)
    if tensor.shape[dim] % size:
        raise ValueError(f"cannot shard dim {dim} of size {tensor.shape[dim]} (shape "
                         f"{tuple(tensor.shape)}) over {size} TP ranks: it must be divisible "
                         f"by the TP size")
    return tensor.chunk(size, dim)[rank].clone()


def unshard(chunks: list[Tensor], dim: int, parts: tuple[int, ...] | None = None) -> Tensor:
    """The full tensor from every rank's chunk, in rank order (local, no communication); for a
    fused weight of ``parts``, each part from the ranks' shards of it."""
    chunks = list(chunks)
    if parts is None:
        return torch.cat(chunks, dim)
    local = [part // len(chunks) for part in parts]
    split = [chunk.split(local, dim) for chunk in chunks]
    return torch.cat([piece for index in range(len(parts))
                      for piece in (pieces[index] for pieces in split)], dim)


def own_shard(whole: Tensor, dim: int, rank: int, size: int,
              parts: tuple[int, ...] | None = None) -> Tensor:
    """Rank ``rank``'s shard of ``whole`` (``unshard``'s inverse)."""
    if parts is None:
        return whole.chunk(size, dim)[rank]
    return torch.cat([part.chunk(size, dim)[rank] for part in whole.split(list(parts), dim)],
                     dim)


def _local_size(total: int, size: int, what: str, fix: str) -> int:
    if total % size:
        raise ValueError(f"{what} = {total} is not divisible by the TP size {size}; {fix}")
    return total // size


def _copy_slice(param: nn.Parameter, source: Tensor, dim: int, group: Group) -> None:
    with torch.no_grad():
        param.copy_(shard(source.detach(), dim, group))


# ------------------------------------------------------------------------------ linears


def _require_bias_free(linear: nn.Linear, what: str) -> None:
    if linear.bias is not None:
        raise ValueError(f"{what} is bias-free; build it from an nn.Linear(..., bias=False)")


def _parallel_from_linear(cls, linear: nn.Linear, group: Group, sequence_parallel: bool,
                          dim: int) -> nn.Module:
    """A column (dim 0) or row (dim 1) parallel layer holding this rank's slice of
    ``linear``."""
    _require_bias_free(linear, cls.__name__)
    layer = cls(linear.in_features, linear.out_features, group,
                sequence_parallel=sequence_parallel, device=linear.weight.device,
                dtype=linear.weight.dtype)
    _copy_slice(layer.weight, linear.weight, dim, group)
    return layer


def shard_linear(linear: nn.Linear, dim: int, group: Group) -> nn.Linear:
    """A bias-free ``nn.Linear`` holding this rank's slice of ``linear.weight`` along ``dim``
    (0: output features, a column split; 1: input features, a row split), tagged with
    ``shard_dim``. It does not communicate: for a model that opens and closes its tensor-
    parallel regions itself, e.g. one all-gather for three projections of the same input."""
    _require_bias_free(linear, "shard_linear")
    _, size = tp_rank_and_size(group)
    features = [linear.out_features, linear.in_features]
    what = ("out_features", "in_features")[dim]
    features[dim] = _local_size(features[dim], size, f"{what} of the linear layer",
                                "choose a TP size that divides it")
    local = torch.nn.utils.skip_init(nn.Linear, features[1], features[0], bias=False,
                                     device=linear.weight.device, dtype=linear.weight.dtype)
    local.weight = _sharded_parameter(tuple(local.weight.shape), dim, linear.weight.device,
                                      linear.weight.dtype)
    _copy_slice(local.weight, linear.weight, dim, group)
    return local



class ColumnParallelLinear(nn.Module):
    """Y = X W^T with W's output rows split over the group; bias-free.

    Input: the full activations, or this rank's sequence shard with ``sequence_parallel``
    (all-gathered first). Output: this rank's ``out_features / tp`` features, full sequence.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        _, size = tp_rank_and_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = group, sequence_parallel
        self.region = TensorParallelRegion(group, sequence_parallel)
        self.local_out_features = _local_size(
            out_features, size, "ColumnParallelLinear out_features",
            "choose out_features (or the TP size) so that it divides")
        self.weight = _sharded_parameter((self.local_out_features, in_features), 0,
                                         device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, *,
                    sequence_parallel: bool = False) -> "ColumnParallelLinear":
        """This rank's rows ``[r*n/tp, (r+1)*n/tp)`` of ``linear.weight`` (copied)."""
        return _parallel_from_linear(cls, linear, group, sequence_parallel, dim=0)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.region.enter(x),
                        self.weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.local_out_features}), sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X W^T with W's input columns split; partial outputs summed over the group.

    Input: this rank's ``in_features / tp`` features (a column-parallel output). Output:
    the full features, replicated, or this rank's sequence shard with ``sequence_parallel``.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        _, size = tp_rank_and_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = group, sequence_parallel
        self.region = TensorParallelRegion(group, sequence_parallel)
        self.local_in_features = _local_size(
            in_features, size, "RowParallelLinear in_features",
            "choose in_features (or the TP size) so that it divides")
        self.weight = _sharded_parameter((out_features, self.local_in_features), 1,
                                         device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, *,
                    sequence_parallel: bool = False) -> "RowParallelLinear":
        """This rank's columns ``[r*n/tp, (r+1)*n/tp)`` of ``linear.weight`` (copied)."""
        return _parallel_from_linear(cls, linear, group, sequence_parallel, dim=1)

    def forward(self, x: Tensor) -> Tensor:
        partial = F.linear(x, self.weight)
        return self.region.leave(partial)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.local_in_features}), "
                f"out_features={self.out_features}, sequence_parallel={self.sequence_parallel}")


# ------------------------------------------------------------------------------- vocab


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over the group.

    Rank r holds rows ``[r*V/tp, (r+1)*V/tp)``; tokens outside give zeros locally and the
    ranks' partial outputs are summed (reduce-scattered to sequence shards with
    ``sequence_parallel``). ``weight`` is the ``[V/tp, dim]`` shard, so a column-parallel
    head over the vocabulary can share it: ``head.weight = embedding.weight``.
    """

    def __init__(self, num_embeddings: int, dim: int, group: Group, *,
                 sequence_parallel: bool = False, padding_idx: int | None = None,
                 device=None, dtype=None):
        super().__init__()
        rank, size = tp_rank_and_size(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.group, self.sequence_parallel = group, sequence_parallel
        self.region = TensorParallelRegion(group, sequence_parallel)
        local = _local_size(num_embeddings, size, "VocabParallelEmbedding num_embeddings",
                            "pad the vocabulary to a multiple of the TP size")
        self.vocab_start, self.vocab_end = rank * local, (rank + 1) * local
        self.padding_idx = padding_idx
        self.weight = _sharded_parameter((local, dim), 0, device, dtype)
        # Where set (``models.master_grads``), the lookup whose backward adds the rows'
        # gradients into the weight's float32 master: ``grads_into.lookup``.
        self.grads_into = None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group, *,
                       sequence_parallel: bool = False) -> "VocabParallelEmbedding":
        """This rank's rows of ``embedding.weight`` (copied)."""
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports neither max_norm, "
                             "scale_grad_by_freq nor sparse; build it from a plain nn.Embedding")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    sequence_parallel=sequence_parallel, padding_idx=embedding.padding_idx,
                    device=embedding.weight.device, dtype=embedding.weight.dtype)
        _copy_slice(layer.weight, embedding.weight, 0, group)
        return layer

    def forward(self, tokens: Tensor) -> Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        padding = self.padding_idx
        if padding is not None:
            padding %= self.num_embeddings
            padding = (padding - self.vocab_start
                       if self.vocab_start <= padding < self.vocab_end else None)
        if (self.grads_into is None or not torch.is_grad_enabled()
                or torch.compiler.is_compiling()):
            out = F.embedding(local, self.weight, padding_idx=padding)
        else:
            out = self.grads_into.lookup(local, self.weight, padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.region.leave(out)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, local rows "
                f"[{self.vocab_start}, {self.vocab_end}), "
                f"sequence_parallel={self.sequence_parallel}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group: dist.ProcessGroup,
                ignore_index: int) -> Tensor:
        rank, _ = tp_rank_and_size(group)
        local_vocab = logits.shape[-1]
        start = rank * local_vocab
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        # the shift only keeps exp() finite; the loss does not depend on it
        row_max = logits.amax(-1)
        ops.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        ops.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        outside = (targets < start) | (targets >= start + local_vocab)
        local_targets = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        ops.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        ignored = targets == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_targets, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_targets, outside, ignored = ctx.saved_tensors
        # out of place: a split backward (runtime/split_backward.py) may run this twice
        onehot = (~outside).to(softmax.dtype).unsqueeze(-1)
        grad = softmax.scatter_add(-1, local_targets.unsqueeze(-1), -onehot)
        # ignored tokens have a constant loss of 0: no gradient at all
        grad.mul_(grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, group: Group,
                                 ignore_index: int = -100) -> Tensor:
    """Per-token cross entropy (float32, shape of ``targets``, 0 at ``ignore_index``) from
    this rank's vocabulary slice of the logits ``[..., V/tp]`` and global target ids.

    Computed in float32 with three small all-reduces (max, sum of exp, target logit) and
    never the full-vocabulary logits; the result is identical on every rank and the backward
    needs no communication.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be "
                         f"targets {tuple(targets.shape)} plus a vocabulary dim")
    _, size = tp_rank_and_size(group)
    if size == 1:
        vocab = logits.shape[-1]
        return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1),
                               reduction="none", ignore_index=ignore_index
                               ).reshape(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index)
