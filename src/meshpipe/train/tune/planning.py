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
from meshpipe.schedules.plan_space import PlanRequest
from meshpipe.schedules.planner import PlanError, fit_efficiency, predict
from meshpipe.schedules.scale import ScaleLayout
from meshpipe.train.config import TrainConfig

# TrainConfig fields that are the layout ``meshpipe plan`` chooses, not input to it.
PLANNED_FIELDS = ("tp", "pp", "vpp", "dp", "cp_ulysses", "cp_ring", "ep", "schedule",
                  "placement", "microbatches", "microbatch_size", "zero", "recompute",
                  "sequence_parallel", "stage_tp")
# The row of benchmarks/gpu_bench.py that --efficiency-from fits: the step as `meshpipe plan`
# writes runs (--compile, its other flags at their defaults).
COMPILED_RUNNER = "meshpipe Trainer (1F1B, 1 stage) --compile"


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
                           config.kv_heads or config.heads, vocab_size(config),
                           config.moe_experts, config.moe_top_k, config.moe_every,
                           config.tie_embeddings)


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
    builds the schedule and splits the layers) and Ulysses' dealing of a tp rank's heads."""
    from meshpipe.context.heads import plan_heads

    def runnable(layout: ScaleLayout) -> bool:
        try:
            candidate = config_for_layout(layout, config)
            if candidate.cp_ulysses > 1:
                plan_heads(model.heads // layout.tp, max(1, model.kv_heads // layout.tp),
                           candidate.cp_ulysses)
        except ValueError:
            return False
        return True

    return runnable


def efficiency_from_gpu_bench(path: Path, request: PlanRequest) -> tuple[PlanRequest, str]:
    """``request`` with its efficiency fitted to the compiled meshpipe step that
    ``benchmarks/gpu_bench.py`` measured on one GPU (its JSON: one run's result or the
    recorded runs), and a line saying what was fitted."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PlanError(f"{path}: cannot read it as gpu_bench's JSON: {error}") from None
    results = [run.get("result", run) for run in document.get("runs", [document])]
    rows = [(result.get("device", "one GPU"), row) for result in results
            for row in result.get("train", [])
            if row.get("status") == "ok" and row.get("model")
            and row.get("runner") == COMPILED_RUNNER]
    if not rows:
        raise PlanError(f"{path}: no compiled meshpipe training step with its model's sizes "
                        f"(rows written by benchmarks/gpu_bench.py with --modes compile since "
                        f"it records them); run it on the GPU to fit")
    device, row = rows[-1]
    sizes = row["model"]
    model = reference_shape(sizes["dim"], sizes["layers"], sizes["heads"], sizes["kv_heads"],
                            sizes["vocab"])
    layout = ScaleLayout(tp=1, pp=1, vpp=1, cp=1, dp=1, microbatch_size=sizes["microbatch_size"],
                         microbatches=sizes["microbatches"], schedule="none")
    measured = PlanRequest(model, request.cluster, 1, sizes["seq_len"],
                           sizes["microbatches"] * sizes["microbatch_size"],
                           efficiency=request.efficiency, runtime=request.runtime)
    before = predict(measured, layout).step_s
    efficiency, factor = fit_efficiency(measured, layout, row["seconds"])
    note = (f"efficiency fitted to {path}'s step ({device}): measured "
            f"{1000 * row['seconds']:.1f} ms, predicted {1000 * before:.1f} ms by the default "
            f"curve; its fractions scaled by {factor:.3f}")
    return replace(request, efficiency=efficiency), note
