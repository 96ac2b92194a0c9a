"""A pack's documents in one call of PyTorch's variable-length flash kernel (CUDA, bf16/fp16).

A packed row whose documents each lie in one run of consecutive positions is, for the flash
kernel, a batch of sequences of different lengths laid end to end: the kernel takes the
tokens flattened to ``[tokens, heads, head_dim]`` and the cumulative lengths of the documents
(``cu_seqlens``), and does no work across documents, in one call per layer whatever their
number. The cumulative lengths are derived once per microbatch (``context.derived``). The
aten ops are called directly (their signature has held since torch 2.6, where the public
``varlen_attn`` changed between releases); grouped key/value heads go in as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Documents:
    """Where the documents of a batch's packed rows start and end among its flattened tokens
    (``cu_seqlens``: int32 on the device, the rows one after another) and the longest one."""

    cu_seqlens: Tensor
    longest: int

    @staticmethod
    def of(lengths: list[int], rows: int, device: torch.device) -> Documents:
        """The documents of ``rows`` packed rows that each hold documents of ``lengths``."""
        ends = torch.tensor(lengths).cumsum(0)
        row_starts = torch.arange(rows) * sum(lengths)
        cumulative = torch.cat([torch.zeros(1, dtype=torch.int64),
                                (row_starts[:, None] + ends).flatten()])
        return Documents(cumulative.to(device, torch.int32), max(lengths))


class _VarlenFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, documents: Documents, causal: bool,
                scale: float | None) -> Tensor:
        cu, longest = documents.cu_seqlens, documents.longest
        out, lse, rng_seed, rng_offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, rng_seed, rng_offset)
        ctx.documents, ctx.causal, ctx.scale = documents, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, rng_seed, rng_offset = ctx.saved_tensors
        cu, longest = ctx.documents.cu_seqlens, ctx.documents.longest
        grad_q, grad_k, grad_v = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, longest, longest, 0.0,
            ctx.causal, rng_seed, rng_offset, scale=ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None


def packed_flash_attention(q: Tensor, k: Tensor, v: Tensor, documents: Documents,
                           causal: bool, scale: float | None) -> Tensor:
    """Attention of ``[b, s, h, d]`` packed rows, each token within its document only, as one
    variable-length flash call."""
    batch, seq = q.shape[:2]
    flat = [t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v)]
    return _VarlenFlash.apply(*flat, documents, causal, scale).view(q.shape)
