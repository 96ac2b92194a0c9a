"""A mixture-of-experts layer's local experts as grouped matrix products.

Run one by one, E local experts cost 3E matrix products forward (6E backward) of a few
rows each: with 64-128 experts per layer, hundreds of small launches per layer and
microbatch. A grouped product (``torch._grouped_mm``) multiplies every expert's rows by its
own weight in one kernel, given the rows sorted by expert and where each expert's rows end.

As ``models.joint`` does for one module's projections, the experts stay the parameters they
are (names, checkpoints, export, expert sharding, masters: nothing changes), but ``lay_out``
makes the layer's gate and up weights one ``[E, 2 hidden, dim]`` storage (expert e's gate,
then its up, as transformers stacks ``gate_up_proj``) and its down weights one
``[E, dim, hidden]``. ``run`` then computes the layer's experts in two grouped products
forward (gate and up together, then down) and four backward, through those storages; each
expert's weight gradients are slices of one tensor, landing in its parameters as before.

Where the weights are not (or no longer) laid out so, or the rows' dtype differs from the
weights' without autocast to it, or the device cannot (``supported``), the layer runs its
experts one by one: the same values.

Under a split backward (ZB-H1, ZB-V, DualPipeV) the input half runs only the inputs' grouped
products and the weight half only the weights': each product asks the autograd engine
whether the gradient it would compute is used in the pass that runs it.

Which runs lay out (``train.run.weight_layout``): ``auto`` on CUDA in bf16 (the kernel
there is bf16 only), ``on`` wherever this torch has a grouped product (on CPU a loop of
products inside one call: for tests and comparisons).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from meshpipe.models.joint import computes_in, in_one_storage, used

# The kernels need every row and column stride to be a multiple of 16 bytes.
_ALIGNMENT_BYTES = 16


def available() -> bool:
    """Whether this torch has a grouped matrix product."""
    return hasattr(torch, "_grouped_mm")


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a grouped product runs on ``device`` in ``dtype``: bf16 on CUDA, any floating
    dtype on the CPU (torch's reference loop)."""
    if not available():
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16
    return device.type == "cpu" and dtype.is_floating_point


def lay_out(modules: Iterable[nn.Module]) -> int:
    """Lay out the local experts of every expert layer in ``modules`` (see the module's
    note) and mark the layer ``grouped``; how many layers. A layer whose experts differ in
    device, dtype or shape, or whose widths the kernels cannot take, is left as it is."""
    laid = 0
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        if not hasattr(module, "local_experts"):  # a ``models.moe.ExpertLayer``
            continue
        gate_up, down = _projections(module)
        if not _can_lay_out(gate_up, down):
            continue
        _stack(gate_up)
        _stack(down)
        module.grouped = True
        laid += 1
    return laid


def ready(layer: nn.Module, rows: Tensor) -> bool:
    """Whether ``run`` can compute ``rows`` through the layer's laid-out weights. Not for no
    rows at all (an expert-parallel rank all of whose tokens went elsewhere): a grouped
    product over a contraction of length 0 is refused or leaves its output unwritten."""
    if not getattr(layer, "grouped", False) or rows.shape[0] == 0:
        return False
    gate_up, down = _projections(layer)
    dtype = gate_up[0].dtype
    return (supported(rows.device, dtype) and computes_in(rows, dtype)
            and in_one_storage(gate_up) and in_one_storage(down))


def run(layer: nn.Module, rows: Tensor, rows_per_expert: Tensor) -> Tensor:
    """The local experts on ``rows`` (sorted by expert, ``rows_per_expert`` of each, a
    device tensor: no host read) by grouped products through the laid-out weights
    (``ready``)."""
    gate_up_weights, down_weights = _projections(layer)
    experts = len(down_weights)
    ends = rows_per_expert.cumsum(0).to(torch.int32)
    rows = rows.to(gate_up_weights[0].dtype)
    hidden = _GroupedLinear.apply(rows, ends, _Stacked.apply(experts, *gate_up_weights))
    gate, up = hidden.chunk(2, dim=-1)
    first = layer.experts[str(layer.local_experts[0])]
    return _GroupedLinear.apply(first.gated(gate, up), ends,
                                _Stacked.apply(experts, *down_weights))


def _projections(layer: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """The local experts' weights in order: gate and up of each expert, then every down."""
    experts = [layer.experts[str(e)] for e in layer.local_experts]
    gate, up, down = experts[0].projections
    return ([w for expert in experts
             for w in (getattr(expert, gate).weight, getattr(expert, up).weight)],
            [getattr(expert, down).weight for expert in experts])


def _can_lay_out(gate_up: Sequence[Tensor], down: Sequence[Tensor]) -> bool:
    """One device, dtype and shape for each projection, widths the kernels take."""
    first = gate_up[0]
    return (not first.is_meta
            and len({(w.device, w.dtype) for w in (*gate_up, *down)}) == 1
            and len({w.shape for w in gate_up}) == 1 and len({w.shape for w in down}) == 1
            and all(size * first.element_size() % _ALIGNMENT_BYTES == 0
                    for size in (*first.shape, *down[0].shape)))


def _stack(weights: Sequence[Tensor]) -> None:
    """Make ``weights`` rows of one storage, one after another."""
    with torch.no_grad():
        storage = torch.cat([w.detach().reshape(-1) for w in weights])
    start = 0
    for weight in weights:
        weight.data = storage[start:start + weight.numel()].view(weight.shape)
        start += weight.numel()


def _stacked(weights: Sequence[Tensor], experts: int) -> Tensor:
    """``weights`` (laid out by ``_stack``) as one ``[experts, out, in]`` view, no copy."""
    first = weights[0].detach()
    rows = sum(w.shape[0] for w in weights) // experts
    columns = first.shape[1]
    return first.as_strided((experts, rows, columns), (rows * columns, columns, 1))


class _Stacked(torch.autograd.Function):
    """``weights`` (laid out by ``_stack``) as one ``[experts, out, in]`` view of their
    storage, no copy; the view's gradient reaches each weight as its rows."""

    @staticmethod
    def forward(ctx, experts: int, *weights: Tensor) -> Tensor:
        ctx.rows = [w.shape[0] for w in weights]
        return _stacked(weights, experts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (None, *grad.reshape(-1, grad.shape[-1]).split(ctx.rows))


class _GroupedLinear(torch.autograd.Function):
    """``x @ stacked[e].T`` for each expert e's rows of ``x`` (``ends``: where each expert's
    rows end); backward, the input's gradient and the weights' where ``joint.used`` (a split
    backward asks for them in two passes, the weights' through ``_Stacked``)."""

    @staticmethod
    def forward(ctx, x: Tensor, ends: Tensor, stacked: Tensor) -> Tensor:
        ctx.save_for_backward(x, ends, stacked)
        return torch._grouped_mm(x, stacked.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, ends, stacked = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, stacked, offs=ends) if used(ctx, 0) else None
        grad_stacked = torch._grouped_mm(grad.t(), x, offs=ends) if used(ctx, 2) else None
        return grad_x, None, grad_stacked

