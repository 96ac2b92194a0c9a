"""Ring attention tiles run on the CPU flash kernel's own modes where the tile allows it.

The diagonal tile of a causal layout (zigzag or contiguous) is the square lower triangle and
must run with ``is_causal=True`` (the kernel then skips the masked half); an unmasked tile
must run with no mask at all. Packed documents and other runs of consecutive positions are
cut into unmasked or causal rectangles; only scattered positions go to the kernel with an
additive mask. The aten ops are replaced by recorders that pass through, so these tests
fail if a tile takes the additive-mask path where the fused modes apply.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshpipe.context.shards import contiguous_positions, packed_positions, zigzag_positions
from meshpipe.context import RingAttention
from meshpipe.context.tiles import CAUSAL_LEAF
from meshpipe.context.blockwise import CAUSAL, CPU_FLASH, CUDA_EFFICIENT, MATH, kernel_for, tile_mask
from meshpipe.context.masks import MAX_RUNS
from meshpipe.testing import run_distributed

pytestmark = pytest.mark.distributed

_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


class _Recorder:
    """Replaces the two CPU flash aten ops with pass-through wrappers that record
    ``(op, is_causal, has_attn_mask, s_q, s_k)`` per call."""

    def __init__(self):
        self.calls: list[tuple[str, bool, bool, int, int]] = []
        self._saved = {}

    def __enter__(self) -> _Recorder:
        aten = torch.ops.aten
        for name, tag, q_index, causal_index in ((_FORWARD, "fwd", 0, 4),
                                                 (_BACKWARD, "bwd", 1, 7)):
            original = getattr(aten, name)
            self._saved[name] = original

            def wrapper(*args, _original=original, _tag=tag, _q=q_index, _c=causal_index,
                        **kwargs):
                self.calls.append((_tag, bool(args[_c]), kwargs.get("attn_mask") is not None,
                                   args[_q].shape[2], args[_q + 1].shape[2]))
                return _original(*args, **kwargs)
            setattr(aten, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.ops.aten, name, original)


def _sdpa_reference(q, k, v, grad_out, causal):
    """SDPA on ``[b, h, s, d]`` float32 with autograd: ``(out, dq, dk, dv)``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                         enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad_out)
    return out.detach(), *(leaf.grad for leaf in leaves)


def test_tile_mask_recognises_the_causal_triangle_only():
    tri = torch.ones(5, 5, dtype=torch.bool).tril()
    assert tile_mask(tri) is CAUSAL
    assert tile_mask(None) is None
    shifted = torch.ones(5, 5, dtype=torch.bool).tril(1)
    assert tile_mask(shifted) is shifted
    rect = torch.ones(3, 5, dtype=torch.bool).tril()
    assert tile_mask(rect) is rect
    packed = tri.clone()
    packed[3:, :3] = False
    assert tile_mask(packed) is packed


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])
def test_fused_tile_forward_backward_equal_sdpa(causal, heads_kv):
    generator = torch.Generator().manual_seed(heads_kv + 10 * causal)
    b, hq, s, d = 2, 4, 37, 16
    q = torch.randn(b, hq, s, d, generator=generator)
    k = torch.randn(b, heads_kv, s, d, generator=generator)
    v = torch.randn(b, heads_kv, s, d, generator=generator)
    grad_out = torch.randn(b, hq, s, d, generator=generator)
    scale = d ** -0.5
    mask = CAUSAL if causal else None
    ref_out, ref_dq, ref_dk, ref_dv = _sdpa_reference(q, k, v, grad_out, causal)

    with _Recorder() as recorder:
        out, lse = CPU_FLASH.forward(q, k, v, mask, scale)
        dq, dk, dv = CPU_FLASH.backward(grad_out, q, k, v, out, lse, mask, scale)
    assert recorder.calls == [("fwd", causal, False, s, s), ("bwd", causal, False, s, s)]
    assert lse.shape == (b, hq, s) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(dq, ref_dq)
    torch.testing.assert_close(dk, ref_dk)
    torch.testing.assert_close(dv, ref_dv)

    # The math kernel reads CAUSAL the same way.
    math_out, math_lse = MATH.forward(q, k, v, mask, scale)
    torch.testing.assert_close(math_out, ref_out)
    torch.testing.assert_close(math_lse, lse)
    for got, want in zip(MATH.backward(grad_out, q, k, v, out, lse, mask, scale),
                         (ref_dq, ref_dk, ref_dv)):
        torch.testing.assert_close(got, want)


