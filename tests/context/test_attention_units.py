"""Single-process pieces of the context-parallel attention: masks, tile plans, blockwise
kernels with log-sum-exp merge, the Ulysses head deal and LocalAttention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from meshpipe.comm.collectives import split_sizes
from meshpipe.context.shards import ShardLayout
from meshpipe.context import AttentionError, LocalAttention, attention_mask, plan_heads
from meshpipe.context import blockwise
from meshpipe.context.blockwise import CAUSAL, CPU_FLASH, MATH, heads_first, merge_block
from meshpipe.context.tiles import CAUSAL_LEAF
from meshpipe.context.masks import (Piece, TokenRun, plan_block, plan_pieces, split_causal,
                                   token_runs)


def _masked_attention(q, k, v, mask, scale):
    """Textbook attention on [b, s, h, d] tensors with an explicit mask (GQA by repeating)."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_attention_mask_combines_causality_and_documents():
    positions = torch.tensor([0, 1, 2, 0, 1])
    doc_ids = torch.tensor([0, 0, 0, 1, 1])
    expected = torch.block_diag(torch.ones(3, 3).tril(), torch.ones(2, 2).tril()).bool()
    assert torch.equal(attention_mask(positions, positions, doc_ids, doc_ids, True), expected)
    assert torch.equal(attention_mask(positions, positions, doc_ids, doc_ids, False),
                       torch.block_diag(torch.ones(3, 3), torch.ones(2, 2)).bool())
    assert attention_mask(positions, positions, None, None, causal=False) is None


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_zigzag_tiles_are_half_live_and_need_no_mask(ranks):
    chunk = 3
    layout = ShardLayout.zigzag(2 * ranks * chunk, ranks)
    for mine in range(ranks):
        for source in range(ranks):
            plan = plan_block(layout.positions(mine), None, layout.positions(source), None, True)
            rows = 2 * chunk if plan.rows is None else len(plan.rows)
            cols = 2 * chunk if plan.cols is None else len(plan.cols)
            if source == mine:
                assert (rows, cols) == (2 * chunk, 2 * chunk) and plan.mask is not None
            else:
                assert rows * cols == 2 * chunk * chunk and plan.mask is None


def test_fully_masked_tiles_are_skipped():
    layout = ShardLayout.contiguous([4, 4])
    assert plan_block(layout.positions(0), None, layout.positions(1), None, True) is None
    docs = torch.tensor([0, 0, 1, 1])
    assert plan_block(torch.arange(4), docs, torch.arange(4), docs + 2, False) is None


