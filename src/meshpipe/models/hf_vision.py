"""Hugging Face vision-language models (Qwen2-VL, Qwen2.5-VL) as meshpipe pipeline stages.

transformers' own modules run everything: the vision tower with its patch merger (the
projector), the token embedding and each decoder layer. The tower sits on the first stage,
beside the embedding its image features replace (the image placeholder tokens' rows), with
that stage's first decoder layers or none (a stage of its own). A microbatch's stage-0
message is ``(tokens, positions, doc_ids, rope, pixels, grids)``: ``rope`` the 3D rotary
positions of every token ``[3, batch, seq]`` (``mrope_positions``: text tokens count up, an
image's tokens take its (time, row, column) from where the text stopped), ``pixels`` the
microbatch's image patches in token order and ``grids`` each image's (t, h, w) in patches.
Between stages ``(hidden, positions, doc_ids, rope)`` travels, each microbatch at its own
length. ``positions`` and ``doc_ids`` are meshpipe's token order for the causal mask, as for
decoders; the rotary tables come from ``rope``.

Parameter names are the weight files' (``visual.blocks.0...``, ``model.layers.0...``),
which transformers 5 maps onto its modules (``model.visual...``,
``model.language_model.layers...``) when it loads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from meshpipe.runtime.substeps import run_steps

# model_type -> (module-name prefix, weight-file prefix), longest module prefix first.
FILE_PREFIXES = {
    "qwen2_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
}
VISION_MODEL_TYPES = tuple(FILE_PREFIXES)
# The parts of a vision-language model (--freeze, --lr-scale), by weight-file prefix; the
# language model is the rest.
PARTS = ("vision", "projector", "language")
PART_PREFIXES = {
    "qwen2_vl": (("visual.merger.", "projector"), ("visual.", "vision")),
    "qwen2_5_vl": (("visual.merger.", "projector"), ("visual.", "vision")),
}
PROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class VisionInfo:
    """What the data and the layer split need of a vision-language model."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    merge_size: int  # image patches merged into one token along each side
    tower_parameters: int  # the vision tower's (with the merger) parameter count
    layer_parameters: int  # one decoder layer's parameter count


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
    for module_prefix, file_prefix in FILE_PREFIXES.get(model_type, ()):
        if module_name.startswith(module_prefix):
            return file_prefix + module_name[len(module_prefix):]
    return module_name


def part_of(model_type: str, name: str) -> str:
    """The part (``PARTS``) a parameter belongs to, by its weight-file name."""
    return next((part for prefix, part in PART_PREFIXES[model_type] if name.startswith(prefix)),
                "language")


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
    visual = skeleton.model.visual
    layer = skeleton.model.language_model.layers[0]
    return VisionInfo(image_token_id=config.image_token_id,
                      vision_start_token_id=config.vision_start_token_id,
                      vision_end_token_id=config.vision_end_token_id,
                      merge_size=config.vision_config.spatial_merge_size,
                      tower_parameters=sum(p.numel() for p in visual.parameters()),
                      layer_parameters=sum(p.numel() for p in layer.parameters()))


def tower_cost_in_layers(info: VisionInfo, patches: int, tokens: int) -> float:
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
    real_rotary_embeddings(model)
    return model


def real_rotary_embeddings(model: nn.Module) -> None:
    """The skeleton's rotary embeddings (text and vision) rebuilt off the meta device: their
    small tables are computed from the config, not stored."""
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if (type(child).__name__.endswith("RotaryEmbedding") and hasattr(child, "config")
                    and any(buffer.is_meta for buffer in child.buffers())):
                with torch.device("cpu"):
                    setattr(owner, name, type(child)(child.config))


