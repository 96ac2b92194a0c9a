"""The attention contract every meshpipe attention honours, and its input checks.

An attention is a callable ``attn(q, k, v, *, positions=None, doc_ids=None, causal=True,
window=None, scale=None, softcap=None)``
with q ``[batch, seq_local, heads_q, head_dim]``, k and v ``[batch, seq_local, heads_kv,
head_dim]`` (``heads_q`` a multiple of ``heads_kv``: grouped-query attention) returning
``[batch, seq_local, heads_q, head_dim]``. ``positions`` (int64 ``[seq_local]``) is each local
token's position inside its document and ``doc_ids`` (int64 ``[seq_local]``) its document:
a query may attend a key of the same document, and with ``causal`` only one whose position
is not after its own; with a sliding ``window`` of ``w`` tokens also only one fewer than ``w``
positions before its own (Mistral's and Gemma's sliding-window layers: ``q_pos - k_pos < w``).
``scale`` multiplies the scores (default: the attention's own, else ``1/sqrt(head_dim)``);
``softcap`` caps them at ``c * tanh(score / c)`` before the softmax (Gemma 2; written out,
as no fused kernel caps scores: materialised by local attention, tile by tile by ring).
Every context-parallel layout (contiguous, zigzag, packed, hybrid) is
expressed through these two tensors, so no attention needs to know how the loader sharded.
What an attention derives from them is kept for as long as the same tensor objects come back
unchanged (every layer of a microbatch; ``context.derived``), so the ranks of a
context-parallel group pass new ``positions`` / ``doc_ids`` tensors together (as a loader
does per microbatch) or the same ones together. Refilling one in place with ``copy_`` is
seen; a receive or collective writing into it is not (torch does not count those as
changes): give such a microbatch new tensors.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class AttentionError(ValueError):
    """The inputs or the configuration of an attention cannot be honoured."""


class Attention(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Tensor | None = None,
                 doc_ids: Tensor | None = None, causal: bool = True, window: int | None = None,
                 scale: float | None = None, softcap: float | None = None) -> Tensor: ...


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None,
                           doc_ids: Tensor | None, where: str) -> None:
    """Raise ``AttentionError`` naming ``where`` and the offending shapes if the inputs break the contract."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise AttentionError(
            f"{where}: q, k, v must be [batch, seq, heads, head_dim]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise AttentionError(f"{where}: k and v must have the same shape; got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
    batch, seq, heads_q, head_dim = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq, head_dim):
        raise AttentionError(
            f"{where}: k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch, sequence "
            f"or head_dim")
    heads_kv = k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise AttentionError(
            f"{where}: {heads_q} query heads are not a multiple of {heads_kv} key/value heads")
    for name, ids in (("positions", positions), ("doc_ids", doc_ids)):
        if ids is None:
            continue
        if ids.dim() != 1 or ids.shape[0] != seq:
            raise AttentionError(f"{where}: {name} must have shape [{seq}] (the local sequence "
                                 f"length); got {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise AttentionError(f"{where}: {name} must be an integer tensor; got {ids.dtype}")
