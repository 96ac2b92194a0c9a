"""Discrete-event simulation of a schedule, and timelines of simulated or measured steps.

``simulate(schedule, costs)`` runs every rank's action list in order under a cost model:
an action starts as soon as its rank is free and its inputs have arrived, so the result is
the earliest possible execution of that exact order. It yields a ``Timeline``: per rank,
the start and end of every action. A ``Timeline`` can equally be built from times measured
in a real training step, and everything derived from it (makespan, bubbles, live
activations) and every picture drawn from it (``render``) works the same for both.
"""

from __future__ import annotations

import math
import statistics
from array import array
from numbers import Real
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from itertools import compress
from operator import add, attrgetter, sub

from meshpipe.schedules.actions import Action, Kind, Schedule
from meshpipe.schedules.validation import ScheduleError

# Identities of the compute kinds: membership by id() stays in C (Enum.__hash__ is Python).
_COMPUTE_KIND_IDS = frozenset(id(kind) for kind in Kind if kind.is_compute)
_kind_of = attrgetter("kind")

Cost = float | Sequence[float]
"""One value for every stage, or one value per stage (index = stage)."""


@dataclass(frozen=True)
class CostModel:
    """How long each kind of action takes, per stage, and what a message between ranks costs.

    Every field is a number (the same for every stage) or a sequence with one entry per
    stage. A full backward B costs what its split halves cost, ``backward == backward_input
    + backward_weight`` on every stage, so that schedules with B and schedules with I and W
    compare fairly. Give any of the three and the others follow: none gives I = W = 1 and
    B = 2; ``backward`` alone splits into equal halves; ``backward`` and one half make the
    other half the difference; one or both halves without ``backward`` leave a missing half
    at 1 and make B their sum. All three are set after construction; a ``backward`` that
    differs from the halves given with it raises ``BackwardCostMismatch`` (a ValueError).
    ``comm`` is the latency of one message sent by a stage to a neighbour stage on another
    rank (stages on the same rank hand over for free).

    ``a2a`` is the expert-parallel all-to-all time of one forward of a stage: the dispatch
    and combine of all its MoE layers, spent on the rank's communication stream while its
    compute waits. The backward moves the same volume back (the reverse all-to-alls), and
    the input-gradient pass is the one that carries it: an F costs ``forward + a2a``, a B
    ``backward + a2a``, an I ``backward_input + a2a``, a W ``backward_weight`` alone. With
    ``a2a`` 0 (the default) costs are those of a dense model.

    ``overlap`` (an OVERLAP action: the F of stage s1 co-scheduled with the B of stage s2)
    is indexed by the stage of its forward half. Without it, an OVERLAP costs what
    co-scheduling gives: the two microbatches' compute runs on one compute stream and
    their all-to-alls on one communication stream, each all-to-all hidden behind the other
    microbatch's compute, so ``max(forward[s1] + backward[s2], a2a[s1] + a2a[s2])``. That is
    the ideal of perfect layer-by-layer interleaving, which the runtime approaches when each
    all-to-all lasts at most one sub-step's compute; give ``overlap`` for a measured figure
    (it wins over the formula). With ``a2a`` 0 the formula is ``forward + backward``, no
    gain from co-scheduling.

    ``activation_bytes`` is the size of one microbatch's saved activations on a stage; with
    it the simulation reports peak live activation memory. ``with_recompute`` turns these
    costs into those of the same model with activation recomputation (checkpointing).
    """

    forward: Cost = 1.0
    backward: Cost | None = None
    backward_input: Cost | None = None
    backward_weight: Cost | None = None
    overlap: Cost | None = None
    comm: Cost = 0.0
    a2a: Cost = 0.0
    activation_bytes: Cost | None = None

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is not None:
                object.__setattr__(self, spec.name, _checked_cost(spec.name, value))
        full, input_half, weight_half = _split_backward(self.backward, self.backward_input,
                                                        self.backward_weight)
        object.__setattr__(self, "backward", full)
        object.__setattr__(self, "backward_input", input_half)
        object.__setattr__(self, "backward_weight", weight_half)

    def scaled(self, factor: float) -> CostModel:
        """Compute costs, ``a2a`` (its all-to-alls are per layer, like compute) and
        activation sizes times ``factor``; ``comm`` is per message and stays. Splitting each
        rank's share of a model into v stages is ``scaled(1 / v)``."""
        def scale(value: float | tuple[float, ...] | None) -> float | tuple[float, ...] | None:
            if value is None or isinstance(value, float):
                return None if value is None else value * factor
            return tuple(v * factor for v in value)

        return replace(self, **{name: scale(getattr(self, name)) for name in _SCALED_COSTS})

    def for_stages_of(self, schedule: Schedule) -> CostModel:
        """Read these costs as one rank's share of the model (1/p of it) and return the
        costs of one of ``schedule``'s stages (1/S of it): ``scaled(p / S)``. With this,
        schedules with different numbers of stages per rank compare like for like."""
        return self.scaled(schedule.num_ranks / schedule.num_stages)

    def with_recompute(self, mode: str, *, memory_fraction: float | None = None,
                       compute_fraction: float | None = None, seq_len: int = 64,
                       dim: int = 64, heads: int = 4) -> CostModel:
        """These costs (a model run without recomputation) with activation recomputation
        ``mode``: "none" (unchanged), "full" (each transformer block re-runs its forward in
        backward, keeping only its input) or "selective" (only the attention core re-runs).

        Backward pays for the recomputed forward: ``compute_fraction`` x ``forward`` is added
        to B and to I, and W stays, so B = I + W still holds. With non-reentrant
        checkpointing the forward is recomputed by the first backward pass that needs its
        saved tensors, which in a split backward is I; W reuses what I recomputed. An
        explicit ``overlap`` cost grows by the same amount (per stage of its forward half);
        without one, an OVERLAP's compute grows through its backward half.
        ``activation_bytes`` is multiplied by ``memory_fraction``, the share of activations
        still saved per microbatch; None is read as 1, one microbatch's activations without
        recomputation, so the result always reports memory, in those units.

        The fractions default to ``recompute_compute_fraction(mode, seq_len, dim)`` and
        ``recompute_memory_fraction(mode, seq_len, dim, heads)`` (Korthikanti et al. 2022)
        for layers of that size. Not modelled: the one layer's activations a recomputation
        briefly rebuilds (a per-rank constant, not per microbatch); in split-backward
        schedules, the recomputed tensors that W needs, which stay live from I until W; and
        the all-to-alls of a recomputed MoE forward: ``a2a`` stays as it is, although a
        full recomputation re-runs each MoE layer's dispatch and combine too (unless the
        runtime keeps the dispatched tokens), so under "full" with ``a2a`` > 0 the B and I
        costs here are short of the real ones by up to ``a2a``.
        Apply it once, to costs without recomputation (it adds on every call).
        """
        _check_recompute_mode(mode)
        if mode == "none":
            if memory_fraction is not None or compute_fraction is not None:
                raise ValueError("recompute 'none' keeps every activation and recomputes "
                                 "nothing: give memory_fraction / compute_fraction only with "
                                 "'full' or 'selective'")
            return self
        if memory_fraction is None:
            memory_fraction = recompute_memory_fraction(mode, seq_len, dim, heads)
        if compute_fraction is None:
            compute_fraction = recompute_compute_fraction(mode, seq_len, dim)
        if not 0 <= memory_fraction <= 1:
            raise ValueError(f"memory_fraction is the share of activations kept: give a "
                             f"number in [0, 1], got {memory_fraction}")
        if not (math.isfinite(compute_fraction) and compute_fraction >= 0):
            raise ValueError(f"compute_fraction is the share of the forward recomputed: give "
                             f"a finite number >= 0, got {compute_fraction}")

        def plus_recompute(value: float | tuple[float, ...] | None
                           ) -> float | tuple[float, ...] | None:
            if value is None:
                return None
            extra = _times(self.forward, compute_fraction)
            if isinstance(value, float) and isinstance(extra, float):
                return value + extra
            count = len(value) if isinstance(value, tuple) else len(extra)
            return tuple(v + e for v, e in zip(_expand(value, count), _expand(extra, count),
                                               strict=True))

        activations = 1.0 if self.activation_bytes is None else self.activation_bytes
        return replace(self, backward=plus_recompute(self.backward),
                       backward_input=plus_recompute(self.backward_input),
                       overlap=plus_recompute(self.overlap),
                       activation_bytes=_times(activations, memory_fraction))

    def per_stage(self, name: str, num_stages: int) -> tuple[float, ...] | None:
        """Field ``name`` expanded to one value per stage (None stays None)."""
        value = getattr(self, name)
        if value is None or isinstance(value, float):
            return None if value is None else (value,) * num_stages
        if len(value) != num_stages:
            raise ValueError(f"CostModel.{name} has {len(value)} per-stage values but the "
                             f"schedule has {num_stages} stages: give one value per stage "
                             f"or a single number")
        return value


