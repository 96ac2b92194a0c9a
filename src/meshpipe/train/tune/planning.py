"""``meshpipe plan`` beside ``meshpipe train``: the decoder's shape from the train flags (a
``--model`` directory's config.json, no weights read; or the reference transformer's
sizes), and the chosen layout as the ``TrainConfig`` that ``--write`` saves."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from meshpipe.schedules.builders import schedule_spec
from meshpipe.schedules.model_shape import (ModelShape, ModelShapeError, reference_shape,
                                            shape_from_hf_config)
from meshpipe.schedules.scale import ScaleLayout
from meshpipe.train.config import TrainConfig

# TrainConfig fields that are the layout ``meshpipe plan`` chooses, not input to it.
PLANNED_FIELDS = ("tp", "pp", "vpp", "dp", "cp_ulysses", "cp_ring", "ep", "schedule",
                  "placement", "microbatches", "microbatch_size", "zero", "recompute",
                  "sequence_parallel", "stage_tp")


def model_shape(config: TrainConfig) -> ModelShape:
    """The shape of ``config``'s model: ``--model DIR``'s config.json, else the reference
    transformer of ``--dim``, ``--layers``, ``--heads``, ``--kv-heads`` and the MoE flags."""
    if config.model:
        path = Path(config.model) / "config.json"
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelShapeError(f"{path}: no such file; --model needs a directory holding "
                                  f"the model's config.json (weights are not read)") from None
        except (OSError, ValueError) as error:
            raise ModelShapeError(f"{path}: cannot read it as JSON: {error}") from None
        return shape_from_hf_config(document, Path(config.model).name or str(config.model))
    from meshpipe.train.run.sources import vocab_size

    return reference_shape(config.dim, config.layers, config.heads,
                           config.kv_heads or config.heads, vocab_size(config), config.moe_experts, config.moe_top_k,
                           config.moe_every, config.tie_embeddings)


def config_for_layout(layout: ScaleLayout, config: TrainConfig) -> TrainConfig:
    """``config`` running ``layout`` in bf16 with compiled blocks (what the plan's host times
    are of), tp > 1 with sequence parallelism."""
    spec = schedule_spec(layout.schedule)
    ring, ulysses = ((layout.cp, 1) if layout.cp_kind == "ring" else (1, layout.cp))
    # A --model's key/value heads are its config.json's: the derived default that stands in
    # the field follows the new tp instead of being taken for a given flag.
    own_sizes = {"kv_heads": None} if config.model else {}
    return replace(config, **own_sizes, tp=layout.tp, pp=layout.pp,
                   vpp=layout.vpp if spec.interleaves else 1, dp=layout.dp, cp_ring=ring,
                   cp_ulysses=ulysses, ep=layout.ep, schedule=layout.schedule,
                   placement="auto", microbatches=layout.microbatches,
                   microbatch_size=layout.microbatch_size, zero=layout.zero,
                   recompute=layout.recompute, sequence_parallel=layout.tp > 1, dtype="bf16",
                   compile=True)


def runnable_by_meshpipe(config: TrainConfig,
                         model: ModelShape) -> Callable[[ScaleLayout], bool]:
    """Whether ``meshpipe train`` runs a layout of ``config``'s model, by the checks it makes
    before any process starts that need no weights: the config's own (the planner already
    builds the schedule and splits the layers), Ulysses' dealing of a tp rank's heads, and
    experts only without tensor parallelism (not yet combined)."""
    from meshpipe.context.heads import plan_heads

    def runnable(layout: ScaleLayout) -> bool:
        if model.experts and layout.tp > 1:
            return False
        try:
            candidate = config_for_layout(layout, config)
            if candidate.cp_ulysses > 1:
                plan_heads(model.heads // layout.tp, max(1, model.kv_heads // layout.tp),
                           candidate.cp_ulysses)
        except ValueError:
            return False
        return True

    return runnable
