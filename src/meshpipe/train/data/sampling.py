"""Seekable samplers of the user's tokenized text (``--data``): ``TextSampler.batch(step)`` is
a pure function of (seed, step), the same on every rank and after a resume, with no state to
checkpoint. The infinite order of the data is a sequence of epochs, each a permutation
seeded by (seed, epoch), so batch ``step`` is found by arithmetic instead of by replaying the
earlier steps. Targets never cross a document boundary: a document's last token, like
padding and a token the data's mask leaves out (a prompt's, under ``--loss-on assistant``),
has ``IGNORE_INDEX`` as its target. With ``pack`` several documents share a sequence and
each batch says where they start. A chat or prompt/completion sample longer than
``seq_len`` is cut to it (the launcher has said so, or refused it under ``--no-truncate``).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace

import numpy as np
import torch

from meshpipe.train.data.cache import TokenizedData
from meshpipe.train.data.images import DocumentImages, Pictures

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TextBatch:
    """``tokens`` and ``targets`` [batch, seq_len] int64; ``targets`` holds the next token of
    the same document piece, ``IGNORE_INDEX`` where there is none. With packing,
    ``doc_lens`` gives each sequence's document-piece lengths in order (each sums to
    seq_len); None without. ``sources``: each sequence's source of a mixture (None: one
    source). With images: ``pictures``, each sequence's images, one ``Pictures`` per
    document piece (one piece a sequence without packing, the padding one too), and
    ``lengths``, each sequence's tokens before its padding."""

    tokens: torch.Tensor
    targets: torch.Tensor
    doc_lens: tuple[tuple[int, ...], ...] | None
    sources: tuple[int, ...] | None = None
    pictures: tuple[tuple[Pictures, ...], ...] | None = None
    lengths: tuple[int, ...] | None = None


