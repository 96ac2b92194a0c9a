"""A context-parallel configuration that cannot be honoured raises the same clear error on
every rank (naming the sizes) instead of hanging or silently computing something else."""

from __future__ import annotations

import re

import pytest
import torch

from meshpipe.context import AttentionError, RingAttention, UlyssesAttention
from meshpipe.testing import run_distributed


def _qkv(seq: int, heads_q: int, heads_kv: int = 1) -> tuple[torch.Tensor, ...]:
    return (torch.randn(1, seq, heads_q, 4), torch.randn(1, seq, heads_kv, 4),
            torch.randn(1, seq, heads_kv, 4))


def _bad_configurations(rank: int, world: int) -> dict[str, str]:
    attempts = {
        "ring: heads differ between ranks":
            lambda: RingAttention()(*_qkv(4, 2 if rank == 0 else 4)),
        "ulysses: heads differ between ranks":
            lambda: UlyssesAttention()(*_qkv(4, 2 if rank == 0 else 4)),
        "ulysses: sequence not split as split_sizes":
            lambda: UlyssesAttention()(*_qkv(3 if rank == 0 else 5, 2)),
        "ulysses: fewer query heads than ranks":
            lambda: UlyssesAttention()(*_qkv(4, 1)),
        "ring: doc_ids on one rank only":
            lambda: RingAttention()(*_qkv(4, 2), doc_ids=torch.zeros(4, dtype=torch.int64)
                                    if rank == 0 else None),
    }
    seen = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            seen[name] = "no error"
        except AttentionError as error:
            seen[name] = str(error)
    return seen


EXPECTED = {
    "ring: heads differ between ranks": r"RingAttention \(rank \d\): ranks of the context-parallel "
                                        r"group disagree on query heads: \[2, 4\]",
    "ulysses: heads differ between ranks": r"UlyssesAttention \(rank \d\): .* disagree on query "
                                           r"heads: \[2, 4\]",
    "ulysses: sequence not split as split_sizes": r"hold \[3, 5\] tokens .* 8 tokens must be "
                                                  r"split as \[4, 4\]",
    "ulysses: fewer query heads than ranks": r"1 query heads cannot be spread over a Ulysses "
                                             r"degree of 2",
    "ring: doc_ids on one rank only": r"disagree on has doc_ids: \[1, 0\]",
}


@pytest.mark.distributed
def test_every_rank_raises_the_same_named_error():
    per_rank = run_distributed(2, _bad_configurations)
    for name, pattern in EXPECTED.items():
        for rank, seen in enumerate(per_rank):
            assert re.search(pattern, seen[name]), f"rank {rank}, {name}: {seen[name]}"
