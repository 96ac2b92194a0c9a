"""Weight gradients added straight into their float32 masters' gradients
(``--grad-accumulation-fusion``, Megatron's gradient-accumulation fusion).

With bfloat16 weights and float32 masters (``runtime.MasterWeights``) a microbatch's weight
gradient is a bfloat16 tensor written to the weight's ``.grad``, then read back by the
master's hook and added in: a launch and a pass over the gradient per weight and
microbatch, and a rounding to bfloat16 before the sum. Here what computes the gradient adds
it into the master's gradient itself, and the weight gets no ``.grad``:

- a linear layer's product (``FusedLinear``, and a joint q/k/v or gate/up product:
  ``models.joint``): on CUDA one ``addmm`` of the bfloat16 operands with a float32 output;
  elsewhere (the CPU, for tests) the same sum from operands cast to float32
  (``add_product``). Inside a compiled graph a ``FusedLinear`` is the plain linear layer;
- a layer's grouped experts (``models.grouped_experts``): each projection's gradient in one
  addition, where 3E weights took a hook and an addition each;
- an embedding's lookup (``FusedEmbedding``; a ``parallel.VocabParallelEmbedding``'s
  through ``GradInto.lookup``): the microbatch's rows added in, where the unfused gradient
  is a whole ``[vocabulary, dim]`` tensor written and read back.

``GradInto`` makes the masters' gradients of one product's weights rows of one float32
matrix, so the product adds into them all at once. ``fuse`` sets it all up for a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshpipe.models import joint
from meshpipe.parallel import VocabParallelEmbedding


# Whether this torch has ``addmm`` with an ``out_dtype`` (2.8 on): looked up once, not per
# product.
_ADDMM_WITH_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def fused_kernel(device: torch.device) -> bool:
    """Whether ``device`` has a matrix product of bfloat16 operands into a float32 output
    (``addmm`` with ``out_dtype``: CUDA, torch 2.8 on)."""
    return device.type == "cuda" and _ADDMM_WITH_OUT_DTYPE


def add_product(into: Tensor, a: Tensor, b: Tensor) -> None:
    """``into += a @ b``: ``into`` float32, ``a`` and ``b`` of a lower precision, summed in
    float32 (on CUDA one ``addmm``, else from ``a`` and ``b`` cast to float32)."""
    if fused_kernel(into.device):
        torch.addmm(into, a, b, out_dtype=torch.float32, out=into)
    else:
        into.addmm_(a.to(into.dtype), b.to(into.dtype))


class GradInto:
    """Adds ``a @ b``, the gradient of weights stacked as rows (``one_matrix``), into the
    float32 gradients of ``masters``, one master per weight, in order. The masters'
    gradients are made rows of one matrix (zeros) when none has one yet, so one product adds
    into them all; where they are not such rows (another gradient reached a master first:
    a tied embedding's, through its hook), the product is computed apart and added into
    each."""

    def __init__(self, masters: Sequence[nn.Parameter]):
        self.masters = list(masters)
        self.rows = [master.shape[0] for master in self.masters]

    def __call__(self, a: Tensor, b: Tensor) -> None:
        into = self._gradients()
        if into is not None:
            add_product(into, a, b)
            return
        product = torch.zeros((sum(self.rows), b.shape[1]), dtype=torch.float32,
                              device=b.device)
        add_product(product, a, b)
        self._add_apart(product)

    def add(self, gradient: Tensor) -> None:
        """Add ``gradient``, the weights' already computed (any dtype, their rows one after
        another: a grouped product's ``[experts, out, in]``), in one addition."""
        into = self._gradients()
        if into is not None:
            into.add_(gradient.view(into.shape))
        else:
            self._add_apart(gradient.reshape(sum(self.rows), -1))

    def lookup(self, tokens: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
        """``weight[tokens]`` (an embedding's, its one master's), whose backward adds the
        rows' gradients into the master's (``FusedEmbedding``, and a
        ``parallel.VocabParallelEmbedding`` given this as its ``grads_into``)."""
        return _Lookup.apply(tokens, weight, padding_idx, self)

    def add_rows(self, index: Tensor, rows: Tensor) -> None:
        """Add ``rows`` into the rows ``index`` of the one master's gradient (an
        embedding's lookup)."""
        (master,) = self.masters
        _gradient_of(master).index_add_(0, index, rows.to(torch.float32))

    def _add_apart(self, gradient: Tensor) -> None:
        for master, part in zip(self.masters, gradient.split(self.rows)):
            if master.grad is None:
                master.grad = part.to(torch.float32, copy=True)
            else:
                master.grad.add_(part)

    def _gradients(self) -> Tensor | None:
        """The masters' gradients as one matrix, or None where they are not its rows."""
        if len(self.masters) == 1:  # a plain linear's: the host's cost per call matters
            grad = _gradient_of(self.masters[0])
            return grad if grad.is_contiguous() else None
        grads = [master.grad for master in self.masters]
        if all(grad is None for grad in grads):
            first = self.masters[0]
            matrix = torch.zeros((sum(self.rows), first.shape[1]), dtype=torch.float32,
                                 device=first.device)
            for master, part in zip(self.masters, matrix.split(self.rows)):
                master.grad = part
            return matrix
        if any(grad is None for grad in grads) or not joint.in_one_storage(grads):
            return None
        return joint.rows_of(grads)


def _gradient_of(master: nn.Parameter) -> Tensor:
    """``master.grad``, made float32 zeros where it has none yet."""
    if master.grad is None:
        master.grad = torch.zeros_like(master, dtype=torch.float32,
                                       memory_format=torch.contiguous_format)
    return master.grad


class FusedLinear(nn.Linear):
    """An ``nn.Linear`` (``fuse`` makes one of a module in place: names, state and
    ``isinstance`` stay) whose product adds its weight's gradient into ``grads_into``'s
    master where it computes in the weight's dtype, eagerly: inside a compiled graph it is
    the plain linear layer."""

    grads_into: GradInto

    def forward(self, x: Tensor) -> Tensor:
        if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or not joint.computes_in(x, self.weight.dtype)):
            return super().forward(x)
        # The weight itself, a leaf: a split backward's input half does not run its node.
        return joint.linear(x, self.weight, self.bias, self.grads_into)


class FusedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` (``fuse`` makes one of a module in place) whose lookup's backward
    adds the looked-up rows' gradients into its weight's float32 master's gradient (one
    ``index_add_`` of the microbatch's rows, in float32), where autograd writes a whole
    ``[vocabulary, dim]`` bfloat16 gradient (zeros, then the rows) that the master's hook
    reads back whole: two passes over every row of the vocabulary a microbatch. Eagerly and
    without ``max_norm``, ``scale_grad_by_freq`` or ``sparse``, else the plain lookup."""

    grads_into: GradInto

    def forward(self, tokens: Tensor) -> Tensor:
        if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or self.max_norm is not None or self.scale_grad_by_freq or self.sparse):
            return super().forward(tokens)
        return self.grads_into.lookup(tokens, self.weight, self.padding_idx)


class _Lookup(torch.autograd.Function):
    """``weight[tokens]``; backward, the rows' gradients added into the master's by ``into``
    (none into the padding row), or returned where ``autograd.grad`` asks for the
    weight's."""

    @staticmethod
    def forward(ctx, tokens: Tensor, weight: Tensor, padding_idx: int | None,
                into: GradInto) -> Tensor:
        ctx.save_for_backward(tokens)
        ctx.padding_idx, ctx.into, ctx.rows = padding_idx, into, weight.shape[0]
        return F.embedding(tokens, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: Tensor):
        runs = joint.engine_runs(ctx, 1)
        if runs is False:
            return None, None, None, None
        (tokens,) = ctx.saved_tensors
        tokens = tokens.reshape(-1)
        rows = grad.reshape(tokens.shape[0], -1)
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((tokens == ctx.padding_idx % ctx.rows).unsqueeze(1), 0)
        if runs is None:  # autograd.grad returns the weight's gradient
            whole = rows.new_zeros((ctx.rows, rows.shape[1]))
            return None, whole.index_add_(0, tokens, rows), None, None
        ctx.into.add_rows(tokens, rows)
        return None, None, None, None


# The torch modules made their fused kind in place (a ``VocabParallelEmbedding`` fuses as it
# is, through its ``grads_into``).
_FUSED = {nn.Linear: FusedLinear, nn.Embedding: FusedEmbedding}


def fuse(modules: Iterable[nn.Module], masters_of) -> int:
    """Give every ``nn.Linear``, ``nn.Embedding`` and ``VocabParallelEmbedding`` of ``modules``
    whose weight has a float32 master of its own (``masters_of(weights)``: their masters, or None) a product or
    lookup that adds its gradient into the master's, every joint module
    (``joint.lay_out``) one for its weights, and every expert layer laid out for grouped
    products (``grouped_experts``) one for each projection's; how many."""
    fused = 0
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        laid_out = getattr(module, "grouped_weights", None)
        if laid_out is not None:
            masters = [masters_of(laid_out.gate_up), masters_of(laid_out.down)]
            if None not in masters:
                module.grouped_grads_into = tuple(GradInto(each) for each in masters)
                fused += 2
        if getattr(module, "joint", False):
            weights = [getattr(module, name).weight
                       for name in getattr(module, joint.JOINT_ATTRIBUTE)]
            masters = masters_of(weights)
            if masters is not None:
                module.grads_into = GradInto(masters)
                fused += 1
        if type(module) in _FUSED or isinstance(module, VocabParallelEmbedding):
            masters = masters_of([module.weight])
            if masters is not None:
                module.__class__ = _FUSED.get(type(module), type(module))
                module.grads_into = GradInto(masters)
                fused += 1
    return fused
