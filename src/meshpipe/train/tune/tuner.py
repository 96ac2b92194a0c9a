"""``meshpipe tune``: measure the reference transformer on this machine, then rank layouts.

Three measurements make the ``Profile`` that ``meshpipe.schedules.ranking`` ranks layouts by:

1. in this process (``profile``): each piece's parameters
   (embedding, one transformer layer, final norm + head), the activation bytes it saves for
   backward per token (what ``torch.autograd.graph.saved_tensors_hooks`` sees in one
   microbatch's forward, weights excluded) and its forward time per token, which only sets
   the pieces' relative weights; and a layer's forward + backward per token, one thread, at
   every token count a layout gives a rank (the shape of cost against size);
2. short training runs of a base layout on ``world_size`` processes (``measure``; local
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
3. ``calibrate``: the profile priced by what the runs measured (the pieces' compute scaled
   to the base layout's stages, the layer curve pinned to each measured microbatch size, a
   per-action cost, messages and a per-step rest); its module says how.

Only the reference transformer (dense, no tensor parallelism) is tuned; context
parallelism is offered as Ulysses, priced by that measured overhead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from meshpipe.schedules.ranking import Prediction, Profile, TuneError, rank_layouts
from meshpipe.train.config import TrainConfig
from meshpipe.train.supervisor.launch import device_for_this_rank
from meshpipe.train.tune.calibrate import calibrate
from meshpipe.train.tune.measure import Measurement, base_layout, measure, measured_sizes
from meshpipe.train.tune.profile import layer_curve, model_profile, token_counts, ulysses_sizes


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
