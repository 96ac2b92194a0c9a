"""One input projected by several weights as one matrix product: the queries, keys and values
of an attention, the gate and up projections of a SwiGLU.

The weights stay the parameters they are (names, checkpoints, export, tensor-parallel
shards, masters: nothing changes), but ``lay_out`` makes a module's weights rows of one
storage, one after another, and marks it ``joint``. Its forward then multiplies by all of
them at once through that storage (``project``): one product forward, and backward one
product for the input's gradient and one for the weights', where separate weights take a
product each and an addition per extra weight for the input's gradient. On a GPU, whose
eager step is bound by the host launching kernels, that is 10 launches fewer per layer and
microbatch (fewer, larger products besides); the weights' gradients are rows of one
tensor, each landing in its parameter as before.

Where the weights are not (or no longer) one storage in order, of one dtype with the input,
or the call is being compiled (inductor takes separate products as they are), ``project``
multiplies by each weight: the same values, computed apart.

A split backward (ZB-H1, ZB-V, DualPipeV) takes each weight's product apart from the input's
(``runtime.split_backward``): the joint product computes only the gradient the pass running
it uses (``used``: the input's in the input half, the weights' in the weight half), the
weights' reaching them through one more node (``_Rows``). The trainer lays out without
``--compile``, and by default on CUDA only (``train.run.weight_layout``).

The same product can add its weights' gradient straight into their float32 masters'
gradients (``--grad-accumulation-fusion``, Megatron's gradient-accumulation fusion): a
module's ``grads_into`` (a ``GradInto``) then takes the product, and the weights get no
``.grad`` of their own. With bfloat16 weights that spares, per weight and microbatch, the
bfloat16 gradient written and read back by the master's hook (a launch and a pass over the
gradient) and its rounding; ``fuse_linears`` does it for every other linear layer, one
weight a product. On CUDA the product is one ``addmm`` with a float32 output; elsewhere
(the CPU, for tests) the same sum from operands cast to float32 (``add_product``). Inside a
compiled graph a ``FusedLinear`` is the plain linear layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# A module's weights projected jointly: the names of its linear layers, as an attribute.
JOINT_ATTRIBUTE = "JOINT_LINEARS"


def lay_out(modules: Iterable[nn.Module]) -> int:
    """Make the ``JOINT_LINEARS`` weights of each module (and submodule) of ``modules`` one
    storage, in order, and mark the module ``joint``; how many modules. A module whose
    weights differ in device, dtype or input width is left as it is."""
    laid = 0
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        names = getattr(module, JOINT_ATTRIBUTE, None)
        if not names:
            continue
        weights = [getattr(module, name).weight for name in names]
        first = weights[0]
        if first.is_meta or any((w.device, w.dtype, w.shape[1]) != (
                first.device, first.dtype, first.shape[1]) for w in weights):
            continue
        lay_out_rows(weights)
        module.joint = True
        laid += 1
    return laid


def lay_out_rows(weights: Sequence[Tensor]) -> None:
    """Make ``weights`` (of one width, device and dtype) rows of one storage, one after
    another; each stays its parameter."""
    with torch.no_grad():
        rows = torch.cat([w.detach() for w in weights])
    start = 0
    for weight in weights:
        weight.data = rows[start:start + weight.shape[0]]
        start += weight.shape[0]


def one_matrix(weights: Sequence[Tensor]) -> Tensor:
    """``weights`` laid out by ``lay_out_rows`` as one matrix, a view of their storage (no
    copy) whose gradient reaches each weight as its rows."""
    return _Rows.apply(*weights)


def project(module: nn.Module, x: Tensor) -> list[Tensor]:
    """``x`` through each of ``module``'s ``JOINT_LINEARS`` (bias-free), as one product where
    ``lay_out`` made them one storage and it still is."""
    out = project_together(module, x)
    if out is None:
        return [getattr(module, name)(x) for name in getattr(module, JOINT_ATTRIBUTE)]
    return list(out.split([getattr(module, name).weight.shape[0]
                           for name in getattr(module, JOINT_ATTRIBUTE)], dim=-1))


def project_together(module: nn.Module, x: Tensor) -> Tensor | None:
    """``x`` through all of ``module``'s ``JOINT_LINEARS`` as one product, their outputs side
    by side in the last dimension; None where they are to be projected apart (``project``)."""
    weights = [getattr(module, name).weight for name in getattr(module, JOINT_ATTRIBUTE)]
    if not (getattr(module, "joint", False) and not torch.compiler.is_compiling()
            and in_one_storage(weights) and computes_in(x, weights[0].dtype)):
        return None
    return _JointLinear.apply(x, one_matrix(weights), None, getattr(module, "grads_into", None))


def computes_in(x: Tensor, dtype: torch.dtype) -> bool:
    """Whether a product of ``x`` by a ``dtype`` weight computes in ``dtype`` with no cast
    (autocast would cast inside the forward, and not in the backward)."""
    device = x.device.type
    return x.dtype == dtype and (not torch.is_autocast_enabled(device)
                                 or torch.get_autocast_dtype(device) == dtype)


def in_one_storage(weights: Sequence[Tensor]) -> bool:
    """Whether ``weights`` are still the rows ``lay_out`` made of one storage, one after
    another (a weight given new data since has another storage)."""
    first = weights[0]
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for weight in weights:
        if (weight.untyped_storage().data_ptr() != storage or weight.data_ptr() != expected
                or not weight.is_contiguous()):
            return False
        expected += weight.numel() * weight.element_size()
    return True


def _rows_of(weights: Sequence[Tensor]) -> Tensor:
    """The rows of every weight as one matrix: a view of their storage, no copy."""
    first = weights[0].detach()
    return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), first.stride())


class _Rows(torch.autograd.Function):
    """``one_matrix``: a view of the weights' storage; backward, each weight its rows."""

    @staticmethod
    def forward(ctx, *weights: Tensor) -> Tensor:
        ctx.rows = [w.shape[0] for w in weights]
        ctx.set_materialize_grads(False)  # none where the product added into the masters
        return _rows_of(weights)

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        return (None,) * len(ctx.rows) if grad is None else grad.split(ctx.rows)


