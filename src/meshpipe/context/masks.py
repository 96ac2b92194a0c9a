"""Attention masks from token positions and document ids, and block plans for blockwise attention.

A query may attend a key of the same document and, when causal, only a key whose position
is not after its own. Masks are boolean ``[seq_q, seq_k]`` (True = may attend), shared by
every batch row and head, so they are cheap next to the attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def attention_mask(q_positions: Tensor, k_positions: Tensor, q_doc_ids: Tensor | None = None,
                   k_doc_ids: Tensor | None = None, causal: bool = True) -> Tensor | None:
    """Boolean ``[seq_q, seq_k]`` mask, or None when every query may attend every key."""
    mask = None
    if causal:
        mask = k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
    if q_doc_ids is not None and k_doc_ids is not None:
        same_document = q_doc_ids.unsqueeze(1) == k_doc_ids.unsqueeze(0)
        mask = same_document if mask is None else mask & same_document
    return mask


def is_plain_sequence(positions: Tensor | None, doc_ids: Tensor | None) -> bool:
    """True when the tokens are one document in order ``0..n-1``: the plain causal mask applies."""
    if positions is not None:
        expected = torch.arange(positions.shape[0], device=positions.device)
        if not torch.equal(positions.to(expected.dtype), expected):
            return False
    if doc_ids is not None and doc_ids.numel() > 0:
        if not bool((doc_ids == doc_ids[0]).all()):
            return False
    return True


@dataclass(frozen=True)
class BlockPlan:
    """The live part of one query-block x key-block tile.

    ``rows`` / ``cols`` index the queries that attend at least one key of the block and the
    keys that at least one query attends (None = all of them); ``mask`` is the mask restricted
    to those rows and columns, or None when it allows everything. Computing only this part is
    what makes zigzag-balanced causal ring attention skip the masked half of a block.
    """

    rows: Tensor | None
    cols: Tensor | None
    mask: Tensor | None


def plan_block(q_positions: Tensor, q_doc_ids: Tensor | None, k_positions: Tensor,
               k_doc_ids: Tensor | None, causal: bool) -> BlockPlan | None:
    """Plan the tile of these queries against these keys; None when it is fully masked."""
    mask = attention_mask(q_positions, k_positions, q_doc_ids, k_doc_ids, causal)
    if mask is None:
        return BlockPlan(rows=None, cols=None, mask=None)
    live_rows = mask.any(dim=1)
    if not bool(live_rows.any()):
        return None
    live_cols = mask.any(dim=0)
    rows = None if bool(live_rows.all()) else live_rows.nonzero().squeeze(1)
    cols = None if bool(live_cols.all()) else live_cols.nonzero().squeeze(1)
    if rows is not None:
        mask = mask.index_select(0, rows)
    if cols is not None:
        mask = mask.index_select(1, cols)
    return BlockPlan(rows=rows, cols=cols, mask=None if bool(mask.all()) else mask)
