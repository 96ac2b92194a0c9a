"""Several ``--data`` sources mixed by weight (``--data a.jsonl:0.7 --data chat/:0.3``).

``MixtureSampler.batch(step)`` is a pure function of (seed, step), like each source's own
sampler, so a resume continues the same order. The sequences are dealt in rounds of
``ROUND`` sequences: in every round each source gets its share of the weights (rounded by
largest remainders, so a source's share is exact to 1 / ``ROUND`` at every round's end) in
an order shuffled by (seed, round). Source ``s``'s ``k``-th sequence is its own sampler's
sequence ``k``: every source runs through its own epochs, whatever the others do. Where the
sources show images (their samplers built with the images' ``patch_dim``, those without
images too), a batch carries each sequence's pictures and length.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from meshpipe.train.data.sampling import TextBatch, TextSampler

ROUND = 10_000


def parse_source(text: str, flag: str = "--data") -> tuple[str, float]:
    """``PATH`` or ``PATH:WEIGHT`` as (path, weight); the weight is 1 when not given. A
    path that exists is taken whole even if it holds a colon."""
    path, colon, weight = text.rpartition(":")
    if not colon or Path(text).exists():
        return text, 1.0
    try:
        value = float(weight)
    except ValueError:
        raise ValueError(f"{flag} {text}: the weight {weight!r} after the last ':' is not a "
                         f"number; write PATH:WEIGHT with a positive weight, such as "
                         f"{path}:0.5") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {text}: the weight {weight} is not a positive number; "
                         f"write PATH:WEIGHT with a positive weight, such as {path}:0.5")
    return path, value


def source_names(paths: list[str]) -> list[str]:
    """A short name per source for metrics: its file or folder name, made unique."""
    names = [Path(path).name or path for path in paths]
    return [name if names.count(name) == 1 else f"{name}#{index}"
            for index, name in enumerate(names)]


def round_counts(weights: list[float], size: int = ROUND) -> np.ndarray:
    """Sequences per source in a round of ``size``: the weights' shares, rounded by largest
    remainders so that they add up to ``size``."""
    shares = np.asarray(weights, dtype=np.float64) / sum(weights) * size
    counts = np.floor(shares).astype(np.int64)
    order = np.argsort(-(shares - counts), kind="stable")
    counts[order[:size - int(counts.sum())]] += 1
    return counts


class MixtureSampler:
    """Batches of ``batch_size`` sequences drawn from ``samplers`` in the proportions of
    ``weights`` (each batch says which source each sequence came from)."""

    def __init__(self, samplers: list[TextSampler], weights: list[float], batch_size: int, *,
                 seed: int = 0):
        self.samplers = samplers
        self.batch_size = batch_size
        self.seed = seed
        self.counts = round_counts(weights)
        self._rounds: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _round(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """Round ``number``'s source of each position, and each position's index among its
        source's positions in the round. The two rounds computed last are kept."""
        if number not in self._rounds:
            generator = np.random.default_rng([self.seed % 2**64, number, 0x6D6978])
            order = generator.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
            index = np.empty(ROUND, dtype=np.int64)
            for source in range(len(self.counts)):
                where = np.flatnonzero(order == source)
                index[where] = np.arange(len(where))
            self._rounds[number] = (order, index)
            for old in list(self._rounds)[:-2]:
                del self._rounds[old]
        return self._rounds[number]

    def assignment(self, numbers) -> tuple[np.ndarray, np.ndarray]:
        """For sequences ``numbers``: their sources and their numbers in those sources."""
        sources = np.empty(len(numbers), dtype=np.int64)
        within = np.empty(len(numbers), dtype=np.int64)
        for row, sequence in enumerate(numbers):
            number, position = divmod(sequence, ROUND)
            order, index = self._round(number)
            sources[row] = order[position]
            within[row] = number * self.counts[order[position]] + index[position]
        return sources, within

    def batch(self, step: int) -> TextBatch:
        """Batch number ``step``: identical on every rank and across restarts."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        first = step * self.batch_size
        sources, within = self.assignment(range(first, first + self.batch_size))
        parts: dict[int, tuple[np.ndarray, TextBatch]] = {}
        for source in np.unique(sources):
            rows = np.flatnonzero(sources == source)
            parts[int(source)] = rows, self.samplers[source].sequences(within[rows].tolist())
        tokens = torch.empty((self.batch_size, self._seq_len), dtype=torch.int64)
        targets = torch.empty_like(tokens)
        doc_lens: list = [None] * self.batch_size
        pictures: list = [None] * self.batch_size
        lengths: list = [None] * self.batch_size
        for rows, part in parts.values():
            index = torch.from_numpy(rows)
            tokens[index] = part.tokens
            targets[index] = part.targets
            for row, pieces in zip(rows, part.doc_lens or [None] * len(rows)):
                doc_lens[row] = pieces
            for row, shown, length in zip(rows, part.pictures or (), part.lengths or ()):
                pictures[row], lengths[row] = shown, length
        packed = self.samplers[0].pack
        with_pictures = all(part.pictures is not None for _, part in parts.values())
        return TextBatch(tokens, targets, tuple(doc_lens) if packed else None,
                         tuple(int(source) for source in sources),
                         tuple(pictures) if with_pictures else None,
                         tuple(lengths) if with_pictures else None)

    @property
    def _seq_len(self) -> int:
        return self.samplers[0].seq_len