def _ring_calls(rank: int, world: int, layout: str, heads_kv: int, seq: int = 24) -> dict:
    torch.set_num_threads(1)
    heads_q, head_dim, batch = 4, 8, 2
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(batch, seq, heads_q, head_dim, generator=generator)
    k = torch.randn(batch, seq, heads_kv, head_dim, generator=generator)
    v = torch.randn(batch, seq, heads_kv, head_dim, generator=generator)
    grad_out = torch.randn(batch, seq, heads_q, head_dim, generator=generator)
    doc_ids = None
    if layout == "zigzag":
        positions = zigzag_positions(seq, world, rank)
    elif layout == "contiguous":
        positions = contiguous_positions(seq, world, rank)
    elif layout == "strided":
        positions = torch.arange(rank, seq, world)
    elif layout == "shuffled":
        positions = torch.randperm(seq, generator=torch.Generator().manual_seed(5))[rank::world]
    else:
        doc_lens = (7, 12, 5)
        positions = packed_positions(doc_lens, world, rank)
        doc_ids = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))

    # Reference: SDPA over the full sequence (packed: block-diagonal causal mask).
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    if doc_ids is not None:
        mask &= doc_ids.unsqueeze(1) == doc_ids.unsqueeze(0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in leaves), attn_mask=mask,
        enable_gqa=heads_kv != heads_q).transpose(1, 2)
    ref.backward(grad_out)

    local = [t[:, positions].clone().requires_grad_() for t in (q, k, v)]
    with _Recorder() as recorder:
        out = RingAttention()(*local, positions=positions,
                              doc_ids=None if doc_ids is None else doc_ids[positions],
                              causal=True)
        out.backward(grad_out[:, positions])
    torch.testing.assert_close(out, ref[:, positions].detach())
    for mine, full in zip(local, leaves):
        torch.testing.assert_close(mine.grad, full.grad[:, positions])
    return {"calls": recorder.calls, "local": len(positions)}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world,heads_kv", [(2, 4), (2, 1), (4, 2)])
def test_ring_tiles_route_to_fused_modes(layout, world, heads_kv):
    results = run_distributed(world, _ring_calls, layout, heads_kv)
    for rank, result in enumerate(results):
        calls = result["calls"]
        assert calls, f"rank {rank}: the CPU flash kernel was never called"
        assert not any(has_mask for _, _, has_mask, _, _ in calls), (
            f"rank {rank}: a tile went through the additive-mask path: {calls}")
        n = result["local"]
        # Exactly one diagonal tile per pass, in the kernel's causal mode, on the whole block.
        for tag in ("fwd", "bwd"):
            causal_calls = [c for c in calls if c[0] == tag and c[1]]
            assert causal_calls == [(tag, True, False, n, n)], (rank, calls)
        assert sum(1 for c in calls if c[0] == "fwd") == sum(1 for c in calls if c[0] == "bwd")


def test_packed_tiles_run_document_by_document_without_a_mask():
    results = run_distributed(2, _ring_calls, "packed", 2)
    for rank, result in enumerate(results):
        calls = result["calls"]
        assert not any(has_mask for _, _, has_mask, _, _ in calls), (rank, calls)
        assert any(causal for _, causal, _, _, _ in calls), (rank, calls)


def test_scattered_positions_fall_back_to_the_additive_mask():
    """Shuffled tokens: more runs of consecutive positions than MAX_RUNS on each rank, so the
    tiles are planned with a materialised mask (and still equal SDPA)."""
    seq = 4 * MAX_RUNS
    for result in run_distributed(2, _ring_calls, "shuffled", 2, seq):
        assert any(has_mask for _, _, has_mask, _, _ in result["calls"])


