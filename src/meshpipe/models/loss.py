"""Next-token cross-entropy that can be normalised over tokens held by other processes."""

from __future__ import annotations

from typing import Literal, overload

import torch.nn.functional as F
from torch import Tensor


@overload
def causal_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = ...,
                   reduction: Literal["mean"] = ...) -> Tensor: ...


@overload
def causal_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = ...,
                   reduction: Literal["sum"] = ...) -> tuple[Tensor, Tensor]: ...


def causal_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100,
                   reduction: str = "mean") -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``logits [..., vocab]`` against ``targets [...]``, in float32.

    ``targets`` are already aligned with the logits (the next token of each position), so a
    sequence sharded over context-parallel ranks needs no shift across shard borders. Targets
    equal to ``ignore_index`` do not count. ``reduction="mean"`` returns the mean over counted
    tokens; ``"sum"`` returns ``(loss_sum, token_count)`` so that a caller can add sums and
    counts over microbatches or ranks and divide once, which is what an unsplit batch means.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"causal_lm_loss: logits {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])}; got {tuple(targets.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"causal_lm_loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1)
    if reduction == "mean":
        return F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index)
    loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index,
                               reduction="sum")
    return loss_sum, (flat_targets != ignore_index).sum()
