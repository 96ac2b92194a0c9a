"""How a model's layer calls its attention: inside a compiled block's graph where the call
only computes, eagerly at a graph break everywhere else.

Most calls read the token layout of their microbatch (documents, windows) or communicate
(Ulysses, ring, hybrid): compiled, they would recompile for every pack and cannot hold a
collective, so they run at a marked graph break (``meshpipe.graph_breaks``), which cuts a
compiled block into two graphs. Two kinds of call stay in the block's graph, one graph a
block, whose every call costs host time the block no longer pays twice:

- a plain sequence (``positions`` and ``doc_ids`` None) on ``LocalAttention``: one SDPA call
  and nothing else (``LocalAttention.runs_in_graph``);
- a pack on ``LocalAttention`` that the variable-length flash kernel takes (CUDA, bf16/fp16:
  ``pack_op.takes``): one custom operator that derives the layout when it runs, whose
  output shapes do not depend on the pack, so no pack recompiles (``context.pack_op``).

TorchDynamo guards on ``positions`` being None, so a run that mixes plain sequences and
packs compiles each kind once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from meshpipe.context.interface import Attention
from meshpipe.context import pack_op
from meshpipe.context.local import LocalAttention
from meshpipe.graph_breaks import graph_break


def attend(attention: Attention, q: Tensor, k: Tensor, v: Tensor, *,
           positions: Tensor | None, doc_ids: Tensor | None, **options: Any) -> Tensor:
    """``attention(q, k, v, positions=..., doc_ids=..., **options)`` (the options the caller
    gives: ``causal``, ``window``, ``scale``, ``softcap``), in the compiled graph when it
    runs there, else eagerly."""
    if isinstance(attention, LocalAttention):
        window, softcap = options.get("window"), options.get("softcap")
        if attention.runs_in_graph(q, positions, doc_ids, window, softcap):
            return attention(q, k, v, **options)
        if torch.compiler.is_compiling() and pack_op.takes(q, positions, window, softcap):
            scale = options.get("scale")
            return pack_op.packed_attention(
                q, k, v, positions, doc_ids, options.get("causal", True), window,
                attention.scale if scale is None else scale)
    return _attend_eagerly(attention, q, k, v, positions=positions, doc_ids=doc_ids, **options)


@graph_break
def _attend_eagerly(attention: Attention, q: Tensor, k: Tensor, v: Tensor,
                    **options: Any) -> Tensor:
    return attention(q, k, v, **options)
