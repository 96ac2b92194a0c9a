"""The layouts ``meshpipe plan`` searches (``planner``): tp within a node, dividing the heads,
kv heads, MLP width and vocabulary (how meshpipe's tensor parallelism splits a model); cp as
ring (zigzag: the sequence in ``2 cp`` pieces) up to ``MAX_CP`` ranks, and Ulysses where a tp
rank's heads and kv heads divide; pp up to the layers; dp dividing the global batch; ep for
expert models dividing the experts and ``dp x cp``; the request's ZeRO levels where a weight
has replicas, microbatch sizes, schedules with the virtual stages each takes, recompute
modes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from meshpipe.schedules.builders import SCHEDULES, schedule_spec
from meshpipe.schedules.cluster import Cluster
from meshpipe.schedules.costs import RECOMPUTE_MODES
from meshpipe.schedules.model_shape import ModelShape
from meshpipe.schedules.ranking import ZERO_LEVELS, divisors, vpp_choices
from meshpipe.schedules.scale import CP_KINDS, MESHPIPE, Efficiency, Runtime, ScaleLayout

MICROBATCH_SIZES = (1, 2, 4, 8)
MAX_CP = 64


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: ``global_batch`` sequences of ``seq_len`` tokens a step on ``gpus``
    GPUs of ``cluster``, and the parts of the search to cover."""

    model: ModelShape
    cluster: Cluster
    gpus: int
    seq_len: int
    global_batch: int
    efficiency: Efficiency = Efficiency()
    runtime: Runtime = MESHPIPE
    schedules: tuple[str, ...] = SCHEDULES
    microbatch_sizes: tuple[int, ...] = MICROBATCH_SIZES
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    zero: tuple[int, ...] = ZERO_LEVELS
    cp_kinds: tuple[str, ...] = CP_KINDS


def layouts(request: PlanRequest) -> Iterator[ScaleLayout]:
    """Every layout of the request's search (see the module docstring)."""
    model, gpus = request.model, request.gpus
    for tp in divisors(min(gpus, request.cluster.gpus_per_node)):
        if gpus % tp or any(size % tp for size in (model.heads, model.kv_heads,
                                                     model.ffn_hidden, model.vocab)):
            continue
        for cp in divisors(gpus // tp):
            if cp > MAX_CP or request.seq_len % (2 * cp if cp > 1 else 1):
                continue
            for kind in _cp_kinds(request, tp, cp):
                for pp in divisors(gpus // (tp * cp)):
                    dp = gpus // (tp * cp * pp)
                    if pp > model.layers or request.global_batch % dp:
                        continue
                    yield from _inner(request, tp, cp, kind, pp, dp)


def _cp_kinds(request: PlanRequest, tp: int, cp: int) -> tuple[str, ...]:
    if cp == 1:
        return ("ring",)
    heads, kv = request.model.heads // tp, max(1, request.model.kv_heads // tp)
    return tuple(kind for kind in request.cp_kinds
                 if kind == "ring" or (heads % cp == 0 and kv % cp == 0))


def _inner(request: PlanRequest, tp: int, cp: int, kind: str, pp: int,
           dp: int) -> Iterator[ScaleLayout]:
    model = request.model
    experts = [ep for ep in divisors(dp * cp) if model.experts % ep == 0] if model.experts \
        else [1]
    per_replica = request.global_batch // dp
    for size in request.microbatch_sizes:
        if per_replica % size:
            continue
        microbatches = per_replica // size
        for schedule in _schedules(request, pp):
            for vpp in _vpp_choices(schedule, pp, model.layers):
                for ep in experts:
                    for zero in request.zero if dp * cp > 1 else (0,):
                        for recompute in request.recompute:
                            yield ScaleLayout(tp, pp, vpp, cp, dp, size, microbatches,
                                              schedule, kind, ep, zero, recompute)


def _vpp_choices(schedule: str, pp: int, layers: int) -> range:
    """``ranking.vpp_choices``, but one stage per rank for GPipe and 1F1B: several stages a
    rank are what interleaved 1F1B is for (and the list scheduler those two take there
    costs more than the rest of a search)."""
    choices = vpp_choices(schedule, pp, layers)
    spec = schedule_spec(schedule)
    if spec.interleaves or spec.v_shaped:
        return choices
    return range(1, 2) if 1 in choices else range(0)


def _schedules(request: PlanRequest, pp: int) -> list[str]:
    """The request's schedules that run on ``pp`` ranks; those that hide expert all-to-alls
    only for expert models (without them they are the schedule they interleave like)."""
    chosen = []
    for name in request.schedules:
        spec = schedule_spec(name)
        if (pp == 1) != spec.one_rank:
            continue
        if spec.hides_all_to_all and not request.model.experts:
            continue
        chosen.append(name)
    return chosen
