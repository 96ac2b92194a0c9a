"""A schedule: for each rank, the ordered actions it runs in one step.

Held as an ``ActionTable`` (the array form, what lowering, validation and simulation read);
the ``Action`` tuples are made on first use. The text of an action is the notation of
``torch.distributed.pipelining`` CSV schedules (``meshpipe.schedules.actions``), and
``to_csv`` / ``from_csv`` read and write that format.
"""

from __future__ import annotations

import csv
import io
from functools import cached_property
from typing import Iterable, Iterator, Sequence

import numpy as np

from meshpipe.schedules.actions import Action
from meshpipe.schedules.table import B_CODE, FIRST_COMM, I_CODE, W_CODE, ActionTable


class Schedule:
    """A complete pipeline schedule: for each rank, the ordered actions it runs in one step.

    ``placement[s]`` is the rank that holds stage ``s``. A schedule is *lowered* once it
    contains SEND/RECV actions (see ``lowering.lower``); before that it holds compute
    actions only and stage-to-stage data flow is implicit.

    ``ranks`` is given as one sequence of ``Action`` per rank, or as an ``ActionTable``
    (the array form builders of large schedules emit). The schedule keeps the table
    (``table``, what lowering, validation and simulation read) and makes ``ranks``, the
    ``Action`` tuples, on first use. Immutable.
    """

    def __init__(self, num_ranks: int, num_stages: int, num_microbatches: int,
                 placement: Sequence[int], ranks: Iterable[Iterable[Action]] | ActionTable,
                 name: str = "") -> None:
        fields = self.__dict__
        fields["num_ranks"] = num_ranks
        fields["num_stages"] = num_stages
        fields["num_microbatches"] = num_microbatches
        fields["placement"] = tuple(placement)
        fields["name"] = name
        if isinstance(ranks, ActionTable):
            fields["table"] = ranks
        else:
            fields["ranks"] = tuple(tuple(actions) for actions in ranks)
            fields["table"] = ActionTable.from_actions(self.ranks)
        if len(self.placement) != self.num_stages:
            raise ValueError(f"placement names {len(self.placement)} stages, "
                             f"schedule has {self.num_stages}")
        if self.table.num_ranks != self.num_ranks:
            raise ValueError(f"{self.table.num_ranks} action lists for {self.num_ranks} ranks")
        for stage, rank in enumerate(self.placement):
            if not 0 <= rank < self.num_ranks:
                raise ValueError(f"stage {stage} placed on rank {rank}, "
                                 f"outside 0..{self.num_ranks - 1}")
        self._check_rows()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Schedule is immutable: cannot set {name!r}; build another "
                             f"one (replace_ranks)")

    def _check_rows(self) -> None:
        """Every stage and microbatch in range, every action on the rank of its stage."""
        table = self.table
        placement = np.array(self.placement, np.int64)
        first_bad: list[int] = []  # the lowest rank with a bad action, among rows and halves
        for begin, end in table.ranges():
            ranks = table.ranks_between(begin, end)
            if self._bad(placement, table.stage[begin:end], table.microbatch[begin:end],
                         ranks, first_bad):
                break
        if table.overlap_rows.size:
            self._bad(placement, table.overlap_stage, table.overlap_microbatch,
                      np.searchsorted(table.offsets, table.overlap_rows, side="right") - 1,
                      first_bad)
        if first_bad:
            self._raise_misplaced_action(min(first_bad))

    def _bad(self, placement: np.ndarray, stages: np.ndarray, microbatches: np.ndarray,
             ranks: np.ndarray, first_bad: list[int]) -> bool:
        """Whether any of these actions is out of range or off its stage's rank (then its
        rank goes to ``first_bad``)."""
        bad = (stages >= self.num_stages) | (microbatches >= self.num_microbatches)
        bad |= placement[np.minimum(stages, self.num_stages - 1)] != ranks
        if bad.any():
            first_bad.append(int(ranks[np.argmax(bad)]))
        return bool(bad.any())

    @cached_property
    def ranks(self) -> tuple[tuple[Action, ...], ...]:
        """Per rank, its actions in order."""
        return tuple(self.table.rank_actions(rank) for rank in range(self.num_ranks))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (self.num_ranks, self.num_stages, self.num_microbatches, self.placement) == (
            other.num_ranks, other.num_stages, other.num_microbatches, other.placement) \
            and self.table.same(other.table)

    def __hash__(self) -> int:
        return hash((self.num_ranks, self.num_stages, self.num_microbatches, self.placement,
                     self.table.digest()))

    def __repr__(self) -> str:
        return (f"Schedule(name={self.name!r}, num_ranks={self.num_ranks}, "
                f"num_stages={self.num_stages}, num_microbatches={self.num_microbatches}, "
                f"placement={self.placement}, {len(self.table)} actions)")

    def _raise_misplaced_action(self, rank: int) -> None:
        """Name the first action of ``rank`` that is out of range or on the wrong rank."""
        for index, action in enumerate(self.ranks[rank]):
            for part in action.computations:
                if part.stage >= self.num_stages or part.microbatch >= self.num_microbatches:
                    raise ValueError(f"rank {rank} action #{index} {action}: stage or "
                                     f"microbatch out of range ({self.num_stages} stages, "
                                     f"{self.num_microbatches} microbatches)")
                if self.placement[part.stage] != rank:
                    raise ValueError(f"rank {rank} action #{index} {action}: stage "
                                     f"{part.stage} is placed on rank "
                                     f"{self.placement[part.stage]}")

    @cached_property
    def is_lowered(self) -> bool:
        return bool((self.table.kind >= FIRST_COMM).any())

    @cached_property
    def forward_only(self) -> bool:
        kinds = self.table.kind
        return not (self.table.overlap_rows.size
                    or np.isin(kinds, (B_CODE, I_CODE, W_CODE)).any())

    @property
    def stages_per_rank(self) -> int:
        """The largest number of stages any one rank holds (the virtual pipeline size)."""
        return max(self.placement.count(rank) for rank in range(self.num_ranks))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def actions(self) -> Iterator[Action]:
        """Every action of every rank, rank by rank."""
        for actions in self.ranks:
            yield from actions

    def replace_ranks(self, ranks: Iterable[Iterable[Action]] | ActionTable,
                      name: str | None = None) -> Schedule:
        """A copy with other action lists (same sizes and placement)."""
        return Schedule(self.num_ranks, self.num_stages, self.num_microbatches, self.placement,
                        ranks, self.name if name is None else name)

    def to_csv(self) -> str:
        """One row per rank, one action per cell: the torch.distributed.pipelining CSV form."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for actions in self.ranks:
            writer.writerow([str(a) for a in actions])
        return buffer.getvalue()

    @staticmethod
    def from_csv(text: str, name: str = "") -> Schedule:
        """Parse ``to_csv`` output, or a torch.distributed.pipelining CSV holding only the
        actions meshpipe has: compute actions (``F``, ``B``, ``I``, ``W``, and an
        ``OVERLAP_F_B`` of one F and one B) and ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``.
        That covers torch's "compute_only" CSVs of multi-stage schedules (empty cells, its
        idle slots, are skipped). torch's "compute_comms" CSVs also hold ``UNSHARD``,
        ``RESHARD`` and ``REDUCE_GRAD`` cells (written without a microbatch), as do the
        orders of its single-stage schedules: such a cell is a ValueError naming its row
        and text; delete those cells to read the rest.

        Ranks, stages, microbatches and placement are read off the actions: a stage's rank
        is the rank whose row holds its actions.
        """
        rows = [[cell for cell in row if cell.strip()]
                for row in csv.reader(io.StringIO(text))]
        ranks = []
        for rank, row in enumerate(rows):
            try:
                ranks.append(tuple(Action.parse(cell) for cell in row))
            except ValueError as error:
                raise ValueError(f"CSV row {rank} (rank {rank}): {error}") from None
        parts = [(rank, p) for rank, actions in enumerate(ranks)
                 for a in actions for p in a.computations]
        if not parts:
            raise ValueError("CSV schedule holds no compute actions")
        num_stages = 1 + max(p.stage for _, p in parts)
        placement: dict[int, int] = {}
        for rank, part in parts:
            if placement.setdefault(part.stage, rank) != rank:
                raise ValueError(f"stage {part.stage} has actions on ranks "
                                 f"{placement[part.stage]} and {rank}")
        missing = sorted(set(range(num_stages)) - placement.keys())
        if missing:
            raise ValueError(f"stages {missing} have no compute actions on any rank")
        return Schedule(
            num_ranks=len(ranks),
            num_stages=num_stages,
            num_microbatches=1 + max(p.microbatch for _, p in parts),
            placement=tuple(placement[s] for s in range(num_stages)),
            ranks=tuple(ranks),
            name=name,
        )

    def __str__(self) -> str:
        header = (f"{self.name or 'schedule'}: {self.num_ranks} ranks, {self.num_stages} stages, "
                  f"{self.num_microbatches} microbatches")
        rows = [f"  rank {r}: " + " ".join(str(a) for a in actions)
                for r, actions in enumerate(self.ranks)]
        return "\n".join([header, *rows])
