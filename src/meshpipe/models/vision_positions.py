"""Where a vision-language model's tokens are: the 3D rotary positions of Qwen2-VL's
decoder (``mrope_positions``) and which image feature each image placeholder takes
(``image_rows``), computed with the data on the host, so that any rank can hold any columns
of a microbatch (context parallelism) and still rotate and embed them right."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


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
