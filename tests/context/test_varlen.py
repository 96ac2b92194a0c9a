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

from flash_stand_in import StandInKernel
from meshpipe.context import LocalAttention, local
from meshpipe.context.masks import MAX_RUNS
from meshpipe.context.varlen import Segments, lse_per_token

NEEDS_LSE_PER_TOKEN = pytest.mark.skipif(
    not lse_per_token(), reason="this torch's variable-length kernel returns no per-token "
    "log-sum-exp: ring tiles of a pack keep a call per piece")


@pytest.mark.parametrize("causal", [True, False])
def test_a_pack_goes_to_the_variable_length_kernel_in_one_call(monkeypatch, causal):
    kernel = StandInKernel(monkeypatch)
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
    assert kernel.calls == [("fwd", (48, 4, 8), (48, 2, 8), cumulative, 11, causal, 0.0, None),
                            ("bwd", (48, 4, 8), (48, 2, 8), cumulative, 11, causal, 0.0, None)]
    monkeypatch.setattr(local, "_varlen_takes", lambda q: False)
    for name, got, want in zip(["out", "dq", "dk", "dv"], varlen, run()):
        torch.testing.assert_close(got, want, msg=name)


def test_a_pack_is_differentiated_by_the_ops_own_formula_on_meta_tensors(monkeypatch):
    """The real ops on meta tensors: a pack's call is the forward op under aten's own
    autograd node, whose backward is one call of the backward op (no Python runs in it, as
    in a Python autograd function: host time a GPU step pays per layer and microbatch)."""
    monkeypatch.setattr(local, "_varlen_takes", lambda q: True)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = (torch.empty(2, 24, heads, 8, **meta, requires_grad=True) for heads in (4, 2, 2))
    lengths = torch.tensor([5, 11, 8])
    out = LocalAttention()(q, k, v, positions=torch.cat([torch.arange(n) for n in lengths]),
                           doc_ids=torch.repeat_interleave(torch.arange(3), lengths))
    (node, _), = out.grad_fn.next_functions
    assert type(node).__name__ == "FlashAttentionBackward0"
    seen = []

    class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Recorder():
        out.backward(torch.empty_like(out))
    assert seen.count("_flash_attention_backward") == 1
    assert [t.grad.shape for t in (q, k, v)] == [t.shape for t in (q, k, v)]


def test_packs_the_kernel_cannot_take_keep_their_paths(monkeypatch):
    """Off CUDA, in float32, or with a document in two runs (no cumulative lengths describe
    it), a pack does not go to the variable-length kernel."""
    kernel = StandInKernel(monkeypatch)
    assert not local._varlen_takes(torch.empty(1, 8, 2, 8, dtype=torch.bfloat16))
    assert not local._varlen_takes(torch.empty(1, 8, 2, 8, device="meta"))
    monkeypatch.setattr(local, "_varlen_takes", lambda q: True)
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    LocalAttention()(q, k, v, positions=torch.tensor([0, 1, 0, 1, 2, 3]),
                     doc_ids=torch.tensor([0, 0, 1, 1, 0, 0]))
    assert kernel.calls == []


@pytest.mark.parametrize("packed", [True, False], ids=["a pack", "a plain sequence"])
def test_a_sliding_window_goes_to_the_variable_length_kernel(monkeypatch, packed):
    """A window shorter than the sequence: the documents (a plain sequence: one per row) in
    one call with the kernel's window of ``window - 1`` keys back, equal to the masked path."""
    from meshpipe.context.varlen import takes_windows

    assert takes_windows()  # this torch's ops take a window
    kernel = StandInKernel(monkeypatch)
    monkeypatch.setattr(local, "_varlen_takes", lambda q: True)
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 11, 8] if packed else [24]
    layout = {}
    if packed:
        layout = dict(doc_ids=torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)),
                      positions=torch.cat([torch.arange(n) for n in lengths]))
    q, k, v = (torch.randn(2, 24, heads, 8, generator=generator) for heads in (4, 2, 2))
    out = LocalAttention()(q, k, v, window=4, **layout)
    ((_, _, _, cumulative, _, causal, _, left),) = kernel.calls
    ends = torch.tensor(lengths).cumsum(0).tolist()
    assert (cumulative, causal, left) == ([0, *ends, *(24 + end for end in ends)], True, 3)
    monkeypatch.setattr(local, "_varlen_takes", lambda q: False)
    torch.testing.assert_close(out, LocalAttention()(q, k, v, window=4, **layout))
    monkeypatch.setattr(local, "_varlen_takes", lambda q: True)
    monkeypatch.setattr(local, "takes_windows", lambda: False)  # an older torch's ops
    LocalAttention()(q, k, v, window=4, **layout)
    assert len(kernel.calls) == 1


def test_segments_lay_the_rows_end_to_end():
    segments = Segments.of([3, 1], [2, 5], rows=3, device=torch.device("cpu"), causal=False)
    assert segments.cu_q.tolist() == [0, 3, 4, 7, 8, 11, 12]
    assert segments.cu_k.tolist() == [0, 2, 7, 9, 14, 16, 21]
    assert segments.cu_q.dtype == segments.cu_k.dtype == torch.int32
    assert (segments.longest_q, segments.longest_k) == (3, 5)


