"""meshpipe's attention inside transformers' decoder layers: the attention function
transformers calls (``attn_implementation="meshpipe"``, ``hf.register_attention``) and what
a layer is called with so that it reaches it."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from meshpipe.context.interface import Attention
from meshpipe.context.routing import GraphPack, attend


def attention_adapter(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None,
                      softcap: float | None = None,
                      meshpipe_attention: Attention | None = None,
                      meshpipe_positions: Tensor | None = None,
                      meshpipe_doc_ids: Tensor | None = None,
                      meshpipe_pack: GraphPack | None = None,
                      **_: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature over a meshpipe attention.

    transformers hands q ``[batch, heads, seq, head_dim]`` and k, v with the key/value heads;
    meshpipe's attentions take ``[batch, seq, heads, head_dim]`` and do grouped-query
    attention themselves. The mask is meshpipe's (positions and document ids, and the
    layer's sliding window), never a materialised one; the layer's scale and soft-cap go
    with the call.
    """
    if meshpipe_attention is None:
        raise RuntimeError("the 'meshpipe' attention runs only inside meshpipe's HFChunk, which "
                           "passes the attention and the token positions to every layer")
    if dropout:
        raise ValueError("meshpipe's attention has no dropout: set attention_dropout to 0.0")
    out = attend(meshpipe_attention, query.transpose(1, 2), key.transpose(1, 2),
                 value.transpose(1, 2), positions=meshpipe_positions, doc_ids=meshpipe_doc_ids,
                 pack=meshpipe_pack,
                 causal=True, window=sliding_window, scale=scaling, softcap=softcap)
    return out, None


def meshpipe_arguments(attention: Attention, positions: Tensor | None, doc_ids: Tensor | None,
                       pack: GraphPack | None) -> dict[str, Any]:
    """What ``attention_adapter`` needs, passed through a layer's keyword arguments."""
    return dict(meshpipe_attention=attention, meshpipe_positions=positions,
                meshpipe_doc_ids=doc_ids, meshpipe_pack=pack)


def call_layer(layer: nn.Module, hidden: Tensor, rotary: tuple[Tensor, Tensor],
               position_ids: Tensor, arguments: dict[str, Any]) -> Tensor:
    """A decoder layer on ``hidden`` with its rotary tables and ``meshpipe_arguments``: the
    hidden states (transformers' layers return them alone or first in a tuple)."""
    out = layer(hidden, position_embeddings=rotary, position_ids=position_ids, **arguments)
    return out[0] if isinstance(out, tuple) else out
