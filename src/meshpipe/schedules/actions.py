"""The schedule IR's actions (``Schedule``, one ordered action list per rank, is in
``meshpipe.schedules.schedule``; the old import from here keeps working).

The text form of an action is the notation of ``torch.distributed.pipelining`` CSV
schedules: ``<stage><kind><microbatch>``, e.g. ``0F3`` (stage 0, forward, microbatch 3),
``2W1``, ``1SEND_F3``, and ``(0F3;0B1)OVERLAP_F_B`` for a forward co-scheduled with a
backward. Pipeline messages always flow between adjacent stages, so the peer of a send or
receive is implied by its kind and stage and is not written.
"""

from __future__ import annotations

import enum
import re
from typing import Iterable, NamedTuple


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
