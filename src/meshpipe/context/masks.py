"""Attention masks from token positions and document ids, and block plans for blockwise attention.

A query may attend a key of the same document and, when causal, only a key whose position
is not after its own; with a sliding ``window``, only a key fewer than ``window`` positions
before its own. Masks are boolean ``[seq_q, seq_k]`` (True = may attend), shared by
every batch row and head, so they are cheap next to the attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .derived import on_host


def attention_mask(q_positions: Tensor, k_positions: Tensor, q_doc_ids: Tensor | None = None,
                   k_doc_ids: Tensor | None = None, causal: bool = True,
                   window: int | None = None) -> Tensor | None:
    """Boolean ``[seq_q, seq_k]`` mask, or None when every query may attend every key."""
    mask = None
    if causal:
        mask = k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
    if window is not None:
        near = q_positions.unsqueeze(1) - k_positions.unsqueeze(0) < window
        mask = near if mask is None else mask & near
    if q_doc_ids is not None and k_doc_ids is not None:
        same_document = q_doc_ids.unsqueeze(1) == k_doc_ids.unsqueeze(0)
        mask = same_document if mask is None else mask & same_document
    return mask


def window_applies(window: int | None, positions: Tensor | None, length: int) -> bool:
    """Whether a sliding ``window`` excludes any key: some position is ``window`` or more
    after another (``positions`` None: the plain sequence ``0..length-1``)."""
    if window is None:
        return False
    (positions,) = on_host(positions)
    span = length if positions is None or positions.numel() == 0 else int(
        positions.max() - positions.min()) + 1
    return span > window


def is_plain_sequence(positions: Tensor | None, doc_ids: Tensor | None) -> bool:
    """True when the tokens are one document in order ``0..n-1``: the plain causal mask applies."""
    positions, doc_ids = on_host(positions, doc_ids)
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
               k_doc_ids: Tensor | None, causal: bool,
               window: int | None = None) -> BlockPlan | None:
    """Plan the tile of these queries against these keys; None when it is fully masked."""
    mask = attention_mask(q_positions, k_positions, q_doc_ids, k_doc_ids, causal, window)
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


@dataclass(frozen=True)
class TokenRun:
    """Tokens ``offset .. offset + length - 1`` of a block: consecutive positions ``start ..
    start + length - 1`` of one document (``doc`` None without document ids)."""

    offset: int
    length: int
    start: int
    doc: int | None

    @property
    def stop(self) -> int:
        """The position after the run's last token."""
        return self.start + self.length


@dataclass(frozen=True)
class Piece:
    """A rectangle of a tile with one mask: query rows ``rows`` against key columns ``cols``
    (local index ranges, None = all of them), either unmasked or ``causal``: the square lower
    triangle, query ``i`` of the range attending keys ``0..i`` of it."""

    rows: slice | None
    cols: slice | None
    causal: bool


MAX_RUNS = 64
"""Blocks of more runs than this (scattered positions, many tiny documents) are planned with
a materialised mask instead of piece by piece."""

MAX_JOINED_RUNS = 4096
"""Where pieces can join into one variable-length call (``varlen.segments_of``), blocks of up
to this many runs are planned by their runs."""


def token_runs(positions: Tensor, doc_ids: Tensor | None,
               limit: int = MAX_RUNS) -> list[TokenRun] | None:
    """A block's tokens as runs of consecutive positions within one document, or None when
    there are more than ``limit`` runs."""
    count = positions.shape[0]
    if count == 0:
        return []
    positions, doc_ids = on_host(positions, doc_ids)
    breaks = positions[1:] != positions[:-1] + 1
    if doc_ids is not None:
        breaks |= doc_ids[1:] != doc_ids[:-1]
    starts = [0, *(breaks.nonzero().squeeze(1) + 1).tolist()]
    if len(starts) > limit:
        return None
    first_positions = positions[starts].tolist()
    docs = [None] * len(starts) if doc_ids is None else doc_ids[starts].tolist()
    ends = [*starts[1:], count]
    return [TokenRun(offset=begin, length=end - begin, start=position, doc=doc)
            for begin, end, position, doc in zip(starts, ends, first_positions, docs)]


def plan_pieces(q_runs: list[TokenRun], k_runs: list[TokenRun], causal: bool,
                q_count: int, k_count: int) -> list[Piece]:
    """The live part of a tile as rectangles the kernel runs without a mask (or in its causal
    mode): for each pair of runs of the same document, the keys before the queries' first
    position (every query sees them), the square where both ranges overlap (causal), and
    the queries after the keys' last position against those keys. Nothing is materialised."""
    pieces: list[Piece] = []
    runs_of_doc: dict[int | None, list[TokenRun]] = {}
    for k in k_runs:
        runs_of_doc.setdefault(k.doc, []).append(k)
    for q in q_runs:
        for k in runs_of_doc.get(q.doc, ()):
            if not causal:
                pieces.append(_piece(q, q.start, q.stop, k, k.start, k.stop, False))
                continue
            if k.start < q.start:
                pieces.append(_piece(q, q.start, q.stop, k, k.start, min(k.stop, q.start), False))
            first, last = max(q.start, k.start), min(q.stop, k.stop)
            if first < last:
                pieces.append(_piece(q, first, last, k, first, last, True))
                if last < q.stop:
                    pieces.append(_piece(q, last, q.stop, k, first, last, False))
    return [_whole(piece, q_count, k_count) for piece in pieces]


def _piece(q: TokenRun, q_first: int, q_last: int, k: TokenRun, k_first: int, k_last: int,
           causal: bool) -> Piece:
    """The piece of positions ``[q_first, q_last)`` x ``[k_first, k_last)`` in local indices."""
    rows = slice(q.offset + q_first - q.start, q.offset + q_last - q.start)
    cols = slice(k.offset + k_first - k.start, k.offset + k_last - k.start)
    return Piece(rows, cols, causal)


def _whole(piece: Piece, q_count: int, k_count: int) -> Piece:
    """``piece`` with a range that covers its whole block written as None."""
    rows = None if piece.rows == slice(0, q_count) else piece.rows
    cols = None if piece.cols == slice(0, k_count) else piece.cols
    return Piece(rows, cols, piece.causal)


def split_causal(piece: Piece, count: int, leaf: int | None) -> list[Piece]:
    """A causal square of more than ``leaf`` rows cut in two, recursively: the upper-left and
    lower-right halves stay causal squares and the lower-left quarter is unmasked. ``leaf``
    None leaves it whole.

    A blockwise kernel skips masked work only in whole blocks of its own size, so a large
    causal square costs it up to 1.6 times the live half; squares of ``leaf`` rows and
    unmasked rectangles cost what they compute. ``count`` is the query block's length (the
    rows of a piece whose range is None).
    """
    if not piece.causal or leaf is None:
        return [piece]
    rows = piece.rows or slice(0, count)
    size = rows.stop - rows.start
    if size <= leaf:
        return [piece]
    cols = piece.cols or slice(0, size)
    half = size // 2
    upper_rows, lower_rows = slice(rows.start, rows.start + half), slice(rows.start + half, rows.stop)
    upper_cols, lower_cols = slice(cols.start, cols.start + half), slice(cols.start + half, cols.stop)
    return [*split_causal(Piece(upper_rows, upper_cols, True), count, leaf),
            Piece(lower_rows, upper_cols, False),
            *split_causal(Piece(lower_rows, lower_cols, True), count, leaf)]
