"""Moved: the shard bookkeeping of context parallelism is ``meshpipe.context.shards`` (and
``split_sizes`` is in ``meshpipe.comm.collectives``); these names still import from here."""

from meshpipe.comm.collectives import split_sizes
from meshpipe.context.shards import (ShardLayout, contiguous_positions, document_ids,
                                     hybrid_positions, packed_hybrid_positions,
                                     packed_positions, positions_in_document,
                                     zigzag_positions)

__all__ = ["ShardLayout", "contiguous_positions", "document_ids", "hybrid_positions",
           "packed_hybrid_positions", "packed_positions", "positions_in_document",
           "split_sizes", "zigzag_positions"]
