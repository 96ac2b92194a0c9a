"""Step 3 of ``meshpipe tune`` (``meshpipe.train.tune.tuner``): the in-process profile
(``profile``) priced by what the short training runs measured (``measure``).

The pieces' compute is scaled so that the base layout's stages cost what was measured; the
layer curve, taken relative to the base layout's size, is pinned to what each measured
microbatch size cost (the one process's curve only shapes the cost between and beyond
them), and the least-squares line through the sizes gives what an action costs whatever its
size; a message costs what was measured beyond the raw transfer, and the step time beyond
the simulated base layout (pipeline on shared cores, gradient all-reduce, optimizer) becomes
a fixed per-step overhead.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from meshpipe.schedules.placement import balanced_layers
from meshpipe.schedules.ranking import Piece, Profile, curve_factor, predict, stage_sum
from meshpipe.train.tune.measure import Measurement


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