def test_pieces_that_tile_both_blocks_in_order_join_into_segments():
    from meshpipe.context.masks import Piece
    from meshpipe.context.varlen import segments_of

    cpu = torch.device("cpu")
    squares = [Piece(slice(0, 3), slice(0, 3), True), Piece(slice(3, 7), slice(3, 7), True)]
    joined = segments_of(squares, 7, 7, rows=2, device=cpu)
    assert joined.cu_q.tolist() == joined.cu_k.tolist() == [0, 3, 7, 10, 14]
    assert joined.causal and (joined.longest_q, joined.longest_k) == (4, 4)
    rectangles = [Piece(slice(0, 3), slice(0, 2), False), Piece(slice(3, 7), slice(2, 5), False)]
    assert segments_of(rectangles, 7, 5, rows=1, device=cpu).cu_k.tolist() == [0, 2, 5]
    for pieces, q_count, k_count in (
            (squares[:1], 3, 3),  # one piece: a plain tile
            ([squares[0], Piece(slice(3, 7), slice(3, 7), False)], 7, 7),  # causal and not
            (squares, 8, 7),  # a query row left out
            (squares[::-1], 7, 7),  # out of order
            ([squares[0], Piece(slice(3, 7), slice(0, 4), True)], 7, 7)):  # keys twice
        assert segments_of(pieces, q_count, k_count, rows=1, device=cpu) is None, pieces


@NEEDS_LSE_PER_TOKEN
def test_a_segments_tile_calls_the_variable_length_ops_on_meta_tensors():
    """The CUDA half-precision kernel with a ``Segments`` mask: the blocks go to the op
    flattened to tokens, the log-sum-exp comes back per row as ``[b, h, s]`` and goes to the
    backward per token, ``[h, b * s]``; grouped key/value heads as they are."""
    from meshpipe.context.blockwise import kernel_for

    kernel = kernel_for(torch.device("cuda"), dtype=torch.bfloat16)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, grad_out = (torch.empty(2, 4, 7, 16, **meta) for _ in range(2))
    k, v = (torch.empty(2, 2, 5, 16, **meta) for _ in range(2))
    segments = Segments.of([3, 4], [2, 3], rows=2, device=torch.device("meta"), causal=False)
    seen = []

    class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "flash" in func.overloadpacket.__name__:
                seen.append((func.overloadpacket.__name__, [
                    tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    with Recorder():
        out, lse = kernel.forward(q, k, v, segments, 0.25)
        grads = kernel.backward(grad_out, q, k, v, out.bfloat16(), lse, segments, 0.25)
    assert out.shape == (2, 4, 7, 16) and lse.shape == (2, 4, 7)
    assert out.dtype == lse.dtype == torch.float32
    assert [tuple(g.shape) for g in grads] == [(2, 4, 7, 16), (2, 2, 5, 16), (2, 2, 5, 16)]
    assert [g.dtype for g in grads] == [torch.float32] * 3
    (forward, forward_shapes), (backward, backward_shapes) = seen
    assert forward == "_flash_attention_forward" and backward == "_flash_attention_backward"
    assert forward_shapes[:3] == [(14, 4, 16), (10, 2, 16), (10, 2, 16)]
    assert backward_shapes[5] == (4, 14)  # the log-sum-exp per token


def _emulated_varlen_ops():
    """CPU stand-ins for the variable-length flash ops with the kernel's semantics: segment
    ``i`` of the queries against segment ``i`` of the keys on the math kernel, log-sum-exp
    ``[heads, tokens]``, and a backward that reads the output and log-sum-exp it is given."""
    from meshpipe.context.blockwise import CAUSAL, MATH

    def pieces(cu_q, cu_k):
        return zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                   zip(cu_k[:-1].tolist(), cu_k[1:].tolist()))

    def heads(x, rows):  # [tokens, h, d] rows -> [1, h, n, d]
        return x[rows[0]:rows[1]].transpose(0, 1).unsqueeze(0)

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale=None):
        out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0])
        for rows, cols in pieces(cu_q, cu_k):
            assert not causal or rows[1] - rows[0] == cols[1] - cols[0]
            o, l = MATH.forward(heads(q, rows), heads(k, cols), heads(v, cols),
                                CAUSAL if causal else None, scale)
            out[rows[0]:rows[1]] = o[0].transpose(0, 1)
            lse[:, rows[0]:rows[1]] = l[0]
        rng = torch.zeros((), dtype=torch.int64)
        return out, lse, rng, rng, torch.empty(0)

    def backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal,
                 seed, offset, *, scale=None):
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for rows, cols in pieces(cu_q, cu_k):
            dq, dk, dv = MATH.backward(
                heads(grad_out, rows), heads(q, rows), heads(k, cols), heads(v, cols),
                heads(out, rows), lse[:, rows[0]:rows[1]].unsqueeze(0),
                CAUSAL if causal else None, scale)
            for grad, part, span in zip(grads, (dq, dk, dv), (rows, cols, cols)):
                grad[span[0]:span[1]] += part[0].transpose(0, 1)
        return tuple(grads)
    return forward, backward


