"""Context-parallel attention equals single-process SDPA on the full sequence.

Every rank builds the same full q/k/v from a seed, computes the reference attention and its
gradients with plain SDPA and an explicitly built mask, then runs the context-parallel
attention on its own shard and compares its output and q/k/v gradients with the matching
slices of the reference. All cases of one world size run inside one ``run_distributed``
call; each rank returns the failures it saw, per case.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from meshpipe.comm.collectives import split_sizes
from meshpipe.context.shards import ShardLayout
from meshpipe.context import HybridAttention, RingAttention, UlyssesAttention, make_attention
from meshpipe.testing import keep_across_calls, run_distributed
from meshpipe.topology import ParallelLayout, Topology


@dataclass(frozen=True)
class Case:
    name: str
    strategy: str  # "ring", "ulysses" or "hybrid" (ring degree x Ulysses degree)
    layout: str  # across the ring: "contiguous", "zigzag" or "packed"
    doc_lens: tuple[int, ...]  # one entry: an unpacked sequence
    heads_q: int
    heads_kv: int
    causal: bool
    ring: int = 1
    pass_positions: bool = True
    batch: int = 2
    head_dim: int = 8
    window: int | None = None  # a sliding window: keys fewer than this many positions back
    scale: float | None = None
    softcap: float | None = None  # scores capped at c * tanh(score / c) (Gemma 2)
    head_groups: int | None = None  # Ulysses: heads in groups whose exchanges overlap


CASES_2 = [
    Case("ring-zigzag-causal", "ring", "zigzag", (16,), 4, 4, True, ring=2),
    Case("ring-contiguous-noncausal-gqa", "ring", "contiguous", (12,), 4, 2, False, ring=2),
    Case("ring-packed3-causal", "ring", "packed", (5, 9, 4), 4, 2, True, ring=2),
    Case("ring-packed3-noncausal", "ring", "packed", (5, 9, 4), 2, 1, False, ring=2),
    Case("ulysses-seq13-causal", "ulysses", "contiguous", (13,), 4, 4, True,
         pass_positions=False),
    Case("ulysses-heads3-noncausal", "ulysses", "contiguous", (12,), 3, 3, False),
    Case("ulysses-gqa-1kv-causal", "ulysses", "contiguous", (10,), 4, 1, True),
    Case("ulysses-packed3-causal", "ulysses", "contiguous", (5, 9, 4), 4, 2, True),
    Case("ring-zigzag-window5", "ring", "zigzag", (16,), 4, 2, True, ring=2, window=5),
    Case("ring-packed3-window4-scaled", "ring", "packed", (5, 9, 4), 4, 2, True, ring=2,
         window=4, scale=0.3),
    Case("ulysses-seq13-window4", "ulysses", "contiguous", (13,), 4, 2, True, window=4,
         pass_positions=False),
    Case("ulysses-packed3-window3-scaled", "ulysses", "contiguous", (5, 9, 4), 4, 4, True,
         window=3, scale=0.3),
    Case("ring-zigzag-softcap", "ring", "zigzag", (16,), 4, 2, True, ring=2, softcap=1.5),
    Case("ulysses-groups2-causal", "ulysses", "contiguous", (16,), 4, 4, True, head_groups=2),
    Case("ulysses-groups2-seq13-gqa", "ulysses", "contiguous", (13,), 8, 4, True,
         pass_positions=False, head_groups=2),
    Case("ulysses-groups2-packed3-window3-softcap", "ulysses", "contiguous", (5, 9, 4), 8, 4,
         True, window=3, softcap=1.5, head_groups=2),
    Case("ulysses-groups2-noncausal", "ulysses", "contiguous", (12,), 4, 4, False,
         head_groups=2),
    Case("ring-packed3-window4-softcap", "ring", "packed", (5, 9, 4), 4, 2, True, ring=2,
         window=4, scale=0.5, softcap=1.5),
]

CASES_4 = [
    Case("ring4-zigzag-causal", "ring", "zigzag", (16,), 2, 2, True, ring=4),
    Case("ring4-zigzag-causal-gqa", "ring", "zigzag", (24,), 4, 1, True, ring=4),
    Case("ring4-uneven-noncausal", "ring", "contiguous", (10,), 2, 2, False, ring=4,
         pass_positions=False),
    Case("ring4-packed3-causal", "ring", "packed", (7, 12, 5), 4, 2, True, ring=4),
    Case("ulysses4-seq10-heads6-gqa2-causal", "ulysses", "contiguous", (10,), 6, 2, True),
    Case("ulysses4-heads5-noncausal", "ulysses", "contiguous", (12,), 5, 5, False),
    Case("ulysses4-gqa-1kv-causal", "ulysses", "contiguous", (9,), 4, 1, True,
         pass_positions=False),
    Case("ulysses4-heads9-gqa3-causal", "ulysses", "contiguous", (11,), 9, 3, True),
    Case("ulysses4-packed3-causal", "ulysses", "contiguous", (7, 12, 5), 4, 2, True),
    Case("ulysses4-groups2-packed3-uneven", "ulysses", "contiguous", (7, 12, 4), 8, 8, True,
         head_groups=2),
    Case("hybrid2x2-zigzag-causal", "hybrid", "zigzag", (16,), 4, 2, True, ring=2),
    Case("hybrid2x2-zigzag-noncausal-gqa", "hybrid", "zigzag", (12,), 4, 1, False, ring=2),
    Case("hybrid2x2-packed3-causal", "hybrid", "packed", (6, 11, 5), 4, 4, True, ring=2),
    Case("hybrid2x2-heads3-causal", "hybrid", "zigzag", (20,), 3, 3, True, ring=2),
    Case("ring4-zigzag-window6-gqa", "ring", "zigzag", (24,), 4, 1, True, ring=4, window=6),
    Case("hybrid2x2-zigzag-window5", "hybrid", "zigzag", (16,), 4, 2, True, ring=2, window=5),
    Case("hybrid2x2-packed3-window4-scaled", "hybrid", "packed", (6, 11, 5), 4, 4, True,
         ring=2, window=4, scale=0.3),
    Case("hybrid2x2-zigzag-softcap", "hybrid", "zigzag", (16,), 4, 2, True, ring=2,
         softcap=1.5),
]

_TOPOLOGIES: dict[tuple[int, int], Topology] = {}


def _grid_groups(ring: int, ulysses: int) -> tuple:
    """(ring group, Ulysses group) of this rank from the project's topology (Ulysses innermost)."""
    key = (ring, ulysses)
    if key not in _TOPOLOGIES:
        _TOPOLOGIES[key] = Topology.build(ParallelLayout(cp_ring=ring, cp_ulysses=ulysses))
        keep_across_calls(_TOPOLOGIES[key].cp_ring_group, _TOPOLOGIES[key].cp_ulysses_group)
    return _TOPOLOGIES[key].cp_ring_group, _TOPOLOGIES[key].cp_ulysses_group


