"""The cost model of a schedule: how long each kind of action takes per stage, what a
message costs, how much a microbatch's activations weigh, and the costs a measured step
shows (``fit_costs``)."""

from __future__ import annotations
import math
import statistics
from numbers import Real
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from meshpipe.schedules.actions import Kind
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.timeline import Timeline

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
    it the simulation reports peak live activation memory. ``held_for_weights`` is what a
    split backward holds on top of them from the start of a microbatch's I to the end of its
    W: the gradients I captured at the stage's weight products, for W to start from
    (``runtime.split_backward``); schedules with B never hold it, and None is none.
    ``with_recompute`` turns these costs into those of the same model with activation
    recomputation (checkpointing); ``weight_recompute`` is what a W re-runs of the
    forward on top of ``backward_weight`` (under full recomputation a split backward
    recomputes a block in I and again in W), which ``with_recompute`` sets.
    """

    forward: Cost = 1.0
    backward: Cost | None = None
    backward_input: Cost | None = None
    backward_weight: Cost | None = None
    overlap: Cost | None = None
    comm: Cost = 0.0
    a2a: Cost = 0.0
    activation_bytes: Cost | None = None
    held_for_weights: Cost | None = None
    weight_recompute: Cost = 0.0

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
        memory sizes times ``factor``; ``comm`` is per message and stays. Splitting each
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
        to B and to I, and W stays, so B = I + W still holds. In a split backward the
        runtime recomputes a region in I, and under "full" once more in W, whose weight
        products read the region's saved tensors again (``runtime.split_backward``): under
        "full" the same amount is the ``weight_recompute`` of each W. The attention core
        that "selective" recomputes holds no weight, so W never reads it. An explicit
        ``overlap`` cost grows by the same amount (per stage of its forward half); without
        one, an OVERLAP's compute grows through its backward half.
        ``activation_bytes`` is multiplied by ``memory_fraction``, the share of activations
        still saved per microbatch; None is read as 1, one microbatch's activations without
        recomputation, so the result always reports memory, in those units.

        The fractions default to ``recompute_compute_fraction(mode, seq_len, dim)`` and
        ``recompute_memory_fraction(mode, seq_len, dim, heads)`` (Korthikanti et al. 2022)
        for layers of that size. Not modelled: the one layer's activations a recomputation
        briefly rebuilds (a per-rank constant, not per microbatch); and the all-to-alls of
        a recomputed MoE forward: ``a2a`` stays as it is, although a full recomputation
        re-runs each MoE layer's dispatch and combine too (unless the runtime keeps the
        dispatched tokens), so under "full" with ``a2a`` > 0 the B and I costs here are
        short of the real ones by up to ``a2a``.
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
                       activation_bytes=_times(activations, memory_fraction),
                       weight_recompute=(plus_recompute(self.weight_recompute)
                                         if mode == "full" else self.weight_recompute))

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
                 "a2a", "activation_bytes", "held_for_weights", "weight_recompute")


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



def fit_message_seconds(timeline: Timeline) -> float | None:
    """What an input from another rank costs in a measured step: the median time from its
    producer's end (F of the stage before, B or I of the stage after) to the start of the
    action that waited for it, over the actions that were idle waiting (their rank's
    previous action ended before the producer did); None if no action waited so."""
    ends: dict[tuple[bool, int, int], tuple[int, float]] = {}
    for rank in timeline.ranks:
        for timed in rank:
            action = timed.action
            if action.kind in (Kind.F, Kind.B, Kind.I):
                ends[(action.kind is Kind.F, action.stage, action.microbatch)] = (
                    timed.rank, timed.end)
    hops = []
    for rank in timeline.ranks:
        previous_end = -math.inf
        for timed in rank:
            action = timed.action
            if action.kind in (Kind.F, Kind.B, Kind.I):
                forward = action.kind is Kind.F
                source = action.stage - 1 if forward else action.stage + 1
                producer = ends.get((forward, source, action.microbatch))
                if producer is not None and producer[0] != timed.rank \
                        and previous_end <= producer[1]:
                    hops.append(timed.start - producer[1])
            previous_end = timed.end
    return statistics.median(hops) if hops else None
