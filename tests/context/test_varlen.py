"""A pack on CUDA in bf16/fp16 is one call of the variable-length flash kernel per layer.

This build has no CUDA kernels, so the two aten ops are replaced by stand-ins that compute
each document with SDPA on the CPU and record their arguments: the tests check what meshpipe
hands the kernel (flattened rows, cumulative lengths per row, grouped key/value heads as
they are, the longest document) and that output and gradients come back in place. The
kernel itself is compared on a GPU (``tests/test_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpipe.context import LocalAttention, local
from meshpipe.context.varlen import Documents


def _per_document(q, k, v, cu, causal, scale):
    pieces = []
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):
        q_doc, k_doc, v_doc = (t[start:stop].transpose(0, 1) for t in (q, k, v))
        pieces.append(F.scaled_dot_product_attention(
            q_doc, k_doc, v_doc, is_causal=causal, scale=scale,
            enable_gqa=True).transpose(0, 1))
    return torch.cat(pieces)


class _StandInKernel:
    """``aten._flash_attention_forward`` / ``_backward`` computed per document on the CPU."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        aten = torch.ops.aten
        monkeypatch.setattr(aten, "_flash_attention_forward", self.forward)
        monkeypatch.setattr(aten, "_flash_attention_backward", self.backward)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
        self.calls.append(("fwd", q.shape, k.shape, cu_q.tolist(), max_q, causal, dropout))
        assert cu_q is cu_k and max_q == max_k and cu_q.dtype == torch.int32
        out = _per_document(q, k, v, cu_q, causal, scale)
        rng = torch.zeros((), dtype=torch.int64)
        return out, torch.zeros(q.shape[1], q.shape[0]), rng, rng, torch.empty(0)

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal,
                 seed, offset, *, scale):
        self.calls.append(("bwd", q.shape, k.shape, cu_q.tolist(), max_q, causal, dropout))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            _per_document(*leaves, cu_q, causal, scale).backward(grad_out)
        return tuple(leaf.grad for leaf in leaves)


@pytest.mark.parametrize("causal", [True, False])
def test_a_pack_goes_to_the_variable_length_kernel_in_one_call(monkeypatch, causal):
    kernel = _StandInKernel(monkeypatch)
    monkeypatch.setattr(local, "_varlen_takes", lambda q: True)
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 11, 8]
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    q, grad = (torch.randn(2, 24, 4, 8, generator=generator) for _ in range(2))
    k, v = (torch.randn(2, 24, 2, 8, generator=generator) for _ in range(2))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = LocalAttention()(*leaves, positions=positions, doc_ids=doc_ids, causal=causal)
        out.backward(grad)
        return [out, *(leaf.grad for leaf in leaves)]

    varlen = run()
    cumulative = [0, 5, 16, 24, 29, 40, 48]  # both rows' documents, end to end
    assert kernel.calls == [("fwd", (48, 4, 8), (48, 2, 8), cumulative, 11, causal, 0.0),
                            ("bwd", (48, 4, 8), (48, 2, 8), cumulative, 11, causal, 0.0)]
    monkeypatch.setattr(local, "_varlen_takes", lambda q: False)
    for name, got, want in zip(["out", "dq", "dk", "dv"], varlen, run()):
        torch.testing.assert_close(got, want, msg=name)


def test_packs_the_kernel_cannot_take_keep_their_paths(monkeypatch):
    """Off CUDA, in float32, or with a document in two runs (no cumulative lengths describe
    it), a pack does not go to the variable-length kernel."""
    kernel = _StandInKernel(monkeypatch)
    assert not local._varlen_takes(torch.empty(1, 8, 2, 8, dtype=torch.bfloat16))
    assert not local._varlen_takes(torch.empty(1, 8, 2, 8, device="meta"))
    monkeypatch.setattr(local, "_varlen_takes", lambda q: True)
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    LocalAttention()(q, k, v, positions=torch.tensor([0, 1, 0, 1, 2, 3]),
                     doc_ids=torch.tensor([0, 0, 1, 1, 0, 0]))
    assert kernel.calls == []


def test_documents_lay_the_rows_end_to_end():
    documents = Documents.of([3, 1], rows=3, device=torch.device("cpu"))
    assert documents.cu_seqlens.tolist() == [0, 3, 4, 7, 8, 11, 12]
    assert documents.cu_seqlens.dtype == torch.int32 and documents.longest == 3
