"""Mixture-of-experts Hugging Face decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) on meshpipe's
expert path.

transformers keeps a layer's experts as two stacked tensors (``gate_up_proj``, ``down_proj``)
but its weight files, on the Hub and as ``save_pretrained`` writes them, hold one tensor per
expert and projection (``model.layers.3.block_sparse_moe.experts.5.w1.weight``). meshpipe
replaces each sparse block of the meta skeleton with an ``HFExperts`` layer whose parameter
names are exactly those of the files: the router (``gate``), one module per expert, and
Qwen2-MoE's shared expert and its sigmoid gate (transformers' own modules). So with ``--ep``
a rank's layer keeps only its experts before any weight is read (each rank reads only its
experts' tensors), checkpoints hold each expert under its own name, and an export writes
the files transformers reads.

The routing is meshpipe's (``meshpipe.models.moe.ExpertLayer``): the router's softmax in
float32, the top-k picks, their gates renormalised where the model does (Mixtral always,
Qwen with ``norm_topk_prob``), the exact-size all-to-alls over the ep ranks, and the two
exchanges as sub-steps for combined 1F1B. Each layer's load-balancing loss is meshpipe's
(per layer and microbatch, summed over layers); the loss adds it times the model's
``router_aux_loss_coef`` where its config asks transformers to (``output_router_logits``).

An expert layer runs in its decoder layer as the two residual halves those architectures
have (attention, then the experts, each after its norm): ``moe_layer_steps``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from meshpipe.models.moe import ExpertLayer


@dataclass(frozen=True)
class ExpertArchitecture:
    """How a model type names and computes its sparse blocks."""

    block: str  # the decoder layer's sparse block, as the weight files name it
    experts_field: str  # the config field with the experts per layer
    width_field: str  # the config field with an expert's hidden width
    projections: tuple[str, str, str]  # an expert's gate, up and down projections
    normalizes: Callable[[Any], bool]  # whether the top-k gates are renormalised
    shared_expert: bool = False  # Qwen2-MoE: a gated expert every token goes through


ARCHITECTURES = {
    "mixtral": ExpertArchitecture("block_sparse_moe", "num_local_experts", "intermediate_size",
                                  ("w1", "w3", "w2"), lambda config: True),
    "qwen2_moe": ExpertArchitecture("mlp", "num_experts", "moe_intermediate_size",
                                    ("gate_proj", "up_proj", "down_proj"),
                                    lambda config: bool(config.norm_topk_prob),
                                    shared_expert=True),
    "qwen3_moe": ExpertArchitecture("mlp", "num_experts", "moe_intermediate_size",
                                    ("gate_proj", "up_proj", "down_proj"),
                                    lambda config: bool(config.norm_topk_prob)),
}


def num_experts(config) -> int:
    """Experts per layer of a transformers config (0 for a dense model)."""
    architecture = ARCHITECTURES.get(config.model_type)
    return int(getattr(config, architecture.experts_field)) if architecture else 0


def aux_coefficient(config) -> float:
    """The weight of the load-balancing loss in the training loss: the model's
    ``router_aux_loss_coef`` where its config has transformers add it (``output_router_logits``),
    else 0 (the loss is still reported)."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0))


class HFExpert(nn.Module):
    """One expert, a gated MLP with the model's activation, under the files' names."""

    def __init__(self, projections: tuple[str, str, str], dim: int, width: int,
                 activation: Callable[[Tensor], Tensor]):
        super().__init__()
        self.projections = projections
        self.activation = activation
        gate, up, down = projections
        self.add_module(gate, nn.Linear(dim, width, bias=False))
        self.add_module(up, nn.Linear(dim, width, bias=False))
        self.add_module(down, nn.Linear(width, dim, bias=False))

    def gated(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.activation(gate) * up

    def forward(self, rows: Tensor) -> Tensor:
        gate, up, down = (getattr(self, name) for name in self.projections)
        return down(self.gated(gate(rows), up(rows)))


class HFExperts(ExpertLayer):
    """A transformers sparse block as a meshpipe expert layer: ``gate`` (the router's
    weight), ``experts.<e>`` and, for Qwen2-MoE, the block's own ``shared_expert`` and
    ``shared_expert_gate``."""

    def __init__(self, block: nn.Module, config, architecture: ExpertArchitecture,
                 capacity_factor: float = 0.0):
        from transformers.activations import ACT2FN

        experts = getattr(config, architecture.experts_field)
        super().__init__(experts, config.num_experts_per_tok, capacity_factor,
                         normalize=architecture.normalizes(config))
        self.gate = nn.Linear(config.hidden_size, experts, bias=False)
        width = getattr(config, architecture.width_field)
        self.experts = nn.ModuleDict({
            str(e): HFExpert(architecture.projections, config.hidden_size, width,
                             ACT2FN[config.hidden_act]) for e in range(experts)})
        if architecture.shared_expert:
            self.shared_expert = block.shared_expert
            self.shared_expert_gate = block.shared_expert_gate

    def router_logits(self, tokens: Tensor) -> Tensor:
        return self.gate(tokens)

    def shared_output(self, tokens: Tensor) -> Tensor | None:
        if not hasattr(self, "shared_expert"):
            return None
        return torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)