class _JointLinear(torch.autograd.Function):
    """``x @ joint.T + bias``; backward, the input's gradient and the weights' where
    ``used``, the weights' added into their masters' by ``into`` where given."""

    @staticmethod
    def forward(ctx, x: Tensor, joint: Tensor, bias: Tensor | None,
                into: GradInto | None) -> Tensor:
        ctx.save_for_backward(x, joint)
        ctx.into = into
        return F.linear(x, joint, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, joint = ctx.saved_tensors
        grad_x = grad.matmul(joint) if used(ctx, 0) else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_joint = None
        runs = engine_runs(ctx, 1)
        if runs is not False:
            columns = x.reshape(-1, x.shape[-1])
            if ctx.into is None or runs is None:  # None: autograd.grad returns it
                grad_joint = rows.t().mm(columns)
            else:
                ctx.into(rows.t(), columns)
        grad_bias = rows.sum(0) if used(ctx, 2) else None
        return grad_x, grad_joint, grad_bias, None


def used(ctx, index: int) -> bool:
    """Whether the autograd engine running a custom function's backward will use its
    gradient for input ``index``: the input half of a split backward does not use the
    weights', its weight half not the input's (``engine_runs``; computed where torch cannot
    tell)."""
    return engine_runs(ctx, index) is not False


def engine_runs(ctx, index: int) -> bool | None:
    """Whether the autograd engine running a custom function's backward runs the node its
    input ``index`` came from. None for a leaf whose gradient an ``autograd.grad`` call
    returns (one of its inputs), of which torch will not tell."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None


def fused_kernel(device: torch.device) -> bool:
    """Whether ``device`` has a matrix product of bfloat16 operands into a float32 output
    (``addmm`` with ``out_dtype``: CUDA, torch 2.8 on)."""
    return device.type == "cuda" and hasattr(torch.ops.aten.addmm, "dtype_out")


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

    def _add_apart(self, gradient: Tensor) -> None:
        for master, part in zip(self.masters, gradient.split(self.rows)):
            if master.grad is None:
                master.grad = part.to(torch.float32, copy=True)
            else:
                master.grad.add_(part)

    def _gradients(self) -> Tensor | None:
        """The masters' gradients as one matrix, or None where they are not its rows."""
        if len(self.masters) == 1:  # a plain linear's: the host's cost per call matters
            master = self.masters[0]
            if master.grad is None:
                master.grad = torch.zeros_like(master, dtype=torch.float32,
                                               memory_format=torch.contiguous_format)
            return master.grad if master.grad.is_contiguous() else None
        grads = [master.grad for master in self.masters]
        if all(grad is None for grad in grads):
            first = self.masters[0]
            matrix = torch.zeros((sum(self.rows), first.shape[1]), dtype=torch.float32,
                                 device=first.device)
            for master, part in zip(self.masters, matrix.split(self.rows)):
                master.grad = part
            return matrix
        if any(grad is None for grad in grads) or not in_one_storage(grads):
            return None
        return _rows_of(grads)


class FusedLinear(nn.Linear):
    """An ``nn.Linear`` (``fuse_linears`` makes one of a module in place: names, state and
    ``isinstance`` stay) whose product adds its weight's gradient into ``grads_into``'s
    master where it computes in the weight's dtype, eagerly: inside a compiled graph it is
    the plain linear layer."""

    grads_into: GradInto

    def forward(self, x: Tensor) -> Tensor:
        if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or not computes_in(x, self.weight.dtype)):
            return super().forward(x)
        # The weight itself, a leaf: a split backward's input half does not run its node.
        return _JointLinear.apply(x, self.weight, self.bias, self.grads_into)


def fuse_linears(modules: Iterable[nn.Module], masters_of) -> int:
    """Give every ``nn.Linear`` of ``modules`` whose weight has a float32 master of its own
    (``masters_of(weights)``: their masters, or None) a product that adds its gradient into
    the master's, every joint module (``lay_out``) one for its weights, and every expert
    layer laid out for grouped products (``grouped_experts``) one for each projection's;
    how many products."""
    fused = 0
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        laid_out = getattr(module, "grouped_weights", None)
        if laid_out is not None:
            masters = [masters_of(laid_out.gate_up), masters_of(laid_out.down)]
            if None not in masters:
                module.grouped_grads_into = tuple(GradInto(each) for each in masters)
                fused += 2
        if getattr(module, "joint", False):
            weights = [getattr(module, name).weight for name in getattr(module, JOINT_ATTRIBUTE)]
            masters = masters_of(weights)
            if masters is not None:
                module.grads_into = GradInto(masters)
                fused += 1
        if type(module) is nn.Linear and module.weight.requires_grad:
            masters = masters_of([module.weight])
            if masters is not None:
                module.__class__ = FusedLinear
                module.grads_into = GradInto(masters)
                fused += 1
    return fused
