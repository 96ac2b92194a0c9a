"""Which of a run's weights are laid out for fewer, larger matrix products, decided once per
run: q/k/v and gate/up projected jointly (``--joint-projections``, ``meshpipe.models.joint``)
and a layer's experts as grouped products (``--grouped-experts``,
``meshpipe.models.grouped_experts``). Both also run under a split backward (ZB-H1, ZB-V,
DualPipeV): their products compute the input's gradient and the weights' apart where a pass
asks for one of them (``joint.used``). And whether the linear layers' products add their
weights' gradients straight into the float32 masters' (``--grad-accumulation-fusion``).
"""

from __future__ import annotations

import torch
from torch import nn

from meshpipe.models import joint, master_grads
from meshpipe.models.grouped_experts import available as grouped_product_available
from meshpipe.models.grouped_experts import lay_out as lay_out_experts
from meshpipe.runtime import MasterWeights
from meshpipe.train.config import TrainConfig


def joint_projections(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run projects q/k/v and gate/up jointly. ``auto``: on CUDA, where launches
    bound an eager step. Not on a CPU, where the backward's concatenation of the
    projections' gradients costs more than the fewer products save (a 4-layer model's step
    5-11 % slower, dim 256-64). Not with ``--compile``, whose blocks take the products as
    they are (their weights then need not alias each other)."""
    if config.compile or config.joint_projections == "off":
        return False
    return config.joint_projections == "on" or device.type == "cuda"


def grouped_experts(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run lays out its expert layers for grouped products. ``auto``: on CUDA in
    bf16, where the kernel is (float32 and fp16 runs' expert weights are float32); ``on``
    wherever this torch has a grouped product (the config refuses it under fp16, whose
    weights are not in the dtype autocast computes in). The experts are eager also under
    ``--compile``, so it does not matter here."""
    if (config.grouped_experts == "off" or config.dtype == "fp16"
            or not grouped_product_available()):
        return False
    return config.grouped_experts == "on" or (device.type == "cuda" and config.dtype == "bf16")


def grad_accumulation_fusion(config: TrainConfig, device: torch.device) -> bool:
    """Whether the linear layers' products (embeddings' lookups, grouped experts) add their
    weights' gradients into the float32 masters' themselves. Only bf16 runs have masters of
    their own. ``auto``: on CUDA, which has the kernel (one ``addmm`` of bfloat16 operands
    into float32: 0.36 against 0.48 ms a layer and microbatch of the 740M model on an H100,
    ``benchmarks/wgrad_accum.py``); ``on`` also elsewhere, from operands cast to float32
    (for tests). Under ``--compile`` what runs eagerly fuses (the embedding, the head, the
    experts); a compiled block computes its gradients in its graph, as before."""
    if config.grad_accumulation_fusion == "off" or config.dtype != "bf16":
        return False
    return config.grad_accumulation_fusion == "on" or master_grads.fused_kernel(device)


def lay_out(config: TrainConfig, device: torch.device, modules: list[nn.Module],
            masters: MasterWeights) -> None:
    """Lay out the weights of ``modules`` as the run asks, once they have their dtype (the
    experts last, as their layout keeps each expert's joint gate and up rows together), and
    fuse their products' gradient accumulation into ``masters`` where it asks."""
    if joint_projections(config, device):
        joint.lay_out(modules)
    if grouped_experts(config, device):
        lay_out_experts(modules)
    if grad_accumulation_fusion(config, device):
        master_grads.fuse(modules, masters.own_masters)
