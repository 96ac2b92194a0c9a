"""A small image-caption corpus made on the spot (no download): coloured shapes drawn with
Pillow, each sample 0-3 pictures of several sizes and a caption saying what they show, in
order. It is what the tests and ``meshpipe demo --vision`` train a vision-language model on;
the caption of a picture can only be told from the picture itself, so a model that learns
it uses the images.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
           "yellow": (235, 210, 40)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((16, 16), (24, 16), (16, 28), (32, 24))
CAPTIONS_FILE = "captions.jsonl"


def write_shapes_corpus(directory: str | Path, samples: int = 64, seed: int = 0, *,
                        max_images: int = 3, blank: bool = False,
                        sizes: tuple[tuple[int, int], ...] = SIZES,
                        min_images: int = 0) -> Path:
    """``samples`` rows of ``directory/captions.jsonl`` and their PNGs, ``min_images`` to
    ``max_images`` pictures a row, each of one of ``sizes`` (width, height); ``blank``:
    every picture plain grey (the control a model cannot learn the captions from)."""
    from PIL import Image, ImageDraw

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for sample in range(samples):
        names, words = [], []
        for index in range(rng.randint(min_images, max_images)):
            colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
            width, height = rng.choice(sizes)
            image = Image.new("RGB", (width, height), (128, 128, 128))
            if not blank:
                _draw(ImageDraw.Draw(image), shape, COLOURS[colour], width, height)
            name = f"shape-{sample}-{index}.png"
            image.save(out / name)
            names.append(name)
            words.append(f"a {colour} {shape}")
        text = (" and ".join(words) + ".") if words else "no picture."
        rows.append({"images": names, "text": text})
    captions = out / CAPTIONS_FILE
    captions.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return captions


def _draw(draw, shape: str, colour: tuple[int, int, int], width: int, height: int) -> None:
    box = (2, 2, width - 3, height - 3)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(width // 2, 2), (2, height - 3), (width - 3, height - 3)], fill=colour)
