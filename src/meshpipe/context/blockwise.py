"""Blockwise attention kernels that return the log-sum-exp, and the merge of partial results.

Ring attention computes its queries against one key/value block at a time and merges the
partial outputs; in backward it needs the gradient of one block's share given the *final*
output and log-sum-exp. Two kernels do this:

- ``CPU_FLASH``: PyTorch's CPU flash-attention kernel (the one SDPA uses on CPU), called
  through its aten ops, which return the log-sum-exp and accept it back in backward. Since
  torch 2.9 it supports grouped-query attention natively (key/value gradients come out
  summed over each group); for an older torch the grouped heads are repeated and their
  gradients summed back. It takes an additive mask. About 3x faster than the math kernel
  on CPU.
- ``CUDA_EFFICIENT``: PyTorch's memory-efficient CUDA kernel (the one SDPA uses for float32
  on CUDA; the flash kernel takes only half precision), through its aten ops. It takes an
  additive bias instead of a mask and the same number of query and key/value heads, so
  grouped key/value heads are repeated for it and their gradients summed back; its
  log-sum-exp comes padded to a multiple of 32 rows and is cut to the tile's, and goes back
  to its backward padded again (the kernel reads it with a head stride of a multiple of 8).
- ``cuda_flash`` (``kernel_for(cuda, dtype=bf16 or fp16)``): tiles in half precision on
  CUDA take the operands in their own dtype (``BlockKernel.dtype``) to PyTorch's flash
  kernel, which returns the log-sum-exp and takes it back in backward and runs grouped
  key/value heads natively; a tile with an explicit mask (which flash cannot take) runs on
  the memory-efficient kernel in the same dtype, and a tile whose mask is
  ``varlen.Segments`` (many pieces of a pack) as one variable-length flash call. Outputs and
  gradients come back in float32, where tiles merge and accumulate.
- ``MATH``: the same computation in plain tensor operations, for any device; with a
  soft-cap (``kernel_for(device, softcap)``) the scores are capped before the softmax and
  the cap's slope enters the score gradients.

Kernels take layouts ``q``: ``[b, hq, s_q, d]``, ``k``/``v``: ``[b, hkv, s_k,
d]``, log-sum-exp ``[b, hq, s_q]``; ``mask`` is boolean ``[s_q, s_k]`` (True = may attend),
None (no mask), or ``CAUSAL``: the square lower-triangular mask, which ``CPU_FLASH`` runs as
the kernel's own causal mode (``is_causal=True``), skipping the masked half of the tile instead
of computing it under an additive mask. ``tile_mask`` turns a plan's boolean mask into
``CAUSAL`` when it is exactly that triangle. Every query row must attend at least one key of
the block: callers compact blocks to their live rows (``masks.plan_block``), so no row is
ever fully masked. Kernels that skip masked work only in whole blocks of their own size
(the CPU's) have a ``causal_leaf``: causal squares longer than it are halved
(``masks.split_causal``); the CUDA kernels skip masked blocks themselves and take a causal
square whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial
from typing import Callable

import torch
from torch import Tensor

from . import varlen
from .varlen import no_rng_state


class _Causal:
    """The square lower-triangular tile mask (query ``i`` attends keys ``0..i``)."""

    def __repr__(self) -> str:
        return "CAUSAL"


CAUSAL = _Causal()
TileMask = Tensor | _Causal | varlen.Segments | None

Forward = Callable[[Tensor, Tensor, Tensor, TileMask, float], tuple[Tensor, Tensor]]
Backward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, TileMask, float],
                    tuple[Tensor, Tensor, Tensor]]


def tile_mask(mask: Tensor | None) -> TileMask:
    """``CAUSAL`` when ``mask`` is the square lower triangle (the diagonal tile of a causal
    layout whose positions increase), else ``mask`` unchanged."""
    if mask is None or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        return mask
    if torch.equal(mask, torch.ones_like(mask).tril()):
        return CAUSAL
    return mask


def _boolean(mask: TileMask, q: Tensor, k: Tensor) -> Tensor | None:
    """``mask`` as a boolean tensor (or None), materialising ``CAUSAL``."""
    if mask is CAUSAL:
        return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return mask


CAUSAL_LEAF = 256
"""Causal squares longer than this are cut into halves for the CPU's kernels."""


