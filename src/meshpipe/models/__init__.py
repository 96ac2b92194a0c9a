"""meshpipe.models: the reference transformer, its pipeline split and its loss."""

from meshpipe.models.loss import causal_lm_loss
from meshpipe.models.split import SharedParameter, TransformerChunk, shared_parameters, split
from meshpipe.models.transformer import Transformer, TransformerConfig

__all__ = [
    "SharedParameter",
    "Transformer",
    "TransformerChunk",
    "TransformerConfig",
    "causal_lm_loss",
    "shared_parameters",
    "split",
]