_SCALED_COSTS = ("forward", "backward", "backward_input", "backward_weight", "overlap",
                 "a2a", "activation_bytes")


def _times(value: float | tuple[float, ...], factor: float) -> float | tuple[float, ...]:
    return value * factor if isinstance(value, float) else tuple(v * factor for v in value)


def _expand(value: float | tuple[float, ...], count: int) -> tuple[float, ...]:
    if isinstance(value, float):
        return (value,) * count
    if len(value) != count:
        raise ValueError(f"CostModel has {len(value)} and {count} per-stage values in the "
                         f"forward and backward costs: give each one value per stage")
    return value


RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
"""Activation recomputation modes: none, the attention core only, each whole block."""


def _check_recompute_mode(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}: choose from "
                         f"{', '.join(RECOMPUTE_MODES)}")


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def recompute_memory_fraction(mode: str, seq_len: int, dim: int, heads: int) -> float:
    """The share of a transformer layer's activation memory still saved for backward under
    recompute ``mode`` ("none", "selective", "full").

    From the per-layer estimate of Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models" (section 4.1, 16-bit activations, no tensor
    parallelism): a layer saves ``s b h (34 + 5 a s / h)`` bytes for sequence length ``s``,
    microbatch size ``b``, width ``h`` and ``a`` attention heads; ``34 s b h`` with selective
    recomputation (the attention core's ``5 a s^2 b`` bytes of scores, softmax and dropout
    are recomputed); ``2 s b h`` with full recomputation (only the layer's input). The
    fraction is the ratio to the first, so ``b`` cancels::

        none: 1    selective: 34 / (34 + 5 a s / h)    full: 2 / (34 + 5 a s / h)

    e.g. s = h = 64, a = 4 (the trainer's defaults): 5 a s / h = 20, selective 34/54 = 0.63,
    full 2/54 = 0.037. The estimate is for a GPT layer (multi-head attention, 4h GELU MLP);
    the reference model's GQA and SwiGLU change the constant 34 a little.
    """
    _check_recompute_mode(mode)
    _check_sizes(seq_len=seq_len, dim=dim, heads=heads)
    if mode == "none":
        return 1.0
    per_layer = 34 + 5 * heads * seq_len / dim
    return (34 if mode == "selective" else 2) / per_layer


