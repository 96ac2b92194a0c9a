"""Blockwise attention kernels with log-sum-exp, in explicit float32 math.

Ring attention computes a query block against one key/value block at a time and merges the
partial results. It needs each block's log-sum-exp and, in backward, the gradient of one
block given the *final* output and log-sum-exp. The kernels here are plain tensor math
rather than SDPA for three reasons: any mask (positions x documents) is exact, rows that a
block masks completely never appear (the caller compacts blocks to their live rows), and
grouped-query attention runs on a ``[batch, heads_kv, group, seq, head_dim]`` view, so key
and value heads are never repeated and their gradients are summed over the group for free.
Everything is computed in float32 and cast back by the caller.

Layouts: queries ``[b, hkv, g, s, d]`` (see ``group_queries``), keys and values
``[b, hkv, s, d]``, masks ``[s_q, s_k]`` boolean or None, log-sum-exp ``[b, hkv, g, s]``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_queries(q: Tensor, heads_kv: int) -> Tensor:
    """``[b, s, hq, d]`` -> float32 ``[b, hkv, g, s, d]``: query head ``i`` uses key/value head ``i // g``."""
    batch, seq, heads_q, head_dim = q.shape
    grouped = q.reshape(batch, seq, heads_kv, heads_q // heads_kv, head_dim)
    return grouped.permute(0, 2, 3, 1, 4).float()


def ungroup_queries(x: Tensor) -> Tensor:
    """Inverse of ``group_queries`` (without the dtype cast): ``[b, hkv, g, s, d]`` -> ``[b, s, hq, d]``."""
    batch, heads_kv, group, seq, head_dim = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(batch, seq, heads_kv * group, head_dim)


def heads_first(x: Tensor) -> Tensor:
    """``[b, s, h, d]`` -> float32 ``[b, h, s, d]``."""
    return x.transpose(1, 2).float()


def _masked_scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def block_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                  scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one key block: ``(out, lse)``. Every row must attend some key."""
    scores = _masked_scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v.unsqueeze(2)), lse


def block_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                   mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block's share of the attention.

    ``lse`` is the log-sum-exp over *all* keys and ``delta = (grad_out * out).sum(-1)`` uses
    the final output, so the probabilities here are the block's slice of the full softmax and
    the block gradients add up to the gradient of the whole attention.
    """
    probs = torch.exp(_masked_scores(q, k, mask, scale) - lse.unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out).sum(dim=2)
    grad_probs = torch.matmul(grad_out, v.unsqueeze(2).transpose(-1, -2))
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1))
    grad_q = torch.matmul(grad_scores, k.unsqueeze(2)) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q).sum(dim=2) * scale
    return grad_q, grad_k, grad_v


def merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor,
                rows: Tensor | None) -> None:
    """Fold one block's ``(block_out, block_lse)`` into the running ``(out, lse)`` in place.

    The merge rescales both sides by ``exp(lse_side - lse_new)`` with ``lse_new =
    logaddexp(lse, block_lse)``, which never exponentiates a positive number. ``rows`` says
    which query rows the block covers (None = all); the running ``lse`` starts at -inf.
    """
    if rows is None:
        running_out, running_lse = out, lse
    else:
        running_out, running_lse = out.index_select(3, rows), lse.index_select(3, rows)
    merged_lse = torch.logaddexp(running_lse, block_lse)
    merged_out = (running_out * torch.exp(running_lse - merged_lse).unsqueeze(-1)
                  + block_out * torch.exp(block_lse - merged_lse).unsqueeze(-1))
    if rows is None:
        out.copy_(merged_out)
        lse.copy_(merged_lse)
    else:
        out.index_copy_(3, rows, merged_out)
        lse.index_copy_(3, rows, merged_lse)
