"""How a model's layer calls its attention: inside a compiled block's graph where the call
only computes, eagerly at a graph break everywhere else.

Most calls read the token layout of their microbatch (documents, windows) or communicate
(Ulysses, ring, hybrid): compiled, they would recompile for every pack and cannot hold a
collective, so they run at a marked graph break (``meshpipe.graph_breaks``), which cuts a
compiled block into two graphs. A plain sequence (``positions`` and ``doc_ids`` None) on
``LocalAttention`` is one SDPA call and nothing else (``LocalAttention.runs_in_graph``): it
stays in the block's graph, one graph a block, whose every call costs host time the block
no longer pays twice. TorchDynamo guards on ``positions`` being None, so a run that mixes
plain sequences and packs compiles each kind once.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from meshpipe.context.interface import Attention
from meshpipe.context.local import LocalAttention
from meshpipe.graph_breaks import graph_break


def attend(attention: Attention, q: Tensor, k: Tensor, v: Tensor, *,
           positions: Tensor | None, doc_ids: Tensor | None, **options: Any) -> Tensor:
    """``attention(q, k, v, positions=..., doc_ids=..., **options)`` (the options the caller
    gives: ``causal``, ``window``, ``scale``, ``softcap``), in the compiled graph when it
    runs there, else eagerly."""
    if isinstance(attention, LocalAttention) and attention.runs_in_graph(
            q, positions, doc_ids, options.get("window"), options.get("softcap")):
        return attention(q, k, v, **options)
    return _attend_eagerly(attention, q, k, v, positions=positions, doc_ids=doc_ids, **options)


@graph_break
def _attend_eagerly(attention: Attention, q: Tensor, k: Tensor, v: Tensor,
                    **options: Any) -> Tensor:
    return attention(q, k, v, **options)