@dataclass(frozen=True)
class BlockKernel:
    """``forward(q, k, v, mask, scale) -> (out, lse)`` and
    ``backward(grad_out, q, k, v, out, lse, mask, scale) -> (dq, dk, dv)``, where ``out`` and
    ``lse`` given to backward are the final ones over all blocks. q, k, v, ``grad_out`` and
    ``out`` go in as ``dtype``; outputs, log-sum-exp and gradients come back in float32.
    ``causal_leaf``: the longest causal square worth one call (None: any).
    ``takes_segments``: whether a tile's mask may be ``varlen.Segments`` (many pieces, one
    variable-length call)."""

    name: str
    forward: Forward
    backward: Backward
    dtype: torch.dtype = torch.float32
    causal_leaf: int | None = CAUSAL_LEAF
    takes_segments: bool = False


def heads_first(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``[b, s, h, d]`` -> ``[b, h, s, d]`` in ``dtype`` (a view when it already is)."""
    return x.transpose(1, 2).to(dtype)


def _grouped(x: Tensor, heads_kv: int) -> Tensor:
    """``[b, hq, s, d]`` -> ``[b, hkv, g, s, d]``: query head ``i`` uses key/value head ``i // g``."""
    batch, heads_q, seq, head_dim = x.shape
    return x.view(batch, heads_kv, heads_q // heads_kv, seq, head_dim)


def _masked_scores(q: Tensor, k: Tensor, mask: TileMask, scale: float,
                   softcap: float | None = None) -> tuple[Tensor, Tensor | None]:
    """The tile's scores, soft-capped if ``softcap`` (``c * tanh(score / c)``) and masked,
    and the cap's slope ``1 - tanh^2`` (None without a cap) for backward."""
    mask = _boolean(mask, q, k)
    scores = torch.matmul(_grouped(q, k.shape[1]), k.unsqueeze(2).transpose(-1, -2)) * scale
    slope = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        slope = 1 - capped * capped
        scores = capped * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores, slope


def _math_forward(q: Tensor, k: Tensor, v: Tensor, mask: TileMask, scale: float,
                  softcap: float | None = None) -> tuple[Tensor, Tensor]:
    scores, _ = _masked_scores(q, k, mask, scale, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   mask: TileMask, scale: float,
                   softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    heads_kv = k.shape[1]
    scores, slope = _masked_scores(q, k, mask, scale, softcap)
    probs = torch.exp(scores - _grouped(lse.unsqueeze(-1), heads_kv))
    grad_out_g = _grouped(grad_out, heads_kv)
    delta = _grouped((grad_out * out).sum(dim=-1, keepdim=True), heads_kv)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out_g).sum(dim=2)
    grad_scores = probs * (torch.matmul(grad_out_g, v.unsqueeze(2).transpose(-1, -2)) - delta)
    if slope is not None:
        grad_scores = grad_scores * slope
    grad_q = torch.matmul(grad_scores, k.unsqueeze(2)) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), _grouped(q, heads_kv)).sum(dim=2) * scale
    return grad_q.flatten(1, 2), grad_k, grad_v


def _flash_mask(mask: TileMask) -> tuple[bool, Tensor | None]:
    """``(is_causal, attn_mask)`` for the CPU flash ops: ``CAUSAL`` runs the kernel's causal
    mode, None no mask, and any other mask goes in additively (0 / -inf)."""
    if mask is CAUSAL:
        return True, None
    if mask is None:
        return False, None
    return False, torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))


_CPU_FLASH_GROUPS_HEADS = torch.__version__ >= (2, 9)
"""Whether the CPU flash ops take fewer key/value heads than query heads: before torch 2.9
they read past the last key/value head (garbage values, then an abort)."""


def _cpu_flash_heads(k: Tensor, v: Tensor, heads_q: int) -> tuple[Tensor, Tensor]:
    """``k`` and ``v`` with the heads this torch's CPU flash ops take."""
    if _CPU_FLASH_GROUPS_HEADS:
        return k, v
    return _repeat_kv(k, heads_q), _repeat_kv(v, heads_q)


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, mask: TileMask,
                       scale: float) -> tuple[Tensor, Tensor]:
    is_causal, attn_mask = _flash_mask(mask)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, *_cpu_flash_heads(k, v, q.shape[1]), 0.0, is_causal, attn_mask=attn_mask,
        scale=scale)


