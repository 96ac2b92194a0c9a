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
gradients (``--grad-accumulation-fusion``, ``models.master_grads``): a module's
``grads_into`` then takes the product, and the weights get no ``.grad`` of their own.
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
    return linear(x, one_matrix(weights), None, getattr(module, "grads_into", None))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, into=None) -> Tensor:
    """``x @ weight.T + bias``, its backward computing only the gradients the pass running it
    uses (``used``), the weight's added into its masters' by ``into`` where given (a
    ``master_grads.GradInto``, a callable taking the product's two operands)."""
    return _JointLinear.apply(x, weight, bias, into)


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


def rows_of(weights: Sequence[Tensor]) -> Tensor:
    """The rows of every weight as one matrix: a view of their storage, no copy."""
    first = weights[0].detach()
    return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), first.stride())


class _Rows(torch.autograd.Function):
    """``one_matrix``: a view of the weights' storage; backward, each weight its rows."""

    @staticmethod
    def forward(ctx, *weights: Tensor) -> Tensor:
        ctx.rows = [w.shape[0] for w in weights]
        ctx.set_materialize_grads(False)  # none where the product added into the masters
        return rows_of(weights)

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        return (None,) * len(ctx.rows) if grad is None else grad.split(ctx.rows)


class _JointLinear(torch.autograd.Function):
    """``x @ joint.T + bias``; backward, the input's gradient and the weights' where
    ``used``, the weights' added into their masters' by ``into`` where given."""

    @staticmethod
    def forward(ctx, x: Tensor, joint: Tensor, bias: Tensor | None, into) -> Tensor:
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
