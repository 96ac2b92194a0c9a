"""The CUDA variable-length flash kernel's two aten ops, computed document by document with
SDPA on the CPU, which has no kernel for them, recording each call's arguments.

``StandInKernel(monkeypatch)`` replaces the ops where meshpipe calls them eagerly, the
forward differentiated as aten's formula does it (by a call of the backward op);
``StandInKernel().backend()`` is a ``torch.compile`` backend for graphs that hold them (the
ops trace on their meta kernels): AOTAutograd's forward and backward graphs run through an
FX interpreter that calls the stand-ins where a graph calls the ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORWARD = torch.ops.aten._flash_attention_forward
BACKWARD = torch.ops.aten._flash_attention_backward


def per_document(q, k, v, cu, causal, scale, left=None):
    """Each segment of ``cu`` on its own, causal or not, keys at most ``left`` offsets back."""
    pieces = []
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):
        offsets = torch.arange(stop - start)
        allowed = torch.ones(len(offsets), len(offsets), dtype=torch.bool)
        if causal:
            allowed &= offsets[None, :] <= offsets[:, None]
        if left is not None:
            allowed &= offsets[:, None] - offsets[None, :] <= left
        q_doc, k_doc, v_doc = (t[start:stop].transpose(0, 1) for t in (q, k, v))
        pieces.append(F.scaled_dot_product_attention(
            q_doc, k_doc, v_doc, attn_mask=allowed, scale=scale,
            enable_gqa=True).transpose(0, 1))
    return torch.cat(pieces)


class StandInKernel:
    """``aten._flash_attention_forward`` / ``_backward`` computed per document on the CPU;
    ``calls``: ``(direction, q shape, k shape, cumulative lengths, longest, causal, dropout,
    window_size_left)`` per call."""

    def __init__(self, monkeypatch=None):
        self.calls: list[tuple] = []
        if monkeypatch is not None:
            aten = torch.ops.aten
            monkeypatch.setattr(aten, "_flash_attention_forward", self.differentiable_forward)
            monkeypatch.setattr(aten, "_flash_attention_backward", self.backward)

    def differentiable_forward(self, q, k, v, *args, **options):
        """The forward op as aten's autograd calls it: the output's gradient comes from one
        call of the backward op, given what the forward saved."""
        return _WithItsFormula.apply(self, args, options, q, k, v)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale=None,
                window_size_left=None, window_size_right=None):
        self.calls.append(("fwd", q.shape, k.shape, cu_q.tolist(), max_q, causal, dropout,
                           window_size_left))
        assert torch.equal(cu_q, cu_k) and max_q == max_k and cu_q.dtype == torch.int32
        assert window_size_left is None or window_size_right == (0 if causal else -1)
        out = per_document(q, k, v, cu_q, causal, scale, window_size_left)
        rng = torch.zeros((), dtype=torch.int64)
        return out, torch.zeros(q.shape[1], q.shape[0]), rng, rng, torch.empty(0)

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal,
                 seed, offset, *, scale=None, window_size_left=None, window_size_right=None):
        self.calls.append(("bwd", q.shape, k.shape, cu_q.tolist(), max_q, causal, dropout,
                           window_size_left))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            per_document(*leaves, cu_q, causal, scale, window_size_left).backward(grad_out)
        return tuple(leaf.grad for leaf in leaves)

    def backend(self):
        """A ``torch.compile`` backend: AOTAutograd's graphs, run with these stand-ins."""
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        stand_ins = {FORWARD.default: self.forward, BACKWARD.default: self.backward}
        rng_ops = torch.ops.higher_order

        class StandIns(torch.fx.Interpreter):
            """Where a graph recomputes (activation checkpointing), AOTAutograd wraps an op
            that may draw random numbers in a higher-order op that saves or restores the
            generator's state around it."""

            def call_function(self, target, args, kwargs):
                if target is rng_ops.run_and_save_rng_state:
                    op, *args = args
                    return torch.get_rng_state(), stand_ins.get(op, op)(*args, **kwargs)
                if target is rng_ops.run_with_rng_state:
                    _, op, *args = args
                    return stand_ins.get(op, op)(*args, **kwargs)
                return stand_ins.get(target, target)(*args, **kwargs)

        def compiler(graph, example_inputs):
            return make_boxed_func(lambda *args: StandIns(graph).run(*args))

        return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


class _WithItsFormula(torch.autograd.Function):
    """aten's derivative of ``_flash_attention_forward``: the query, key and value
    gradients from ``_flash_attention_backward`` on the forward's output, log-sum-exp and
    random state; its other outputs have none."""

    @staticmethod
    def forward(ctx, kernel, args, options, q, k, v):
        out, lse, seed, offset, debug = kernel.forward(q, k, v, *args, **options)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.kernel, ctx.args, ctx.options = kernel, args, options
        ctx.mark_non_differentiable(lse, seed, offset, debug)
        return out, lse, seed, offset, debug

    @staticmethod
    def backward(ctx, grad_out, *_):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        cu_q, cu_k, max_q, max_k, dropout, causal, _ = ctx.args
        grads = ctx.kernel.backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                    dropout, causal, seed, offset, **ctx.options)
        return (None, None, None, *grads)