def _packed_ring_on_segments(rank: int, world: int,
                             lengths: list[int]) -> list[tuple[int, bool]]:
    """A packed ring (every document split across the ranks) on the CUDA half kernel's
    wiring, in float32 with the emulated variable-length ops: output and gradients against
    SDPA over the whole pack; returns each ring step's tiles as (count, all Segments)."""
    from meshpipe.context import RingAttention, ring
    from meshpipe.context.blockwise import (MATH, BlockKernel, _cuda_half_backward,
                                            _cuda_half_forward)
    from meshpipe.context.shards import ShardLayout
    from meshpipe.context.varlen import lse_per_token

    torch.set_num_threads(1)
    shards = ShardLayout.packed(lengths, world)
    held = shards.positions(rank)
    all_doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
    generator = torch.Generator().manual_seed(2)
    seq = sum(lengths)
    q, grad = (torch.randn(2, seq, 4, 8, generator=generator) for _ in range(2))
    k, v = (torch.randn(2, seq, 2, 8, generator=generator) for _ in range(2))
    mask = torch.ones(seq, seq, dtype=torch.bool).tril() & (
        all_doc_ids[:, None] == all_doc_ids[None, :])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), attn_mask=mask,
                                         enable_gqa=True).transpose(1, 2)
    ref.backward(grad)

    def forward(q, k, v, mask, scale):
        return (_cuda_half_forward if isinstance(mask, Segments) else MATH.forward)(
            q, k, v, mask, scale)

    def backward(grad_out, q, k, v, out, lse, mask, scale):
        return (_cuda_half_backward if isinstance(mask, Segments) else MATH.backward)(
            grad_out, q, k, v, out, lse, mask, scale)

    stand_in = BlockKernel("segments on math", forward, backward, causal_leaf=None,
                           takes_segments=True)
    planned = []

    def plan_ring(*args, _plan=ring._plan_ring):
        planned.extend(_plan(*args))
        return planned

    assert lse_per_token()  # asked of the real op's meta kernel before the stand-ins go in
    aten = torch.ops.aten
    saved = (ring.kernel_for, ring.flash_takes, ring._plan_ring,
             aten._flash_attention_forward, aten._flash_attention_backward)
    ring.kernel_for = lambda device, softcap=None, dtype=torch.float32: stand_in
    ring.flash_takes = lambda q: True
    ring._plan_ring = plan_ring
    aten._flash_attention_forward, aten._flash_attention_backward = _emulated_varlen_ops()
    try:
        local_doc_ids = all_doc_ids[held]
        local = [t[:, held].clone().requires_grad_() for t in (q, k, v)]
        out = RingAttention()(*local, positions=held - starts[local_doc_ids],
                              doc_ids=local_doc_ids)
        out.backward(grad[:, held])
    finally:
        (ring.kernel_for, ring.flash_takes, ring._plan_ring, aten._flash_attention_forward,
         aten._flash_attention_backward) = saved
    torch.testing.assert_close(out, ref[:, held].detach())
    for mine, full in zip(local, leaves):
        torch.testing.assert_close(mine.grad, full.grad[:, held])
    return [(len(tiles), all(isinstance(tile.mask, Segments) for tile in tiles))
            for tiles in planned]


@NEEDS_LSE_PER_TOKEN
@pytest.mark.distributed
@pytest.mark.parametrize("lengths", [[6, 10, 4, 8], [2] * (MAX_RUNS + 6)],
                         ids=["4 documents", "more documents than MAX_RUNS"])
def test_a_packed_ring_step_is_one_variable_length_call(lengths):
    """Each ring step of a pack is one tile of segments: rank 0's own block (every
    document's causal square), nothing from rank 1's later halves; rank 1's own block, and
    rank 0's earlier halves (every document's unmasked rectangle). Blocks of more runs than
    the per-piece planner takes still join."""
    from meshpipe.testing import run_distributed

    assert run_distributed(2, _packed_ring_on_segments, lengths) == [
        [(1, True), (0, True)], [(1, True), (1, True)]]


def test_a_pack_of_many_documents_is_still_one_call(monkeypatch):
    kernel = StandInKernel(monkeypatch)
    monkeypatch.setattr(local, "_varlen_takes", lambda q: True)
    documents = MAX_RUNS + 36
    doc_ids = torch.arange(documents).repeat_interleave(2)
    positions = torch.arange(2).repeat(documents)
    q, k, v = (torch.randn(1, 2 * documents, heads, 8) for heads in (4, 2, 2))
    out = LocalAttention()(q, k, v, positions=positions, doc_ids=doc_ids)
    ((tag, *_, cumulative, longest, causal, _, _),) = kernel.calls
    assert (tag, len(cumulative), longest, causal) == ("fwd", documents + 1, 2, True)
    monkeypatch.setattr(local, "_varlen_takes", lambda q: False)
    torch.testing.assert_close(out, LocalAttention()(q, k, v, positions=positions,
                                                     doc_ids=doc_ids))