def mrope_positions(tokens: Tensor, grids: Tensor, image_token_id: int, merge_size: int,
                    doc_lens: list[list[int]] | None = None) -> Tensor:
    """The 3D rotary positions ``[3, rows, seq]`` of ``tokens`` ``[rows, seq]`` whose image
    placeholders belong to the images of ``grids`` (in order). A text token is one past
    the position before it on all three axes; an image's tokens are its (frame, row,
    column) of merged patches, offset by where the text stopped, and the text after it goes
    on from the largest. Each document of ``doc_lens`` (per row; None: a row is one) starts
    at zero. This is transformers' ``get_rope_index`` for images."""
    rows, seq = tokens.shape
    out = np.empty((3, rows, seq), dtype=np.int64)
    ids = tokens.numpy()
    image_counts = (grids[:, 0] * grids[:, 1] * grids[:, 2] // merge_size ** 2).tolist()
    spans = [(int(t), int(h) // merge_size, int(w) // merge_size) for t, h, w in grids.tolist()]
    image = 0
    for row in range(rows):
        lengths = doc_lens[row] if doc_lens is not None else [seq]
        start = 0
        for length in lengths:
            image = _document_positions(ids[row, start:start + length],
                                        out[:, row, start:start + length], image, image_counts,
                                        spans, image_token_id)
            start += length
    if image != len(image_counts):
        raise ValueError(f"the tokens hold placeholders for {image} images but {len(spans)} "
                         "were given")
    return torch.from_numpy(out)


def _document_positions(ids: np.ndarray, out: np.ndarray, image: int, counts: list[int],
                        spans: list[tuple[int, int, int]], image_token_id: int) -> int:
    """One document's positions into ``out`` ``[3, len]``; the index of its next image."""
    placeholders = np.flatnonzero(ids == image_token_id)
    cursor, position, used = 0, 0, 0
    while used < len(placeholders):
        begin = int(placeholders[used])
        text = begin - cursor
        out[:, cursor:begin] = np.arange(position, position + text)
        position += text
        frames, height, width = spans[image]
        count = counts[image]
        grid = np.indices((frames, height, width)).reshape(3, -1)
        out[:, begin:begin + count] = grid + position
        position += max(height, width)
        cursor = begin + count
        used += count
        image += 1
    out[:, cursor:] = np.arange(position, position + len(ids) - cursor)
    return image


def image_rows(tokens: Tensor, image_token_id: int) -> Tensor:
    """For each token, the row of the microbatch's image features it takes (its image
    placeholders numbered in order, row by row), -1 for a text token."""
    placeholders = tokens == image_token_id
    return torch.where(placeholders, placeholders.reshape(-1).cumsum(0).reshape(tokens.shape) - 1,
                       -1)


def image_features(visual: nn.Module, pixels: Tensor, grids: Tensor) -> Tensor:
    """The merged features of the images, one row per image token, in order."""
    out = visual(pixels.to(next(visual.parameters()).dtype), grid_thw=grids)
    return getattr(out, "pooler_output", out)


class VisionChunk(nn.Module):
    """A stage of a vision-language model: the decoder chunk ``decoder`` (an ``HFChunk``)
    with, on the first stage, the vision tower whose features replace the image
    placeholders' embeddings."""

    def __init__(self, decoder: nn.Module, visual: nn.Module | None, image_token_id: int):
        super().__init__()
        self.decoder = decoder
        self.visual = visual
        self.image_token_id = image_token_id
        self.is_first, self.is_last = decoder.is_first, decoder.is_last

    def forward(self, x: Tensor, positions: Tensor | None = None, doc_ids: Tensor | None = None,
                rope: Tensor | None = None, pixels: Tensor | None = None,
                grids: Tensor | None = None, rows: Tensor | None = None):
        return run_steps(self.forward_steps(x, positions, doc_ids, rope, pixels, grids, rows))

    def forward_steps(self, x: Tensor, positions: Tensor | None = None,
                      doc_ids: Tensor | None = None, rope: Tensor | None = None,
                      pixels: Tensor | None = None, grids: Tensor | None = None,
                      rows: Tensor | None = None):
        hidden = self._embedded(x, pixels, grids, rows) if self.is_first else x
        out = yield from self.decoder.decoder_steps(hidden, x, positions, doc_ids, None,
                                                    rope=rope)
        return out if self.is_last else (*out, rope)

    def _embedded(self, tokens: Tensor, pixels: Tensor | None, grids: Tensor | None,
                  rows: Tensor | None) -> Tensor:
        """The token embeddings, an image placeholder's replaced by its image feature:
        ``rows`` (``image_rows``, of the tokens this rank holds) says which."""
        hidden = self.decoder.embed_tokens(tokens)
        if pixels is None or not pixels.shape[0]:
            return hidden
        features = image_features(self.visual, pixels, grids).to(hidden.dtype)
        if rows is None:
            rows = image_rows(tokens, self.image_token_id)
        shown = (rows >= 0).unsqueeze(-1)
        return torch.where(shown, features[rows.clamp(min=0)], hidden)

    def extra_repr(self) -> str:
        return f"vision={self.visual is not None}"


def split_vision_model(model: nn.Module, chunks: list[nn.Module],
                       image_token_id: int) -> list[VisionChunk]:
    """The decoder's chunks as vision-language stages, the tower on the first."""
    visual = model.model.visual
    return [VisionChunk(chunk, visual if index == 0 else None, image_token_id)
            for index, chunk in enumerate(chunks)]
