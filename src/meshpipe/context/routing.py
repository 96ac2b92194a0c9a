"""How a model's layer calls its attention: inside a compiled block's graph where the call
only computes, eagerly at a graph break everywhere else.

Most calls read the token layout of their microbatch (documents, windows) or communicate
(Ulysses, ring, hybrid): compiled, they would recompile for every pack and cannot hold a
collective, so they run at a marked graph break (``meshpipe.graph_breaks``), which cuts a
compiled block into two graphs. Two kinds of call on ``LocalAttention`` stay in the block's
graph, one graph a block, whose every call costs host time the block no longer pays twice:

- a plain sequence (``positions`` and ``doc_ids`` None): one SDPA call and nothing else
  (``LocalAttention.runs_in_graph``);
- a pack the variable-length flash kernel takes (CUDA, bf16/fp16), given its documents as
  a ``GraphPack``: the chunk derives it from the token layout before its blocks run,
  outside their graphs, once per microbatch (``pack_for_graph``), and the graph holds one
  call of the kernel's aten op, differentiated by its own formula, as eagerly
  (``varlen.packed_flash_attention``). What varies from pack to pack (the cumulative
  lengths' count, the longest document) becomes dynamic at the first pack that differs,
  which recompiles once.

TorchDynamo guards on ``positions`` being None, so a run that mixes plain sequences and
packs compiles each kind once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from meshpipe.context.blockwise import flash_takes_queries
from meshpipe.context.interface import Attention
from meshpipe.context.local import LocalAttention, pack_documents
from meshpipe.context.varlen import Segments, packed_flash_attention, takes_windows
from meshpipe.graph_breaks import graph_break


@dataclass(frozen=True)
class GraphPack:
    """A pack's documents as causal segments of the variable-length flash kernel, and
    whether this torch's kernel takes a sliding window: all a compiled block's graph reads
    of a pack (what tracing cannot compute: ``takes_windows`` reads the op's schema)."""

    documents: Segments
    windows: bool


def pack_for_graph(attention: Attention, positions: Tensor | None, doc_ids: Tensor | None,
                   hidden: Tensor) -> GraphPack | None:
    """The ``GraphPack`` of a microbatch whose layers call ``attention`` on ``hidden``
    ``[batch, seq, dim]`` with this token layout, where its compiled blocks keep the pack's
    attention in their graphs: ``LocalAttention`` (one rank's whole sequence) of a pack in
    bf16/fp16 on a device the variable-length kernel runs on, each document one run of
    positions; else None (a pack then runs at a graph break)."""
    if positions is None or not isinstance(attention, LocalAttention):
        return None
    documents = pack_documents(positions, doc_ids, hidden)
    return None if documents is None else GraphPack(documents, takes_windows())


def attend(attention: Attention, q: Tensor, k: Tensor, v: Tensor, *,
           positions: Tensor | None, doc_ids: Tensor | None, pack: GraphPack | None = None,
           **options: Any) -> Tensor:
    """``attention(q, k, v, positions=..., doc_ids=..., **options)`` (the options the caller
    gives: ``causal``, ``window``, ``scale``, ``softcap``), in the compiled graph when it
    runs there, else eagerly. ``pack``: the microbatch's ``pack_for_graph``."""
    if isinstance(attention, LocalAttention):
        window, softcap = options.get("window"), options.get("softcap")
        if attention.runs_in_graph(q, positions, doc_ids, window, softcap):
            return attention(q, k, v, **options)
        if pack is not None and torch.compiler.is_compiling() and _graph_takes(
                pack, q, window, softcap):
            scale = options.get("scale")
            return packed_flash_attention(q, k, v, pack.documents, options.get("causal", True),
                                          window, attention.scale if scale is None else scale)
    return _attend_eagerly(attention, q, k, v, positions=positions, doc_ids=doc_ids, **options)


def _graph_takes(pack: GraphPack, q: Tensor, window: int | None,
                 softcap: float | None) -> bool:
    """Whether the variable-length kernel takes this call of a pack, from what tracing reads:
    no soft-cap, queries it takes, a window only where it takes one (the device was checked
    by ``pack_for_graph``)."""
    return softcap is None and flash_takes_queries(q) and (window is None or pack.windows)


@graph_break
def _attend_eagerly(attention: Attention, q: Tensor, k: Tensor, v: Tensor,
                    **options: Any) -> Tensor:
    return attention(q, k, v, **options)
