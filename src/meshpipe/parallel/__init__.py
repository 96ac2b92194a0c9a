"""Tensor parallelism as modules a model composes (Megatron style, exact gradients).

``tp_comm`` holds the autograd collectives over a TP group; ``tensor`` the column- and
row-parallel linears, the vocab-parallel embedding and cross entropy, and the parameter
tags (``shard_dim``, ``mark_sequence_parallel``) the trainer reads to sync and check
gradients. ``group=None`` or a one-rank group means no TP: everything is the plain op.
"""

from .tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     is_sequence_parallel_param, mark_fused, mark_sequence_parallel, own_shard,
                     shard, shard_dim, shard_linear, shard_parts, unshard,
                     vocab_parallel_cross_entropy)
from .tp_comm import (TensorParallelRegion, copy_to_tp, gather_from_sequence,
                      gather_rows_summing_gradients, gather_rows_to_replicate,
                      gather_to_replicate, reduce_from_tp, reduce_scatter_to_sequence,
                      scatter_to_sequence, tp_rank_and_size)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "TensorParallelRegion",
    "VocabParallelEmbedding", "copy_to_tp", "gather_from_sequence",
    "gather_rows_summing_gradients", "gather_rows_to_replicate", "gather_to_replicate",
    "is_sequence_parallel_param", "mark_fused", "mark_sequence_parallel", "own_shard",
    "reduce_from_tp", "reduce_scatter_to_sequence", "scatter_to_sequence", "shard",
    "shard_dim", "shard_linear", "shard_parts", "tp_rank_and_size", "unshard",
    "vocab_parallel_cross_entropy",
]
