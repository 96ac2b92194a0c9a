"""Tiles: the kernel calls blockwise attention is made of, and what they add up to.

A ``Tile`` is one call of a ``blockwise`` kernel: query rows against key columns under one
mask. Ring attention runs a list of tiles per ring step, Ulysses and local attention one list
over the whole sequence. Rows and columns are ranges (views) where they can be, partial
outputs merge in place by log-sum-exp (``attend``), and ``TileGradients`` runs the same
tiles backward, accumulating each gradient into the part of the block it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .blockwise import (CAUSAL, CAUSAL_LEAF, BlockKernel, TileMask, heads_first, merge_block,
                        tile_mask)
from .masks import BlockPlan, Piece, split_causal

_FLOAT32_COMPUTE = (torch.float32, torch.bfloat16, torch.float16)


def runs_on_cpu_kernel(x: Tensor) -> bool:
    """Whether attention on ``x`` takes the CPU flash kernel through tiles where plain SDPA
    would also do: on CPU, in a dtype the tiles' float32 compute does not lose precision for
    (float64 keeps SDPA)."""
    return x.device.type == "cpu" and x.dtype in _FLOAT32_COMPUTE


Index = Tensor | slice | None
"""Rows or columns of a tile: a local index range, an index tensor, or None for all."""


@dataclass(frozen=True)
class Tile:
    """One kernel call: query rows ``rows`` against key columns ``cols`` under ``mask``
    (``blockwise.CAUSAL``, None, or a boolean mask)."""

    rows: Index
    cols: Index
    mask: TileMask

    @staticmethod
    def of_plan(plan: BlockPlan | None) -> list[Tile]:
        return [] if plan is None else [Tile(plan.rows, plan.cols, tile_mask(plan.mask))]

    @staticmethod
    def of_piece(piece: Piece) -> Tile:
        return Tile(piece.rows, piece.cols, CAUSAL if piece.causal else None)


def take(x: Tensor, dim: int, index: Index) -> Tensor:
    """``x`` at ``index`` along ``dim``: a view for a range, a copy for an index tensor."""
    if index is None:
        return x
    if isinstance(index, slice):
        return x.narrow(dim, index.start, index.stop - index.start)
    return x.index_select(dim, index)


def accumulate(total: Tensor | None, part: Tensor, dim: int, index: Index,
               shape: torch.Size) -> Tensor:
    """``total`` plus ``part`` at ``index`` along ``dim``; a first ``part`` covering every
    index becomes the total itself, a first partial one lands in float32 zeros of ``shape``."""
    if total is None:
        if index is None:
            return part
        total = torch.zeros(shape, dtype=torch.float32, device=part.device)
    if index is None:
        total += part
    elif isinstance(index, slice):
        total.narrow(dim, index.start, index.stop - index.start).add_(part)
    else:
        total.index_add_(dim, index, part)
    return total


SEQ = 1  # the sequence dim of [b, s, h, d] blocks and of their gradient accumulators


def empty_output(queries: Tensor) -> tuple[Tensor, Tensor]:
    """A running float32 output of zeros and log-sum-exp of -inf: what no key contributes."""
    return (torch.zeros_like(queries, dtype=torch.float32),
            torch.full(queries.shape[:-1], float("-inf"), device=queries.device))


def block_kv(kv: tuple[Tensor, Tensor], tile: Tile,
             dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The keys and values of a ``[b, s, hkv, d]`` block at the tile's columns, heads first,
    in the kernel's ``dtype``."""
    return (heads_first(take(kv[0], SEQ, tile.cols), dtype),
            heads_first(take(kv[1], SEQ, tile.cols), dtype))


class TileGradients:
    """This rank's query gradient, accumulated tile by tile in backward (``queries`` and
    ``grad_out`` in the kernel's dtype, the final ``out`` and ``lse`` in float32)."""

    def __init__(self, kernel: BlockKernel, queries: Tensor, grad_out: Tensor, out: Tensor,
                 lse: Tensor, scale: float):
        self.kernel, self.queries, self.grad_out = kernel, queries, grad_out
        self.out, self.lse, self.scale = out.to(kernel.dtype), lse, scale
        self.grad_queries: Tensor | None = None

    def gradients(self, tile: Tile, kv: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Add one tile's query gradient; return its key and value gradients as ``[b, s_live,
        hkv, d]`` (views of the kernel's output, which lies in that order)."""
        rows = tile.rows
        keys, values = block_kv(kv, tile, self.kernel.dtype)
        grad_q, grad_k, grad_v = self.kernel.backward(
            take(self.grad_out, 2, rows), take(self.queries, 2, rows), keys, values,
            take(self.out, 2, rows), take(self.lse, 2, rows), tile.mask, self.scale)
        self.grad_queries = accumulate(self.grad_queries, grad_q, 2, rows,
                                        self.queries.shape)
        return grad_k.transpose(1, 2), grad_v.transpose(1, 2)


def attend(kernel: BlockKernel, queries: Tensor, kv: tuple[Tensor, Tensor], tiles: list[Tile],
           scale: float, out: Tensor | None = None, lse: Tensor | None = None
           ) -> tuple[Tensor | None, Tensor | None]:
    """Run ``tiles`` of ``queries`` (``[b, h, s, d]`` in the kernel's dtype) against the block
    ``kv`` and fold them into the running float32 ``(out, lse)`` (None: nothing yet). A first
    tile covering every row becomes the output itself; the others merge in place."""
    for tile in tiles:
        keys, values = block_kv(kv, tile, kernel.dtype)
        block_out, block_lse = kernel.forward(take(queries, 2, tile.rows), keys, values,
                                              tile.mask, scale)
        if out is None and tile.rows is None:
            out, lse = block_out, block_lse
            continue
        if out is None:
            out, lse = empty_output(queries)
        merge_block(out, lse, block_out, block_lse, tile.rows)
    return out, lse


def causal_square(count: int, causal: bool, leaf: int | None = CAUSAL_LEAF) -> list[Tile]:
    """The tiles of a whole sequence of ``count`` tokens against itself: unmasked, or the
    causal square cut down to ``leaf`` rows (None: whole)."""
    return [Tile.of_piece(piece)
            for piece in split_causal(Piece(None, None, causal), count, leaf)]

