"""Images of ``--data`` for a vision-language ``--model``: read with Pillow, turned into
patches by the model directory's own image processor (transformers' Pillow backend where
torchvision is not installed, its torchvision one where it is), once, into the data cache. An
image is a file or its encoded bytes (datasets' Image columns in Parquet and Arrow files).

A row's images are written where they are shown, as the model's placeholder: one image
token, which the tokenized row then holds as many times as the image gives tokens
(``VisionInfo.tokens_per_image``: Qwen's patches over the merge size squared, LLaVA's tower
patches with or without its class token). Those tokens are never targets.

In the cache the images are ``pixels.npy`` (float32 patches of every image, in order; a
processor that gives whole images, LLaVA's, has them cut into the tower's patches),
``grids.npy`` (each image's (t, h, w) in patches) and ``image_offsets.npy`` (each document's
first image, and one past the last); ``DocumentImages`` maps them and hands a sequence's
images to the samplers.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from meshpipe.models.hf_vision import as_patches
from meshpipe.train.data.npy_stream import NpyStream
from meshpipe.train.data.tokenizers import load_offline

@dataclass(frozen=True)
class Pictures:
    """Images in token order: their patches ``[patches, patch_dim]`` and (t, h, w) grids
    ``[images, 3]``."""

    pixels: torch.Tensor
    grids: torch.Tensor

    @staticmethod
    def joined(parts: list[Pictures], patch_dim: int) -> Pictures:
        if not parts:
            return Pictures(torch.zeros(0, patch_dim), torch.zeros(0, 3, dtype=torch.int64))
        return Pictures(torch.cat([part.pixels for part in parts]),
                        torch.cat([part.grids for part in parts]))


class ImageInputs:
    """A vision-language model's image processor and placeholder tokens."""

    def __init__(self, model_dir: str | Path, vision, tokenizer):
        # From its module: transformers 5.17 without torchvision exports a stand-in under the
        # package's name that refuses to load, where the class itself falls back to the
        # Pillow processors.
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        directory = Path(model_dir)
        self._processor = load_offline(AutoImageProcessor, directory, "image processor")
        self.vision = vision  # the model's hf_vision.VisionInfo
        self.image_token_id = vision.image_token_id
        shown = [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]
        # What a caption row shows for each of its images.
        self.marker = "".join(tokenizer.token_texts([i for i in shown if i is not None]))
        config = (directory / "preprocessor_config.json").read_bytes()
        self.name = f"images:{hashlib.sha256(config).hexdigest()[:16]}"

    def process(self, sources: list[Path | bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The images' patches (float32 ``[patches, patch_dim]``) and grids (``[n, 3]``) from
        their files or encoded bytes (``image_sources``); a one-line ValueError (to follow the
        row's place) for an image that cannot be read."""
        from PIL import Image, UnidentifiedImageError

        images = []
        for number, source in enumerate(sources, 1):
            named = (f"image {number} of the row ({len(source)} bytes)"
                     if isinstance(source, bytes) else f"image {source}")
            try:
                with Image.open(io.BytesIO(source) if isinstance(source, bytes)
                                else source) as image:
                    images.append(image.convert("RGB"))
            except FileNotFoundError:
                raise ValueError(f": {named} does not exist (image paths are relative to "
                                 "the data file)") from None
            except (UnidentifiedImageError, OSError) as err:
                raise ValueError(f": cannot read {named} ({err})") from None
        out = self._processor(images=images, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if self.vision.patch_size:  # whole images (LLaVA's processors): kept as patches
            return as_patches(pixels, self.vision.patch_size)
        return pixels, np.asarray(out["image_grid_thw"], dtype=np.int64)

    def tokens_per_image(self, grids: np.ndarray) -> np.ndarray:
        return self.vision.tokens_per_image(grids)

    def expand(self, ids: list[int], mask: np.ndarray | None,
               grids: np.ndarray) -> tuple[list[int], np.ndarray]:
        """``ids`` with each image placeholder repeated as many times as its image gives
        tokens, and the target mask with those tokens left out; a one-line ValueError when
        the row does not show each of its images once."""
        mask = np.ones(len(ids), dtype=np.uint8) if mask is None else mask
        where = [index for index, token in enumerate(ids) if token == self.image_token_id]
        if len(where) != len(grids):
            raise ValueError(f": the row shows {len(where)} image placeholders for "
                             f"{len(grids)} images: each image is shown once")
        counts = self.tokens_per_image(grids)
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[where] = counts
        expanded = np.repeat(np.asarray(ids, dtype=np.int64), repeats)
        expanded_mask = np.repeat(mask, repeats)
        expanded_mask[expanded == self.image_token_id] = 0
        return expanded.tolist(), expanded_mask


@dataclass
class DocumentImages:
    """The images of a tokenized dataset's documents (memory-mapped patches)."""

    pixels: np.ndarray  # [patches, patch_dim] float32
    grids: np.ndarray  # [images, 3]
    image_offsets: np.ndarray  # [documents + 1]: document d's images are [o[d], o[d + 1])

    @classmethod
    def none(cls, documents: int, patch_dim: int) -> DocumentImages:
        """No images for any of ``documents`` documents: a source without images in a
        mixture whose other sources show some."""
        return cls(np.zeros((0, patch_dim), dtype=np.float32), np.zeros((0, 3), dtype=np.int64),
                   np.zeros(documents + 1, dtype=np.int64))

    @cached_property
    def patch_starts(self) -> np.ndarray:
        """Where each image's patches start in ``pixels``, and the end."""
        return np.concatenate([[0], np.cumsum(self.grids.prod(axis=1))]).astype(np.int64)

    @property
    def patch_dim(self) -> int:
        return self.pixels.shape[1]

    def of(self, document: int) -> Pictures:
        """Document ``document``'s images."""
        first, last = int(self.image_offsets[document]), int(self.image_offsets[document + 1])
        starts = self.patch_starts
        pixels = np.asarray(self.pixels[starts[first]:starts[last]])
        return Pictures(torch.from_numpy(pixels.copy()),
                        torch.from_numpy(np.asarray(self.grids[first:last]).copy()))

    def part(self, documents: slice) -> DocumentImages:
        """The images of documents ``documents`` (their offsets from zero again)."""
        offsets = np.asarray(self.image_offsets[documents.start:documents.stop + 1])
        first, last = int(offsets[0]), int(offsets[-1])
        starts = self.patch_starts
        return DocumentImages(self.pixels[starts[first]:starts[last]],
                              self.grids[first:last], offsets - first)

    def patches(self) -> int:
        return int(self.grids.prod(axis=1).sum())


class ImageColumns:
    """pixels.npy (streamed), grids.npy and image_offsets.npy of the documents' images,
    written only once some row shows one (data without images has none)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.pixels: NpyStream | None = None
        self.patch_dim = 0
        self.grids: list[np.ndarray] = []
        self.per_document: list[np.ndarray] = []

    def add(self, shown: list[tuple[np.ndarray, np.ndarray] | None],
            lengths: np.ndarray) -> None:
        kept = [images for images, length in zip(shown, lengths) if length > 0]
        self.per_document.append(np.array([0 if images is None else len(images[1])
                                           for images in kept], dtype=np.int64))
        for images in kept:
            if images is None:
                continue
            pixels, grids = images
            if self.pixels is None:
                self.pixels = NpyStream(self.directory / "pixels.npy", np.float32)
                self.patch_dim = pixels.shape[1]
            self.pixels.write(pixels.reshape(-1))
            self.grids.append(grids)

    def counts(self) -> dict:
        """What meta.json records of the images."""
        if self.pixels is None:
            return {}
        return {"images": int(sum(len(grids) for grids in self.grids)),
                "patch_dim": self.patch_dim}

    def __enter__(self) -> ImageColumns:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.pixels is None:
            return
        self.pixels.__exit__(*exc_info)
        if exc_info[0] is None:
            np.save(self.directory / "grids.npy", np.concatenate(self.grids))
            counts = np.concatenate(self.per_document)
            np.save(self.directory / "image_offsets.npy",
                    np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def image_sources(entries: list, file: Path) -> list[Path | bytes]:
    """A row's images as files (relative paths from the data file's folder) or encoded bytes:
    each entry a path, bytes, or datasets' Image value ``{"bytes", "path"}`` (what its
    Parquet and Arrow files hold); a one-line ValueError (to follow the row's place) for an
    entry that is none of them."""
    sources: list[Path | bytes] = []
    for entry in entries:
        if isinstance(entry, dict):
            entry = entry.get("bytes") if entry.get("bytes") is not None else entry.get("path")
        if isinstance(entry, str):
            sources.append(file.parent / entry)
        elif isinstance(entry, bytes):
            sources.append(entry)
        else:
            raise ValueError(": an image must be a file path, the image's bytes or "
                             "{\"bytes\": ..., \"path\": ...} (datasets' Image); got "
                             f"{type(entry).__name__}")
    return sources
