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

Under ``--grad-accumulation-fusion`` (``models.master_grads``) each projection's weight
gradient is added into the experts' float32 masters' gradients, laid out alike, in one
addition, where 3E weights each took a hook and an addition.

Under a split backward (ZB-H1, ZB-V, DualPipeV) the input half runs only the inputs' grouped
products and the weight half only the weights': each product asks the autograd engine
whether the gradient it would compute is used in the pass that runs it.

Which runs lay out (``train.run.weight_layout``): ``auto`` on CUDA in bf16 (the kernel
there is bf16 only), ``on`` wherever this torch has a grouped product (on CPU a loop of
products inside one call: for tests and comparisons).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from meshpipe.models.joint import computes_in, lay_out_rows, one_matrix, used

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


@dataclass(frozen=True)
class LaidOut:
    """A layer's local experts' weights as ``lay_out`` made them (gate and up of each
    expert, then every down: the parameters themselves) and where each then began. Kept
    on the layer (``grouped_weights``) so that a microbatch neither collects 3E weights
    again nor asks each for its storage (0.5 ms of host time for 128 experts)."""

    gate_up: list[Tensor]
    down: list[Tensor]
    addresses: tuple[int, ...]

    @classmethod
    def of(cls, gate_up: list[Tensor], down: list[Tensor]) -> LaidOut:
        return cls(gate_up, down, tuple(w.data_ptr() for w in (*gate_up, *down)))

    def intact(self) -> bool:
        """Whether every weight still starts where it was laid out (a weight given new
        data since starts elsewhere)."""
        return tuple(w.data_ptr() for w in (*self.gate_up, *self.down)) == self.addresses


def lay_out(modules: Iterable[nn.Module]) -> int:
    """Lay out the local experts of every expert layer in ``modules`` (see the module's
    note), kept as the layer's ``grouped_weights``; how many layers. A layer whose experts
    differ in device, dtype or shape, or whose widths the kernels cannot take, is left as
    it is."""
    laid = 0
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        if not hasattr(module, "grouped_weights"):  # a ``models.moe.ExpertLayer``
            continue
        gate_up, down = _projections(module)
        if not _can_lay_out(gate_up, down):
            continue
        lay_out_rows(gate_up)
        lay_out_rows(down)
        module.grouped_weights = LaidOut.of(gate_up, down)
        laid += 1
    return laid


def ready(layer: nn.Module, rows: Tensor) -> bool:
    """Whether ``run`` can compute ``rows`` through the layer's laid-out weights. Not for no
    rows at all (an expert-parallel rank all of whose tokens went elsewhere): a grouped
    product over a contraction of length 0 is refused or leaves its output unwritten."""
    weights = layer.grouped_weights
    if weights is None or rows.shape[0] == 0:
        return False
    dtype = weights.down[0].dtype
    return supported(rows.device, dtype) and computes_in(rows, dtype) and weights.intact()


def run(layer: nn.Module, rows: Tensor, rows_per_expert: Tensor) -> Tensor:
    """The local experts on ``rows`` (sorted by expert, ``rows_per_expert`` of each, a
    device tensor: no host read) by grouped products through the laid-out weights
    (``ready``)."""
    gate_up_weights, down_weights = layer.grouped_weights.gate_up, layer.grouped_weights.down
    gate_up_into, down_into = getattr(layer, "grouped_grads_into", (None, None))
    experts = len(down_weights)
    ends = rows_per_expert.cumsum(0).to(torch.int32)
    rows = rows.to(gate_up_weights[0].dtype)
    hidden = _GroupedLinear.apply(rows, ends, _stacked(gate_up_weights, experts), gate_up_into)
    gate, up = hidden.chunk(2, dim=-1)
    first = layer.experts[str(layer.local_experts[0])]
    return _GroupedLinear.apply(first.gated(gate, up), ends, _stacked(down_weights, experts),
                                down_into)


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


def _stacked(weights: Sequence[Tensor], experts: int) -> Tensor:
    """``weights`` (laid out one after another) as one ``[experts, out, in]`` view, no copy,
    differentiable to each weight."""
    return one_matrix(weights).view(experts, -1, weights[0].shape[1])


class _GroupedLinear(torch.autograd.Function):
    """``x @ stacked[e].T`` for each expert e's rows of ``x`` (``ends``: where each expert's
    rows end); backward, the input's gradient and the weights' where ``joint.used`` (a split
    backward asks for them in two passes, the weights' through ``joint.one_matrix``), the
    weights' added into their float32 masters' in one addition by ``into`` where given
    (``--grad-accumulation-fusion``: one launch where each of 3E weights took a hook's)."""

    @staticmethod
    def forward(ctx, x: Tensor, ends: Tensor, stacked: Tensor, into) -> Tensor:
        ctx.save_for_backward(x, ends, stacked)
        ctx.into = into
        return torch._grouped_mm(x, stacked.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, ends, stacked = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, stacked, offs=ends) if used(ctx, 0) else None
        grad_stacked = torch._grouped_mm(grad.t(), x, offs=ends) if used(ctx, 2) else None
        if grad_stacked is not None and ctx.into is not None:
            ctx.into.add(grad_stacked)
            grad_stacked = None
        return grad_x, None, grad_stacked, None