def _cpu_flash_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, mask: TileMask,
                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    is_causal, attn_mask = _flash_mask(mask)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, *_cpu_flash_heads(k, v, q.shape[1]), out, lse, 0.0, is_causal,
        attn_mask=attn_mask, scale=scale)
    return dq, _sum_groups(dk, k.shape[1]), _sum_groups(dv, k.shape[1])


MATH = BlockKernel("math", _math_forward, _math_backward)
CPU_FLASH = BlockKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)


_BIAS_ROW_ALIGNMENT = 16
"""Elements: the memory-efficient kernel reads a bias whose row stride is a multiple of this
(SDPA pads its masks the same way)."""


def _efficient_bias(mask: TileMask, q: Tensor) -> Tensor | None:
    """An explicit mask as the memory-efficient kernel's additive bias: 0 / -inf rows padded
    to its alignment, broadcast over batch and heads. None for ``CAUSAL`` or no mask."""
    if mask is None or mask is CAUSAL:
        return None
    rows, cols = mask.shape
    padded_cols = -(-cols // _BIAS_ROW_ALIGNMENT) * _BIAS_ROW_ALIGNMENT
    bias = torch.zeros(rows, padded_cols, dtype=q.dtype, device=q.device)[:, :cols]
    bias.masked_fill_(~mask, float("-inf"))
    return bias.expand(q.shape[0], q.shape[1], rows, cols)


def _repeat_kv(x: Tensor, heads_q: int) -> Tensor:
    """``[b, hkv, s, d]`` with each head repeated for its query group (``[b, hq, s, d]``)."""
    return x if x.shape[1] == heads_q else x.repeat_interleave(heads_q // x.shape[1], dim=1)


def _sum_groups(grad: Tensor, heads_kv: int) -> Tensor:
    """The gradient of repeated key/value heads summed back onto ``heads_kv`` heads."""
    return grad if grad.shape[1] == heads_kv else _grouped(grad, heads_kv).sum(dim=2)


def _cuda_efficient_forward(q: Tensor, k: Tensor, v: Tensor, mask: TileMask,
                            scale: float) -> tuple[Tensor, Tensor]:
    heads_q = q.shape[1]
    out, lse, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, heads_q), _repeat_kv(v, heads_q), _efficient_bias(mask, q), True,
        0.0, mask is CAUSAL, scale=scale)
    return out, lse[..., :q.shape[2]]


_LSE_ROW_ALIGNMENT = 32
"""Rows: the memory-efficient kernel's log-sum-exp is laid out padded to a multiple of this
(its backward requires head and batch strides that are multiples of 8)."""


def _efficient_lse(lse: Tensor) -> Tensor:
    """``lse`` ``[b, h, s]`` in the kernel's own padded layout ``[b, h, ceil32(s)]`` (the
    padding rows are never read)."""
    rows = lse.shape[-1]
    padded_rows = -(-rows // _LSE_ROW_ALIGNMENT) * _LSE_ROW_ALIGNMENT
    padded = lse.new_zeros(*lse.shape[:-1], padded_rows)
    padded[..., :rows] = lse
    return padded


def _cuda_efficient_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, mask: TileMask,
                             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    heads_q, heads_kv = q.shape[1], k.shape[1]
    # The philox seed and offset: host scalars, as SDPA's own forward returns them; unread at p=0.
    no_dropout = torch.zeros((), dtype=torch.int64, device="cpu")
    dq, dk, dv, _dbias = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, _repeat_kv(k, heads_q), _repeat_kv(v, heads_q), _efficient_bias(mask, q),
        out, _efficient_lse(lse), no_dropout, no_dropout, 0.0, [True, True, True, False],
        mask is CAUSAL, scale=scale)
    return dq, _sum_groups(dk, heads_kv), _sum_groups(dv, heads_kv)


CUDA_EFFICIENT = BlockKernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward,
                             causal_leaf=None)


_FLASH_HEAD_DIMS = range(8, 257, 8)
"""The head sizes PyTorch's CUDA flash kernel takes."""
FLASH_DTYPES = (torch.bfloat16, torch.float16)