def recompute_compute_fraction(mode: str, seq_len: int, dim: int) -> float:
    """The share of a layer's forward that backward re-runs under recompute ``mode``.

    Full recomputation re-runs the whole forward (1). Selective recomputation re-runs the
    attention core: of a layer's forward matmul FLOPs ``24 b s h^2 + 4 b s^2 h``
    (Korthikanti et al. 2022, section 6), ``Q K^T`` and ``scores V`` are ``4 b s^2 h``, so
    the share is ``s / (6 h + s)`` (softmax and dropout, memory-bound, are not counted):
    s = h = 64 gives 1/7.
    """
    _check_recompute_mode(mode)
    _check_sizes(seq_len=seq_len, dim=dim)
    if mode == "none":
        return 0.0
    return 1.0 if mode == "full" else seq_len / (6 * dim + seq_len)


class BackwardCostMismatch(ValueError):
    """A full backward cost B that differs from the split halves given with it (I + W).

    ``backward_weight`` (or ``backward_input``) is None when only the other half was given
    and it alone costs more than B. ``stage`` is None for single numbers. ``describe``
    words the error with other names for the three costs (the CLI's ``--b/--i/--w``).
    """

    def __init__(self, backward: float, backward_input: float | None,
                 backward_weight: float | None, stage: int | None) -> None:
        self.backward = backward
        self.backward_input = backward_input
        self.backward_weight = backward_weight
        self.stage = stage
        super().__init__(self.describe("backward", "backward_input", "backward_weight"))

    def describe(self, backward: str, backward_input: str, backward_weight: str) -> str:
        where = "" if self.stage is None else f" on stage {self.stage}"
        if self.backward_input is None or self.backward_weight is None:
            name, half = ((backward_input, self.backward_input)
                          if self.backward_weight is None
                          else (backward_weight, self.backward_weight))
            halves = f"{name} {half:g} alone is more"
        else:
            halves = (f"{backward_input} {self.backward_input:g} + {backward_weight} "
                      f"{self.backward_weight:g} = {self.backward_input + self.backward_weight:g}")
        return (f"a full backward must cost what its split halves cost: {backward} "
                f"{self.backward:g} but {halves}{where}; give {backward} alone, the halves "
                f"alone, or values that add up")


def _split_backward(backward: float | tuple[float, ...] | None,
                    backward_input: float | tuple[float, ...] | None,
                    backward_weight: float | tuple[float, ...] | None
                    ) -> tuple[float | tuple[float, ...], ...]:
    """(B, I, W) from those given, with B = I + W on every stage (rules: ``CostModel``).

    A number given stays a number; a cost derived from a per-stage sequence is one."""
    given = (backward, backward_input, backward_weight)
    lengths = sorted({len(value) for value in given if isinstance(value, tuple)})
    if not lengths:
        return _split_stage(*given, stage=None)
    if len(lengths) > 1:
        raise ValueError(f"CostModel.backward, backward_input and backward_weight have "
                         f"{' and '.join(map(str, lengths))} per-stage values: give each one "
                         f"value per stage, or a single number")

    def on_stage(value: float | tuple[float, ...] | None, stage: int) -> float | None:
        return value[stage] if isinstance(value, tuple) else value

    per_stage = zip(*(_split_stage(*(on_stage(value, stage) for value in given), stage=stage)
                      for stage in range(lengths[0])))
    return tuple(value if isinstance(value, float) else derived
                 for value, derived in zip(given, per_stage))


def _split_stage(backward: float | None, backward_input: float | None,
                 backward_weight: float | None, stage: int | None) -> tuple[float, float, float]:
    """(B, I, W) of one stage (or of every stage, ``stage`` None) from those given."""
    if backward is None:
        input_half = 1.0 if backward_input is None else backward_input
        weight_half = 1.0 if backward_weight is None else backward_weight
        return input_half + weight_half, input_half, weight_half
    if backward_input is None and backward_weight is None:
        return backward, backward / 2, backward / 2
    if backward_input is not None and backward_weight is not None:
        if not _same_cost(backward, backward_input + backward_weight):
            raise BackwardCostMismatch(backward, backward_input, backward_weight, stage)
        return backward, backward_input, backward_weight
    half = backward_weight if backward_input is None else backward_input
    if half > backward and not _same_cost(half, backward):
        raise BackwardCostMismatch(backward, backward_input, backward_weight, stage)
    rest = max(0.0, backward - half)
    return (backward, rest, half) if backward_input is None else (backward, half, rest)


