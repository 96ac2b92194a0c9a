"""Hugging Face vision-language models (Qwen2-VL, Qwen2.5-VL, LLaVA) as meshpipe pipeline
stages.

transformers' own modules run everything: the vision tower with its patch merger (the
projector), the token embedding and each decoder layer. The tower sits on the first stage,
beside the embedding its image features replace (the image placeholder tokens' rows), with
that stage's first decoder layers or none (a stage of its own). A microbatch's stage-0
message is ``(tokens, positions, doc_ids, rope, pixels, grids, rows)``: ``rope`` Qwen's 3D
rotary positions of every token ``[3, batch, seq]`` (``vision_positions.mrope_positions``;
None for LLaVA, whose decoder rotates by the token positions), ``pixels`` the microbatch's
image patches in token order, ``grids`` each image's (t, h, w) in patches and ``rows`` the
image feature each token takes (``image_rows``). Between stages ``(hidden, positions,
doc_ids, rope)`` travels, each microbatch at its own length. ``positions`` and ``doc_ids``
are meshpipe's token order for the causal mask, as for decoders.

Which models, their weight-file names, their parts (``--freeze``) and their tower are data
(``ARCHITECTURES``). Parameter names are the weight files' (``visual.blocks.0...``,
``model.layers.0...``), which transformers 5 maps onto its modules (``model.visual...``,
``model.language_model.layers...``) when it loads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from meshpipe.models.vision_positions import image_rows
from meshpipe.parallel import (gather_rows_summing_gradients, gather_rows_to_replicate,
                               mark_sequence_parallel, scatter_to_sequence, tp_rank_and_size)
from meshpipe.runtime.substeps import run_steps

PROCESSOR_FILE = "preprocessor_config.json"
# The parts of a vision-language model (--freeze, --lr-scale).
PARTS = ("vision", "projector", "language")


@dataclass(frozen=True)
class Architecture:
    """How meshpipe reads one kind of vision-language model."""

    # (module-name prefix, weight-file prefix), the longest module prefix first.
    file_prefixes: tuple[tuple[str, str], ...]
    # (weight-file prefix, part): a weight's part for --freeze (the language model: the rest).
    part_prefixes: tuple[tuple[str, str], ...]
    tower: type  # the nn.Module that turns a microbatch's images into its image features
    rope_3d: bool  # whether the decoder rotates by (time, row, column) positions


class QwenTower(nn.Module):
    """Qwen2-VL's and Qwen2.5-VL's tower with its patch merger (the projector): the
    processor gives patches already, with each image's (t, h, w) grid."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.visual = model.model.visual

    def forward(self, pixels: Tensor, grids: Tensor) -> Tensor:
        out = self.visual(pixels.to(next(self.visual.parameters()).dtype), grid_thw=grids)
        return getattr(out, "pooler_output", out)

    @staticmethod
    def patches_per_image(pixels: Tensor, grids: Tensor) -> list[int]:
        """Each image's patches, in order (a host read of the grids, which the tower itself
        reads too)."""
        return grids.prod(dim=-1).tolist()


class LlavaTower(nn.Module):
    """A LLaVA model's CLIP or SigLIP tower and its projector: the hidden states of the
    configured layer(s), without the first token under the "default" strategy, projected.
    The cache holds each image as patches (``as_images`` folds them back)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.vision_tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        config = model.config
        layers = config.vision_feature_layer
        self.layers = [layers] if isinstance(layers, int) else list(layers)
        self.drop_first = config.vision_feature_select_strategy == "default"
        self.patch_size = config.vision_config.patch_size
        # Its processor makes every image this size: the grids need not be read back from
        # the device (a host synchronization every microbatch on a GPU).
        self.side = config.vision_config.image_size // self.patch_size

    def forward(self, pixels: Tensor, grids: Tensor) -> Tensor:
        images = as_images(pixels, self.side, self.side, self.patch_size)
        out = self.vision_tower(images.to(next(self.projector.parameters()).dtype),
                                output_hidden_states=True)
        chosen = [out.hidden_states[layer] for layer in self.layers]
        if self.drop_first:
            chosen = [hidden[:, 1:] for hidden in chosen]
        features = self.projector(torch.cat(chosen, dim=-1))
        return features.reshape(-1, features.shape[-1])

    def patches_per_image(self, pixels: Tensor, grids: Tensor) -> list[int]:
        """Each image's patches, in order: every image is the processor's size."""
        patches = self.side * self.side
        return [patches] * (pixels.shape[0] // patches)


QWEN = Architecture(file_prefixes=(("model.language_model.", "model."),
                                   ("model.visual.", "visual.")),
                    part_prefixes=(("visual.merger.", "projector"), ("visual.", "vision")),
                    tower=QwenTower, rope_3d=True)
LLAVA = Architecture(file_prefixes=(("model.language_model.", "language_model.model."),
                                    ("model.vision_tower.", "vision_tower."),
                                    ("model.multi_modal_projector.", "multi_modal_projector."),
                                    ("lm_head.", "language_model.lm_head.")),
                     part_prefixes=(("multi_modal_projector.", "projector"),
                                    ("vision_tower.", "vision")),
                     tower=LlavaTower, rope_3d=False)
ARCHITECTURES = {"qwen2_vl": QWEN, "qwen2_5_vl": QWEN, "llava": LLAVA}
VISION_MODEL_TYPES = tuple(ARCHITECTURES)


def as_patches(images: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[n, c, H, W]`` (of one size) as rows of ``c * p * p`` values, one per patch,
    image by image and row by row, and each image's (1, H / p, W / p) grid."""
    n, channels, height, width = images.shape
    rows, columns = height // patch_size, width // patch_size
    patches = images.reshape(n, channels, rows, patch_size, columns, patch_size).transpose(
        0, 2, 4, 1, 3, 5).reshape(n * rows * columns, channels * patch_size * patch_size)
    return patches, np.tile(np.array([[1, rows, columns]], dtype=np.int64), (n, 1))


