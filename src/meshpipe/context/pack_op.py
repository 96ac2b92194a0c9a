"""A pack's local attention inside a compiled block: one custom operator
(``meshpipe::packed_attention``), so that ``--compile --pack`` keeps a block one graph.

A pack's attention reads the token layout of its microbatch (the documents' cumulative
lengths, derived once per microbatch from ``positions`` and ``doc_ids``): traced, it would
recompile for every pack, so it ran at a graph break that cut each block into two graphs,
each of whose calls costs host time forward and backward (on an H100 a ``--pack --compile``
step took 1.24x the unpacked one, with the same GPU work). As an operator the graph holds
it as one opaque call whose output shapes follow from the queries alone; at run time the
operator derives the layout (``local.varlen_segments``) and makes one call of the
variable-length flash kernel, forward and backward, as the eager path does.

It serves where that kernel takes the pack (CUDA, bf16/fp16, a head size flash takes, a
kernel that returns its log-sum-exp per token, a window it takes: ``takes``). A pack whose
documents are not each one run of positions, which the kernel cannot cut, computes as the
eager ``LocalAttention`` does, and its backward is that masked attention's, written out.
``enable`` (called before blocks are compiled) registers the operators and reads the facts
about this torch and GPU that tracing must not call for.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from .blockwise import _FLASH_HEAD_DIMS, flash_takes
from .local import LocalAttention, varlen_segments
from .masks import attention_mask
from .varlen import _flash_backward, _flash_forward, lse_per_token, no_rng_state, takes_windows

# Filled by ``enable``: whether this torch's kernel returns a per-token log-sum-exp (the
# operator's declared output), and whether it takes a sliding window.
_KERNEL = {"ready": False, "windows": False}


def enable(device: torch.device) -> None:
    """Register the operators and note what this torch's kernel and ``device`` offer, before
    any block that may call them is compiled (idempotent)."""
    _operators()
    probe = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16, device="meta")
    _KERNEL["ready"] = device.type == "cuda" and lse_per_token() and flash_takes(
        probe) and torch.cuda.get_device_capability(device) >= (8, 0)
    _KERNEL["windows"] = takes_windows()


def takes(q: Tensor, positions: Tensor | None, window: int | None,
          softcap: float | None) -> bool:
    """Whether a compiled block calls the operator for this attention: a pack (``positions``
    given) of ``q`` that the variable-length kernel takes. Reads only what tracing may."""
    return (_KERNEL["ready"] and positions is not None and softcap is None
            and q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] in _FLASH_HEAD_DIMS and (window is None or _KERNEL["windows"]))


def packed_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                     doc_ids: Tensor | None, causal: bool, window: int | None,
                     scale: float | None) -> Tensor:
    """``LocalAttention`` of a pack of ``[b, s, h, d]`` queries, keys and values, as one
    call of the operator ``enable`` registered."""
    out, _ = torch.ops.meshpipe.packed_attention(q, k, v, positions, doc_ids, causal, window,
                                                 scale)
    return out


@cache
def _operators():
    """Define the forward and backward operators (once per process); the forward one."""

    @torch.library.custom_op("meshpipe::packed_attention", mutates_args=())
    def forward(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, doc_ids: Tensor | None,
                causal: bool, window: int | None,
                scale: float | None) -> tuple[Tensor, Tensor]:
        segments = varlen_segments(q, positions, doc_ids, causal, window)
        if segments is None:
            with torch.no_grad():
                out = _eager(q, k, v, positions, doc_ids, causal, window, scale)
            return out.contiguous(), _lse_like(q)  # the log-sum-exp is unread then
        out, lse, *_ = _flash_forward(*_flat(q, k, v), segments, scale)
        return out.view(q.shape), lse

    @forward.register_fake
    def _(q, k, v, positions, doc_ids, causal, window, scale):
        return q.new_empty(q.shape), _lse_like(q)

    @torch.library.custom_op("meshpipe::packed_attention_backward", mutates_args=())
    def backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 positions: Tensor, doc_ids: Tensor | None, causal: bool, window: int | None,
                 scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
        segments = varlen_segments(q, positions, doc_ids, causal, window)
        if segments is None:
            return _masked_backward(grad, q, k, v, out, positions, doc_ids, causal, window,
                                    scale)
        grads = _flash_backward(*_flat(grad.contiguous(), q, k, v, out), lse, segments, scale,
                                (no_rng_state(), no_rng_state()))
        return tuple(g.view(t.shape) for g, t in zip(grads, (q, k, v)))

    @backward.register_fake
    def _(grad, q, k, v, out, lse, positions, doc_ids, causal, window, scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def save(ctx, inputs, output) -> None:
        q, k, v, positions, doc_ids, causal, window, scale = inputs
        ctx.save_for_backward(q, k, v, *output, positions, doc_ids)
        ctx.options = (causal, window, scale)

    def differentiate(ctx, grad_out: Tensor, _grad_lse: Tensor | None):
        q, k, v, out, lse, positions, doc_ids = ctx.saved_tensors
        grads = backward(grad_out, q, k, v, out, lse, positions, doc_ids, *ctx.options)
        return (*grads, None, None, None, None, None)

    forward.register_autograd(differentiate, setup_context=save)
    return forward


def _eager(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, doc_ids: Tensor | None,
           causal: bool, window: int | None, scale: float | None) -> Tensor:
    return LocalAttention(scale)(q, k, v, positions=positions, doc_ids=doc_ids, causal=causal,
                                 window=window)


def _masked_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                     positions: Tensor, doc_ids: Tensor | None, causal: bool,
                     window: int | None, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of masked attention, written out in float32 (an operator's own code runs
    below autograd, which cannot differentiate it): the probabilities recomputed from the
    scores, then the softmax's backward. Grouped key/value heads sum their queries'."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    qf, kf, vf, outf, gradf = (t.transpose(1, 2).float() for t in (q, k, v, out, grad))
    kf, vf = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kf, vf))
    scale = dim ** -0.5 if scale is None else scale
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    allowed = attention_mask(positions, positions, doc_ids, doc_ids, causal, window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    grad_v = torch.matmul(probabilities.transpose(-1, -2), gradf)
    grad_p = torch.matmul(gradf, vf.transpose(-1, -2))
    grad_s = probabilities * (grad_p - (gradf * outf).sum(-1, keepdim=True)) * scale
    grad_q = torch.matmul(grad_s, kf)
    grad_k = torch.matmul(grad_s.transpose(-1, -2), qf)

    def back(g: Tensor, like: Tensor, grouped: bool) -> Tensor:
        if grouped:
            g = g.view(batch, kv_heads, heads // kv_heads, seq, dim).sum(2)
        return g.transpose(1, 2).to(like.dtype).contiguous()

    return back(grad_q, q, False), back(grad_k, k, True), back(grad_v, v, True)


def _flat(*tensors: Tensor) -> list[Tensor]:
    """``[b, s, h, d]`` -> ``[b * s, h, d]``, the kernel's tokens first."""
    return [t.reshape(-1, *t.shape[2:]) for t in tensors]


def _lse_like(q: Tensor) -> Tensor:
    """The kernel's log-sum-exp of queries ``q``: float32 ``[heads, tokens]``."""
    return q.new_empty((q.shape[2], q.shape[0] * q.shape[1]), dtype=torch.float32)