@cache
def _flash_capable(device_index: int | None) -> bool:
    """Whether the CUDA device has the flash kernel (Ampere, compute capability 8.0, or newer)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def flash_takes(q: Tensor) -> bool:
    """Whether PyTorch's flash kernel takes ``q``: bf16 or fp16, a head size it takes, SDPA's
    flash backend not switched off, on a device that has it (a tensor off CUDA, 'meta' in
    the routing tests, is taken to have it)."""
    return flash_takes_queries(q) and flash_runs_on(q.device)


def flash_takes_queries(q: Tensor) -> bool:
    """Whether the flash kernel takes queries of ``q``'s dtype and head size (``flash_takes``
    without the device: what tracing a compiled graph can read)."""
    return q.dtype in FLASH_DTYPES and q.shape[-1] in _FLASH_HEAD_DIMS


def flash_runs_on(device: torch.device) -> bool:
    """Whether PyTorch's flash kernel runs on ``device`` (``flash_takes`` without the
    queries' dtype and head size)."""
    return torch.backends.cuda.flash_sdp_enabled() and (
        device.type != "cuda" or _flash_capable(device.index))


def _takes_flash(q: Tensor, mask: TileMask) -> bool:
    """Whether a half-precision tile runs on the flash kernel: causal or unmasked, and
    ``flash_takes``."""
    return not isinstance(mask, Tensor) and flash_takes(q)


def _cuda_half_forward(q: Tensor, k: Tensor, v: Tensor, mask: TileMask,
                       scale: float) -> tuple[Tensor, Tensor]:
    if isinstance(mask, varlen.Segments):
        return varlen.tile_forward(q, k, v, mask, scale)
    if _takes_flash(q, mask):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, mask is CAUSAL, False, scale=scale)
    else:
        out, lse = _cuda_efficient_forward(q, k, v, mask, scale)
    return out.float(), lse


def _cuda_half_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, mask: TileMask,
                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    if isinstance(mask, varlen.Segments):
        return varlen.tile_backward(grad_out, q, k, v, out, lse, mask, scale)
    if _takes_flash(q, mask):
        # The kernel reads the log-sum-exp as a dense [b, h, s_q]; a tile of some rows is a view.
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0,
            mask is CAUSAL, no_rng_state(), no_rng_state(), scale=scale)
    else:
        grads = _cuda_efficient_backward(grad_out, q, k, v, out, lse, mask, scale)
    return tuple(grad.float() for grad in grads)


_CUDA_HALF = {dtype: BlockKernel("cuda_flash", _cuda_half_forward, _cuda_half_backward,
                                 dtype=dtype, causal_leaf=None, takes_segments=True)
              for dtype in (torch.bfloat16, torch.float16)}


def kernel_for(device: torch.device, softcap: float | None = None,
               dtype: torch.dtype = torch.float32) -> BlockKernel:
    """The fastest kernel available for ``dtype`` tensors on ``device``: on CUDA the flash
    kernel in half precision and the memory-efficient one in float32 (an exact path); scores
    soft-capped at ``softcap`` (Gemma 2) run on ``MATH`` with the cap, which no fused kernel
    applies."""
    if softcap is not None:
        return BlockKernel(f"math softcap {softcap}", partial(_math_forward, softcap=softcap),
                           partial(_math_backward, softcap=softcap))
    if device.type == "cpu":
        return CPU_FLASH
    if device.type == "cuda":
        return _CUDA_HALF.get(dtype, CUDA_EFFICIENT)
    return MATH


def merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor,
                rows: Tensor | slice | None) -> None:
    """Fold one block's ``(block_out, block_lse)`` into the running ``(out, lse)`` in place.

    Both sides are rescaled by ``exp(lse_side - lse_new)`` with ``lse_new = logaddexp(lse,
    block_lse)``, which never exponentiates a positive number. ``rows`` are the query rows
    the block covers: None for all, a range (merged in place through views), or an index
    tensor. The running ``lse`` starts at -inf and its output at 0. ``block_out`` is scaled
    in place: it is the kernel's fresh output, consumed here.
    """
    if isinstance(rows, Tensor):
        running_out, running_lse = out.index_select(2, rows), lse.index_select(2, rows)
        _merge_into(running_out, running_lse, block_out, block_lse)
        out.index_copy_(2, rows, running_out)
        lse.index_copy_(2, rows, running_lse)
    elif rows is None:
        _merge_into(out, lse, block_out, block_lse)
    else:
        count = rows.stop - rows.start
        _merge_into(out.narrow(2, rows.start, count), lse.narrow(2, rows.start, count),
                    block_out, block_lse)


def _merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    merged_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged_lse).unsqueeze(-1))
    out.add_(block_out.mul_(torch.exp(block_lse - merged_lse).unsqueeze(-1)))
    lse.copy_(merged_lse)
