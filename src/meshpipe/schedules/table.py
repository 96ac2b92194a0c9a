"""The array form of a schedule: every action of every rank as a row of small integers.

A schedule of a 512-rank pipeline holds tens of millions of actions; as Python objects they
would take gigabytes. An ``ActionTable`` keeps them in flat numpy columns, ranks one after
another: ``kind`` (int8 code, the position of the ``Kind`` in its enum), ``stage`` and
``microbatch`` (int32), with ``offsets[r]:offsets[r + 1]`` the rows of rank r. An OVERLAP
row holds its forward half's stage and microbatch like ``Action`` does; the backward halves
of the (few) OVERLAP rows sit in a side table (``overlap_rows`` and its two columns).

Lowering, validation and simulation (``dataflow``) work on these columns; ``Action``
objects are made only when someone asks for a rank's actions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from meshpipe.schedules.actions import Action, Kind

KINDS: tuple[Kind, ...] = tuple(Kind)
CODE = {kind: code for code, kind in enumerate(KINDS)}
# The int8 code of each kind (``actions.F`` and its siblings are constructors of Actions).
F_CODE, B_CODE, I_CODE, W_CODE, OVERLAP_CODE = (
    CODE[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP))
SEND_F_CODE, RECV_F_CODE, SEND_B_CODE, RECV_B_CODE = (
    CODE[k] for k in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B))
FIRST_COMM = SEND_F_CODE  # codes from here on are SEND/RECV
# An OVERLAP row is made as its forward half first, then paired with its backward half.
_PLAIN_KINDS = tuple(Kind.F if kind is Kind.OVERLAP else kind for kind in KINDS)
CHUNK = 1 << 18  # rows per range (``ActionTable.ranges``)
_EMPTY_ROWS = np.zeros(0, np.int64)
_EMPTY_INTS = np.zeros(0, np.int32)


@dataclass(frozen=True, eq=False)
class ActionTable:
    """Every rank's ordered actions as flat columns (see the module doc)."""

    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    offsets: np.ndarray
    overlap_rows: np.ndarray = field(default_factory=lambda: _EMPTY_ROWS)
    overlap_stage: np.ndarray = field(default_factory=lambda: _EMPTY_INTS)
    overlap_microbatch: np.ndarray = field(default_factory=lambda: _EMPTY_INTS)

    @staticmethod
    def from_columns(kind: np.ndarray, stage: np.ndarray, microbatch: np.ndarray,
                     counts: Sequence[int]) -> ActionTable:
        """A table of plain actions (no OVERLAP), ``counts[r]`` rows for rank r."""
        offsets = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        return ActionTable(np.ascontiguousarray(kind, np.int8),
                           np.ascontiguousarray(stage, np.int32),
                           np.ascontiguousarray(microbatch, np.int32), offsets)

    @staticmethod
    def from_actions(ranks: Iterable[Iterable[Action]]) -> ActionTable:
        """The table of per-rank ``Action`` sequences."""
        code = CODE
        kinds, stages, microbatches, counts = [], [], [], []
        overlap_rows, overlap_stages, overlap_microbatches = [], [], []
        for actions in ranks:
            actions = tuple(actions)
            for action in actions:
                if not isinstance(action, Action):
                    raise TypeError(f"a schedule holds Action values, got "
                                    f"{type(action).__name__} {action!r}")
                if action.parts:
                    backward = action.parts[1]
                    overlap_rows.append(len(kinds))
                    overlap_stages.append(backward.stage)
                    overlap_microbatches.append(backward.microbatch)
                kinds.append(code[action.kind])
                stages.append(action.stage)
                microbatches.append(action.microbatch)
            counts.append(len(actions))
        table = ActionTable.from_columns(np.array(kinds, np.int8), np.array(stages, np.int32),
                                         np.array(microbatches, np.int32), counts)
        if not overlap_rows:
            return table
        return table.with_overlaps(np.array(overlap_rows, np.int64),
                                   np.array(overlap_stages, np.int32),
                                   np.array(overlap_microbatches, np.int32))

    def with_overlaps(self, rows: np.ndarray, stages: np.ndarray,
                      microbatches: np.ndarray) -> ActionTable:
        """This table with the backward halves of its OVERLAP rows (``rows`` increasing)."""
        return ActionTable(self.kind, self.stage, self.microbatch, self.offsets,
                           rows, stages, microbatches)

    @property
    def num_ranks(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def counts(self) -> np.ndarray:
        """Rows per rank."""
        return np.diff(self.offsets)

    def rank_of_rows(self) -> np.ndarray:
        """For every row, its rank (int32)."""
        return np.repeat(np.arange(self.num_ranks, dtype=np.int32), self.counts())

    def ranks_between(self, begin: int, end: int) -> np.ndarray:
        """The rank of each row of ``begin:end``."""
        if begin >= end:
            return np.zeros(0, np.int64)
        first, last = np.searchsorted(self.offsets, (begin, end - 1), side="right") - 1
        bounds = np.clip(self.offsets[first:last + 2], begin, end)
        return np.repeat(np.arange(first, last + 1), np.diff(bounds))

    def rank_actions(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s actions as ``Action`` values."""
        begin, end = int(self.offsets[rank]), int(self.offsets[rank + 1])
        kinds = _PLAIN_KINDS
        actions = [Action(kinds[k], s, m) for k, s, m in
                   zip(self.kind[begin:end].tolist(), self.stage[begin:end].tolist(),
                       self.microbatch[begin:end].tolist())]
        first, last = np.searchsorted(self.overlap_rows, (begin, end))
        for position in range(int(first), int(last)):
            row = int(self.overlap_rows[position])
            backward = Action(Kind.B, int(self.overlap_stage[position]),
                              int(self.overlap_microbatch[position]))
            actions[row - begin] = Action.overlap(actions[row - begin], backward)
        return tuple(actions)

    def action(self, row: int) -> Action:
        """The action of global row ``row`` (for messages: it makes its rank's actions)."""
        rank = int(np.searchsorted(self.offsets, row, side="right")) - 1
        return self.rank_actions(rank)[row - int(self.offsets[rank])]

    def ranges(self) -> Iterator[tuple[int, int]]:
        """The rows as consecutive ranges of at most ``CHUNK`` (one empty range for an empty
        table): going through millions of rows a range at a time keeps the temporaries
        small, and fresh memory is slow to touch."""
        rows, chunk = len(self), CHUNK
        yield from ((begin, min(rows, begin + chunk)) for begin in range(0, rows, chunk))
        if not rows:
            yield 0, 0

    def parts_between(self, begin: int, end: int) -> Parts:
        """The compute parts of rows ``begin:end``, in table order."""
        compute = np.flatnonzero(self.kind[begin:end] < FIRST_COMM) + begin
        kind = self.kind[compute]
        kind = np.where(kind == OVERLAP_CODE, np.int8(F_CODE), kind)
        parts = Parts(compute, kind, self.stage[compute], self.microbatch[compute])
        first, last = np.searchsorted(self.overlap_rows, (begin, end))
        if first == last:
            return parts
        halves = Parts(self.overlap_rows[first:last], np.full(last - first, B_CODE, np.int8),
                       self.overlap_stage[first:last], self.overlap_microbatch[first:last])
        return parts.merged(halves)

    def same(self, other: ActionTable) -> bool:
        """Whether both tables hold the same actions in the same order."""
        return all(np.array_equal(getattr(self, name), getattr(other, name)) for name in
                   ("offsets", "kind", "stage", "microbatch", "overlap_rows", "overlap_stage",
                    "overlap_microbatch"))

    def digest(self) -> int:
        return hash((self.offsets.tobytes(), self.kind.tobytes(), self.stage.tobytes(),
                     self.microbatch.tobytes(), self.overlap_stage.tobytes(),
                     self.overlap_microbatch.tobytes()))


    def paired_with(self, backward: ActionTable) -> ActionTable:
        """OVERLAP rows pairing each forward row of this table with the B row of
        ``backward`` at the same position (two plain tables of equal shape)."""
        kind = np.full(len(self), OVERLAP_CODE, np.int8)
        return ActionTable(kind, self.stage, self.microbatch, self.offsets,
                           np.arange(len(self), dtype=np.int64), backward.stage,
                           backward.microbatch)


def stacked(ranks: Sequence[ActionTable]) -> ActionTable:
    """One table holding the given tables' ranks one after another."""
    counts = np.concatenate([table.counts() for table in ranks]) if ranks else []
    bases = np.cumsum([0] + [len(table) for table in ranks])
    table = ActionTable.from_columns(
        *(np.concatenate([getattr(t, name) for t in ranks]) if ranks else np.zeros(0, np.int32)
          for name in ("kind", "stage", "microbatch")), counts)
    if not any(t.overlap_rows.size for t in ranks):
        return table
    return table.with_overlaps(
        np.concatenate([t.overlap_rows + base for t, base in zip(ranks, bases)]),
        np.concatenate([t.overlap_stage for t in ranks]),
        np.concatenate([t.overlap_microbatch for t in ranks]))


def concatenated(pieces: Sequence[ActionTable]) -> ActionTable:
    """One rank's table: the one-rank ``pieces`` one after another."""
    whole = stacked(pieces)
    return ActionTable(whole.kind, whole.stage, whole.microbatch,
                       np.array([0, len(whole)], np.int64), whole.overlap_rows,
                       whole.overlap_stage, whole.overlap_microbatch)


@dataclass(frozen=True)
class Parts:
    """Compute parts in table order: the row they belong to, and their kind (F, B, I or W),
    stage and microbatch. The B half of an OVERLAP follows its F half."""

    row: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray

    def merged(self, halves: Parts) -> Parts:
        """These parts and ``halves`` (each B half placed right after its row's F half)."""
        order = np.argsort(np.concatenate([self.row, halves.row]), kind="stable")
        return Parts(*(np.concatenate([mine, theirs])[order] for mine, theirs in
                       ((self.row, halves.row), (self.kind, halves.kind),
                        (self.stage, halves.stage), (self.microbatch, halves.microbatch))))


def stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for integer keys in ``0..bound-1``, on 16-bit keys
    (radix sort, linear time) when the keys in use number at most 65536."""
    if bound > 1 << 16:
        used = np.zeros(bound, bool)
        used[keys] = True
        if int(used.sum()) > 1 << 16:
            return np.argsort(keys, kind="stable")
        keys = (np.cumsum(used) - 1)[keys]
    return np.argsort(keys.astype(np.uint16), kind="stable")


def positions_in_runs(sorted_keys: np.ndarray) -> np.ndarray:
    """For each element of a sorted array, its position among the equal elements."""
    index = np.arange(sorted_keys.size, dtype=np.int32 if sorted_keys.size < 1 << 31
                      else np.int64)
    starts = np.ones(sorted_keys.size, bool)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    first = np.where(starts, index, 0)
    np.maximum.accumulate(first, out=first)
    index -= first
    return index


class Repeats:
    """Finds keys (integers below ``bound``) that an earlier element of the same array
    holds, in linear time, with one scratch array reused across calls."""

    def __init__(self, bound: int) -> None:
        self._first = np.zeros(bound, np.int32 if CHUNK < 1 << 31 else np.int64)

    def within(self, keys: np.ndarray) -> np.ndarray:
        """Per element, whether an earlier element holds the same key."""
        index = np.arange(keys.size, dtype=self._first.dtype)
        self._first[keys[::-1]] = index[::-1]  # the earliest write lands last
        return self._first[keys] != index
