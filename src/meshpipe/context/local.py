"""Single-process attention through ``scaled_dot_product_attention``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .interface import check_attention_inputs
from .masks import attention_mask, is_plain_sequence


class LocalAttention(nn.Module):
    """Attention over the tokens this process holds, with SDPA.

    A plain sequence (no packing, positions 0..n-1) takes SDPA's ``is_causal`` fast path;
    otherwise the mask is built from ``positions`` and ``doc_ids``. Grouped-query attention
    goes to SDPA as is (``enable_gqa``), without repeating key/value heads.
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Tensor | None = None,
                doc_ids: Tensor | None = None, causal: bool = True) -> Tensor:
        check_attention_inputs(q, k, v, positions, doc_ids, "LocalAttention")
        gqa = q.shape[2] != k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if is_plain_sequence(positions, doc_ids):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale,
                                                 enable_gqa=gqa)
        else:
            if positions is None:
                positions = torch.arange(q.shape[2], device=q.device)
            mask = attention_mask(positions, positions, doc_ids, doc_ids, causal)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=gqa)
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        return "" if self.scale is None else f"scale={self.scale}"