def test_every_other_token_is_cut_into_pieces():
    for result in run_distributed(2, _ring_calls, "strided", 2):
        assert not any(has_mask for _, _, has_mask, _, _ in result["calls"])


def test_bfloat16_ring_matches_float32_contract():
    """bf16 inputs: tiles still compute in float32 (as before), the output comes back bf16."""
    results = run_distributed(2, _bf16_ring)
    for error in results:
        assert error < 2e-2


def _bf16_ring(rank: int, world: int) -> float:
    torch.set_num_threads(1)
    seq, heads, head_dim = 16, 2, 8
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, seq, heads, head_dim, generator=generator) for _ in range(3))
    positions = zigzag_positions(seq, world, rank)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         is_causal=True).transpose(1, 2)[:, positions]
    with _Recorder() as recorder:
        out = RingAttention()(*(t[:, positions].bfloat16() for t in (q, k, v)),
                              positions=positions, causal=True)
    assert out.dtype == torch.bfloat16
    assert any(causal for _, causal, _, _, _ in recorder.calls)
    return float((out.float() - ref).abs().max())


def test_long_diagonal_tiles_are_halved_and_stay_exact():
    """Blocks longer than CAUSAL_LEAF: the diagonal tile runs as causal squares of at most
    CAUSAL_LEAF rows plus unmasked rectangles (values checked against SDPA inside)."""
    seq = 2 * 2 * (CAUSAL_LEAF + 4)
    for rank, result in enumerate(run_distributed(2, _ring_calls, "zigzag", 2, seq)):
        causal_rows = [s_q for _, causal, _, s_q, _ in result["calls"] if causal]
        assert causal_rows and max(causal_rows) <= CAUSAL_LEAF, (rank, result["calls"])
        assert not any(has_mask for _, _, has_mask, _, _ in result["calls"])