@pytest.mark.parametrize("mask", [None, CAUSAL], ids=["unmasked", "causal"])
def test_the_cpu_flash_kernel_repeats_grouped_heads_for_a_torch_before_2_9(mask, monkeypatch):
    """Before torch 2.9 the CPU flash ops read past the last key/value head when there are
    fewer of them than query heads; the kernel then repeats them and sums their gradients
    back, and equals the math kernel."""
    monkeypatch.setattr(blockwise, "_CPU_FLASH_GROUPS_HEADS", False)
    torch.manual_seed(0)
    q, grad = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    assert [t.shape[1] for t in blockwise._cpu_flash_heads(k, v, 4)] == [4, 4]

    def forward_and_backward(kernel):
        out, lse = kernel.forward(q, k, v, mask, 0.3)
        return out, lse, *kernel.backward(grad, q, k, v, out, lse, mask, 0.3)
    for got, want in zip(forward_and_backward(CPU_FLASH), forward_and_backward(MATH)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kernel", [MATH, CPU_FLASH], ids=lambda k: k.name)
@settings(max_examples=30, deadline=None)
@given(seq=st.integers(1, 12), heads_kv=st.integers(1, 3), group=st.integers(1, 3),
       blocks=st.integers(1, 4), causal=st.booleans(), docs=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_blockwise_merge_and_backward_equal_full_attention(kernel, seq, heads_kv, group, blocks,
                                                           causal, docs, seed):
    generator = torch.Generator().manual_seed(seed)
    batch, head_dim, heads_q = 2, 4, heads_kv * group
    q = torch.randn(batch, seq, heads_q, head_dim, generator=generator, requires_grad=True)
    k = torch.randn(batch, seq, heads_kv, head_dim, generator=generator, requires_grad=True)
    v = torch.randn(batch, seq, heads_kv, head_dim, generator=generator, requires_grad=True)
    grad_out = torch.randn(batch, seq, heads_q, head_dim, generator=generator)
    doc_ids = torch.sort(torch.randint(0, docs, (seq,), generator=generator)).values
    positions = torch.randperm(seq, generator=generator)  # any order: the mask is data
    scale = head_dim ** -0.5
    mask = attention_mask(positions, positions, doc_ids, doc_ids, causal)
    reference = _masked_attention(q, k, v, mask, scale)
    reference.backward(grad_out)

    queries, grad_o = heads_first(q.detach()), heads_first(grad_out)
    out = torch.zeros_like(queries)
    lse = torch.full(queries.shape[:-1], float("-inf"))
    tiles = []
    for cols in (b for b in torch.arange(seq).tensor_split(blocks) if len(b)):
        plan = plan_block(positions, doc_ids, positions[cols], doc_ids[cols], causal)
        if plan is None:
            continue
        keys = cols if plan.cols is None else cols[plan.cols]
        rows = torch.arange(seq) if plan.rows is None else plan.rows
        tiles.append((rows, keys, plan.mask))
        block_out, block_lse = kernel.forward(queries[:, :, rows], heads_first(k.detach()[:, keys]),
                                              heads_first(v.detach()[:, keys]), plan.mask, scale)
        merge_block(out, lse, block_out, block_lse, plan.rows)
    torch.testing.assert_close(out.transpose(1, 2), reference.detach())

    grad_q, grad_k, grad_v = torch.zeros_like(queries), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, tile_mask in tiles:
        dq, dk, dv = kernel.backward(
            grad_o[:, :, rows], queries[:, :, rows], heads_first(k.detach()[:, keys]),
            heads_first(v.detach()[:, keys]), out[:, :, rows], lse[:, :, rows], tile_mask, scale)
        grad_q.index_add_(2, rows, dq)
        grad_k.index_add_(1, keys, dk.transpose(1, 2))
        grad_v.index_add_(1, keys, dv.transpose(1, 2))
    torch.testing.assert_close(grad_q.transpose(1, 2), q.grad)
    torch.testing.assert_close(grad_k, k.grad)
    torch.testing.assert_close(grad_v, v.grad)


@settings(max_examples=200, deadline=None)
@given(heads_kv=st.integers(1, 8), group=st.integers(1, 6), ranks=st.integers(1, 8))
def test_head_deal_covers_every_query_head_with_its_kv_head(heads_kv, group, ranks):
    heads_q = heads_kv * group
    if heads_q < ranks:
        with pytest.raises(AttentionError, match=f"{heads_q} query heads .* degree of {ranks}"):
            plan_heads(heads_q, heads_kv, ranks)
        return
    plan = plan_heads(heads_q, heads_kv, ranks)
    assert [len(heads) for heads in plan.query_heads] == split_sizes(heads_q, ranks)
    assert sorted(plan.query_order()) == list(range(heads_q))
    kv_counts = [len(heads) for heads in plan.kv_heads]
    assert kv_counts == split_sizes(sum(kv_counts), ranks)
    for rank in range(ranks):
        local = plan.local_kv_index(rank)
        assert [plan.kv_heads[rank][i] for i in local] == [
            head // group for head in plan.query_heads[rank]]
    if ranks % heads_kv == 0:
        assert kv_counts == [1] * ranks  # each key/value head reaches only its ranks
    if heads_kv % ranks == 0 and heads_q % ranks == 0:
        assert sum(kv_counts) == heads_kv  # no replication at all


def test_local_attention_takes_the_causal_fast_path_for_a_plain_sequence(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    LocalAttention()(q, k, v)
    LocalAttention()(q, k, v, positions=torch.arange(6))
    assert [c.get("is_causal", False) for c in calls] == [True, True]
    assert all(c.get("attn_mask") is None for c in calls)


def test_local_attention_runs_a_pack_document_by_document_without_a_mask(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        calls.append((q.shape[2], kwargs.get("is_causal", False),
                      kwargs.get("attn_mask") is not None))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    LocalAttention()(q, k, v, doc_ids=torch.tensor([0, 0, 0, 0, 1, 1]))
    assert calls == [(4, True, False), (2, True, False)]
    calls.clear()
    # A document in two runs (positions 0-1 and 4-5 on either side of another): one mask.
    LocalAttention()(q, k, v, positions=torch.tensor([0, 1, 0, 1, 2, 3]),
                     doc_ids=torch.tensor([0, 0, 1, 1, 0, 0]))
    assert calls == [(6, False, True)]


def test_a_pack_off_the_cpu_is_one_call_with_its_mask(monkeypatch):
    """Any device but the CPU (CUDA's SDPA would plan anew for every document length) runs
    a pack as one SDPA call with its mask, which equals the per-document calls; longer
    packs still run per document."""
    from meshpipe.context import local

    assert not local._per_document(torch.empty(1, 4, 24, 8, device="meta"))
    assert local._per_document(torch.empty(1, 4, local.MASKED_PACK_TOKENS + 1, 8,
                                           device="meta"))
    assert local._per_document(torch.empty(1, 4, 24, 8))
    q, k, v = (torch.randn(1, 24, heads, 8) for heads in (4, 2, 2))
    positions = torch.cat([torch.arange(10), torch.arange(14)])
    doc_ids = torch.tensor([0] * 10 + [1] * 14)
    per_document = LocalAttention()(q, k, v, positions=positions, doc_ids=doc_ids)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        calls.append((q.shape[2], kwargs.get("attn_mask") is not None))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(local, "_per_document", lambda q: False)
    one_call = LocalAttention()(q, k, v, positions=positions, doc_ids=doc_ids)
    assert calls == [(24, True)]
    torch.testing.assert_close(one_call, per_document)


def test_a_masked_call_off_the_cpu_repeats_the_key_value_heads(monkeypatch):
    """SDPA's fused CUDA kernels take no grouped key/value heads beside a mask (it falls
    back to the math kernel); off the CPU the heads are repeated instead. Meta tensors
    stand for CUDA ones here."""
    from meshpipe.context import local

    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kwargs: calls.append(
                            (k.shape[1], kwargs["enable_gqa"])) or q)
    mask = torch.ones(24, 24, dtype=torch.bool)
    for device in ("meta", "cpu"):
        q, k, v = (torch.empty(1, heads, 24, 8, device=device) for heads in (4, 2, 2))
        local._masked_sdpa(q, k, v, mask, None, gqa=True)
    assert calls == [(4, False), (2, True)]


def test_local_attention_on_a_pack_equals_attention_per_document():
    generator = torch.Generator().manual_seed(3)
    lengths = [3, 5, 2]
    q = torch.randn(2, 10, 4, 8, generator=generator)
    k, v = torch.randn(2, 10, 2, 8, generator=generator), torch.randn(2, 10, 2, 8, generator=generator)
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    out = LocalAttention()(q, k, v, positions=positions, doc_ids=doc_ids)
    pieces = [LocalAttention()(*(t[:, s] for t in (q, k, v)))
              for s in torch.arange(10).split(lengths)]
    torch.testing.assert_close(out, torch.cat(pieces, dim=1))


@pytest.mark.parametrize("shapes, positions, message", [
    (((1, 4, 3, 8), (1, 4, 2, 8)), None, "3 query heads are not a multiple of 2"),
    (((1, 4, 2, 8), (1, 5, 2, 8)), None, "do not match q"),
    (((1, 4, 2, 8), (1, 4, 2, 8)), torch.arange(5), r"positions must have shape \[4\]"),
    (((1, 4, 2, 8), (1, 4, 2, 8)), torch.zeros(4), "must be an integer tensor"),
])
def test_bad_inputs_are_named(shapes, positions, message):
    q_shape, kv_shape = shapes
    with pytest.raises(AttentionError, match=message):
        LocalAttention()(torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape),
                         positions=positions)


def _covered(pieces, rows: int, cols: int) -> torch.Tensor:
    """How many pieces cover each (query, key) pair."""
    count = torch.zeros(rows, cols, dtype=torch.int64)
    for piece in pieces:
        r, c = piece.rows or slice(0, rows), piece.cols or slice(0, cols)
        block = torch.ones(r.stop - r.start, c.stop - c.start, dtype=torch.int64)
        if piece.causal:
            assert block.shape[0] == block.shape[1], piece
            block = block.tril()
        count[r, c] += block
    return count


@settings(max_examples=300, deadline=None)
@given(data=st.data(), doc_lens=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       documents=st.booleans(), causal=st.booleans())
def test_pieces_cover_exactly_the_mask_once(data, doc_lens, documents, causal):
    """Any two blocks cut from a pack (runs of consecutive positions, in any order): the
    pieces cover every pair the mask allows exactly once and nothing else."""
    positions = torch.cat([torch.arange(n) for n in doc_lens])
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)])
    if not documents:  # one sequence: positions are the token indices
        positions, doc_ids = torch.arange(len(positions)), None
    total = len(positions)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, total - 1)), max_size=4)))
    chunks = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, total]) if a < b]
    order = data.draw(st.permutations(range(len(chunks))))
    picks = [data.draw(st.lists(st.sampled_from(order), min_size=1, unique=True))
             for _ in range(2)]
    blocks = [torch.tensor([i for chunk in pick for i in chunks[chunk]]) for pick in picks]
    (q_pos, k_pos), docs = [positions[b] for b in blocks], [
        None if doc_ids is None else doc_ids[b] for b in blocks]
    pieces = plan_pieces(token_runs(q_pos, docs[0]), token_runs(k_pos, docs[1]), causal,
                         len(q_pos), len(k_pos))
    mask = attention_mask(q_pos, k_pos, docs[0], docs[1], causal)
    expected = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool) if mask is None else mask
    assert torch.equal(_covered(pieces, len(q_pos), len(k_pos)), expected.long())