def as_images(patches: Tensor, rows: int, columns: int, patch_size: int) -> Tensor:
    """``as_patches`` undone for images of ``rows`` x ``columns`` patches: ``[n, c, H, W]``."""
    n = patches.shape[0] // (rows * columns)
    channels = patches.shape[1] // patch_size ** 2
    return patches.reshape(n, rows, columns, channels, patch_size, patch_size).permute(
        0, 3, 1, 4, 2, 5).reshape(n, channels, rows * patch_size, columns * patch_size)


def reference_images(model_type: str, pixels: Tensor, grids: Tensor, config) -> dict:
    """The unmodified transformers model's image arguments for ``pixels`` and ``grids``."""
    if ARCHITECTURES[model_type].rope_3d:
        return dict(pixel_values=pixels, image_grid_thw=grids)
    _, rows, columns = grids[0].tolist()
    return dict(pixel_values=as_images(pixels, rows, columns, config.vision_config.patch_size))


@dataclass(frozen=True)
class VisionInfo:
    """What the data and the layer split need of a vision-language model."""

    model_type: str
    image_token_id: int
    vision_start_token_id: int | None  # written before an image's tokens (Qwen), or none
    vision_end_token_id: int | None
    merge_size: int  # image patches merged into one token along each side
    tower_parameters: int  # the vision tower's (with the projector) parameter count
    layer_parameters: int  # one decoder layer's parameter count
    extra_tokens: int = 0  # an image's tokens beyond its patches (a class token kept or not)
    patch_size: int = 0  # > 0: the processor gives whole images, cut into patches this size

    @property
    def rope_3d(self) -> bool:
        return ARCHITECTURES[self.model_type].rope_3d

    def tokens_per_image(self, grids: np.ndarray) -> np.ndarray:
        return grids.prod(axis=1) // self.merge_size ** 2 + self.extra_tokens


def decoder_of(model: nn.Module) -> tuple[nn.Module, object]:
    """A causal LM's decoder (embedding, layers, norm, rotary embedding) and its config; a
    vision-language model's is its language model."""
    inner = model.model
    if hasattr(inner, "language_model"):
        return inner.language_model, model.config.text_config
    return inner, model.config


def is_vision_model(model_type: str) -> bool:
    return model_type in VISION_MODEL_TYPES


def file_name(model_type: str, module_name: str) -> str:
    """A parameter's name in the weight files, from its module path."""
    prefixes = ARCHITECTURES[model_type].file_prefixes if model_type in ARCHITECTURES else ()
    for module_prefix, file_prefix in prefixes:
        if module_name.startswith(module_prefix):
            return file_prefix + module_name[len(module_prefix):]
    return module_name


def part_of(model_type: str, name: str) -> str:
    """The part (``PARTS``) a parameter belongs to, by its weight-file name."""
    return next((part for prefix, part in ARCHITECTURES[model_type].part_prefixes
                 if name.startswith(prefix)), "language")


def parse_parts(text: str, flag: str = "--freeze") -> tuple[str, ...]:
    """``vision,projector`` as a tuple of parts; a one-line ValueError for another name."""
    parts = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        raise ValueError(f"{flag} {text}: {', '.join(unknown)} is not a part of a "
                         f"vision-language model; name some of {', '.join(PARTS)}")
    return parts


