"""A rank's share of each batch: the stage-0 inputs and last-stage targets of every
microbatch, on the rank's device, and what each microbatch's summed loss is divided by.

Every rank of a context-parallel group gets the same batch and keeps its slice of the
sequence: zigzag over the ring, then a contiguous Ulysses split (``hybrid_positions``). A
packed batch (``--pack``) runs each microbatch as one row holding this rank's piece of every
document (each document split contiguously over the ring, then Ulysses), with each token's
position inside its document and its document id, so that attention applies the
block-diagonal causal mask without materialising it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshpipe.context.derived import to_device
from meshpipe.context.shards import hybrid_positions, packed_hybrid_positions
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.source_losses import SourcedTargets
from meshpipe.train.run import data_sources, sources


@dataclass(frozen=True)
class Microbatches:
    """One step's messages for stage 0 and targets for the loss, and the loss denominator:
    the replica's counted targets per microbatch, so the step's loss is the mean over every
    counted target of the batch (padding and each document's last token do not count)."""

    inputs: list[Any]
    targets: list[torch.Tensor]
    loss_denominator: float


class RankBatches:
    """``batches(sampler, step)``: this rank's ``Microbatches`` of batch ``step``."""

    def __init__(self, config: TrainConfig, cp_ring_rank: int, cp_ulysses_rank: int,
                 device: torch.device):
        self.config = config
        self.cp_ranks = (cp_ring_rank, cp_ulysses_rank)
        self.device = device
        self.positions = hybrid_positions(config.seq_len, config.cp_ring, cp_ring_rank,
                                          config.cp_ulysses, cp_ulysses_rank)
        # Without context parallelism a rank holds the plain sequence, which the model
        # takes as no positions (nothing to derive or send; compiled, one graph a block).
        self._slices = config.cp_ring * config.cp_ulysses > 1
        self._device_positions = to_device(self.positions, device) if self._slices else None
        self._vision = sources.model_info(config.model).vision if config.model else None

    def __call__(self, sampler: Any, step: int) -> Microbatches:
        batch = sampler.batch(step)
        counted = max(data_sources.counted_targets(batch.targets), 1)
        denominator = counted / self.config.microbatches
        size = self.config.microbatch_size
        if getattr(batch, "pictures", None) is not None:
            inputs, targets, held = self._with_images(batch)
        elif getattr(batch, "doc_lens", None) is not None:
            inputs, targets, held = self._packed(batch)
        else:
            tokens = to_device(self._held(batch.tokens, self.positions), self.device)
            targets = list(to_device(self._held(batch.targets, self.positions),
                                     self.device).split(size))
            inputs = [(t, self._device_positions, None) for t in tokens.split(size)]
            held = [self.positions] * len(targets)
        if getattr(batch, "sources", None) is not None:
            targets = self._sourced(targets, batch, held)
        return Microbatches(inputs, targets, denominator)

    def _sourced(self, targets: list[torch.Tensor], batch,
                 held: list[torch.Tensor]) -> list[SourcedTargets]:
        """A mixture's microbatch targets with each target's source (its sequence's), laid
        out as the targets are (``held``: the columns this rank keeps of each microbatch's
        rows, which a packed microbatch has as one)."""
        size = self.config.microbatch_size
        rows = torch.tensor(batch.sources).reshape(-1, 1).expand_as(batch.targets)
        sourced = []
        for index, (mine, columns) in enumerate(zip(targets, held)):
            of_rows = rows[index * size:(index + 1) * size].reshape(mine.shape[0], -1)
            # Without context parallelism a rank holds a microbatch's first columns (all of
            # them, or as many as its longest sequence with images).
            sources = (of_rows[:, columns] if self._slices
                       else of_rows[:, :mine.shape[1]]).contiguous()
            sourced.append(SourcedTargets(mine, to_device(sources, self.device)))
        return sourced

    def _held(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The columns of ``rows`` at this rank's ``positions``; without context parallelism
        (every column) ``rows`` itself: a host index over every column costs milliseconds
        when it wakes the thread pool."""
        return rows[:, positions] if self._slices else rows

    def _with_images(self, batch) -> tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]:
        """A vision-language model's microbatches: ``(tokens, positions, doc_ids, rope,
        pixels, grids, image_rows)`` (``hf_vision.VisionChunk``; ``rope`` None where the
        decoder rotates by the token positions). Without packing or context
        parallelism a microbatch is as long as its longest sequence (no padding to
        ``--seq-len``); with packing it is one row. Under context parallelism each rank
        holds its columns of the tokens, their 3D positions and which image feature each
        image token takes, and every rank has the microbatch's images."""
        from meshpipe.models.vision_positions import image_rows, mrope_positions
        from meshpipe.train.data.images import Pictures

        size, device, vision = self.config.microbatch_size, self.device, self._vision
        inputs, targets, helds = [], [], []
        for start in range(0, batch.tokens.shape[0], size):
            rows = slice(start, start + size)
            pieces = [piece for row in batch.pictures[rows] for piece in row]
            pictures = Pictures.joined(pieces, batch.pictures[0][0].pixels.shape[1])
            if batch.doc_lens is None:
                length = batch.tokens.shape[1] if self._slices else self._rows_length(
                    max(batch.lengths[rows]))
                tokens, row_targets = batch.tokens[rows, :length], batch.targets[rows, :length]
                doc_lens, held = None, self.positions if self._slices else None
                positions, doc_ids = self._device_positions, None
            else:
                tokens = batch.tokens[rows].reshape(1, -1)
                row_targets = batch.targets[rows].reshape(1, -1)
                doc_lens = [[n for lens in batch.doc_lens[rows] for n in lens]]
                held = packed_hybrid_positions(doc_lens[0], self.config.cp_ring,
                                               self.cp_ranks[0], self.config.cp_ulysses,
                                               self.cp_ranks[1])
                positions, doc_ids = sources.packed_layout(doc_lens[0], held)
            rope = mrope_positions(tokens, pictures.grids, vision.image_token_id,
                                   vision.merge_size, doc_lens) if vision.rope_3d else None
            feature_rows = image_rows(tokens, vision.image_token_id)
            if held is not None:
                tokens, row_targets = tokens[:, held], row_targets[:, held]
                feature_rows = feature_rows[:, held]
                rope = None if rope is None else rope[:, :, held]
            inputs.append(tuple(None if t is None else to_device(t, device) for t in (
                tokens, positions, doc_ids, rope, pictures.pixels, pictures.grids,
                feature_rows)))
            targets.append(to_device(row_targets, device))
            helds.append(torch.arange(tokens.shape[1]) if held is None else held)
        return inputs, targets, helds

    def _rows_length(self, longest: int) -> int:
        """A microbatch's columns: its longest sequence, rounded up to a multiple of the tp
        size under sequence parallelism (which splits them evenly over the tp ranks)."""
        shards = self.config.tp if self.config.sequence_parallel else 1
        return -(-longest // shards) * shards

    def _packed(self, batch) -> tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]:
        """Each microbatch's inputs and targets, as one row, and the columns of it this rank
        holds."""
        config, device = self.config, self.device
        inputs, targets, helds = [], [], []
        for row_tokens, row_targets, lengths in sources.packed_rows(batch,
                                                                    config.microbatch_size):
            held = packed_hybrid_positions(lengths, config.cp_ring, self.cp_ranks[0],
                                           config.cp_ulysses, self.cp_ranks[1])
            positions, doc_ids = sources.packed_layout(lengths, held)
            inputs.append((to_device(self._held(row_tokens, held), device),
                           to_device(positions, device), to_device(doc_ids, device)))
            targets.append(to_device(self._held(row_targets, held), device))
            helds.append(held)
        return inputs, targets, helds