def _same_cost(a: float, b: float) -> bool:
    """Equal up to rounding (scaled costs, decimal fractions such as 0.1 + 0.2)."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _checked_cost(name: str, value: object) -> float | tuple[float, ...]:
    if isinstance(value, Real) and not isinstance(value, bool):
        values: tuple[object, ...] = (value,)
    elif isinstance(value, Sequence) and not isinstance(value, str):
        values = tuple(value)
        if not values:
            raise ValueError(f"CostModel.{name} is an empty sequence: give a number or "
                             f"one value per stage")
    else:
        raise TypeError(f"CostModel.{name} must be a number or a sequence of numbers "
                        f"(one per stage), got {type(value).__name__}")
    for item in values:
        if isinstance(item, bool) or not isinstance(item, Real):
            raise TypeError(f"CostModel.{name} holds {item!r}: costs are numbers")
        if not math.isfinite(item) or item < 0:
            raise ValueError(f"CostModel.{name} holds {item!r}: costs must be finite and >= 0")
    floats = tuple(float(item) for item in values)
    return floats if isinstance(value, Sequence) else floats[0]


@dataclass(frozen=True, slots=True)
class TimedAction:
    """One action of one rank with when it started and ended (simulated units or seconds)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """Per rank, the actions it ran in execution order, each with a start and an end.

    Build one from ``TimedAction`` lists (``Timeline([[...], [...]])``) or from flat
    records of measured data (``Timeline.from_records``). ``seconds_per_unit`` says what
    one time unit is (``1.0`` for times measured in seconds; ``None`` for the abstract
    units of a simulation). ``origin`` is time zero of the step, by default the earliest
    start; no action may start before it. Times are kept in flat arrays so that simulating
    millions of actions stays cheap; ``ranks`` materialises the ``TimedAction`` tuples on
    first use.
    """

    def __init__(self, ranks: Iterable[Iterable[TimedAction]], *,
                 origin: float | None = None, seconds_per_unit: float | None = None) -> None:
        actions: list[tuple[Action, ...]] = []
        starts: list[array] = []
        ends: list[array] = []
        for rank, timed in enumerate(ranks):
            timed = tuple(timed)
            for item in timed:
                if not isinstance(item, TimedAction):
                    raise TypeError(f"rank {rank}: a Timeline holds TimedAction values, "
                                    f"got {type(item).__name__}")
                if item.rank != rank:
                    raise ValueError(f"{item.action} says rank {item.rank} but is listed "
                                     f"under rank {rank}")
                if not item.end >= item.start:
                    raise ValueError(f"rank {rank} {item.action}: ends at {item.end} before "
                                     f"it starts at {item.start}")
            actions.append(tuple(item.action for item in timed))
            starts.append(array("d", (item.start for item in timed)))
            ends.append(array("d", (item.end for item in timed)))
        self._init_columns(actions, starts, ends, origin, seconds_per_unit)

    @classmethod
    def from_columns(cls, actions: Sequence[Sequence[Action]], starts: Sequence[Sequence[float]],
                     ends: Sequence[Sequence[float]], *, origin: float | None = None,
                     seconds_per_unit: float | None = None) -> Timeline:
        """Per rank, parallel sequences of actions, start times and end times (the fast
        path ``simulate`` uses: lengths and starts against ``origin`` are checked, ends
        against starts are not)."""
        if not len(actions) == len(starts) == len(ends):
            raise ValueError(f"{len(actions)} action lists, {len(starts)} start lists and "
                             f"{len(ends)} end lists: give one of each per rank")
        for rank, (acts, begin, finish) in enumerate(zip(actions, starts, ends)):
            if not len(acts) == len(begin) == len(finish):
                raise ValueError(f"rank {rank}: {len(acts)} actions, {len(begin)} starts and "
                                 f"{len(finish)} ends: give one start and end per action")
        timeline = cls.__new__(cls)
        timeline._init_columns([tuple(a) for a in actions],
                               [b if isinstance(b, array) else array("d", b) for b in starts],
                               [e if isinstance(e, array) else array("d", e) for e in ends],
                               origin, seconds_per_unit)
        return timeline

    @classmethod
    def from_records(cls, records: Iterable[tuple[int, Action | str, float, float]], *,
                     num_ranks: int | None = None, origin: float | None = None,
                     seconds_per_unit: float | None = 1.0) -> Timeline:
        """Build from ``(rank, action, start, end)`` records, e.g. times measured in a step.

        Actions may be ``Action`` values or their text form (``"1F3"``); times are seconds
        unless ``seconds_per_unit`` says otherwise. Records are grouped by rank and ordered
        by start time; ranks without records get empty lists.
        """
        per_rank: dict[int, list[TimedAction]] = {}
        for rank, action, start, end in records:
            if isinstance(action, str):
                action = Action.parse(action)
            per_rank.setdefault(rank, []).append(
                TimedAction(rank, action, float(start), float(end)))
        count = num_ranks if num_ranks is not None else 1 + max(per_rank, default=-1)
        outside = sorted(r for r in per_rank if not 0 <= r < count)
        if outside:
            raise ValueError(f"records name ranks {outside}, outside 0..{count - 1}")
        ranks = [sorted(per_rank.get(r, ()), key=lambda t: (t.start, t.end)) for r in range(count)]
        return cls(ranks, origin=origin, seconds_per_unit=seconds_per_unit)

    def _init_columns(self, actions: list[tuple[Action, ...]], starts: list[array],
                      ends: list[array], origin: float | None,
                      seconds_per_unit: float | None) -> None:
        self._actions = tuple(actions)
        self._starts = tuple(starts)
        self._ends = tuple(ends)
        earliest = min((min(column) for column in starts if column), default=None)
        if origin is None:
            origin = 0.0 if earliest is None else earliest
        elif earliest is not None and earliest < origin:
            self._raise_start_before(origin)
        self.origin = float(origin)
        self.seconds_per_unit = seconds_per_unit

    def _raise_start_before(self, origin: float) -> None:
        """Name the first action (by rank) that starts before ``origin``."""
        for rank, column in enumerate(self._starts):
            index = next((i for i, start in enumerate(column) if start < origin), None)
            if index is not None:
                raise ValueError(
                    f"rank {rank} action #{index} {self._actions[rank][index]} starts at "
                    f"{column[index]:g}, before the timeline's origin {origin:g}: give an "
                    f"origin at or before the earliest start "
                    f"({min(min(c) for c in self._starts if c):g}), or leave it unset")

    @property
    def num_ranks(self) -> int:
        return len(self._actions)

    @cached_property
    def ranks(self) -> tuple[tuple[TimedAction, ...], ...]:
        """Per rank, a tuple of ``TimedAction`` in execution order."""
        return tuple(self.rank(r) for r in range(self.num_ranks))

    def rank(self, rank: int) -> tuple[TimedAction, ...]:
        """The timed actions of one rank, in execution order."""
        return tuple(TimedAction(rank, a, s, e) for a, s, e in
                     zip(self._actions[rank], self._starts[rank], self._ends[rank]))

    def __iter__(self) -> Iterator[TimedAction]:
        """Every timed action, rank by rank."""
        for rank in range(self.num_ranks):
            yield from self.rank(rank)

    def __len__(self) -> int:
        return sum(len(actions) for actions in self._actions)

    @cached_property
    def end(self) -> float:
        """When the last action ends."""
        return max((max(column) for column in self._ends if column), default=self.origin)

    @property
    def makespan(self) -> float:
        """Time from the origin until the last action ends."""
        return max(0.0, self.end - self.origin)

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Per rank, the total time spent in compute actions (sends and receives excluded)."""
        return tuple(
            math.fsum(compress(map(sub, ends, starts),
                               map(_COMPUTE_KIND_IDS.__contains__,
                                   map(id, map(_kind_of, acts)))))
            for acts, starts, ends in zip(self._actions, self._starts, self._ends))

    @property
    def bubble_ratios(self) -> tuple[float, ...]:
        """Per rank, the fraction of the makespan it spent idle."""
        span = self.makespan
        return tuple(0.0 if span == 0 else max(0.0, span - b) / span for b in self.busy)

    @property
    def bubble_ratio(self) -> float:
        """Idle time of all ranks over ``num_ranks * makespan``."""
        total = self.num_ranks * self.makespan
        return 0.0 if total == 0 else max(0.0, total - math.fsum(self.busy)) / total

    @cached_property
    def forward_only(self) -> bool:
        return not any(p.kind.is_backward for acts in self._actions
                       for a in acts for p in a.computations)

    def peak_activations(self, activation_bytes: Sequence[float] | None = None
                         ) -> tuple[float, ...]:
        """Per rank, the peak of live activations: a count, or bytes if sizes are given.

        A (stage, microbatch) pair is live from the start of its forward until the end of
        its backward (of its W for a split backward); in a forward-only timeline, until
        the end of its forward. ``activation_bytes[stage]`` weighs each pair; without it
        each pair counts 1. Each rank's actions are swept in execution order.
        """
        forward_only = self.forward_only
        return tuple(_peak_live(actions, activation_bytes, forward_only)
                     for actions in self._actions)

    def __repr__(self) -> str:
        return (f"Timeline({self.num_ranks} ranks, {len(self)} actions, "
                f"makespan={self.makespan:g})")


def _peak_live(actions: Sequence[Action], weights: Sequence[float] | None,
               forward_only: bool) -> float:
    """Sweep one rank's actions in order: a forward adds its pair when it starts, a B or W
    (or, forward-only, the forward itself) removes it when it ends."""
    kind_f, kind_overlap, releases = Kind.F, Kind.OVERLAP, (Kind.B, Kind.W)
    live = peak = 0
    for action in actions:
        kind = action.kind
        if kind is kind_f:
            weight = 1 if weights is None else weights[action.stage]
            live += weight
            if live > peak:
                peak = live
            if forward_only:
                live -= weight
        elif kind in releases:
            live -= 1 if weights is None else weights[action.stage]
        elif kind is kind_overlap:
            forward_half, backward_half = action.parts
            live += 1 if weights is None else weights[forward_half.stage]
            if live > peak:
                peak = live
            live -= 1 if weights is None else weights[backward_half.stage]
    return peak


class SimulationDeadlock(ScheduleError):
    """The schedule cannot finish: some rank waits for something that never happens.

    ``rank``, ``index``, ``action`` and ``waiting_for`` locate the first stuck rank; the
    message lists every stuck rank.
    """


@dataclass(frozen=True)
class Simulation:
    """The outcome of ``simulate``: the timeline and what it costs in time and memory."""

    schedule: Schedule
    costs: CostModel
    timeline: Timeline

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    @property
    def busy(self) -> tuple[float, ...]:
        return self.timeline.busy

    @property
    def bubble_ratios(self) -> tuple[float, ...]:
        return self.timeline.bubble_ratios

    @property
    def bubble_ratio(self) -> float:
        return self.timeline.bubble_ratio

    @cached_property
    def peak_activations(self) -> tuple[int, ...]:
        """Per rank, the most (stage, microbatch) pairs whose activations are live at once."""
        return tuple(int(p) for p in self.timeline.peak_activations())

    @cached_property
    def peak_activation_bytes(self) -> tuple[float, ...] | None:
        """Per rank, the peak live activation size; None without ``costs.activation_bytes``."""
        sizes = self.costs.per_stage("activation_bytes", self.schedule.num_stages)
        return None if sizes is None else self.timeline.peak_activations(sizes)

    def summary(self) -> str:
        """One line: makespan, overall bubble and the largest peak of live activations."""
        peak = max(self.peak_activations, default=0)
        return (f"makespan {self.makespan:g}, bubble {100 * self.bubble_ratio:.1f}%, "
                f"peak live activations {peak}")


# Token spaces of the simulation: what a finished action makes available.
_FORWARD_DONE, _GRAD_DONE, _INPUT_GRAD_DONE = 0, 1, 2
_TOKEN_NAMES = {_FORWARD_DONE: "F", _GRAD_DONE: "B or I", _INPUT_GRAD_DONE: "I"}


def fit_costs(timeline: Timeline, num_stages: int) -> CostModel:
    """The costs a measured step shows: per stage, the median duration of each kind of
    compute action in ``timeline`` (a stage with no action of a kind gets the median over
    the stages that have one). Messages cost 0: the measured time a rank waits for one is
    what the simulated bubble of these costs leaves out, so the two bubbles side by side
    say how much of the measured one is communication and runtime overhead."""
    durations: dict[tuple[Kind, int], list[float]] = {}
    for rank in timeline.ranks:
        for timed in rank:
            key = (timed.action.kind, timed.action.stage)
            durations.setdefault(key, []).append(timed.end - timed.start)

    def per_stage(kind: Kind) -> tuple[float, ...] | None:
        medians = {stage: statistics.median(values) for (k, stage), values in durations.items()
                   if k is kind}
        if not medians:
            return None
        fallback = statistics.median(medians.values())
        return tuple(medians.get(stage, fallback) for stage in range(num_stages))

    halves = per_stage(Kind.I), per_stage(Kind.W)
    split = halves[0] is not None and halves[1] is not None
    return CostModel(forward=per_stage(Kind.F) or 0.0,
                     backward=None if split else per_stage(Kind.B),
                     backward_input=halves[0] if split else None,
                     backward_weight=halves[1] if split else None,
                     overlap=per_stage(Kind.OVERLAP))


def simulate(schedule: Schedule, costs: CostModel | None = None) -> Simulation:
    """Execute ``schedule`` under ``costs`` as early as its order and data flow allow.

    Each rank runs its list in order; a compute action starts when its rank is free and its
    inputs are ready: F(s,m) after F(s-1,m), B or I(s,m) after F(s,m) and the input
    gradient from B or I(s+1,m), W(s,m) after I(s,m), an OVERLAP after both halves'
    inputs; each lasts as ``CostModel`` says (expert-parallel all-to-alls included, hidden
    in an OVERLAP). An input produced on another rank arrives ``costs.comm`` later. SEND/RECV
    actions of a lowered schedule take no time (communication is modelled by ``comm``).
    Raises ``SimulationDeadlock`` naming the stuck ranks if the schedule cannot finish.
    """
    costs = CostModel() if costs is None else costs
    return Simulation(schedule, costs, _Simulator(schedule, costs).run())


def _plus(costs: tuple[float, ...], extra: tuple[float, ...]) -> tuple[float, ...]:
    """Per stage, ``costs + extra`` (exactly ``costs`` where ``extra`` is 0)."""
    return tuple(map(add, costs, extra))


class _Simulator:
    """The event-driven core: each rank advances until an input is missing, then parks
    on that input until the action producing it ends. Linear in the number of actions."""

    def __init__(self, schedule: Schedule, costs: CostModel) -> None:
        self.schedule = schedule
        num_stages = schedule.num_stages
        placement = schedule.placement
        # What an OVERLAP co-schedules: compute on one stream, all-to-alls on the other.
        self.forward_compute = costs.per_stage("forward", num_stages)
        self.backward_compute = costs.per_stage("backward", num_stages)
        self.a2a = costs.per_stage("a2a", num_stages)
        # How long each plain kind lasts, read by the hot loop: F, B and I wait for their
        # stage's all-to-alls, W has none.
        self.forward = _plus(self.forward_compute, self.a2a)
        self.backward = _plus(self.backward_compute, self.a2a)
        self.backward_input = _plus(costs.per_stage("backward_input", num_stages), self.a2a)
        self.backward_weight = costs.per_stage("backward_weight", num_stages)
        self.overlap = costs.per_stage("overlap", num_stages)
        comm = costs.per_stage("comm", num_stages)
        # Latency of the input of stage s: from s-1 (forward) or s+1 (backward).
        self.forward_latency = tuple(
            comm[s - 1] if s > 0 and placement[s - 1] != placement[s] else 0.0
            for s in range(num_stages))
        self.backward_latency = tuple(
            comm[s + 1] if s + 1 < num_stages and placement[s + 1] != placement[s] else 0.0
            for s in range(num_stages))
        size = num_stages * schedule.num_microbatches
        # End time of each token (index stage * M + microbatch); -1 while not produced.
        self.done = [array("d", [-1.0]) * size for _ in range(3)]
        self.waiting: list[dict[int, list[int]]] = [{}, {}, {}]

    def run(self) -> Timeline:
        schedule = self.schedule
        num_ranks = schedule.num_ranks
        self.position = [0] * num_ranks
        self.clock = [0.0] * num_ranks
        self.starts = [array("d", bytes(8 * len(actions))) for actions in schedule.ranks]
        self.ends = [array("d", bytes(8 * len(actions))) for actions in schedule.ranks]
        self.blocked_on: list[tuple[int, int] | None] = [None] * num_ranks
        runnable = list(range(num_ranks))
        while runnable:
            runnable.extend(self._advance(runnable.pop()))
        stuck = [r for r in range(num_ranks) if self.position[r] < len(schedule.ranks[r])]
        if stuck:
            raise self._deadlock(stuck)
        return Timeline.from_columns(schedule.ranks, self.starts, self.ends, origin=0.0)

    def _advance(self, rank: int) -> list[int]:
        """Run ``rank`` until it finishes or waits; return the ranks its actions woke up.

        The hot loop of the simulator: plain kinds are handled inline with local names
        (millions of actions at p=512); OVERLAP and SEND/RECV take the slower general path.
        """
        actions = self.schedule.ranks[rank]
        num_microbatches = self.schedule.num_microbatches
        last_stage = self.schedule.num_stages - 1
        forward_done, grad_done, input_grad_done = self.done
        forward_waiting, grad_waiting, input_grad_waiting = self.waiting
        forward, backward = self.forward, self.backward
        backward_input, backward_weight = self.backward_input, self.backward_weight
        forward_latency, backward_latency = self.forward_latency, self.backward_latency
        kind_f, kind_b, kind_i, kind_w, kind_overlap = Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP
        starts, ends = self.starts[rank], self.ends[rank]
        woken: list[int] = []
        position = self.position[rank]
        clock = self.clock[rank]
        count = len(actions)
        while position < count:
            action = actions[position]
            kind = action.kind
            if kind is kind_f:
                stage = action.stage
                token = stage * num_microbatches + action.microbatch
                if stage:
                    ready = forward_done[token - num_microbatches]
                    if ready < 0:
                        self._park(rank, _FORWARD_DONE, token - num_microbatches)
                        break
                    ready += forward_latency[stage]
                    if ready > clock:
                        clock = ready
                start = clock
                clock += forward[stage]
                if forward_done[token] >= 0:
                    self._duplicate(rank, position, _FORWARD_DONE, token)
                forward_done[token] = clock
                if forward_waiting and token in forward_waiting:
                    woken.extend(forward_waiting.pop(token))
            elif kind is kind_b or kind is kind_i:
                stage = action.stage
                token = stage * num_microbatches + action.microbatch
                ready = forward_done[token]
                if ready < 0:
                    self._park(rank, _FORWARD_DONE, token)
                    break
                if stage < last_stage:
                    grad = grad_done[token + num_microbatches]
                    if grad < 0:
                        self._park(rank, _GRAD_DONE, token + num_microbatches)
                        break
                    grad += backward_latency[stage]
                    if grad > ready:
                        ready = grad
                if ready > clock:
                    clock = ready
                start = clock
                if kind is kind_b:
                    clock += backward[stage]
                else:
                    clock += backward_input[stage]
                    input_grad_done[token] = clock
                    if input_grad_waiting and token in input_grad_waiting:
                        woken.extend(input_grad_waiting.pop(token))
                if grad_done[token] >= 0:
                    self._duplicate(rank, position, _GRAD_DONE, token)
                grad_done[token] = clock
                if grad_waiting and token in grad_waiting:
                    woken.extend(grad_waiting.pop(token))
            elif kind is kind_w:
                stage = action.stage
                token = stage * num_microbatches + action.microbatch
                ready = input_grad_done[token]
                if ready < 0:
                    self._park(rank, _INPUT_GRAD_DONE, token)
                    break
                if ready > clock:
                    clock = ready
                start = clock
                clock += backward_weight[stage]
            elif kind is kind_overlap:
                ready = self._overlap_ready(rank, action)
                if ready is None:
                    break
                start = max(clock, ready)
                clock = start + self._overlap_cost(action)
                for part in action.parts:
                    token = part.stage * num_microbatches + part.microbatch
                    self._produce(rank, position, _FORWARD_DONE if part.kind is kind_f
                                  else _GRAD_DONE, token, clock, woken)
            else:
                start = clock
            starts[position] = start
            ends[position] = clock
            position += 1
        self.position[rank] = position
        self.clock[rank] = clock
        return woken

    def _overlap_ready(self, rank: int, action: Action) -> float | None:
        """When both halves' inputs are ready, or None after parking on a missing one."""
        forward_part, backward_part = action.parts
        num_microbatches = self.schedule.num_microbatches
        needs = []
        if forward_part.stage:
            needs.append((_FORWARD_DONE, forward_part, -1, self.forward_latency))
        needs.append((_FORWARD_DONE, backward_part, 0, None))
        if backward_part.stage < self.schedule.num_stages - 1:
            needs.append((_GRAD_DONE, backward_part, +1, self.backward_latency))
        ready = 0.0
        for space, part, offset, latency in needs:
            token = (part.stage + offset) * num_microbatches + part.microbatch
            end = self.done[space][token]
            if end < 0:
                self._park(rank, space, token)
                return None
            ready = max(ready, end + (latency[part.stage] if latency else 0.0))
        return ready

    def _overlap_cost(self, action: Action) -> float:
        """The explicit ``overlap`` cost, else the co-scheduled time (see ``CostModel``):
        both halves' compute back to back, or both all-to-alls if they take longer."""
        forward_stage, backward_stage = (part.stage for part in action.parts)
        if self.overlap is not None:
            return self.overlap[forward_stage]
        return max(self.forward_compute[forward_stage] + self.backward_compute[backward_stage],
                   self.a2a[forward_stage] + self.a2a[backward_stage])

    def _park(self, rank: int, space: int, token: int) -> None:
        self.waiting[space].setdefault(token, []).append(rank)
        self.blocked_on[rank] = (space, token)

    def _produce(self, rank: int, position: int, space: int, token: int, end: float,
                 woken: list[int]) -> None:
        done = self.done[space]
        if done[token] >= 0:
            self._duplicate(rank, position, space, token)
        done[token] = end
        waiters = self.waiting[space].pop(token, None)
        if waiters:
            woken.extend(waiters)

    def _duplicate(self, rank: int, position: int, space: int, token: int) -> None:
        stage, microbatch = divmod(token, self.schedule.num_microbatches)
        action = self.schedule.ranks[rank][position]
        raise ScheduleError(
            f"rank {rank} action #{position} {action}: {_TOKEN_NAMES[space]} of stage {stage} "
            f"microbatch {microbatch} runs a second time; each (stage, microbatch) needs "
            f"exactly one F and one B (or one I and one W): check the schedule with "
            f"meshpipe.schedules.validation.validate", rank=rank, index=position, action=action)

    def _deadlock(self, stuck: list[int]) -> SimulationDeadlock:
        schedule = self.schedule
        producers = {}
        for rank, actions in enumerate(schedule.ranks):
            for index, action in enumerate(actions):
                for part in action.computations:
                    producers.setdefault((part.kind, part.stage, part.microbatch), (rank, index))
        lines, waits = [], []
        for rank in stuck:
            index = self.position[rank]
            space, token = self.blocked_on[rank]
            stage, microbatch = divmod(token, schedule.num_microbatches)
            kinds = {_FORWARD_DONE: (Kind.F,), _GRAD_DONE: (Kind.B, Kind.I),
                     _INPUT_GRAD_DONE: (Kind.I,)}[space]
            wanted = " or ".join(f"{stage}{k.value}{microbatch}" for k in kinds)
            found = [producers[(k, stage, microbatch)] for k in kinds
                     if (k, stage, microbatch) in producers]
            if found:
                where = ", ".join(f"rank {r} action #{i}" for r, i in found)
                reason = f"scheduled at {where}, which never runs"
            else:
                reason = "which no rank runs"
            lines.append(f"rank {rank} is stuck at action #{index} "
                         f"{schedule.ranks[rank][index]}: it waits for {wanted}, {reason}")
            waits.append(wanted)
        first = stuck[0]
        return SimulationDeadlock(
            "schedule cannot finish (deadlock): " + "; ".join(lines)
            + ". Reorder the actions so every input is produced before it is needed.",
            rank=first, index=self.position[first],
            action=schedule.ranks[first][self.position[first]], waiting_for=waits[0])
