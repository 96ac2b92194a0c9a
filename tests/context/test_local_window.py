"""LocalAttention with a sliding window and a per-call scale equals SDPA with the mask written
out: plain, packed and non-causal, and a window wider than the sequence changes nothing."""

import pytest
import torch
import torch.nn.functional as F

from meshpipe.context import LocalAttention
from meshpipe.context.masks import window_applies


def _reference(q, k, v, doc_lens, causal, window, scale):
    blocks = [torch.ones(n, n, dtype=torch.bool) for n in doc_lens]
    blocks = [b.tril() if causal else b for b in blocks]
    blocks = [b.triu(1 - window) if window is not None else b for b in blocks]
    return F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=torch.block_diag(*blocks),
        scale=scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


@pytest.mark.parametrize("doc_lens,causal,window,scale", [
    ((40,), True, 7, None), ((40,), True, 40, None), ((40,), False, 5, 0.2),
    ((9, 20, 11), True, 4, 0.3), ((300,), True, 64, None)])
def test_window_and_scale_match_the_written_out_mask(doc_lens, causal, window, scale):
    generator = torch.Generator().manual_seed(len(doc_lens) * 100 + window)
    total = sum(doc_lens)
    q = torch.randn(2, total, 4, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, total, 2, 8, generator=generator, requires_grad=True)
            for _ in range(2))
    doc_ids = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    starts = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0)[:-1].tolist()])
    positions = torch.arange(total) - starts[doc_ids]
    out = LocalAttention()(q, k, v, positions=positions,
                           doc_ids=doc_ids if len(doc_lens) > 1 else None, causal=causal,
                           window=window, scale=scale)
    grad = torch.randn(out.shape, generator=generator)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected_out = _reference(q, k, v, doc_lens, causal, window, scale)
    expected = torch.autograd.grad(expected_out, (q, k, v), grad)
    torch.testing.assert_close(out, expected_out)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_a_window_applies_only_where_a_key_is_that_far_back():
    assert not window_applies(None, None, 100)
    assert not window_applies(100, None, 100) and window_applies(99, None, 100)
    assert not window_applies(8, torch.tensor([0, 1, 2, 0, 1]), 5)


def test_soft_capped_scores_match_the_written_out_attention():
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 24, 4, 8, generator=generator) * 4
    k, v = (torch.randn(2, 24, 2, 8, generator=generator) * 4 for _ in range(2))
    cap, scale, window = 5.0, 0.3, 6
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * scale
    scores = torch.tanh(scores / cap) * cap
    allowed = torch.ones(24, 24, dtype=torch.bool).tril().triu(1 - window)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    expected = torch.einsum("bhqk,bkhd->bqhd", weights, v.repeat_interleave(2, dim=2))
    out = LocalAttention()(q, k, v, window=window, scale=scale, softcap=cap)
    torch.testing.assert_close(out, expected)
    uncapped = LocalAttention()(q, k, v, window=window, scale=scale)
    assert not torch.allclose(out, uncapped)  # the cap changes these large scores
