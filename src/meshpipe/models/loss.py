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
    return _added_over_chunks(_loss_sum, chunk_tokens, (logits, targets), (ignore_index,))


def _added_over_chunks(function, chunk_tokens: int, tensors: tuple[Tensor, ...],
                       options: tuple) -> Tensor:
    """``function(*chunks, *options)`` added over chunks of ``chunk_tokens`` rows of
    ``tensors`` (the first is the logits), each recomputed in backward."""
    recompute = torch.is_grad_enabled() and tensors[0].requires_grad
    total = None
    for chunks in zip(*(tensor.split(chunk_tokens) for tensor in tensors)):
        part = (checkpoint(function, *chunks, *options, use_reentrant=False) if recompute
                else function(*chunks, *options))
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
    flat = (logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), groups.reshape(-1))
    total = _added_over_chunks(_grouped_sums, chunk_tokens, flat, (num_groups, ignore_index))
    return logits.new_zeros(num_groups, dtype=torch.float32) if total is None else total


def _grouped_sums(logits: Tensor, targets: Tensor, groups: Tensor, num_groups: int,
                  ignore_index: int) -> Tensor:
    losses = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index,
                             reduction="none")
    return losses.new_zeros(num_groups).index_add(0, groups, losses)
