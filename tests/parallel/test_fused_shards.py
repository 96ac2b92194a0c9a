"""A fused weight (Phi-3's q/k/v rows) is sharded part by part: every rank holds its share
of each part side by side, and unsharding puts each part back together."""

import torch

from meshpipe.parallel import own_shard, unshard


def test_fused_parts_shard_and_unshard_part_by_part():
    parts = (8, 4, 4)  # q, k, v rows
    whole = torch.arange(16 * 3).reshape(16, 3)
    shards = [own_shard(whole, 0, rank, 2, parts) for rank in range(2)]
    q, k, v = whole.split(parts)
    assert torch.equal(shards[1], torch.cat([q[4:], k[2:], v[2:]]))
    assert torch.equal(unshard(shards, 0, parts), whole)
    assert torch.equal(unshard([own_shard(whole, 1, r, 3) for r in range(3)], 1), whole)