class TextSampler:
    """Batches of ``batch_size`` sequences of ``seq_len`` tokens; ``batch(step)`` is a pure
    function of (seed, step).

    Without ``pack`` every document is cut into pieces of at most ``seq_len`` tokens, one
    piece per sequence (padded with ``pad_id``); epoch ``e`` visits every piece once, in a
    permutation seeded by (seed, e). With ``pack`` the epochs' permutations of whole
    documents are concatenated into one endless stream and cut into consecutive windows of
    ``seq_len`` tokens; ``doc_lens`` tells attention where each document piece starts.
    Data with chat or prompt/completion samples is packed whole instead: a sample's answer
    means nothing without its prompt, so the pieces (each sample whole, cut to ``seq_len``)
    fill the sequences in the epoch's order, a piece that does not fit starting the next,
    and the rest of a sequence is padding (a document of its own, with no targets).

    ``patch_dim``: the patch width of the images a mixture's other sources show; data
    without images then gives its sequences no pictures of that width, so that every batch
    of the mixture has them.
    """

    def __init__(self, data: TokenizedData, seq_len: int, batch_size: int, *, seed: int = 0,
                 pack: bool = False, pad_id: int = 0, patch_dim: int = 0):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and "
                             f"{batch_size}")
        if data.num_tokens == 0:
            raise ValueError(f"this split of --data has {data.num_documents} documents and no "
                             "tokens, so it cannot give a sequence: add text to --data")
        self.data = data
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.pack = pack
        self.pad_id = pad_id
        self._starts = np.asarray(data.offsets[:-1], dtype=np.int64)
        self._doc_lengths = data.lengths.copy()
        long = data.samples_longer_than(seq_len)
        self._doc_lengths[long] = seq_len
        self._stream_tokens = int(self._doc_lengths.sum())
        self._mask = data.mask
        self._images = (DocumentImages.none(data.num_documents, patch_dim)
                        if data.images is None and patch_dim else data.images)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._whole = pack and data.kinds is not None
        if self._whole or not pack:
            self._piece_starts, self._piece_lengths, self._piece_docs = self._pieces()
        # With whole samples: the first sequence number of each epoch computed so far, and
        # the two latest epochs' sequences (where each starts in the epoch's order).
        self._epoch_firsts = [0]
        self._fills: dict[int, np.ndarray] = {}

    def batch(self, step: int) -> TextBatch:
        """Batch number ``step``: identical on every rank and across restarts."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        first = step * self.batch_size
        return self.sequences(range(first, first + self.batch_size))

    def sequences(self, numbers) -> TextBatch:
        """Sequences number ``numbers`` of the endless order (batch ``k`` holds numbers
        ``k * batch_size`` onwards)."""
        if self._whole:
            return self._whole_batch(numbers)
        if self.pack:
            return self._packed_batch(numbers)
        return self._unpacked_batch(numbers)

    def _leave_out_untrained(self, targets: np.ndarray, target_tokens: np.ndarray) -> None:
        """``IGNORE_INDEX`` where the data's mask says a target token is not trained."""
        if self._mask is not None:
            targets[self._mask[target_tokens] == 0] = IGNORE_INDEX

    # -- epochs ------------------------------------------------------------------------------

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s permutation of the units (pieces, or documents with ``pack``)
        and, with ``pack``, the stream offset at which each of its documents starts.

        The two epochs computed last are kept: a batch spans at most an epoch boundary
        (unless the data is smaller than a batch)."""
        if epoch not in self._epochs:
            units = len(self._piece_starts) if self._whole or not self.pack else len(
                self._doc_lengths)
            generator = np.random.default_rng([self.seed % 2**64, epoch])
            order = generator.permutation(units)
            starts = (np.concatenate([[0], np.cumsum(self._doc_lengths[order])])
                      if self.pack and not self._whole else np.zeros(0, dtype=np.int64))
            self._epochs[epoch] = (order, starts)
            for old in list(self._epochs)[:-2]:
                del self._epochs[old]
        return self._epochs[epoch]

    # -- without packing ---------------------------------------------------------------------

    def _pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Start (into the token array), length and document of every piece: document
        ``d`` gives ``ceil(len_d / seq_len)`` pieces, all of ``seq_len`` tokens but its
        last."""
        per_doc = -(-self._doc_lengths // self.seq_len)
        doc = np.repeat(np.arange(len(per_doc)), per_doc)
        first_piece = np.cumsum(per_doc) - per_doc
        index_in_doc = np.arange(len(doc)) - first_piece[doc]
        starts = self._starts[doc] + index_in_doc * self.seq_len
        lengths = np.minimum(self.seq_len, self._starts[doc] + self._doc_lengths[doc] - starts)
        return starts, lengths, doc

    def _unpacked_batch(self, rows) -> TextBatch:
        tokens = np.full((len(rows), self.seq_len), self.pad_id, dtype=np.int64)
        targets = np.full((len(rows), self.seq_len), IGNORE_INDEX, dtype=np.int64)
        count = len(self._piece_starts)
        placed = []
        for row, sequence in enumerate(rows):
            epoch, index = divmod(sequence, count)
            piece = self._epoch(epoch)[0][index]
            self._place_piece(piece, tokens[row], targets[row], 0)
            placed.append([piece])
        return self._with_pictures(TextBatch(torch.from_numpy(tokens), torch.from_numpy(targets),
                                             None), placed)

    def _with_pictures(self, batch: TextBatch, placed: list[list[int]] | None) -> TextBatch:
        """``batch`` with the images of the pieces ``placed`` in each sequence and the
        sequences' lengths, where the data has images (None: the packed stream of data
        without images, every sequence full)."""
        if self._images is None:
            return batch
        empty = Pictures.joined([], self._images.patch_dim)
        if placed is None:
            return replace(batch, pictures=tuple((empty,) * len(lens) for lens in batch.doc_lens),
                           lengths=(self.seq_len,) * len(batch.doc_lens))
        pictures = tuple(tuple(self._images.of(int(self._piece_docs[piece])) for piece in row)
                         for row in placed)
        lengths = tuple(int(self._piece_lengths[row].sum()) for row in placed)
        if batch.doc_lens is not None:  # the padding piece has no images
            pictures = tuple(row + (empty,) * (len(lens) - len(row))
                             for row, lens in zip(pictures, batch.doc_lens))
        return replace(batch, pictures=pictures, lengths=lengths)

    def _place_piece(self, piece: int, tokens: np.ndarray, targets: np.ndarray,
                     at: int) -> int:
        """Piece ``piece``'s tokens and targets into a row from column ``at`` (padded rows:
        its last token has no target); its length."""
        start, length = int(self._piece_starts[piece]), int(self._piece_lengths[piece])
        tokens[at:at + length] = self.data.tokens[start:start + length]
        targets[at:at + length - 1] = tokens[at + 1:at + length]
        self._leave_out_untrained(targets[at:at + length - 1],
                                  np.arange(start + 1, start + length))
        return length

    # -- with packing, whole samples --------------------------------------------------------

    def _whole_batch(self, rows) -> TextBatch:
        tokens = np.full((len(rows), self.seq_len), self.pad_id, dtype=np.int64)
        targets = np.full((len(rows), self.seq_len), IGNORE_INDEX, dtype=np.int64)
        doc_lens, placed = [], []
        for row, sequence in enumerate(rows):
            at, lengths = 0, []
            pieces = self._sequence_pieces(sequence)
            for piece in pieces:
                lengths.append(self._place_piece(piece, tokens[row], targets[row], at))
                at += lengths[-1]
            if at < self.seq_len:
                lengths.append(self.seq_len - at)  # the padding
            doc_lens.append(tuple(lengths))
            placed.append(list(pieces))
        return self._with_pictures(TextBatch(torch.from_numpy(tokens), torch.from_numpy(targets),
                                             tuple(doc_lens)), placed)

    def _sequence_pieces(self, sequence: int) -> np.ndarray:
        """The pieces of sequence number ``sequence``. Epochs hold different numbers of
        sequences, so the epochs before it are filled once, in order (a resume at a late
        step fills them at its first batch; each costs a pass over the pieces)."""
        while self._epoch_firsts[-1] <= sequence:
            epoch = len(self._epoch_firsts) - 1
            self._epoch_firsts.append(self._epoch_firsts[-1] + len(self._fill(epoch)) - 1)
        epoch = bisect_right(self._epoch_firsts, sequence) - 1
        index = sequence - self._epoch_firsts[epoch]
        bounds = self._fill(epoch)
        return self._epoch(epoch)[0][bounds[index]:bounds[index + 1]]

    def _fill(self, epoch: int) -> np.ndarray:
        """Where each sequence of epoch ``epoch`` starts in the epoch's order of pieces, and
        the order's end: pieces go into a sequence while they fit."""
        if epoch not in self._fills:
            lengths = self._piece_lengths[self._epoch(epoch)[0]].tolist()
            bounds, fill = [0], 0
            for index, length in enumerate(lengths):
                if fill + length > self.seq_len:
                    bounds.append(index)
                    fill = 0
                fill += length
            bounds.append(len(lengths))
            self._fills[epoch] = np.asarray(bounds, dtype=np.int64)
            for old in list(self._fills)[:-2]:
                del self._fills[old]
        return self._fills[epoch]

    # -- with packing ------------------------------------------------------------------------

    def _packed_batch(self, rows) -> TextBatch:
        tokens = np.empty((len(rows), self.seq_len), dtype=np.int64)
        targets = np.empty_like(tokens)
        doc_lens = []
        for row, sequence in enumerate(rows):
            sources, lengths = self._window(sequence * self.seq_len)
            index = np.arange(self.seq_len) + np.repeat(
                sources - (np.cumsum(lengths) - lengths), lengths)
            tokens[row] = self.data.tokens[index]
            targets[row, :-1] = tokens[row, 1:]
            self._leave_out_untrained(targets[row, :-1], index[1:])
            targets[row, np.cumsum(lengths) - 1] = IGNORE_INDEX
            doc_lens.append(tuple(int(n) for n in lengths))
        return self._with_pictures(TextBatch(torch.from_numpy(tokens), torch.from_numpy(targets),
                                             tuple(doc_lens)), None)

    def _window(self, begin: int) -> tuple[np.ndarray, np.ndarray]:
        """The document pieces of stream tokens ``[begin, begin + seq_len)``: where each
        starts in the token array, and its length."""
        total = self._stream_tokens
        end = begin + self.seq_len
        sources, lengths = [], []
        for epoch in range(begin // total, (end - 1) // total + 1):
            low = max(begin, epoch * total) - epoch * total
            high = min(end, (epoch + 1) * total) - epoch * total
            piece_sources, piece_lengths = self._epoch_pieces(epoch, low, high)
            sources.append(piece_sources)
            lengths.append(piece_lengths)
        return np.concatenate(sources), np.concatenate(lengths)

    def _epoch_pieces(self, epoch: int, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
        """The pieces of epoch ``epoch``'s tokens ``[low, high)``: every document that
        overlaps the range, clipped to it."""
        order, starts = self._epoch(epoch)
        first = int(np.searchsorted(starts, low, side="right")) - 1
        last = int(np.searchsorted(starts, high, side="left"))
        piece_begin = np.maximum(starts[first:last], low)
        piece_end = np.minimum(starts[first + 1:last + 1], high)
        sources = self._starts[order[first:last]] + (piece_begin - starts[first:last])
        nonempty = piece_end > piece_begin  # documents without tokens give no piece
        return sources[nonempty], (piece_end - piece_begin)[nonempty]
