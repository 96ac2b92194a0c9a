"""Tensor parallelism for Hugging Face decoders, as for the reference transformer: heads, MLP
width and vocabulary split over the tp ranks (Megatron's column/row split), optionally with
sequence parallelism.

The split is a plan by module name (``SPLITS``, data): a *column* projection keeps this
rank's rows of its weight (output features: its heads, its part of the MLP width; a bias is
split with them), a *row* projection this rank's columns (input features) and ends the
tensor-parallel region (the partial outputs summed, or reduce-scattered to sequence
shards). The region starts where its input enters the attention or the MLP module
(``REGIONS``: a forward pre-hook; backward: the ranks' input gradients summed; with
sequence parallelism: the sequence shards gathered first, so the module sees its whole
sequence). The embedding is vocabulary-parallel and the head a column projection over the
vocabulary (the loss is then ``vocab_parallel_cross_entropy``). A fused projection (``FUSED``:
Phi-3's q/k/v and gate/up) is split part by part and tagged (``parallel.mark_fused``), so
checkpoints and ``--check`` put each part back together. transformers' own attention
and MLP code runs unchanged on the local heads: each attention module gets a copy of the
config with its local head counts.

``shard_skeleton`` replaces the modules on the meta device, before any weight is read; each
new parameter records the slice of the checkpoint tensor it holds (``ROWS_ATTR``), so
materialising reads only that slice from the safetensors files. Weights applied to the
local heads only (Qwen3's and Gemma 3's q/k norms) and, with sequence parallelism, the
norms are tagged so their partial gradients are summed over the tp ranks. A vision-language
model's embedding sums the ranks' rows whole even with sequence parallelism: its stage places
the image features over the whole sequence, then keeps its shard
(``hf_vision.VisionChunk``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshpipe.models.hf_moe import HFExperts
from meshpipe.models.hf_vision import decoder_of, is_vision_model
from meshpipe.parallel import (TensorParallelRegion, VocabParallelEmbedding, mark_fused,
                               mark_sequence_parallel)
from meshpipe.parallel.tensor import _SHARD_ATTR

COLUMN, ROW = "column", "row"
# Each split projection of a decoder layer, by the end of its module name.
SPLITS = {"self_attn.q_proj": COLUMN, "self_attn.k_proj": COLUMN, "self_attn.v_proj": COLUMN,
          "self_attn.o_proj": ROW, "mlp.gate_proj": COLUMN, "mlp.up_proj": COLUMN,
          "mlp.down_proj": ROW, "self_attn.qkv_proj": COLUMN, "mlp.gate_up_proj": COLUMN}
# Fused projections (Phi-3): their rows are parts, each split on its own, so a rank holds
# its q, k and v heads (its gate and up width) side by side: the parts' sizes by config.
FUSED = {"self_attn.qkv_proj": lambda c: (c.num_attention_heads * _head_dim(c),
                                          kv_heads(c) * _head_dim(c), kv_heads(c) * _head_dim(c)),
         "mlp.gate_up_proj": lambda c: (c.intermediate_size, c.intermediate_size)}
# Head counts an attention module may keep as attributes.
HEAD_COUNTS = ("num_heads", "num_key_value_heads")
# The modules whose input starts a tensor-parallel region.
REGIONS = ("self_attn", "mlp")
# Weights applied per head: on a rank's own heads, their gradients are partial sums.
PER_HEAD = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# An expert's hidden width and a shared expert's, where not ``intermediate_size`` (Qwen MoE).
EXPERT_WIDTHS = ("moe_intermediate_size", "shared_expert_intermediate_size")
# Where a parameter's rows come from: [(dim, start, stop)] slices of the checkpoint tensor,
# concatenated.
ROWS_ATTR = "_meshpipe_checkpoint_slice"


def check_sizes(config: Any, tp: int, where: str) -> None:
    """One-line ValueErrors, before any process starts, for a ``tp`` the model cannot split."""
    sizes = {"attention heads (num_attention_heads)": config.num_attention_heads,
             "key/value heads (num_key_value_heads)": kv_heads(config),
             "MLP width (intermediate_size)": config.intermediate_size,
             "vocabulary (vocab_size)": config.vocab_size,
             **{f"expert width ({field})": getattr(config, field) for field in EXPERT_WIDTHS
                if getattr(config, field, None)}}
    for what, size in sizes.items():
        if size % tp:
            raise ValueError(f"--tp {tp} must divide the {what} of {where}, {size}; use a tp "
                             f"that divides {size}")


def kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class ColumnParallel(nn.Module):
    """This rank's output rows of a projection, inside a tensor-parallel region (``enters``:
    starting one itself, as the head does)."""

    def __init__(self, linear: nn.Linear, region: TensorParallelRegion, *,
                 enters: bool = False, parts: tuple[int, ...] | None = None):
        super().__init__()
        self.region = region
        self.enters = enters
        self.weight = _slice_of(linear.weight, 0, region, parts)
        self.bias = None if linear.bias is None else _slice_of(linear.bias, 0, region, parts)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.region.enter(x) if self.enters else x, self.weight, self.bias)


class RowParallel(nn.Module):
    """This rank's input columns of a projection, ending a tensor-parallel region; a bias
    is added once, after the ranks' partial outputs are summed (on a sequence shard under
    sequence parallelism, so its gradient is then partial)."""

    def __init__(self, linear: nn.Linear, region: TensorParallelRegion):
        super().__init__()
        self.region = region
        self.weight = _slice_of(linear.weight, 1, region)
        self.bias = linear.bias
        if self.bias is not None and region.sequence_parallel:
            mark_sequence_parallel(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = self.region.leave(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """Gemma 3's embedding (rows times ``sqrt(hidden_size)``), vocabulary-parallel."""

    def __init__(self, *args: Any, scale: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(tokens) * torch.tensor(self.scale, dtype=self.weight.dtype)


def _slice_of(param: nn.Parameter, dim: int, region: TensorParallelRegion,
              parts: tuple[int, ...] | None = None) -> nn.Parameter:
    """A meta parameter for this rank's ``dim`` shard of ``param`` (of each of its ``parts``
    for a fused weight), tagged with the slices of the checkpoint tensor it holds and along
    which dim it is split."""
    slices, start = [], 0
    for part in parts or (param.shape[dim],):
        size = part // region.size
        slices.append((dim, start + region.rank * size, start + (region.rank + 1) * size))
        start += part
    shape = list(param.shape)
    shape[dim] = sum(stop - first for _, first, stop in slices)
    local = nn.Parameter(torch.empty(shape, device="meta", dtype=param.dtype),
                         requires_grad=param.requires_grad)
    setattr(local, ROWS_ATTR, slices)
    setattr(local, _SHARD_ATTR, dim)
    if parts is not None:
        mark_fused(local, parts)
    return local


def shard_skeleton(model: nn.Module, region: TensorParallelRegion) -> None:
    """Split ``model`` (on the meta device) for this rank's tp ``region`` (module docstring):
    its decoder and head (a vision-language model's tower stays whole on every rank)."""
    base, config = decoder_of(model)
    check_sizes(config, region.size, "the model")
    local_config = copy.copy(config)
    local_config.num_attention_heads = config.num_attention_heads // region.size
    local_config.num_key_value_heads = kv_heads(config) // region.size
    expert_layers = {name: module for name, module in base.named_modules()
                     if isinstance(module, HFExperts)}
    for layer in expert_layers.values():
        _split_experts(layer, region)
    inside_experts = tuple(f"{name}." for name in expert_layers)
    for name, module in list(base.named_modules()):
        if name in expert_layers or name.startswith(inside_experts):
            continue
        end = next((end for end in SPLITS if name.endswith(end)), None)
        if end is not None:
            owner, attribute = _owner(base, name)
            fused = FUSED.get(end)
            setattr(owner, attribute, ColumnParallel(
                module, region, parts=fused(config) if fused else None)
                if SPLITS[end] == COLUMN else RowParallel(module, region))
        if name.endswith("self_attn"):
            _local_heads(module, local_config, region.size)
        if name.endswith(REGIONS):
            module.register_forward_pre_hook(_entering(region), with_kwargs=True)
    tied = model.lm_head.weight is base.embed_tokens.weight
    base.embed_tokens = _vocab_parallel(base.embed_tokens, region,
                                        whole=is_vision_model(model.config.model_type))
    if tied:
        model.lm_head = _TiedHead(base.embed_tokens.weight, region)
    else:
        model.lm_head = ColumnParallel(model.lm_head, region, enters=True)
    for name, param in base.named_parameters():
        if name.endswith(PER_HEAD) or (region.sequence_parallel and name.endswith("norm.weight")):
            mark_sequence_parallel(param)


def _split_experts(layer: HFExperts, region: TensorParallelRegion) -> None:
    """An expert layer for ``region``, as the reference model's (``MoE.split_width``): each
    expert keeps its slice of the hidden width (gate and up by output, down by input; the
    router whole), and the layer sums its experts' outputs over the region. Qwen2-MoE's
    shared expert is split as a dense MLP, a region of its own on the tokens the layer
    routes (the whole sequence under sequence parallelism)."""
    layer.tp = region
    for expert in layer.experts.values():
        for name, dim in zip(expert.projections, (0, 0, 1)):
            projection = getattr(expert, name)
            projection.weight = _slice_of(projection.weight, dim, region)
            projection.out_features, projection.in_features = projection.weight.shape
    shared = getattr(layer, "shared_expert", None)
    if shared is not None:
        whole = TensorParallelRegion(region.group)
        shared.gate_proj = ColumnParallel(shared.gate_proj, whole)
        shared.up_proj = ColumnParallel(shared.up_proj, whole)
        shared.down_proj = RowParallel(shared.down_proj, whole)
        shared.register_forward_pre_hook(_entering(whole), with_kwargs=True)


def _local_heads(attention: nn.Module, local_config: Any, size: int) -> None:
    """Give an attention module its rank's head counts: the config it reads them from, and
    the counts some modules keep (Phi-3 slices its fused q/k/v with them)."""
    attention.config = local_config
    for count in HEAD_COUNTS:
        if isinstance(getattr(attention, count, None), int):
            setattr(attention, count, getattr(attention, count) // size)


def _entering(region: TensorParallelRegion):
    """A forward pre-hook that starts ``region`` on a module's hidden states (the first
    positional argument, or ``hidden_states``)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (region.enter(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": region.enter(kwargs["hidden_states"])}
    return hook


class _TiedHead(nn.Module):
    """The head over this rank's vocabulary rows, sharing the embedding's shard."""

    def __init__(self, weight: nn.Parameter, region: TensorParallelRegion):
        super().__init__()
        self.region = region
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.region.enter(x), self.weight)


def _vocab_parallel(embedding: nn.Embedding, region: TensorParallelRegion, *,
                    whole: bool = False) -> nn.Module:
    """``embedding`` split by vocabulary rows; ``whole``: its output is the whole sequence
    even under sequence parallelism."""
    scale = getattr(embedding, "scalar_embed_scale", None)
    options = dict(sequence_parallel=region.sequence_parallel and not whole,
                   padding_idx=embedding.padding_idx, device="meta",
                   dtype=embedding.weight.dtype)
    layer = (VocabParallelEmbedding(embedding.num_embeddings, embedding.embedding_dim,
                                    region.group, **options) if scale is None
             else ScaledVocabParallelEmbedding(embedding.num_embeddings,
                                               embedding.embedding_dim, region.group,
                                               scale=scale, **options))
    rows = layer.weight.shape[0]
    setattr(layer.weight, ROWS_ATTR, [(0, region.rank * rows, (region.rank + 1) * rows)])
    return layer


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attribute = name.rpartition(".")
    return model.get_submodule(parent), attribute