def parse_lr_scales(text: str) -> dict[str, float]:
    """``vision=0.1,projector=1`` as {part: scale}; a one-line ValueError for a bad entry."""
    scales = {}
    for entry in (entry.strip() for entry in text.split(",") if entry.strip()):
        part, _, value = entry.partition("=")
        parse_parts(part, "--lr-scale")
        try:
            scales[part.strip()] = float(value)
        except ValueError:
            scales[part.strip()] = -1.0
        if not scales[part.strip()] > 0:
            raise ValueError(f"--lr-scale {text}: {entry} is not part=SCALE with a positive "
                             "scale, e.g. vision=0.1")
    return scales


def vision_info(path: Path, config, skeleton: nn.Module) -> VisionInfo:
    """Token ids and merge size from the config of the model in ``path``, parameter counts
    from its meta ``skeleton`` (no memory); a one-line ValueError without its processor."""
    if not (path / PROCESSOR_FILE).is_file():
        raise ValueError(f"--model {path} is a vision-language model without its image "
                         f"processor ({PROCESSOR_FILE}): save the processor beside the model "
                         "(processor.save_pretrained(directory))")
    tower = ARCHITECTURES[config.model_type].tower(skeleton)
    layer = skeleton.model.language_model.layers[0]
    sizes = dict(tower_parameters=sum(p.numel() for p in tower.parameters()),
                 layer_parameters=sum(p.numel() for p in layer.parameters()))
    if config.model_type == "llava":
        embeddings = skeleton.model.vision_tower.embeddings
        kept_class = int(hasattr(embeddings, "class_embedding"))
        image_token = getattr(config, "image_token_id", None)
        return VisionInfo(model_type="llava",
                          image_token_id=config.image_token_index if image_token is None
                          else image_token,
                          vision_start_token_id=None, vision_end_token_id=None, merge_size=1,
                          extra_tokens=kept_class - int(tower.drop_first),
                          patch_size=config.vision_config.patch_size, **sizes)
    return VisionInfo(model_type=config.model_type, image_token_id=config.image_token_id,
                      vision_start_token_id=config.vision_start_token_id,
                      vision_end_token_id=config.vision_end_token_id,
                      merge_size=config.vision_config.spatial_merge_size, **sizes)


def tower_cost_in_layers(info: VisionInfo, patches: float, tokens: float) -> float:
    """The tower's compute in decoder layers' worth: a product of ``n`` parameters over ``m``
    rows costs ``2nm``, the tower's over the data's image patches, a layer's over its tokens
    (attention's own quadratic term is left out of both)."""
    if not tokens:
        return 0.0
    return info.tower_parameters * patches / (info.layer_parameters * tokens)


