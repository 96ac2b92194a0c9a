"""The schedule IR: actions, and a schedule as one ordered action list per rank.

The text form of an action is the notation of ``torch.distributed.pipelining`` CSV
schedules: ``<stage><kind><microbatch>``, e.g. ``0F3`` (stage 0, forward, microbatch 3),
``2W1``, ``1SEND_F3``, and ``(0F3;0B1)OVERLAP_F_B`` for a forward co-scheduled with a
backward. Pipeline messages always flow between adjacent stages, so the peer of a send or
receive is implied by its kind and stage and is not written.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from functools import cached_property
from typing import TYPE_CHECKING, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

if TYPE_CHECKING:
    from meshpipe.schedules.table import ActionTable


class Kind(enum.Enum):
    """What an action does. Values are the torch.distributed.pipelining spellings."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the published name of the input-gradient half of a backward
    W = "W"
    OVERLAP = "OVERLAP_F_B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    # Members are singletons compared by identity; Enum's own __hash__ is a Python call,
    # which dominates hashing actions (tuples holding a Kind) in large schedules.
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_backward(self) -> bool:
        """B, I and W: the kinds that consume a forward's saved activations."""
        return self in (Kind.B, Kind.I, Kind.W)


_COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP})
_OVERLAP = Kind.OVERLAP

# Direction of the peer stage for each communication kind.
_PEER_OFFSET = {Kind.SEND_F: +1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: +1}

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_OVERLAP_RE = re.compile(r"^\((.+);(.+)\)OVERLAP_F_B$")
_UNSUPPORTED_TORCH_RE = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*$")


class _ActionFields(NamedTuple):
    kind: Kind
    stage: int
    microbatch: int
    parts: tuple[Action, ...] = ()


class Action(_ActionFields):
    """One step of one rank: ``kind`` applied to ``microbatch`` on ``stage``.

    An ``OVERLAP`` action carries its two halves in ``parts`` (a forward, then a
    backward, usually of another microbatch and possibly another stage); its own
    ``stage`` and ``microbatch`` are those of the forward half.

    An immutable tuple underneath: schedules hold millions of actions, and tuple
    construction, hashing and field access run in C.
    """

    __slots__ = ()

    def __new__(cls, kind: Kind, stage: int, microbatch: int,
                parts: tuple[Action, ...] = ()) -> Action:
        if stage < 0 or microbatch < 0:
            raise ValueError(f"action {kind.value}: stage and microbatch must be >= 0, "
                             f"got stage={stage} microbatch={microbatch}")
        if parts or kind is _OVERLAP:
            parts = _overlap_parts(kind, stage, microbatch, parts)
        return tuple.__new__(cls, (kind, stage, microbatch, parts))

    @staticmethod
    def overlap(forward: Action, backward: Action) -> Action:
        """Co-schedule ``forward`` (an F) with ``backward`` (a B) as one OVERLAP action."""
        return Action(Kind.OVERLAP, forward.stage, forward.microbatch, (forward, backward))

    @property
    def peer(self) -> int | None:
        """The stage on the other end of a send or receive; None for compute actions."""
        offset = _PEER_OFFSET.get(self.kind)
        return None if offset is None else self.stage + offset

    @property
    def computations(self) -> tuple[Action, ...]:
        """The plain compute actions this action performs: its parts for OVERLAP, else itself."""
        return self.parts if self.parts else (self,)

    def __str__(self) -> str:
        if self.kind is Kind.OVERLAP:
            return f"({self.parts[0]};{self.parts[1]}){self.kind.value}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @staticmethod
    def parse(text: str) -> Action:
        """Parse the text form (inverse of ``str``)."""
        text = text.strip()
        if match := _OVERLAP_RE.match(text):
            return Action.overlap(Action.parse(match.group(1)), Action.parse(match.group(2)))
        if match := _ACTION_RE.match(text):
            stage, kind, microbatch = match.groups()
            return Action(Kind(kind), int(stage), int(microbatch))
        if _UNSUPPORTED_TORCH_RE.match(text):
            raise ValueError(f"cannot parse action {text!r}: torch.distributed.pipelining's "
                             f"UNSHARD, RESHARD and REDUCE_GRAD actions (FSDP and gradient "
                             f"reduction) have no meshpipe equivalent; meshpipe reads compute "
                             f"actions (F, B, I, W, OVERLAP_F_B) and SEND/RECV only: delete "
                             f"the UNSHARD, RESHARD and REDUCE_GRAD cells")
        raise ValueError(f"cannot parse action {text!r}: expected <stage><kind><microbatch> "
                         f"such as '0F3', '1SEND_B2' or '(0F3;0B1)OVERLAP_F_B'")


def _overlap_parts(kind: Kind, stage: int, microbatch: int,
                   parts: Iterable[Action]) -> tuple[Action, Action]:
    """The parts of an OVERLAP action as a tuple, after checking that they are a forward
    then a full backward and that the action's own stage and microbatch are the forward's
    (the slow path of ``Action.__new__``: plain actions never get here)."""
    if kind is not _OVERLAP:
        raise ValueError(f"only an OVERLAP action has parts, not a {kind.value} action "
                         f"(parts={parts!r}); build one with Action.overlap(forward, backward)")
    try:
        parts = tuple(parts)
    except TypeError:
        raise TypeError(f"the parts of an OVERLAP action are a sequence (forward, backward), "
                        f"got {type(parts).__name__}") from None
    forward, backward = parts if len(parts) == 2 else (None, None)
    if not (isinstance(forward, Action) and isinstance(backward, Action)
            and forward.kind is Kind.F and backward.kind is Kind.B):
        raise ValueError(f"an OVERLAP pairs an F with a B: its parts are (forward, backward), "
                         f"got {parts!r}; build one with Action.overlap(forward, backward)")
    if stage != forward.stage or microbatch != forward.microbatch:
        raise ValueError(f"the OVERLAP of {forward} and {backward} has the stage and "
                         f"microbatch of its forward ({forward.stage}, {forward.microbatch}), "
                         f"not ({stage}, {microbatch}); build it with Action.overlap(forward, "
                         f"backward)")
    return parts


def F(stage: int, microbatch: int) -> Action:
    return Action(Kind.F, stage, microbatch)


def B(stage: int, microbatch: int) -> Action:
    return Action(Kind.B, stage, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: E741,E743
    return Action(Kind.I, stage, microbatch)


def W(stage: int, microbatch: int) -> Action:
    return Action(Kind.W, stage, microbatch)


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
        from meshpipe.schedules.table import ActionTable
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
        from meshpipe.schedules.table import FIRST_COMM
        return bool((self.table.kind >= FIRST_COMM).any())

    @cached_property
    def forward_only(self) -> bool:
        from meshpipe.schedules.table import B, I, W
        kinds = self.table.kind
        return not (self.table.overlap_rows.size or np.isin(kinds, (B, I, W)).any())

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