def replace_sparse_blocks(model: nn.Module, capacity_factor: float = 0.0) -> list[HFExperts]:
    """Swap every sparse block of a meta-device causal LM for an ``HFExperts`` registered
    under the files' name of the block; returns them in layer order (empty for a dense
    model). A Qwen MoE model's dense layers (``mlp_only_layers``, ``decoder_sparse_step``)
    keep their MLP."""
    config = model.config
    architecture = ARCHITECTURES.get(config.model_type)
    if architecture is None:
        return []
    replaced = []
    for layer in model.model.layers:
        if not hasattr(layer.mlp, "experts"):
            continue
        with torch.device("meta"):
            experts = HFExperts(layer.mlp, config, architecture, capacity_factor)
        del layer.mlp
        layer.add_module(architecture.block, experts)
        replaced.append(experts)
    return replaced


def expert_layer(layer: nn.Module) -> HFExperts | None:
    """The layer's expert block, or None for a dense layer."""
    return next((child for child in layer.children() if isinstance(child, HFExperts)), None)


def moe_layer_steps(layer: nn.Module, experts: HFExperts, attend: Callable[[Tensor], Tensor],
                    hidden: Tensor, aux: Tensor):
    """A decoder layer with experts as sub-steps: ``hidden + attention(norm(hidden))`` by
    ``attend``, then the experts on the post-attention norm, cut at their exchanges;
    returns ``(hidden, aux + the layer's load-balancing loss)``."""
    hidden = attend(hidden)
    y, layer_aux, (hidden, aux) = yield from experts.forward_steps(
        layer.post_attention_layernorm(hidden), keep=(hidden, aux))
    return hidden + y, aux + layer_aux


def as_file_tensors(name: str, tensor: Tensor,
                    architecture: ExpertArchitecture) -> dict[str, Tensor]:
    """A tensor of transformers' module tree (how the unmodified model's gradients are
    keyed) under the weight files' names: a stacked expert tensor (``...mlp.experts.
    gate_up_proj`` or ``down_proj``) as one tensor per expert and projection, the block's
    other tensors under the block's file name (Mixtral's ``block_sparse_moe``)."""
    name = name.replace(".mlp.", f".{architecture.block}.", 1)
    block, _, stacked = name.rpartition(".experts.")
    if stacked not in ("gate_up_proj", "down_proj"):
        return {name: tensor}
    gate, up, down = architecture.projections
    pieces = {}
    for e, expert in enumerate(tensor):
        if stacked == "down_proj":
            pieces[f"{block}.experts.{e}.{down}.weight"] = expert
        else:
            gate_rows, up_rows = expert.chunk(2, dim=0)
            pieces[f"{block}.experts.{e}.{gate}.weight"] = gate_rows
            pieces[f"{block}.experts.{e}.{up}.weight"] = up_rows
    return pieces


@contextlib.contextmanager
def recorded_router_logits(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """While open, the router logits of every forward of an unmodified transformers model:
    one list per sparse block, in layer order (what ``--check``'s one-process reference
    computes the load-balancing loss from)."""
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    recorded: list[list[Tensor]] = [[] for _ in routers]
    handles = [router.register_forward_hook(
        lambda module, inputs, output, seen=seen: seen.append(output[0]))
        for router, seen in zip(routers, recorded)]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def load_balancing_loss(logits: Tensor, top_k: int) -> Tensor:
    """One layer's load-balancing loss over all of a microbatch's tokens, computed whole:
    ``E * sum_e f_e * P_e``, ``f_e`` the share of the top-k picks that chose expert e and
    ``P_e`` its mean router probability."""
    probabilities = logits.float().softmax(dim=-1)
    experts = probabilities.shape[-1]
    picks = torch.bincount(probabilities.topk(top_k, dim=-1).indices.reshape(-1),
                           minlength=experts)
    share = picks.float() / (probabilities.shape[0] * top_k)
    return experts * (share * probabilities.mean(dim=0)).sum()
