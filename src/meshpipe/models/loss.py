"""Next-token cross-entropy that can be normalised over tokens held by other processes.

The loss is computed in float32 over chunks of ``CHUNK_TOKENS`` positions, each recomputed
in backward (activation checkpointing): autograd then keeps no float32 copy of the logits
and no log-softmax of the whole vocabulary for every position, only the logits themselves
(with a 150k vocabulary and 8k positions, each whole float32 copy is 5 GB).
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Positions whose float32 log-softmax exists at once (forward and backward alike).
CHUNK_TOKENS = 2048


@overload
def causal_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = ...,
                   reduction: Literal["mean"] = ..., chunk_tokens: int = ...) -> Tensor: ...


@overload
def causal_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = ...,
                   reduction: Literal["sum"] = ...,
                   chunk_tokens: int = ...) -> tuple[Tensor, Tensor]: ...


def causal_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100,
                   reduction: str = "mean",
                   chunk_tokens: int = CHUNK_TOKENS) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``logits [..., vocab]`` against ``targets [...]``, in float32.

    ``targets`` are already aligned with the logits (the next token of each position), so a
    sequence sharded over context-parallel ranks needs no shift across shard borders. Targets
    equal to ``ignore_index`` do not count. ``reduction="mean"`` returns the mean over counted
    tokens; ``"sum"`` returns ``(loss_sum, token_count)`` so that a caller can add sums and
    counts over microbatches or ranks and divide once, which is what an unsplit batch means.
    More than ``chunk_tokens`` positions are summed chunk by chunk (see the module docstring).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"causal_lm_loss: logits {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])}; got {tuple(targets.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"causal_lm_loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    loss_sum = _chunked_sum(flat_logits, flat_targets, ignore_index, chunk_tokens)
    count = (flat_targets != ignore_index).sum()
    if reduction == "mean":
        return loss_sum / count
    return loss_sum, count


def _chunked_sum(logits: Tensor, targets: Tensor, ignore_index: int, chunk_tokens: int) -> Tensor:
    if logits.shape[0] <= chunk_tokens:
        return _loss_sum(logits, targets, ignore_index)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    total = None
    for piece, piece_targets in zip(logits.split(chunk_tokens), targets.split(chunk_tokens)):
        part = (checkpoint(_loss_sum, piece, piece_targets, ignore_index, use_reentrant=False)
                if recompute else _loss_sum(piece, piece_targets, ignore_index))
        total = part if total is None else total + part
    return total


def _loss_sum(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def grouped_loss_sums(logits: Tensor, targets: Tensor, groups: Tensor, num_groups: int,
                      ignore_index: int = -100,
                      chunk_tokens: int = CHUNK_TOKENS) -> Tensor:
    """``causal_lm_loss``'s sum split by ``groups`` (an int tensor of ``targets``' shape,
    values below ``num_groups``): a float32 tensor of ``num_groups`` sums, whose total is
    the loss sum (a mixture's per-source losses at the cost of one loss)."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets, flat_groups = targets.reshape(-1), groups.reshape(-1)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    total = None
    for start in range(0, flat_logits.shape[0], chunk_tokens):
        pieces = (flat_logits[start:start + chunk_tokens],
                  flat_targets[start:start + chunk_tokens],
                  flat_groups[start:start + chunk_tokens], num_groups, ignore_index)
        part = (checkpoint(_grouped_sums, *pieces, use_reentrant=False) if recompute
                else _grouped_sums(*pieces))
        total = part if total is None else total + part
    if total is None:
        return logits.new_zeros(num_groups, dtype=torch.float32)
    return total


def _grouped_sums(logits: Tensor, targets: Tensor, groups: Tensor, num_groups: int,
                  ignore_index: int) -> Tensor:
    losses = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index,
                             reduction="none")
    return losses.new_zeros(num_groups).index_add(0, groups, losses)
