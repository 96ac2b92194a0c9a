"""Choosing a layout: predict the step time and peak memory of every layout (pp, vpp, dp,
cp, microbatches, schedule) of a world size from a ``Profile`` of the model, and rank them.

Pure Python (no torch): ``meshpipe.train.tune.tuner`` measures the profile from a real step, and
this module only does arithmetic and simulation, so rankings are testable without processes.

The model of one layout:

- compute: each stage's F, I and W for one microbatch are its pieces' (the embedding on the
  first stage, its transformer layers, the final norm + head + loss on the last) costs per
  token times the tokens a rank holds of a microbatch (``microbatch_size x seq_len / cp``),
  times ``token_curve``'s factor for that many tokens (a layer's forward and backward per
  token, measured alone at each size a layout uses, relative to the measured layout's: small
  matrices cost more per token, and so do large ones once they leave the cache), plus
  ``action_overhead_s`` per action (dispatch, bookkeeping: what an action costs whatever
  its size, fitted from two measured microbatch sizes). A context-parallel rank's share is
  priced as a layer over that many tokens. A fused backward B and the split halves I and W
  are priced apart (running backward as two autograd passes costs more than one): schedules
  with B
  use the first, ZB-H1, ZB-V and DualPipeV the second. The first stage's split backward
  has no input gradient to compute (its input is token ids), so its I costs nothing and
  its W the whole backward.
- contention: with ``cores`` set (processes sharing a machine's cores, as local runs do),
  the simulation shares them among every rank of every replica computing at once
  (``simulate(..., cores=, replicas=dp x cp)``: processor sharing), so the compute costs
  are those of a rank running alone, and a layout that keeps more ranks busy than there
  are cores runs each action slower.
- messages: one activation message between ranks costs ``latency + bytes / bandwidth``
  plus ``message_overhead_s``, what a real step adds beyond a raw transfer (the runtime's
  message path, waking the receiver: measured as the producer's end to the waiting
  consumer's start).
- context parallelism is costed as Ulysses. ``ulysses`` holds, per cp size, what a layer's
  Ulysses attention costs beyond the same layer computing the rank's share of tokens alone
  (measured: its exchanges, the token-layout all-gathers, the waits), forward and
  input-gradient pass together, as a ``Link`` over the rank's hidden bytes per microbatch;
  half of it goes to each pass. A cp size without a measurement falls back to an estimate:
  two exchanges of a rank's activations (q/k/v in, attention output back) per pass, each
  priced as a message to the ``cp - 1`` other ranks. Ring attention is not modelled.
- the step: the simulated makespan of the schedule, then the gradient all-reduce over the
  ``dp x cp`` replicas of the rank's stages (ring all-reduce: ``latency + 2 (n-1)/n bytes /
  bandwidth``), the optimizer (seconds per parameter held) and a fixed per-step overhead
  (loss and norm all-reduces, data), whichever rank takes longest.
- the zero level (``ZERO_LEVELS``, tried where a stage has replicas): ``--zero 1`` and 2
  reduce-scatter the gradients and all-gather the weights (the bytes of one all-reduce) and
  update a ``1/replicas`` shard, so the optimizer's time is divided by the replicas.
- memory per rank: ``state_bytes`` for each parameter of its stages (fp32 weights 4 B,
  gradients 4 B, AdamW's two moments 8 B; ``--zero 1`` shares the moments out over the
  replicas, 2 the gradients too; bf16: 2 B weights and 4 B masters, shared out at 1 and 2
  like the moments), plus the schedule's peak of live
  activations, each (stage, microbatch) pair weighing its pieces' saved bytes per token
  times the tokens, and in a split backward the gradients it holds from I to W
  (``Piece.held_for_weights``; none on the first stage). Not modelled: temporaries inside
  one action, allocator slack, the process's own baseline (torch, data).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshpipe.schedules.builders import SCHEDULES, build, schedule_spec
from meshpipe.schedules.schedule import Schedule

# --zero: 0 every replica holds the whole optimizer state, 1 the AdamW moments are sharded
# over the replicas of each weight, 2 the reduced gradients too (``parallel.zero``).
ZERO_LEVELS = (0, 1, 2)
WEIGHT_BYTES = 4.0  # fp32
GRADIENT_BYTES = 4.0
MOMENT_BYTES = 8.0  # AdamW's exp_avg and exp_avg_sq
# --dtype bf16: bfloat16 weights beside float32 masters (sharded like the moments).
LOW_PRECISION_WEIGHT_BYTES = 2.0
MASTER_BYTES = 4.0
from meshpipe.schedules.costs import CostModel
from meshpipe.schedules.placement import balanced_layers
from meshpipe.schedules.simulator import simulate

# Virtual stages per rank tried for schedules that take any (gpipe, 1f1b, interleaved, ...).
MAX_VPP = 4
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class TuneError(ValueError):
    """Input the tuner cannot rank: the message is one line that says what to change."""


class NoLayoutError(TuneError):
    """No layout of the world size fits the model and the batch."""


class MemoryBudgetError(TuneError):
    """Every layout needs more memory than the budget; ``smallest`` is the least any needs."""

    def __init__(self, message: str, smallest: float):
        super().__init__(message)
        self.smallest = smallest


@dataclass(frozen=True)
class Piece:
    """One part of the model: compute seconds per token (forward, input-gradient and
    weight-gradient halves of a split backward, and a fused backward), activation bytes
    saved per token, parameters, and the bytes per token a split backward holds on top of
    the activations from its I to its W (``CostModel.held_for_weights``)."""

    forward: float
    backward_input: float
    backward_weight: float
    backward: float
    activation_bytes: float
    parameters: int
    held_for_weights: float = 0.0


@dataclass(frozen=True)
class Link:
    """What moving ``n`` bytes costs: ``latency + n / bytes_per_s`` seconds."""

    latency: float
    bytes_per_s: float

    def seconds(self, size: float) -> float:
        return self.latency + size / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    """Everything the tuner knows about a model on a machine (see the module docstring).

    ``seq_len``, ``heads`` and ``layers`` bound the layouts (cp must divide the first two, a
    stage needs a layer); ``hidden_bytes_per_token`` sizes a message between stages."""

    layers: int
    heads: int
    seq_len: int
    embedding: Piece
    layer: Piece
    head: Piece
    hidden_bytes_per_token: float
    message: Link
    all_reduce: Link
    optimizer_s_per_parameter: float = 0.0
    masters: bool = False  # bf16 weights with float32 masters (``state_bytes``)
    step_overhead_s: float = 0.0
    message_overhead_s: float = 0.0
    action_overhead_s: float = 0.0
    cores: float | None = None
    token_curve: tuple[tuple[float, float], ...] = ()
    ulysses: tuple[tuple[int, Link], ...] = ()


@dataclass(frozen=True)
class Layout:
    """One way to run a step: ``microbatches x microbatch_size`` sequences per replica."""

    pp: int
    vpp: int
    dp: int
    cp: int
    microbatches: int
    microbatch_size: int
    schedule: str
    zero: int = 0

    def describe(self) -> str:
        zero = f", zero {self.zero}" if self.zero else ""
        return (f"pp {self.pp}, vpp {self.vpp}, dp {self.dp}, cp {self.cp}, {self.microbatches} "
                f"microbatches of {self.microbatch_size}, {self.schedule}{zero}")


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step: ``step_s`` = ``pipeline_s`` (the simulated makespan) +
    ``sync_s`` (gradient all-reduce, optimizer, fixed overhead); ``peak_bytes`` is the
    largest rank's memory."""

    layout: Layout
    step_s: float
    pipeline_s: float
    sync_s: float
    bubble: float
    peak_bytes: float