def _ring_layout(case: Case, ring: int) -> ShardLayout:
    total = sum(case.doc_lens)
    if case.layout == "zigzag":
        return ShardLayout.zigzag(total, ring)
    if case.layout == "packed":
        return ShardLayout.packed(case.doc_lens, ring)
    return ShardLayout.contiguous(split_sizes(total, ring))


def _local_tokens(case: Case, world: int, rank: int) -> torch.Tensor:
    """Global indices of the tokens this rank holds, in local order."""
    ring = world if case.strategy == "ring" else case.ring
    ulysses = world // ring
    ring_tokens = _ring_layout(case, ring).positions(rank // ulysses)
    piece = ShardLayout.contiguous(split_sizes(len(ring_tokens), ulysses)).positions(rank % ulysses)
    return ring_tokens[piece]


def _attention(case: Case, world: int):
    if case.strategy == "ring":
        return RingAttention()
    if case.strategy == "ulysses":
        return UlyssesAttention(head_groups=case.head_groups)
    ring_group, ulysses_group = _grid_groups(case.ring, world // case.ring)
    return HybridAttention(ring_group, ulysses_group)


def _reference_mask(doc_lens: tuple[int, ...], causal: bool,
                    window: int | None = None) -> torch.Tensor:
    blocks = [torch.ones(n, n, dtype=torch.bool) for n in doc_lens]
    if causal:
        blocks = [block.tril() for block in blocks]
    if window is not None:  # query i sees key j only if i - j < window
        blocks = [block.triu(1 - window) for block in blocks]
    return torch.block_diag(*blocks)


def _reference_attention(case: Case, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
    """The whole sequence's attention in one process: SDPA, or written out with the cap."""
    mask = _reference_mask(case.doc_lens, case.causal, case.window)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if case.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale,
                                              enable_gqa=case.heads_q != case.heads_kv
                                              ).transpose(1, 2)
    k, v = (t.repeat_interleave(case.heads_q // case.heads_kv, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (case.scale or case.head_dim ** -0.5)
    scores = torch.tanh(scores / case.softcap) * case.softcap
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def _run_case(case: Case, world: int, rank: int) -> list[str]:
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    total = sum(case.doc_lens)
    b, d = case.batch, case.head_dim

    def full(heads: int) -> torch.Tensor:
        return torch.randn(b, total, heads, d, generator=generator)

    q, k, v = full(case.heads_q), full(case.heads_kv), full(case.heads_kv)
    grad_out = full(case.heads_q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference_attention(case, *leaves)
    ref.backward(grad_out)

    doc_ids = torch.repeat_interleave(torch.arange(len(case.doc_lens)),
                                      torch.tensor(case.doc_lens))
    doc_starts = torch.tensor([0, *torch.tensor(case.doc_lens).cumsum(0)[:-1].tolist()])
    positions_in_doc = torch.arange(total) - doc_starts[doc_ids]

    tokens = _local_tokens(case, world, rank)
    local = [t[:, tokens].clone().requires_grad_() for t in (q, k, v)]
    out = _attention(case, world)(
        *local, positions=positions_in_doc[tokens] if case.pass_positions else None,
        doc_ids=doc_ids[tokens] if len(case.doc_lens) > 1 else None, causal=case.causal,
        window=case.window, scale=case.scale, softcap=case.softcap)
    out.backward(grad_out[:, tokens])

    failures = []
    checks = [("out", out, ref)] + [(f"grad {name}", local_t.grad, full_t.grad)
                                    for name, local_t, full_t in zip("qkv", local, leaves)]
    for what, got, full_value in checks:
        try:
            torch.testing.assert_close(got, full_value[:, tokens])
        except AssertionError as error:
            failures.append(f"{case.name} rank {rank} {what}: {error}")
    return failures


def _run_cases(rank: int, world: int, cases: list[Case]) -> dict[str, list[str]]:
    return {case.name: _run_case(case, world, rank) for case in cases}


_RESULTS: dict[int, dict[str, list[str]] | Exception] = {}


def _failures(world: int, case: Case) -> list[str]:
    """This case's failures on every rank; all cases of a world size run in one call, once."""
    if world not in _RESULTS:
        cases = CASES_2 if world == 2 else CASES_4
        try:
            per_rank = run_distributed(world, _run_cases, cases, timeout=300)
        except Exception as error:  # noqa: BLE001 - reported by every case of this size
            _RESULTS[world] = error
        else:
            _RESULTS[world] = {c.name: [f for rank_result in per_rank for f in rank_result[c.name]]
                               for c in cases}
    outcome = _RESULTS[world]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome[case.name]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.name)
def test_parity_on_2_ranks(case: Case) -> None:
    assert _failures(2, case) == []


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.name)
def test_parity_on_4_ranks(case: Case) -> None:
    assert _failures(4, case) == []


def _factory_kinds(rank: int, world: int) -> list[str]:
    ring_group, ulysses_group = _grid_groups(2, 2)
    no_cp = Topology.build(ParallelLayout(dp=world))
    return [type(make_attention(u, r)).__name__
            for u, r in ((None, None), (no_cp.cp_ulysses_group, no_cp.cp_ring_group),
                         (ulysses_group, None), (None, ring_group), (ulysses_group, ring_group))]


@pytest.mark.distributed
def test_make_attention_picks_the_strategy_from_the_groups() -> None:
    kinds = run_distributed(4, _factory_kinds)
    assert kinds == [["LocalAttention", "LocalAttention", "UlyssesAttention", "RingAttention",
                      "HybridAttention"]] * 4