class _EfficientRecorder(TorchDispatchMode):
    """Records the arguments (by name, defaults filled in) of every memory-efficient attention
    op called under it (this CPU build runs those ops on the meta device only)."""

    NAMES = ("_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_efficient_attention_backward")

    def __init__(self):
        super().__init__()
        self.calls: dict[str, list[dict]] = {name: [] for name in self.NAMES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in self.calls:
            named = {arg.name: arg.default_value for arg in func._schema.arguments}
            named.update(zip(named, args), **kwargs)
            self.calls[name].append(named)
        return func(*args, **kwargs)


def test_kernel_for_picks_each_devices_lse_kernel():
    assert kernel_for(torch.device("cpu")) is CPU_FLASH
    assert kernel_for(torch.device("cuda", 0)) is CUDA_EFFICIENT
    assert kernel_for(torch.device("meta")) is MATH


@pytest.mark.parametrize("mask_kind", ["causal", "none", "explicit"])
def test_cuda_efficient_tile_calls_the_aten_ops_with_their_shapes(mask_kind):
    """The CUDA kernel's wiring, run on meta tensors (this build has no CUDA kernels): grouped
    key/value heads repeated for the op and their gradients summed back, the log-sum-exp
    cut from the op's 32-row padding to the tile's rows and padded again for the backward,
    whose kernel needs its head and batch strides to be multiples of 8 (a tile of 37 rows
    failed on the GPU with 'LSE is not correctly aligned'), an explicit mask as a 4-d additive
    bias whose rows are 16-element aligned, CAUSAL as the op's own causal mode."""
    b, hq, hkv, s_q, s_k, d = 2, 4, 2, 37, 37 if mask_kind == "causal" else 21, 16
    meta = dict(device="meta")
    q, grad_out = torch.empty(b, hq, s_q, d, **meta), torch.empty(b, hq, s_q, d, **meta)
    k, v = torch.empty(b, hkv, s_k, d, **meta), torch.empty(b, hkv, s_k, d, **meta)
    mask = {"causal": CAUSAL, "none": None,
            "explicit": torch.ones(s_q, s_k, dtype=torch.bool, **meta)}[mask_kind]

    with _EfficientRecorder() as recorder:
        out, lse = CUDA_EFFICIENT.forward(q, k, v, mask, 0.25)
        dq, dk, dv = CUDA_EFFICIENT.backward(grad_out, q, k, v, out, lse, mask, 0.25)

    assert out.shape == (b, hq, s_q, d) and lse.shape == (b, hq, s_q)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    (forward_args,) = recorder.calls[_EfficientRecorder.NAMES[0]]
    (backward_args,) = recorder.calls[_EfficientRecorder.NAMES[1]]
    for args in forward_args, backward_args:
        assert args["key"].shape == args["value"].shape == (b, hq, s_k, d)
        assert args["is_causal"] == (mask_kind == "causal") and args["scale"] == 0.25
        assert args["dropout_p"] == 0.0
        if mask_kind == "explicit":
            bias = args["attn_bias"]
            assert bias.shape == (b, hq, s_q, s_k) and bias.stride(2) % 16 == 0
        else:
            assert args["attn_bias"] is None
    assert forward_args["compute_log_sumexp"] is True
    assert backward_args["grad_input_mask"] == [True, True, True, False]
    backward_lse = backward_args["logsumexp"]
    assert backward_lse.shape == (b, hq, 64) and backward_lse.is_contiguous()
    assert backward_lse.stride(1) % 8 == 0 and backward_lse.stride(0) % 8 == 0


def test_the_efficient_kernels_lse_goes_back_in_its_padded_layout_with_its_values():
    from meshpipe.context.blockwise import _efficient_lse

    lse = torch.randn(2, 3, 37)
    padded = _efficient_lse(lse)
    assert padded.shape == (2, 3, 64) and padded.stride()[:2] == (192, 64)
    assert torch.equal(padded[..., :37], lse)


def test_kernel_for_takes_the_flash_kernel_for_half_precision_on_cuda():
    cuda = torch.device("cuda", 0)
    for dtype in (torch.bfloat16, torch.float16):
        kernel = kernel_for(cuda, dtype=dtype)
        assert (kernel.name, kernel.dtype, kernel.causal_leaf) == ("cuda_flash", dtype, None)
    assert kernel_for(cuda, dtype=torch.float32) is CUDA_EFFICIENT
    assert kernel_for(torch.device("cpu"), dtype=torch.bfloat16) is CPU_FLASH
    assert kernel_for(cuda, softcap=30.0, dtype=torch.bfloat16).name == "math softcap 30.0"


_FLASH_OPS = ("_scaled_dot_product_flash_attention",
              "_scaled_dot_product_flash_attention_backward")


@pytest.mark.parametrize("mask_kind,head_dim,expected", [
    ("causal", 16, "flash"), ("none", 128, "flash"), ("explicit", 16, "efficient"),
    ("causal", 12, "efficient")])
def test_half_precision_cuda_tiles_go_to_the_flash_kernel(mask_kind, head_dim, expected):
    """On meta tensors (this build has no CUDA kernels): a bf16 causal or unmasked tile calls
    the flash ops with the operands in bf16 and grouped key/value heads as they are; a tile
    with an explicit mask, or a head size flash cannot take, calls the memory-efficient ops
    in bf16. Outputs, log-sum-exp and gradients come back float32."""
    kernel = kernel_for(torch.device("cuda"), dtype=torch.bfloat16)
    b, hq, hkv, s_q, s_k = 2, 4, 2, 37, 37 if mask_kind == "causal" else 21
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, grad_out = (torch.empty(b, hq, s_q, head_dim, **meta) for _ in range(2))
    k, v = (torch.empty(b, hkv, s_k, head_dim, **meta) for _ in range(2))
    mask = {"causal": CAUSAL, "none": None,
            "explicit": torch.ones(s_q, s_k, dtype=torch.bool, device="meta")}[mask_kind]
    recorder = _EfficientRecorder()
    recorder.calls.update({name: [] for name in _FLASH_OPS})
    with recorder:
        out, lse = kernel.forward(q, k, v, mask, 0.25)
        grads = kernel.backward(grad_out, q, k, v, out.bfloat16(), lse, mask, 0.25)

    ops = _FLASH_OPS if expected == "flash" else _EfficientRecorder.NAMES
    assert {name for name, calls in recorder.calls.items() if calls} == set(ops)
    (forward_args,), (backward_args,) = (recorder.calls[name] for name in ops)
    assert forward_args["query"].dtype == forward_args["key"].dtype == torch.bfloat16
    grad_out_arg = backward_args.get("grad_out", backward_args.get("grad_out_"))
    assert grad_out_arg.dtype == backward_args["out"].dtype == torch.bfloat16
    assert forward_args["is_causal"] == backward_args["is_causal"] == (mask_kind == "causal")
    if expected == "flash":
        assert forward_args["key"].shape[1] == backward_args["value"].shape[1] == hkv
        assert backward_args["logsumexp"].is_contiguous()
    assert out.dtype == lse.dtype == torch.float32 and out.shape == (b, hq, s_q, head_dim)
    assert [grad.dtype for grad in grads] == [torch.float32] * 3
    assert [grad.shape for grad in grads] == [q.shape, k.shape, v.shape]


def _half_precision_ring(rank: int, world: int, seq: int) -> list[tuple]:
    """A zigzag ring in bf16 on a stand-in for the CUDA flash kernel (the math kernel taking
    bf16 operands, whole causal squares): output and gradients against float32 SDPA on the
    same bf16-rounded values; returns the dtypes and row counts the kernel was given."""
    from meshpipe.context import ring
    from meshpipe.context.blockwise import BlockKernel

    torch.set_num_threads(1)
    seen = []

    def forward(q, k, v, mask, scale):
        seen.append(("fwd", q.dtype, k.dtype, mask is CAUSAL, q.shape[2]))
        return MATH.forward(q.float(), k.float(), v.float(), mask, scale)

    def backward(grad_out, q, k, v, out, lse, mask, scale):
        seen.append(("bwd", grad_out.dtype, out.dtype, mask is CAUSAL, q.shape[2]))
        return MATH.backward(*(t.float() for t in (grad_out, q, k, v, out)), lse, mask, scale)

    half = BlockKernel("half math", forward, backward, dtype=torch.bfloat16, causal_leaf=None)
    generator = torch.Generator().manual_seed(11)
    q, grad_out = (torch.randn(1, seq, 4, 8, generator=generator).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, seq, 2, 8, generator=generator).bfloat16() for _ in range(2))
    positions = zigzag_positions(seq, world, rank)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True,
                                         enable_gqa=True).transpose(1, 2)
    ref.backward(grad_out.float())
    local = [t[:, positions].clone().requires_grad_() for t in (q, k, v)]
    original = ring.kernel_for
    ring.kernel_for = lambda device, softcap=None, dtype=torch.float32: half
    try:
        out = RingAttention()(*local, positions=positions)
        out.backward(grad_out[:, positions])
    finally:
        ring.kernel_for = original
    tolerance = dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref[:, positions].detach(), **tolerance)
    for mine, full in zip(local, leaves):
        assert mine.grad.dtype == torch.bfloat16
        torch.testing.assert_close(mine.grad.float(), full.grad[:, positions], **tolerance)
    return seen


def test_a_half_precision_kernel_gets_its_own_dtype_and_whole_causal_squares():
    """The tile machinery with a kernel whose ``dtype`` is bf16 (the CUDA flash kernel's
    contract): q/k/v, the output gradient and the final output reach it in bf16, the running
    output merges in float32, and a block longer than CAUSAL_LEAF is one causal tile."""
    seq = 4 * (CAUSAL_LEAF + 4)
    for rank, seen in enumerate(run_distributed(2, _half_precision_ring, seq)):
        assert {(first, second) for _, first, second, _, _ in seen} == {
            (torch.bfloat16, torch.bfloat16)}, (rank, seen)
        causal_rows = {(tag, rows) for tag, _, _, causal, rows in seen if causal}
        assert causal_rows == {("fwd", seq // 2), ("bwd", seq // 2)}, (rank, seen)