def parse_bytes(text: str) -> int:
    """A memory size such as ``2GB``, ``512MiB``, ``1.5 GiB`` or ``1000000`` (bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise TuneError(f"cannot read {text!r} as a memory size: give bytes (1000000) or a "
                        f"number with a unit: KB, MB, GB (powers of 1000) or KiB, MiB, GiB "
                        f"(powers of 1024), e.g. 2GB or 512MiB")
    size = float(match.group(1)) * _SIZE_UNITS[unit]
    if size < 1:
        raise TuneError(f"memory size {text!r} is less than one byte: give a positive size")
    return int(size)


def format_bytes(size: float) -> str:
    """``size`` in KiB, MiB or GiB (the largest unit it has one of), three significant
    digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


def layouts(world_size: int, profile: Profile, global_batch: int,
            schedules: Sequence[str] = SCHEDULES) -> list[Layout]:
    """Every layout of ``world_size`` ranks (``pp x dp x cp``) that can run ``global_batch``
    sequences per step with one of ``schedules``; a ``NoLayoutError`` if there is none."""
    found = list(_layouts(world_size, profile, global_batch, schedules))
    if not found:
        raise NoLayoutError(_no_layout_message(world_size, profile, global_batch, schedules))
    return found


def _layouts(world_size: int, profile: Profile, global_batch: int,
             schedules: Sequence[str]) -> Iterable[Layout]:
    for cp in divisors(world_size):
        if profile.heads % cp or profile.seq_len % cp:
            continue
        for pp in divisors(world_size // cp):
            dp = world_size // (cp * pp)
            if pp > profile.layers or global_batch % dp:
                continue
            for microbatches in divisors(global_batch // dp):
                size = global_batch // (dp * microbatches)
                for schedule in schedules:
                    for vpp in vpp_choices(schedule, pp, profile.layers):
                        layout = Layout(pp, vpp, dp, cp, microbatches, size, schedule)
                        if buildable(layout):
                            for zero in ZERO_LEVELS if dp * cp > 1 else (0,):
                                yield replace(layout, zero=zero)


def divisors(n: int) -> list[int]:
    """``n``'s divisors, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def vpp_choices(schedule: str, pp: int, layers: int) -> range:
    """Stages per rank worth trying: 1 for a one-rank schedule and those of one stage per
    rank, 2 for the V schedules, up to ``MAX_VPP`` for the others (from 2 for one that
    equals another schedule at 1), each stage holding at least a layer."""
    spec = schedule_spec(schedule)
    if spec.one_rank:
        return range(1, 2) if pp == 1 else range(0)
    if pp == 1:
        return range(0)  # one pipeline rank: the one-rank schedule is the schedule
    if spec.stages_per_rank == "one":
        return range(1, 2)
    if spec.v_shaped:
        return range(2, 3) if 2 * pp <= layers else range(0)
    first = 2 if spec.at_one_stage_per_rank else 1
    return range(first, min(MAX_VPP, layers // pp) + 1)


def buildable(layout: Layout) -> bool:
    """Whether the schedule builder accepts these sizes (its own constraints, e.g.
    interleaved's microbatch counts)."""
    try:
        _schedule(layout)
    except ValueError:
        return False
    return True


def _schedule(layout: Layout) -> Schedule:
    return build(layout.schedule, layout.pp, layout.microbatches, stages_per_rank=layout.vpp)


def _no_layout_message(world_size: int, profile: Profile, global_batch: int,
                       schedules: Sequence[str]) -> str:
    working = [size for size in range(1, 65)
               if any(True for _ in _layouts(size, profile, global_batch, schedules))][:6]
    hint = (f"; world sizes with layouts: {', '.join(map(str, working))}" if working else "")
    return (f"world size {world_size} has no valid layout for {profile.layers} layers, "
            f"{profile.heads} heads, seq-len {profile.seq_len} and a global batch of "
            f"{global_batch} sequences: pp x dp x cp must equal the world size with pp at most "
            f"the layers, dp dividing the global batch and cp dividing the heads and seq-len"
            f"{hint}")


def stage_costs(layout: Layout, profile: Profile, num_stages: int) -> CostModel:
    """The ``CostModel`` of one layout's stages (seconds; bytes for activations)."""
    tokens = layout.microbatch_size * profile.seq_len / layout.cp
    counts = balanced_layers(profile.layers, num_stages)
    scale = tokens * curve_factor(profile.token_curve, tokens)

    def per_stage(kind: str, fixed: float = profile.action_overhead_s,
                  per_token: float = scale) -> tuple[float, ...]:
        return tuple(fixed + per_token * stage_sum(profile, kind, stage, count, num_stages)
                     for stage, count in enumerate(counts))

    message = (profile.message.seconds(profile.hidden_bytes_per_token * tokens)
               + profile.message_overhead_s)
    if schedule_spec(layout.schedule).split_backward:
        halves = per_stage("backward_input"), per_stage("backward_weight")
        # Stage 0's input is token ids: its whole backward runs in W, and I holds nothing.
        fixed = profile.action_overhead_s
        backward = {"backward_input": (fixed, *halves[0][1:]),
                    "backward_weight": (halves[0][0] + halves[1][0] - fixed, *halves[1][1:]),
                    "held_for_weights": (0.0, *per_stage("held_for_weights", 0.0, tokens)[1:])}
    else:
        backward = {"backward": per_stage("backward")}
    all_to_all = tuple(count * _ulysses_s(layout, profile, tokens) for count in counts)
    return CostModel(forward=per_stage("forward"), **backward, comm=message, a2a=all_to_all,
                     activation_bytes=per_stage("activation_bytes", 0.0, tokens))


def curve_factor(curve: Sequence[tuple[float, float]], tokens: float) -> float:
    """The factor of ``curve`` ((tokens, factor) points, tokens increasing) at ``tokens``:
    linear in log tokens between points, the end values beyond them (1 without points)."""
    if not curve:
        return 1.0
    sizes, factors = zip(*curve)
    return float(np.interp(math.log(tokens), [math.log(size) for size in sizes], factors))


def stage_sum(profile: Profile, field: str, stage: int, layers: int, num_stages: int) -> float:
    """A stage's total of a ``Piece`` field (``layers`` transformer layers, plus the
    embedding on the first stage and the head on the last)."""
    total = layers * getattr(profile.layer, field)
    if stage == 0:
        total += getattr(profile.embedding, field)
    if stage == num_stages - 1:
        total += getattr(profile.head, field)
    return total


def _ulysses_s(layout: Layout, profile: Profile, tokens: float) -> float:
    """What Ulysses adds to one layer's forward (and again to its input-gradient pass): half
    the measured overhead of ``profile.ulysses`` at this cp, else the estimate of two
    exchanges of a rank's activations with the other ``cp - 1`` ranks."""
    if layout.cp == 1:
        return 0.0
    measured = dict(profile.ulysses).get(layout.cp)
    if measured is not None:
        return measured.seconds(profile.hidden_bytes_per_token * tokens) / 2
    share = profile.hidden_bytes_per_token * tokens * (layout.cp - 1) / layout.cp
    return 2 * (profile.message.latency * (layout.cp - 1) + share / profile.message.bytes_per_s)


def all_reduce_s(link: Link, size: float, ranks: int) -> float:
    """A ring all-reduce of ``size`` bytes over ``ranks`` ranks (0 for one rank)."""
    if ranks == 1:
        return 0.0
    return link.seconds(2 * (ranks - 1) / ranks * size)


def predict(layout: Layout, profile: Profile) -> Prediction:
    """Simulate ``layout``'s schedule under ``profile`` (see the module docstring)."""
    schedule = _schedule(layout)
    simulation = simulate(schedule, stage_costs(layout, profile, schedule.num_stages),
                          cores=profile.cores, replicas=layout.dp * layout.cp)
    parameters = _parameters_per_rank(schedule, profile)
    replicas = layout.dp * layout.cp
    updated = replicas if layout.zero else 1  # the share of its weights a rank updates
    sync = max(all_reduce_s(profile.all_reduce, GRADIENT_BYTES * held, replicas)
               + profile.optimizer_s_per_parameter * held / updated for held in parameters)
    sync += profile.step_overhead_s
    peak = max(state_bytes(layout.zero, replicas, profile.masters) * held + live for held, live in
               zip(parameters, simulation.peak_activation_bytes))
    return Prediction(layout, simulation.makespan + sync, simulation.makespan, sync,
                      simulation.bubble_ratio, peak)


def state_bytes(zero: int, replicas: int, masters: bool = False) -> float:
    """Bytes a rank holds per parameter of its stages at ``zero`` with ``replicas`` replicas
    of each weight: the weights, the gradients (shared out at 2) and the AdamW moments
    (shared out at 1 and 2); with ``masters`` (bf16) bfloat16 weights and float32 masters
    (shared out at 1 and 2)."""
    gradients = GRADIENT_BYTES / replicas if zero >= 2 else GRADIENT_BYTES
    moments = MOMENT_BYTES / replicas if zero >= 1 else MOMENT_BYTES
    if not masters:
        return WEIGHT_BYTES + gradients + moments
    shared_masters = MASTER_BYTES / replicas if zero >= 1 else MASTER_BYTES
    return LOW_PRECISION_WEIGHT_BYTES + shared_masters + gradients + moments


def _parameters_per_rank(schedule: Schedule, profile: Profile) -> list[int]:
    counts = balanced_layers(profile.layers, schedule.num_stages)
    held = [0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement):
        held[rank] += int(stage_sum(profile, "parameters", stage, counts[stage],
                                     schedule.num_stages))
    return held


def rank_layouts(world_size: int, profile: Profile, global_batch: int,
                 memory_budget: float | None = None,
                 schedules: Sequence[str] = SCHEDULES) -> list[Prediction]:
    """Every layout of ``world_size`` that fits ``memory_budget`` bytes per rank, fastest
    predicted step first (ties: less memory first). Raises ``NoLayoutError`` if the world
    size has no layout and ``MemoryBudgetError`` (naming the smallest budget that fits) if
    none fits the budget."""
    predictions = [predict(layout, profile)
                   for layout in layouts(world_size, profile, global_batch, schedules)]
    fitting = [p for p in predictions if memory_budget is None or p.peak_bytes <= memory_budget]
    if not fitting:
        smallest = min(predictions, key=lambda p: p.peak_bytes)
        raise MemoryBudgetError(
            f"memory budget {format_bytes(memory_budget)} per rank is below every layout of "
            f"world size {world_size}: the smallest budget that fits is "
            f"{format_bytes(smallest.peak_bytes)} ({math.ceil(smallest.peak_bytes)} bytes, "
            f"{smallest.layout.describe()}); give --memory-budget at least that",
            smallest.peak_bytes)
    return sorted(fitting, key=lambda p: (p.step_s, p.peak_bytes))


TABLE_HEADER = ("rank", "pp", "vpp", "dp", "cp", "zero", "microbatches", "mb size",
                "schedule", "step ms", "pipeline ms", "bubble", "peak memory")


def table(predictions: Sequence[Prediction], top: int | None = None) -> str:
    """The first ``top`` predictions as a Markdown table."""
    rows = [TABLE_HEADER]
    for place, p in enumerate(predictions[:top], start=1):
        layout = p.layout
        rows.append((str(place), str(layout.pp), str(layout.vpp), str(layout.dp), str(layout.cp),
                     str(layout.zero), str(layout.microbatches), str(layout.microbatch_size),
                     layout.schedule,
                     f"{1000 * p.step_s:.1f}", f"{1000 * p.pipeline_s:.1f}",
                     f"{100 * p.bubble:.1f}%", format_bytes(p.peak_bytes)))
    numeric = [column not in ("schedule",) for column in TABLE_HEADER]
    lines = ["| " + " | ".join(rows[0]) + " |",
             "| " + " | ".join("---:" if right else "---" for right in numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines) + "\n"
