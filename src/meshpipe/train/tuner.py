"""``meshpipe tune``: measure the reference transformer on this machine, then rank layouts.

Three measurements make the ``Profile`` that ``meshpipe.schedules.ranking`` ranks layouts by:

1. in this process (``tune_profile``): each piece's parameters
   (embedding, one transformer layer, final norm + head), the activation bytes it saves for
   backward per token (what ``torch.autograd.graph.saved_tensors_hooks`` sees in one
   microbatch's forward, weights excluded) and its forward time per token, which only sets
   the pieces' relative weights; and a layer's forward + backward per token, one thread, at
   every token count a layout gives a rank (the shape of cost against size);
2. short training runs of a base layout on ``world_size`` processes (``tune_runs``; local
   CPU processes, or under torchrun the job's ranks on their GPUs):
   the smallest pp above 1 the world size allows, with 1F1B and with ZB-H1, then in a
   second phase with 1F1B at every microbatch size the ranked layouts use
   (``measured_sizes``, ``measured_phases``), the runs of a phase taking steps in turn
   (so a slow spell of the machine touches them alike); the executor's
   per-action timeline of each step gives every stage's F and B (1F1B), I and W (ZB-H1)
   (``fit_costs``; on shared cores each action shortened to what it would have taken
   alone, from the ranks computing beside it), F + B at each microbatch size, what an
   input from another rank costs (``fit_message_seconds``) and the pipeline's span, and
   the trainer's step time the rest; the same processes time a message between two ranks,
   an all-reduce over all of them (at two sizes each: latency and bandwidth), an optimizer
   step, and for each cp size the layouts offer, a layer with Ulysses attention over cp
   ranks against the same layer on the rank's tokens alone, at the smallest and largest
   microbatch (``_ulysses_times``);
3. ``calibrate``: the pieces' compute is scaled so that the base layout's stages cost what
   was measured; the layer curve, taken relative to the base layout's size, is pinned to
   what each measured microbatch size cost (the one process's curve only shapes the cost
   between and beyond them), and the least-squares line through the sizes gives what an
   action costs whatever its size; a message costs what was measured beyond the raw
   transfer, and the step time beyond the simulated base layout (pipeline on shared cores,
   gradient all-reduce, optimizer) becomes a fixed per-step overhead.

Only the reference transformer (dense, no tensor parallelism) is tuned; context
parallelism is offered as Ulysses, priced by that measured overhead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from meshpipe.schedules.placement import balanced_layers
from meshpipe.schedules.ranking import (Piece, Prediction, Profile, TuneError, curve_factor,
                                        predict, rank_layouts, stage_sum)
from meshpipe.train.config import TrainConfig
from meshpipe.train.launch import device_for_this_rank
from meshpipe.train.tune_profile import layer_curve, model_profile, token_counts, ulysses_sizes
from meshpipe.train.tune_runs import Measurement, base_layout, measure, measured_sizes


@dataclass(frozen=True)
class TuneResult:
    """The ranking, fastest first, and what it was computed from."""

    predictions: list[Prediction]
    profile: Profile
    measurement: Measurement


def check_tunable(config: TrainConfig) -> None:
    """The tuner models the dense reference transformer without tensor parallelism."""
    unsupported = [(bool(config.model), "--model"), (config.moe_experts > 0, "--moe-experts"),
                   (config.tp > 1 or bool(config.stage_tp), "--tp / --stage-tp"),
                   (config.pack or bool(config.data), "--data / --pack")]
    given = [flag for present, flag in unsupported if present]
    if given:
        raise TuneError(f"meshpipe tune measures the reference transformer on the shipped "
                        f"corpus (dense, no tensor parallelism): drop {', '.join(given)}")


def global_batch_of(config: TrainConfig) -> int:
    """Sequences per step of ``config``: the default global batch to tune for."""
    return config.dp * config.microbatches * config.microbatch_size


def calibrate(profile: Profile, measurement: Measurement, cores: float | None = None
              ) -> Profile:
    """``profile`` (from ``model_profile``) priced by ``measurement`` (see the module
    docstring); ``cores``: the cores the ranks share (None: each rank has its own)."""
    layout = measurement.layout
    tokens = layout.microbatch_size * profile.seq_len / layout.cp
    stages = layout.pp * layout.vpp
    weight = sum(stage_sum(profile, "forward", stage, layers, stages)
                 for stage, layers in enumerate(balanced_layers(profile.layers, stages)))
    reference = curve_factor(profile.token_curve, tokens)
    curve = tuple((size, factor / reference) for size, factor in profile.token_curve)
    relative = {size: size * profile.seq_len * curve_factor(curve, size * profile.seq_len)
                / tokens for size, _ in measurement.sizes}
    fixed = _action_overhead(measurement, relative)
    curve = _pinned_curve(curve, measurement, relative, fixed, profile.seq_len)

    def factor(measured: tuple[float, ...]) -> float:
        return max(0.0, sum(measured) - stages * fixed) / (tokens * weight)

    factors = {name: factor(getattr(measurement, name))
               for name in ("forward", "backward_input", "backward_weight", "backward")}

    def priced(piece: Piece) -> Piece:
        return replace(piece, **{name: f * piece.forward for name, f in factors.items()})

    message_bytes = profile.hidden_bytes_per_token * tokens
    extra = (0.0 if measurement.message_s is None
             else max(0.0, measurement.message_s - measurement.message.seconds(message_bytes)))
    fitted = replace(profile, embedding=priced(profile.embedding), action_overhead_s=fixed,
                     layer=priced(profile.layer), head=priced(profile.head), token_curve=curve,
                     message=measurement.message, all_reduce=measurement.all_reduce,
                     message_overhead_s=extra, cores=cores, ulysses=measurement.ulysses,
                     optimizer_s_per_parameter=measurement.optimizer_s_per_parameter)
    base = predict(layout, fitted)
    rest = measurement.step_s - base.step_s
    return replace(fitted, step_overhead_s=max(0.0, rest))


def _action_overhead(measurement: Measurement, relative: dict[int, float]) -> float:
    """What a compute action costs whatever its size: F + B summed over the ``S`` stages is
    ``2 S c + r V`` at each measured microbatch size, where ``r`` (``relative``) is what
    the layer curve says that size costs against the base size; the least-squares line
    through the sizes gives ``c`` (0 with one size; noise may not make it negative, nor
    more than half of an action's time at any measured size)."""
    if len(measurement.sizes) < 2:
        return 0.0
    stages = len(measurement.forward)
    sizes, seconds = zip(*measurement.sizes)
    _, intercept = np.polyfit([relative[size] for size in sizes], seconds, 1)
    return float(min(max(0.0, intercept / (2 * stages)), min(seconds) / (4 * stages)))


def _pinned_curve(curve: tuple[tuple[float, float], ...], measurement: Measurement,
                  relative: dict[int, float], fixed: float, seq_len: int
                  ) -> tuple[tuple[float, float], ...]:
    """The layer curve (1 at the base size) pinned to the training runs: at each measured
    microbatch size its factor times what F + B measured over what the curve predicts, so
    that a microbatch of a measured size is priced at what it cost in the training
    processes (which one layer alone in this process does not show: the other ranks
    computing beside it, the stage's other pieces, its caches); between sizes the
    correction is interpolated in log tokens as the curve is, beyond them the nearest
    size's holds."""
    stages = len(measurement.forward)
    variable = sum(measurement.forward) + sum(measurement.backward) - 2 * stages * fixed
    corrections = tuple((float(size * seq_len),
                         (seconds - 2 * stages * fixed) / (variable * relative[size]))
                        for size, seconds in measurement.sizes)
    knots = sorted({tokens for tokens, _ in curve} | {tokens for tokens, _ in corrections})
    return tuple((tokens, curve_factor(curve, tokens) * curve_factor(corrections, tokens))
                 for tokens in knots)


def _shared_cores() -> int | None:
    """The cores the measured ranks share: this machine's for CPU processes (local, or
    torchrun's on one node), None for ranks on GPUs (each computes on its own)."""
    return None if device_for_this_rank().type == "cuda" else os.cpu_count()


def tune(config: TrainConfig, world_size: int, memory_budget: float | None,
         global_batch: int | None = None) -> TuneResult:
    """Rank every layout of ``world_size`` processes for ``config``'s model and batch.

    Input that has no answer (no layout, a budget below every layout's memory) fails in
    one line before any process starts: memory does not depend on the measured times."""
    check_tunable(config)
    batch = global_batch_of(config) if global_batch is None else global_batch
    profile = model_profile(config)
    fitting = rank_layouts(world_size, profile, batch, memory_budget)
    profile = replace(profile, token_curve=layer_curve(
        config, token_counts(profile, world_size, batch)))
    layout = base_layout(world_size, profile, batch, config.microbatch_size)
    cores = _shared_cores()
    measurement = measure(config, layout, measured_sizes(fitting, layout, profile, memory_budget),
                          cores, ulysses_sizes(profile, world_size, batch))
    priced = calibrate(profile, measurement, cores)
    return TuneResult(rank_layouts(world_size, priced, batch, memory_budget), priced,
                      measurement)
