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
    linears = [getattr(module, name) for name in getattr(module, JOINT_ATTRIBUTE)]
    weights = [linear.weight for linear in linears]
    if not (getattr(module, "joint", False) and not torch.compiler.is_compiling()
            and in_one_storage(weights) and computes_in(x, weights[0].dtype)):
        return [linear(x) for linear in linears]
    out = _JointLinear.apply(x, one_matrix(weights))
    return list(out.split([w.shape[0] for w in weights], dim=-1))


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
        if weight.untyped_storage().data_ptr() != storage or weight.data_ptr() != expected:
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
        return _rows_of(weights)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.split(ctx.rows)


class _JointLinear(torch.autograd.Function):
    """``x @ joint.T``; backward, the input's gradient and the weights' where ``used``."""

    @staticmethod
    def forward(ctx, x: Tensor, joint: Tensor) -> Tensor:
        ctx.save_for_backward(x, joint)
        return F.linear(x, joint)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, joint = ctx.saved_tensors
        grad_x = grad.matmul(joint) if used(ctx, 0) else None
        grad_joint = (grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
                      if used(ctx, 1) else None)
        return grad_x, grad_joint


def used(ctx, index: int) -> bool:
    """Whether the autograd engine running a custom function's backward will use its
    gradient for input ``index``: the input half of a split backward does not use the
    weights', its weight half not the input's. Which nodes a pass runs is known for every
    node but a leaf under ``autograd.grad`` (the input half's call), for which torch cannot
    tell: computed."""
    node = ctx.next_functions[index][0]
    if not ctx.needs_input_grad[index] or node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True