def test_token_runs_give_up_beyond_the_limit():
    positions = torch.arange(0, 20, 2)
    assert len(token_runs(positions, None, limit=10)) == 10
    assert token_runs(positions, None, limit=9) is None
    assert token_runs(torch.arange(5), None) == [TokenRun(0, 5, 0, None)]


@pytest.mark.parametrize("size", [1, 7, 64, 65, 300, 513])
def test_split_causal_covers_the_triangle_once_with_small_causal_squares(size):
    pieces = split_causal(Piece(None, None, True), size, leaf=64)
    assert torch.equal(_covered(pieces, size, size),
                       torch.ones(size, size, dtype=torch.int64).tril())
    assert all(p.rows.stop - p.rows.start <= 64 for p in pieces if p.causal and p.rows)
    assert len(pieces) == 1 if size <= 64 else len(pieces) > 1
    # An offset square (rows 3.., keys 5..) keeps its offsets.
    shifted = split_causal(Piece(slice(3, 3 + size), slice(5, 5 + size), True), size + 3, 64)
    covered = _covered(shifted, size + 3, size + 5)[3:, 5:]
    assert torch.equal(covered, torch.ones(size, size, dtype=torch.int64).tril())


@pytest.mark.parametrize("heads_kv", [4, 2])
def test_local_attention_on_a_long_sequence_splits_the_causal_square_and_equals_sdpa(
        heads_kv, monkeypatch):
    seq = CAUSAL_LEAF + 45
    generator = torch.Generator().manual_seed(heads_kv)
    q = torch.randn(1, seq, 4, 8, generator=generator, requires_grad=True)
    k = torch.randn(1, seq, heads_kv, 8, generator=generator, requires_grad=True)
    v = torch.randn(1, seq, heads_kv, 8, generator=generator, requires_grad=True)
    grad_out = torch.randn(1, seq, 4, 8, generator=generator)
    reference = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
        enable_gqa=heads_kv != 4).transpose(1, 2)
    reference.backward(grad_out)
    expected = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    rows = []
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def spy(query, *args, **kwargs):
        rows.append((query.shape[2], args[3]))  # (query rows, is_causal)
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", spy)
    out = LocalAttention()(q, k, v)
    out.backward(grad_out)
    torch.testing.assert_close(out, reference)
    for leaf, want in zip((q, k, v), expected):
        torch.testing.assert_close(leaf.grad, want)
    assert len(rows) > 1 and all(n <= CAUSAL_LEAF for n, causal in rows if causal)
