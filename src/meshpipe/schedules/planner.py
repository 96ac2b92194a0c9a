"""``meshpipe plan``: search every layout of a decoder on a cluster of GPUs, predict each
one's step with the cost model at scale (``scale``), and rank those that fit in memory.

The search covers every layout ``plan_space.layouts`` lists. Most of it never reaches the
simulator: a layout's step is at least its busiest rank's compute for every
microbatch plus what follows the pipeline, so layouts are simulated in the order of that
bound until the bound passes the ``top``-th best step found, and a layout whose weights,
optimizer state and one microbatch's activations already exceed a GPU is dropped unseen.
Simulations are shared between layouts whose schedules have the same shape and whose
stage costs are in the same proportions (``_simulated``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from meshpipe.schedules.builders import build, schedule_spec
from meshpipe.schedules.costs import CostModel
from meshpipe.schedules.model_shape import ModelShape
from meshpipe.schedules.placement import balanced_layers, loop_placement, v_placement
from meshpipe.schedules.plan_space import PlanRequest, layouts
from meshpipe.schedules.ranking import TuneError, format_bytes
from meshpipe.schedules.scale import (Efficiency, LayerCosts, ScaleLayout,
                                      gradient_accumulation_s, gradient_sync_s, layer_costs,
                                      pipeline_message_s, saved_bytes_per_token, state_bytes_of)
from meshpipe.schedules.simulator import simulate

LOGIT_BYTES = 4.0  # the loss's float32 logits, kept for its backward


class PlanError(TuneError):
    """A request no layout answers; the message says what does not fit and what to change."""


@dataclass(frozen=True)
class PlanPrediction:
    """A layout's predicted step: ``step_s`` = ``pipeline_s`` (the simulated schedule) +
    ``sync_s`` (exposed gradient reduction, ZeRO's gather, the optimizer);
    ``exposed_comm_s`` the communication nothing hides (tp, cp, experts' all-to-alls where
    the schedule waits for them, data parallelism); ``memory_bytes`` the fullest GPU's."""

    layout: ScaleLayout
    step_s: float
    pipeline_s: float
    sync_s: float
    bubble: float
    exposed_comm_s: float
    memory_bytes: float
    mfu: float
    tflops_per_gpu: float


@dataclass
class Plan:
    """The ranked predictions (fastest first) and how much of the search it took."""

    predictions: list[PlanPrediction]
    layouts: int = 0
    simulated: int = 0
    too_large: int = 0
    refused: int = 0


@dataclass
class _Stages:
    """Per stage: forward, backward (fused, or its I and W), all-to-all, what of it a
    co-scheduled forward and backward leave unhidden, activation bytes of one microbatch;
    parameters (dense, expert) and exposed communication per microbatch."""

    forward: list[float] = field(default_factory=list)
    backward_input: list[float] = field(default_factory=list)
    backward_weight: list[float] = field(default_factory=list)
    a2a: list[float] = field(default_factory=list)
    a2a_unhidden: list[float] = field(default_factory=list)
    activation: list[float] = field(default_factory=list)
    dense: list[float] = field(default_factory=list)
    experts: list[float] = field(default_factory=list)
    exposed: list[float] = field(default_factory=list)


class _Planner:
    """One request's caches: layer costs per layout shape, schedules, simulations."""

    def __init__(self, request: PlanRequest):
        self.request = request
        self.model = request.model
        self._layers: dict[tuple, tuple[LayerCosts, LayerCosts]] = {}
        self._stages: dict[tuple, _Stages] = {}
        self._placements: dict[tuple, tuple[int, ...]] = {}
        self._ranks: dict[tuple, tuple[tuple[float, ...], ...]] = {}
        self._schedules: dict[tuple, object] = {}
        self._simulations: dict[tuple, tuple[float, float, tuple[float, ...]]] = {}
        self.simulated = 0

    # -- costs ---------------------------------------------------------------------------------
    def layer_pair(self, layout: ScaleLayout, split: bool) -> tuple[LayerCosts, LayerCosts]:
        """A dense and an expert layer's costs (the second equals the first for dense models)."""
        key = (layout.tp, layout.cp, layout.cp_kind, layout.microbatch_size, layout.ep,
               layout.recompute, split)
        if key not in self._layers:
            request = self.request

            def costs(moe: bool) -> LayerCosts:
                return layer_costs(self.model, request.cluster, layout, request.seq_len,
                                   request.efficiency, request.runtime, moe, split)

            dense = costs(False)
            self._layers[key] = (dense, costs(True) if self.model.experts else dense)
        return self._layers[key]

    def stages(self, layout: ScaleLayout, num_stages: int, split: bool) -> _Stages:
        key = (layout.tp, layout.cp, layout.cp_kind, layout.microbatch_size, layout.ep,
               layout.recompute, split, num_stages)
        if key not in self._stages:
            self._stages[key] = self._stages_of(layout, num_stages, split)
        return self._stages[key]

    def _stages_of(self, layout: ScaleLayout, num_stages: int, split: bool) -> _Stages:
        model, request = self.model, self.request
        dense_layer, moe_layer = self.layer_pair(layout, split)
        moe_share = model.moe_layers / model.layers
        mix = {name: (1 - moe_share) * getattr(dense_layer, name)
               + moe_share * getattr(moe_layer, name)
               for name in ("forward", "backward_input", "backward_weight", "exposed_comm",
                            "a2a", "activation_bytes")}
        per_layer_dense = (model.attention_parameters() / layout.tp
                           + (1 - moe_share) * model.dense_mlp_parameters() / layout.tp
                           + moe_share * model.moe_shared_parameters() / layout.tp)
        per_layer_experts = moe_share * model.expert_parameters() / layout.ep
        head = _head_costs(model, request, layout)
        out = _Stages()
        for stage, count in enumerate(balanced_layers(model.layers, num_stages)):
            last = stage == num_stages - 1
            out.forward.append(count * mix["forward"] + (head[0] if last else 0.0))
            out.backward_input.append(count * mix["backward_input"] + (head[1] if last else 0.0))
            dense = (count * per_layer_dense
                     + (model.embedding_parameters() / layout.tp if stage == 0 else 0)
                     + (model.head_parameters() / layout.tp if last else 0))
            experts = count * per_layer_experts
            out.backward_weight.append(
                count * mix["backward_weight"] + (head[2] if last else 0.0)
                + gradient_accumulation_s(request.cluster, dense + experts, request.runtime,
                                          request.efficiency))
            out.a2a.append(count * mix["a2a"])
            out.a2a_unhidden.append(count * moe_share * _unhidden_all_to_all(moe_layer))
            out.activation.append(count * mix["activation_bytes"] + (head[3] if last else 0.0)
                                  + (_recompute_working_set(model, layout, request.seq_len)
                                     if layout.recompute == "full" and count else 0.0))
            out.dense.append(dense)
            out.experts.append(experts)
            out.exposed.append(count * mix["exposed_comm"])
        return out

    # -- schedules -----------------------------------------------------------------------------
    def schedule(self, layout: ScaleLayout):
        key = (layout.schedule, layout.pp, layout.vpp, layout.microbatches)
        if key not in self._schedules:
            try:
                self._schedules[key] = build(layout.schedule, layout.pp, layout.microbatches,
                                             stages_per_rank=layout.vpp)
            except ValueError:
                self._schedules[key] = None
        return self._schedules[key]

    def _simulated(self, schedule, costs: CostModel, unit: float, unit_bytes: float,
                   key: tuple) -> tuple[float, float, tuple[float, ...]]:
        """(makespan, bubble, peak activation bytes per rank), from a layout with the same
        schedule and proportional costs where one was simulated."""
        if key not in self._simulations:
            simulation = simulate(schedule, costs)
            self.simulated += 1
            self._simulations[key] = (simulation.makespan / unit, simulation.bubble_ratio,
                                      tuple(b / unit_bytes
                                            for b in simulation.peak_activation_bytes))
        makespan, bubble, peaks = self._simulations[key]
        return makespan * unit, bubble, tuple(p * unit_bytes for p in peaks)

    # -- one layout ----------------------------------------------------------------------------
    def placement(self, layout: ScaleLayout) -> tuple[int, ...]:
        """Stage -> rank of the layout's schedule, without building it."""
        key = (layout.schedule, layout.pp, layout.vpp)
        if key not in self._placements:
            spec = schedule_spec(layout.schedule)
            self._placements[key] = (v_placement(layout.pp) if spec.v_shaped
                                     else loop_placement(layout.pp, layout.vpp))
        return self._placements[key]

    def ranks(self, layout: ScaleLayout) -> tuple[tuple[float, ...], ...]:
        """The distinct ranks of the layout's pipeline, each as (its work for one microbatch,
        the part of it up to its input gradients (all of it with a fused backward), the
        forwards of the stages below its first, their backwards up to the input gradients,
        its dense and expert parameters, its last backward, one microbatch's
        activations)."""
        placement = self.placement(layout)
        split = schedule_spec(layout.schedule).split_backward
        key = (layout.tp, layout.cp, layout.cp_kind, layout.microbatch_size, layout.ep,
               layout.recompute, split, layout.schedule, layout.pp, layout.vpp)
        if key not in self._ranks:
            stages = self.stages(layout, len(placement), split)
            backward = [i + (0.0 if split else w)
                        for i, w in zip(stages.backward_input, stages.backward_weight)]
            found = set()
            for rank in range(layout.pp):
                held = [s for s, r in enumerate(placement) if r == rank]
                below = range(min(held))
                found.add((sum(stages.forward[s] + stages.backward_input[s]
                               + stages.backward_weight[s] for s in held),
                           sum(stages.forward[s] + backward[s] for s in held),
                           sum(stages.forward[s] for s in below),
                           sum(backward[s] for s in below),
                           sum(stages.dense[s] for s in held),
                           sum(stages.experts[s] for s in held),
                           sum(stages.backward_input[s] + stages.backward_weight[s]
                               for s in held),
                           sum(stages.activation[s] for s in held)))
            self._ranks[key] = tuple(found)
        return self._ranks[key]

    def bounds(self, layout: ScaleLayout) -> tuple[float, float]:
        """(a lower bound of its step, its fullest GPU's weights, state and one microbatch's
        activations). A rank computes its work for every microbatch one action after
        another, from when the forwards of the stages below its first have run once; its
        last input gradient (that of the last microbatch on its first stage) comes after all
        its forwards and input gradients, and the stages below it still owe theirs: the
        bound is the largest over the ranks (1F1B's bubble exactly), plus what follows the
        pipeline."""
        request = self.request
        step, memory = 0.0, 0.0
        m = layout.microbatches
        for work, to_input, head, tail, dense, experts, window, activation in self.ranks(layout):
            exposed, optimizer = gradient_sync_s(request.cluster, layout, dense, experts,
                                                 window, request.runtime, request.efficiency)
            pipeline = head + max(m * work, m * to_input + tail)
            step = max(step, pipeline + exposed + optimizer)
            memory = max(memory, state_bytes_of(layout, dense, experts) + activation)
        return step, memory + request.cluster.reserved_bytes

    def predict(self, layout: ScaleLayout) -> PlanPrediction | None:
        schedule = self.schedule(layout)
        if schedule is None:
            return None
        request, model = self.request, self.model
        spec = schedule_spec(layout.schedule)
        stages = self.stages(layout, schedule.num_stages, spec.split_backward)
        message = pipeline_message_s(model, request.cluster, layout, request.seq_len)
        if spec.split_backward:
            passes = dict(backward_input=tuple(stages.backward_input),
                            backward_weight=tuple(stages.backward_weight))
        else:
            passes = dict(backward=tuple(i + w for i, w in zip(stages.backward_input,
                                                                  stages.backward_weight)))
        if spec.hides_all_to_all:
            passes["overlap"] = tuple(f + i + w + unhidden for f, i, w, unhidden in zip(
                stages.forward, stages.backward_input, stages.backward_weight,
                stages.a2a_unhidden))
        costs = CostModel(forward=tuple(stages.forward), **passes, comm=message,
                          a2a=tuple(stages.a2a), activation_bytes=tuple(stages.activation))
        unit = max(stages.forward)
        unit_bytes = max(stages.activation) or 1.0
        key = (layout.schedule, layout.pp, layout.vpp, layout.microbatches,
               _proportions(stages, unit, message), tuple(round(a / unit_bytes, 3)
                                                          for a in stages.activation))
        makespan, bubble, peaks = self._simulated(schedule, costs, unit, unit_bytes, key)
        ranks = [[] for _ in range(layout.pp)]
        for stage, rank in enumerate(schedule.placement):
            ranks[rank].append(stage)
        sync, memory, exposed = 0.0, 0.0, 0.0
        waited = stages.a2a_unhidden if spec.hides_all_to_all else [2 * a for a in stages.a2a]
        for rank, held in enumerate(ranks):
            dense = sum(stages.dense[s] for s in held)
            experts = sum(stages.experts[s] for s in held)
            window = sum(stages.backward_input[s] + stages.backward_weight[s] for s in held)
            dp_exposed, optimizer = gradient_sync_s(request.cluster, layout, dense, experts,
                                                    window, request.runtime,
                                                    request.efficiency)
            sync = max(sync, dp_exposed + optimizer)
            memory = max(memory, state_bytes_of(layout, dense, experts) + peaks[rank])
            exposed = max(exposed, dp_exposed + layout.microbatches * sum(
                stages.exposed[s] + waited[s] for s in held))
        step = makespan + sync
        tokens = request.global_batch * request.seq_len
        flops = 3 * model.model_flops_per_token(request.seq_len) * tokens
        per_gpu = flops / (step * layout.gpus)
        return PlanPrediction(layout, step, makespan, sync, bubble, exposed,
                              memory + request.cluster.reserved_bytes,
                              per_gpu / request.cluster.peak_flops, per_gpu / 1e12)


def _unhidden_all_to_all(layer: LayerCosts) -> float:
    """What an OVERLAP leaves of one expert layer's all-to-alls: the runtime co-schedules a
    forward and a backward sub-step by sub-step, so the forward's dispatch and combine hide
    behind the other microbatch's layer backward and the backward's behind its layer
    forward, each only as far as that compute lasts (``benchmarks/moe_overlap.py``: at
    all-to-alls twice a sub-step's compute the runtime hid 66-68 %, where a perfect
    interleaving, the simulator's default for OVERLAP, hides 82 %)."""
    backward = layer.backward_input + layer.backward_weight
    return max(0.0, layer.a2a - backward) + max(0.0, layer.a2a - layer.forward)


def _head_costs(model: ModelShape, request: PlanRequest,
                layout: ScaleLayout) -> tuple[float, float, float, float]:
    """The last stage's output projection and loss for one microbatch: forward, I, W
    seconds and the float32 logits it keeps for backward (bytes)."""
    tokens = layout.microbatch_size * request.seq_len / layout.cp
    vocab = model.vocab / layout.tp
    product = request.efficiency.matmul_s(2 * tokens * model.hidden * vocab, tokens, vocab,
                                          model.hidden, request.cluster.peak_flops)
    logits = tokens * vocab * LOGIT_BYTES
    loss = request.efficiency.stream_s(3 * logits, request.cluster)
    return product + loss, product + loss, product, logits


def _recompute_working_set(model: ModelShape, layout: ScaleLayout, seq_len: int) -> float:
    """What a layer holds while full recomputation re-runs it (one layer's activations)."""
    tokens = layout.microbatch_size * seq_len / layout.cp
    return saved_bytes_per_token(model, model.experts > 0, "none") * tokens / layout.tp


def _proportions(stages: _Stages, unit: float, message: float) -> tuple:
    """Stage costs relative to the largest forward, to three significant digits: layouts
    whose costs agree this far share a simulation."""
    def scaled(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(float(f"{v / unit:.3g}") for v in values)

    return (scaled(stages.forward), scaled(stages.backward_input),
            scaled(stages.backward_weight), scaled(stages.a2a), scaled(stages.a2a_unhidden),
            float(f"{message / unit:.3g}"))


def plan(request: PlanRequest, top: int = 10,
         runnable: Callable[[ScaleLayout], bool] | None = None) -> Plan:
    """The ``top`` fastest layouts that fit (see the module docstring), fastest first;
    with ``runnable``, only layouts it accepts (what a runtime can run of those the cost
    model prices: ``meshpipe plan`` asks ``meshpipe train``'s own checks)."""
    planner = _Planner(request)
    candidates, too_large, smallest = [], 0, None
    usable = request.cluster.memory_bytes
    count = 0
    for layout in layouts(request):
        count += 1
        step, memory = planner.bounds(layout)
        if memory > usable:
            too_large += 1
            smallest = memory if smallest is None else min(smallest, memory)
            continue
        candidates.append((step, layout))
    if not candidates:
        raise PlanError(_nothing_fits(request, count, smallest))
    candidates.sort(key=lambda item: item[0])
    best: list[PlanPrediction] = []
    refused = 0
    for bound, layout in candidates:
        if len(best) >= top and bound > best[top - 1].step_s:
            break
        if runnable is not None and not runnable(layout):
            refused += 1
            continue
        predicted = planner.predict(layout)
        if predicted is None or predicted.memory_bytes > usable:
            continue
        best.append(predicted)
        best.sort(key=lambda p: (p.step_s, p.memory_bytes))
    if not best:
        if refused:
            raise PlanError(f"none of the {refused} layouts of {request.model.name} that fit "
                            f"{request.gpus} GPUs can run: see the first one's error with "
                            f"meshpipe train --check")
        raise PlanError(_nothing_fits(request, count, smallest))
    return Plan(best[:top], count, planner.simulated, too_large, refused)


def predict(request: PlanRequest, layout: ScaleLayout) -> PlanPrediction:
    """One layout's prediction (a ``PlanError`` if its schedule does not take its sizes)."""
    predicted = _Planner(request).predict(layout)
    if predicted is None:
        raise PlanError(f"schedule {layout.schedule} does not run {layout.microbatches} "
                        f"microbatches on pp {layout.pp} with vpp {layout.vpp}")
    return predicted


def fit_efficiency(request: PlanRequest, layout: ScaleLayout,
                   measured_s: float) -> tuple[Efficiency, float]:
    """The request's efficiency scaled so that ``layout``'s predicted step is the
    ``measured_s`` a GPU took (bisection on the factor: a step's time falls as the factor
    grows, down to the host's floor), and the factor."""
    def step(factor: float) -> float:
        return predict(replace(request, efficiency=request.efficiency.scaled(factor)),
                       layout).step_s

    efficiency = request.efficiency
    low = 0.05
    high = 1 / max(efficiency.matmul, efficiency.memory, *(f for _, f in efficiency.attention))
    if step(high) > measured_s:
        return request.efficiency.scaled(high), high
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) > measured_s else (low, middle)
    return request.efficiency.scaled(high), high


def _nothing_fits(request: PlanRequest, count: int, smallest: float | None) -> str:
    model, cluster = request.model, request.cluster
    if not count:
        return (f"no layout of {request.gpus} GPUs runs {model.name} ({model.layers} layers, "
                f"{model.heads} heads) at a global batch of {request.global_batch} and "
                f"seq-len {request.seq_len}: tp x cp x pp x dp must equal --gpus with tp "
                f"dividing the heads and a node ({cluster.gpus_per_node}), dp the global batch")
    need = f"; the smallest layout needs {format_bytes(smallest)}" if smallest else ""
    return (f"{model.name} ({model.parameters() / 1e9:.1f}B parameters) fits no layout of "
            f"{request.gpus} {cluster.name} GPUs with {format_bytes(cluster.memory_bytes)} each "
            f"at seq-len {request.seq_len}{need}: give more --gpus, a shorter --seq-len, or "
            f"GPUs with more memory")


TABLE_HEADER = ("rank", "tp", "pp", "vpp", "cp", "dp", "ep", "zero", "mb", "microbatches",
                "schedule", "recompute", "step s", "MFU", "bubble", "exposed comm s",
                "memory")


def table(predictions: Sequence[PlanPrediction], top: int | None = None) -> str:
    """The first ``top`` predictions as a Markdown table."""
    rows = [TABLE_HEADER]
    for place, p in enumerate(predictions[:top], start=1):
        layout = p.layout
        cp = f"{layout.cp} {layout.cp_kind}" if layout.cp > 1 else "1"
        rows.append((str(place), str(layout.tp), str(layout.pp), str(layout.vpp), cp,
                     str(layout.dp), str(layout.ep), str(layout.zero),
                     str(layout.microbatch_size), str(layout.microbatches), layout.schedule,
                     layout.recompute, f"{p.step_s:.4g}", f"{100 * p.mfu:.1f}%",
                     f"{100 * p.bubble:.1f}%", f"{p.exposed_comm_s:.3g}",
                     format_bytes(p.memory_bytes)))
    text = ["| " + " | ".join(rows[0]) + " |",
            "| " + " | ".join("---" if c in ("schedule", "recompute") else "---:"
                              for c in TABLE_HEADER) + " |"]
    text += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(text) + "\n"