def build_skeleton(config, attention_name: str) -> nn.Module:
    """The whole model on the meta device, its decoder's attention ``attention_name`` (the
    tower keeps transformers' own), its rotary embeddings real."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(
            config, attn_implementation={"text_config": attention_name,
                                         "vision_config": "sdpa"})
    real_buffers(model)
    return model


def real_buffers(model: nn.Module) -> None:
    """The skeleton's computed buffers made real: its rotary embeddings (text and vision)
    rebuilt off the meta device from their config, and the token positions of a tower's
    embeddings (``position_ids``, 0..n-1)."""
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if (type(child).__name__.endswith("RotaryEmbedding") and hasattr(child, "config")
                    and any(buffer.is_meta for buffer in child.buffers())):
                with torch.device("cpu"):
                    setattr(owner, name, type(child)(child.config))
        positions = owner._buffers.get("position_ids")
        if positions is not None and positions.is_meta:
            owner.register_buffer("position_ids", torch.arange(positions.shape[-1]).expand(
                positions.shape), persistent=False)


class VisionChunk(nn.Module):
    """A stage of a vision-language model: the decoder chunk ``decoder`` (an ``HFChunk``)
    with, on the first stage, the vision tower whose features replace the image
    placeholders' embeddings.

    The ranks that hold the stage's tokens share the tower's work out: each runs it on its
    share of the microbatch's images (``image_share``: the context-parallel ranks of
    ``cp_group`` each a share, which its tp ranks of ``tp_group`` share again) and the ranks
    gather the features, each then having all of them. A rank's tower gradient is then its
    images' only: summed over the tp ranks (the tower's weights are tagged so by
    ``split_vision_model``) and, as every weight's, over the context-parallel ranks. With
    ``sequence_parallel`` each rank keeps its shard of the sequence once the features are in
    place."""

    def __init__(self, decoder: nn.Module, tower: nn.Module | None, image_token_id: int,
                 rope_3d: bool = False, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None):
        super().__init__()
        self.decoder = decoder
        self.tower = tower
        self.image_token_id = image_token_id
        self.rope_3d = rope_3d
        self.tp_group = tp_group if tp_rank_and_size(tp_group)[1] > 1 else None
        self.cp_group = cp_group if tp_rank_and_size(cp_group)[1] > 1 else None
        self.sequence_parallel = sequence_parallel and self.tp_group is not None
        self.is_first, self.is_last = decoder.is_first, decoder.is_last

    @property
    def layers(self) -> nn.ModuleDict:
        """The decoder layers (the blocks ``--compile`` compiles)."""
        return self.decoder.layers

    def forward(self, x: Tensor, positions: Tensor | None = None, doc_ids: Tensor | None = None,
                rope: Tensor | None = None, pixels: Tensor | None = None,
                grids: Tensor | None = None, rows: Tensor | None = None):
        return run_steps(self.forward_steps(x, positions, doc_ids, rope, pixels, grids, rows))

    def forward_steps(self, x: Tensor, positions: Tensor | None = None,
                      doc_ids: Tensor | None = None, rope: Tensor | None = None,
                      pixels: Tensor | None = None, grids: Tensor | None = None,
                      rows: Tensor | None = None):
        hidden = x
        if self.is_first:
            hidden = self._embedded(x, pixels, grids, rows)
            if self.sequence_parallel:
                hidden = scatter_to_sequence(hidden, self.tp_group)
        out = yield from self.decoder.decoder_steps(hidden, x, positions, doc_ids, None,
                                                    rope=rope, rope_3d=self.rope_3d)
        return out if self.is_last else (*out, rope)

    def _embedded(self, tokens: Tensor, pixels: Tensor | None, grids: Tensor | None,
                  rows: Tensor | None) -> Tensor:
        """The token embeddings, an image placeholder's replaced by its image feature:
        ``rows`` (``image_rows``, of the tokens this rank holds) says which."""
        hidden = self.decoder.embed_tokens(tokens)
        if pixels is None or not pixels.shape[0]:
            return hidden
        features = self._features(pixels, grids, hidden)
        if rows is None:
            rows = image_rows(tokens, self.image_token_id)
        shown = (rows >= 0).unsqueeze(-1)
        return torch.where(shown, features[rows.clamp(min=0)], hidden)

    def _features(self, pixels: Tensor, grids: Tensor, hidden: Tensor) -> Tensor:
        """The images' features in order, in ``hidden``'s dtype: the tower's over all of
        them, or each rank's over its share, gathered (the tp ranks' first, then the
        context-parallel ranks', whose tokens each use some of them)."""
        if self.tp_group is None and self.cp_group is None:
            return self.tower(pixels, grids).to(hidden.dtype)
        patches = self.tower.patches_per_image(pixels, grids)
        first, last = 0, len(patches)
        for group in (self.cp_group, self.tp_group):
            if group is not None:
                low, high = image_share(patches[first:last], *tp_rank_and_size(group))
                first, last = first + low, first + high
        if last > first:
            start, stop = sum(patches[:first]), sum(patches[:last])
            mine = self.tower(pixels[start:stop], grids[first:last]).to(hidden.dtype)
        else:  # in the graph as the others' shares are, so that every rank's backward
            # joins the gather's (an all-reduce over the cp ranks)
            mine = hidden.new_zeros((0, hidden.shape[-1])).requires_grad_(
                torch.is_grad_enabled() and any(p.requires_grad for p in self.tower.parameters()))
        mine = gather_rows_to_replicate(mine, self.tp_group)
        return gather_rows_summing_gradients(mine, self.cp_group)

    def extra_repr(self) -> str:
        return f"vision={self.tower is not None}"


def image_share(patches: list[int], rank: int, size: int) -> tuple[int, int]:
    """The images ``[first, last)`` of ``rank`` of ``size`` ranks sharing images of
    ``patches`` patches each: consecutive images, each to the rank its middle patch falls
    in, so that the ranks' patches are about even (a rank may have none)."""
    total = sum(patches)
    if not total:
        return 0, 0
    owners, before = [], 0
    for count in patches:
        owners.append(min(size - 1, (2 * before + count) * size // (2 * total)))
        before += count
    mine = [index for index, owner in enumerate(owners) if owner == rank]
    return (mine[0], mine[-1] + 1) if mine else (0, 0)


def split_vision_model(model: nn.Module, chunks: list[nn.Module], image_token_id: int,
                       tp_group=None, sequence_parallel: bool = False,
                       cp_group=None) -> list[VisionChunk]:
    """The decoder's chunks as vision-language stages, the tower on the first; with a
    ``tp_group`` of several ranks the tower's weights are tagged for their gradients' sum
    over it (``VisionChunk``: each rank runs the tower on its share of the images)."""
    architecture = ARCHITECTURES[model.config.model_type]
    tower = architecture.tower(model)
    if tp_rank_and_size(tp_group)[1] > 1:
        for param in tower.parameters():
            mark_sequence_parallel(param)
    return [VisionChunk(chunk, tower if index == 0 else None, image_token_id,
                        architecture.rope_3d, tp_group, sequence_parallel, cp_group)
            for index, chunk in enumerate(chunks)]
