"""The building blocks the dense and the expert MLPs share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshpipe.models import joint
from meshpipe.parallel import TensorParallelRegion, shard_linear


def linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free linear layer left uninitialised: ``Transformer`` initialises every weight.
    On the CPU, or on the meta device where that is the default (the skeleton
    ``Transformer`` builds before it makes the parts a rank holds real)."""
    meta = torch.get_default_device().type == "meta"
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False,
                                    device="meta" if meta else "cpu")


class GatedActivation(nn.Module):
    """``silu(gate) * up``: a module of its own so that ``--compile`` can fuse it alone."""

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


class SwiGLU(nn.Module):
    JOINT_LINEARS = ("w_gate", "w_up")  # one product once laid out (``models.joint``)
    projections = ("w_gate", "w_up", "w_down")  # as an expert (``models.grouped_experts``)

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_gate = linear(dim, hidden)
        self.w_up = linear(dim, hidden)
        self.w_down = linear(hidden, dim)
        self.activation = GatedActivation()
        self.tp = TensorParallelRegion()

    def shard(self, tp: TensorParallelRegion) -> None:
        """Keep this rank's slice of the hidden width, entering and leaving ``tp`` itself."""
        self.tp = tp
        self.shard_weights(tp)

    def shard_weights(self, tp: TensorParallelRegion) -> None:
        """Keep this rank's slice of the hidden width: gate/up by output, down by input. The
        output is then this rank's part of a sum over ``tp``; the caller completes it (an
        expert's: the layer, once for all its experts' rows)."""
        self.w_gate = shard_linear(self.w_gate, 0, tp.group)
        self.w_up = shard_linear(self.w_up, 0, tp.group)
        self.w_down = shard_linear(self.w_down, 1, tp.group)

    def gated(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.activation(gate, up)

    def forward(self, x: Tensor) -> Tensor:
        x = self.tp.enter(x)
        gate, up = joint.project(self, x)
        return self.tp.leave(self.w_down(self.gated(gate, up)))
