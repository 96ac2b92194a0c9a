"""``meshpipe tune``: measure the reference transformer on this machine, then rank layouts.

Three measurements make the ``Profile`` that ``meshpipe.schedules.tune`` ranks layouts by:

1. in this process (``model_profile``, ``layer_curve``): each piece's parameters
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

import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshpipe.context import LocalAttention, UlyssesAttention
from meshpipe.models import causal_lm_loss
from meshpipe.models.transformer import Transformer
from meshpipe.runtime import activity
from meshpipe.schedules import Timeline, fit_costs
from meshpipe.schedules.costs import fit_message_seconds
from meshpipe.schedules.placement import balanced_layers
from meshpipe.schedules.simulator import mean_speeds
from meshpipe.schedules.tune import (Layout, Link, Piece, Prediction, Profile, TuneError,
                                     buildable, curve_factor, layouts, predict, rank_layouts,
                                     stage_sum)
from meshpipe.train import sources
from meshpipe.train.config import TrainConfig
from meshpipe.train.devices import local_ranks, plan_devices
from meshpipe.train.launch import Supervision, device_for_this_rank, launch, under_torchrun

# Training steps of the measured run; the first is a warm-up and not used.
MEASURE_STEPS = 6
# Repetitions of each timed operation (the median counts).
REPEATS = 7
# In-process timings (``_seconds_in_turn``): turns over the timed functions, calls per turn.
TURNS = 3
CALLS_PER_TURN = 3
# Placeholder link of the first, compute-free pass (memory and input checks only).
_UNMEASURED_LINK = Link(latency=0.0, bytes_per_s=1e12)


@dataclass(frozen=True)
class Measurement:
    """What the base layout's short run measured (seconds; per stage, one microbatch)."""

    layout: Layout
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    # Per microbatch size trained (the base size among them): F + B of one microbatch,
    # summed over the stages.
    sizes: tuple[tuple[int, float], ...]
    pipeline_s: float
    step_s: float
    message_s: float | None  # an input from another rank: producer's end to consumer's start
    message: Link
    all_reduce: Link
    optimizer_s_per_parameter: float
    ulysses: tuple[tuple[int, Link], ...] = ()  # per cp: a layer's overhead (``Profile``)


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


def model_profile(config: TrainConfig, device: torch.device | None = None) -> Profile:
    """The in-process part of the profile (parameters, activation bytes and relative
    forward time per piece), on ``device`` (default: this rank's training device); links
    and overheads are placeholders until ``calibrate``."""
    device = device_for_this_rank() if device is None else device
    torch.manual_seed(config.seed)
    model = Transformer(sources.model_config(config), recompute=config.recompute).to(device)
    tokens = config.microbatch_size * config.seq_len
    pieces = _pieces(model, config, device)
    with torch.no_grad():
        seconds = _seconds_in_turn(pieces, device)
    measured = {name: (_saved_bytes(run, model) / tokens,
                       statistics.median(seconds[name]) / tokens)
                for name, run in pieces.items()}
    parameters = {"embedding": model.embedding.weight.numel(),
                  "layer": sum(p.numel() for p in model.layers[0].parameters()),
                  "head": sum(p.numel() for p in (*model.norm.parameters(),
                                                  *model.head.parameters()))}

    def piece(name: str) -> Piece:
        saved, seconds = measured[name]
        return Piece(seconds, seconds, seconds, 2 * seconds, saved, parameters[name])

    return Profile(layers=config.layers, heads=config.heads, seq_len=config.seq_len,
                   embedding=piece("embedding"), layer=piece("layer"), head=piece("head"),
                   hidden_bytes_per_token=4.0 * config.dim, message=_UNMEASURED_LINK,
                   all_reduce=_UNMEASURED_LINK)


def _pieces(model: Transformer, config: TrainConfig,
            device: torch.device) -> dict[str, Callable[[], torch.Tensor]]:
    """One microbatch's forward through each piece, as a function returning its output."""
    vocab = model.config.vocab_size
    shape = (config.microbatch_size, config.seq_len)
    tokens = torch.randint(vocab, shape, device=device)
    targets = torch.randint(vocab, shape, device=device)
    positions = torch.arange(config.seq_len, device=device)
    hidden = torch.randn(*shape, config.dim, requires_grad=True, device=device)

    def head() -> torch.Tensor:
        return causal_lm_loss(model.head(model.norm(hidden)), targets, reduction="sum")[0]

    return {"embedding": lambda: model.embedding(tokens),
            "layer": lambda: model.layers[0](hidden, positions, None),
            "head": head}


def _saved_bytes(run: Callable[[], torch.Tensor], model: torch.nn.Module) -> float:
    """Bytes of the distinct tensors autograd saves for backward in ``run``, weights not
    counted (they are counted as parameters)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return float(sum(saved.values()))


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: CUDA runs asynchronously, and the host's
    clock must see its end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clocked(run: Callable[[], Any], device: torch.device,
             start_together: Callable[[], Any] = lambda: None) -> float:
    """Seconds of one call of ``run``, its device work included, started on an idle
    device (and after ``start_together``, a barrier where ranks time together)."""
    _synchronize(device)
    start_together()
    start = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - start


def _seconds_in_turn(runs: dict[Any, Callable[[], Any]],
                     device: torch.device) -> dict[Any, list[float]]:
    """The seconds of ``CALLS_PER_TURN`` calls of each of ``runs``, in ``TURNS`` turns over
    the runs, each turn's calls after an untimed one (the run's data back in the caches
    the other runs used): a slow spell of the machine spoils a turn, not every call of
    one run."""
    times: dict[Any, list[float]] = {name: [] for name in runs}
    for _ in range(TURNS):
        for name, run in runs.items():
            run()
            times[name].extend(_clocked(run, device) for _ in range(CALLS_PER_TURN))
    return times


def token_counts(profile: Profile, world_size: int, global_batch: int) -> list[int]:
    """The tokens a rank computes per microbatch in some layout of ``world_size``."""
    return sorted({layout.microbatch_size * profile.seq_len // layout.cp
                   for layout in layouts(world_size, profile, global_batch)})


def ulysses_sizes(profile: Profile, world_size: int, global_batch: int) -> dict[int, list[int]]:
    """Per cp size above 1 that a layout of ``world_size`` uses: the smallest and largest
    microbatch size it comes with (what ``_ulysses_times`` measures)."""
    sizes: dict[int, set[int]] = {}
    for layout in layouts(world_size, profile, global_batch):
        if layout.cp > 1:
            sizes.setdefault(layout.cp, set()).add(layout.microbatch_size)
    return {cp: sorted({min(found), max(found)}) for cp, found in sorted(sizes.items())}


def _layer(config: TrainConfig, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(config.seed)
    model = Transformer(sources.model_config(config), recompute=config.recompute)
    return model.layers[0].to(device)


def _priced_shape(config: TrainConfig, tokens: int) -> tuple[int, int]:
    """``(rows, length)`` of the input a layer over ``tokens`` tokens is priced at: rows of
    ``seq_len`` tokens, or one shorter row."""
    return max(1, tokens // config.seq_len), min(tokens, config.seq_len)


def layer_curve(config: TrainConfig, counts: list[int], device: torch.device | None = None
                ) -> tuple[tuple[float, float], ...]:
    """A transformer layer's forward and backward seconds per token, alone in this process,
    at each of ``counts`` tokens (``_priced_shape``), on ``device`` (default: this rank's
    training device): the shape of the cost per token that one measured size cannot show.
    One thread, as the training processes run."""
    device = device_for_this_rank() if device is None else device
    layer = _layer(config, device)

    def step(tokens: int) -> Callable[[], None]:
        rows, length = _priced_shape(config, tokens)
        hidden = torch.randn(rows, length, config.dim, requires_grad=True, device=device)
        positions = torch.arange(length, device=device)
        return lambda: layer(hidden, positions, None).sum().backward()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = _seconds_in_turn({tokens: step(tokens) for tokens in counts}, device)
    finally:
        torch.set_num_threads(threads)
    # The fastest call: the least disturbed by other processes.
    return tuple((float(tokens), min(seconds[tokens]) / tokens) for tokens in counts)


def base_layout(world_size: int, profile: Profile, global_batch: int,
                microbatch_size: int) -> Layout:
    """The layout measured: 1F1B at the smallest pp above 1, one stage per rank, no
    context parallelism, microbatches nearest ``microbatch_size``; one rank: no pipeline."""
    candidates = [layout for layout in layouts(world_size, profile, global_batch)
                  if layout.cp == 1 and layout.vpp == 1 and layout.schedule in ("1f1b", "none")]
    if not candidates:
        raise TuneError(f"world size {world_size} has no layout without context parallelism "
                        f"to measure: use a world size with a pipeline or data-parallel layout")
    return min(candidates, key=lambda layout: (layout.pp == 1, layout.pp,
                                               abs(layout.microbatch_size - microbatch_size),
                                               -layout.microbatches))


def config_for(layout: Layout, config: TrainConfig, **overrides: Any) -> TrainConfig:
    """``config`` with ``layout``'s sizes (cp as Ulysses) and schedule."""
    return replace(config, pp=layout.pp, vpp=layout.vpp, dp=layout.dp, cp_ulysses=layout.cp,
                   cp_ring=1, microbatches=layout.microbatches,
                   microbatch_size=layout.microbatch_size, schedule=layout.schedule,
                   placement="auto", **overrides)


def size_layout(layout: Layout, size: int) -> Layout:
    """``layout`` at microbatches of ``size`` sequences, about as many sequences per step."""
    return replace(layout, microbatch_size=size,
                   microbatches=max(1, layout.microbatches * layout.microbatch_size // size))


def measured_sizes(predictions: list[Prediction], layout: Layout, profile: Profile,
                   memory_budget: float | None = None) -> list[int]:
    """The microbatch sizes to train ``layout`` at: its own, and every size a ranked layout
    uses where ``layout`` at that size can run and fits ``memory_budget``."""
    def runs(sized: Layout) -> bool:
        return buildable(sized) and (memory_budget is None
                                     or predict(sized, profile).peak_bytes <= memory_budget)

    sizes = {prediction.layout.microbatch_size for prediction in predictions}
    return sorted({layout.microbatch_size}
                  | {size for size in sizes if runs(size_layout(layout, size))})


def measured_phases(layout: Layout, sizes: Sequence[int] = ()) -> list[dict[str, Layout]]:
    """The runs measured, in two phases (the runs of a phase take their steps in turn):
    ``fused`` (the base layout) and ``split`` (with ZB-H1, which times I and W apart; where
    it can run), then, with more than one of ``sizes``, one run per microbatch size (the
    base size among them: each size's cost is taken against it, in the same phase).

    The sizes run apart because every run taking its steps in turn slows the others (each
    step starts with caches the other runs filled): with five more runs, the base layout's
    step came out 9-15 % slower than with the split run alone, so the base level is taken
    where fewer runs share the processes and the sizes give only ratios."""
    first = {"fused": layout, "split": replace(layout, schedule="zb-h1")}
    if layout.pp == 1 or not buildable(first["split"]):
        del first["split"]
    if len(sizes) < 2:
        return [first]
    return [first, {f"size {size}": size_layout(layout, size) for size in sizes}]


def run_configs(config: TrainConfig, layout: Layout, sizes: Sequence[int] = (),
                steps: int = MEASURE_STEPS) -> list[list[TrainConfig]]:
    """The measured runs' configs, phase by phase, in ``measured_phases`` order."""
    return [[config_for(measured, config, steps=steps, timeline_step=0, eval_every=0,
                        check=False, progress=False, resume=False, checkpoint_every=0,
                        export="", device=device_for_this_rank().type)
             for measured in phase.values()] for phase in measured_phases(layout, sizes)]


def measure(config: TrainConfig, layout: Layout, sizes: Sequence[int] = (),
            cores: float | None = None,
            ulysses: dict[int, list[int]] | None = None) -> Measurement:
    """Run a few training steps of each of ``measured_phases(layout, sizes)`` on local
    processes (or the job's ranks under torchrun) and time them; ``cores``: the cores they
    share (None: each its own); ``ulysses``: the cp sizes and microbatch sizes to time
    Ulysses at (``ulysses_sizes``)."""
    phases = run_configs(config, layout, sizes)
    first = phases[0][0]
    logs = Path(tempfile.mkdtemp(prefix="meshpipe-tune-logs-"))
    with tempfile.TemporaryDirectory(prefix="meshpipe-tune-") as tmp:
        result = Path(tmp) / "measured.json"
        launch(_measure_on_this_rank, first.world_size, phases, str(result),
               ulysses or {}, supervision=Supervision(hang_timeout=first.hang_timeout,
                                                      log_dir=logs),
               devices=plan_devices(first.device, "auto", local_ranks(first.world_size)))
        # Only a failed run's logs are kept: its error names them.
        shutil.rmtree(logs, ignore_errors=True)
        return _measurement(layout, json.loads(result.read_text()), sizes, cores)


def _measure_on_this_rank(phases: list[list[TrainConfig]], result_path: str,
                          ulysses: dict[int, list[int]]) -> None:
    """Every rank: each phase's training steps, its runs taking steps in turn (one step of
    each, then the next step of each: a slow spell of the machine touches every run alike,
    so what they differ by is the layouts'); after the first phase, the link, optimizer
    and Ulysses timings. What every rank measured goes to ``result_path``: written by rank
    0 of local processes, by every rank under torchrun (each rank there runs ``tune`` and
    reads its own file)."""
    # Imported here: the trainer is only needed in the measuring processes.
    from meshpipe.train.trainer import Trainer

    torch.set_num_threads(1)
    runs: list[list[dict[str, Any]]] = []
    mine: dict[str, Any] = {}
    for configs in phases:
        trainers = [Trainer(config) for config in configs]
        runs.extend(_steps_in_turn(trainers, configs[0].steps))
        mine = mine or _probes(trainers[0], configs[0], ulysses)
        del trainers  # the next phase's trainers need the memory
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {**mine, "runs": runs})
    if dist.get_rank() == 0 or under_torchrun():
        Path(result_path).write_text(json.dumps(gathered))


def _steps_in_turn(trainers: list[Any], steps: int) -> list[list[dict[str, Any]]]:
    """``steps`` timed steps of each trainer (``_timed_step``), one step of each in turn."""
    runs: list[list[dict[str, Any]]] = [[] for _ in trainers]
    for step in range(steps):
        for trainer, timed in zip(trainers, runs):
            timed.append(_timed_step(trainer, step))
    return runs


def _probes(trainer: Any, config: TrainConfig, ulysses: dict[int, list[int]]
            ) -> dict[str, Any]:
    """This rank's place, and the message, all-reduce, optimizer and Ulysses timings."""
    device = trainer.device
    parameters = [p for _, p in trainer.parameters]
    hidden = config.microbatch_size * config.seq_len // config.layout.cp * config.dim
    return {"pipeline": list(trainer.topology.pipeline_ranks),
            "pp_rank": trainer.topology.pp_rank,
            "message": _message_times(hidden, device),
            "all_reduce": _all_reduce_times(parameters, device),
            "optimizer_s_per_parameter": _optimizer_seconds(trainer) / max(
                1, sum(p.numel() for p in parameters)),
            "ulysses": _ulysses_times(config, ulysses, device)}


def _timed_step(trainer: Any, step: int) -> dict[str, Any]:
    """One step's time and this rank's executor timeline (every rank starts together)."""
    trainer.step = step  # what an injected fault (MESHPIPE_FAULT) counts
    dist.barrier()
    with activity.doing(f"step {step}", step=step):
        stats = trainer.train_step(step)
    return {"seconds": stats.seconds,
            "actions": [(str(t.action), t.start, t.end) for t in trainer.last_result.timeline]}


def _timed(operation: Callable[[], None], device: torch.device) -> float:
    """Median seconds of ``operation`` after one untimed call; every rank calls it."""
    operation()
    return statistics.median(_clocked(operation, device, dist.barrier) for _ in range(REPEATS))


def _message_times(hidden_floats: int, device: torch.device) -> list[tuple[int, float]]:
    """One-way seconds of a message rank 0 -> rank 1 (half a ping-pong) of one float and of
    one activation message; the other ranks wait. No points with one rank: nothing travels."""
    if dist.get_world_size() < 2:
        return []
    results = []
    for floats in (1, hidden_floats):
        buffer = torch.zeros(floats, device=device)

        def ping_pong() -> None:
            if dist.get_rank() == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif dist.get_rank() == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)

        results.append((4 * floats, _timed(ping_pong, device) / 2))
    return results


def _all_reduce_times(parameters: list[torch.nn.Parameter],
                      device: torch.device) -> list[tuple[int, float]]:
    """Seconds of an all-reduce over every rank of one float and of this rank's gradients
    (the largest size over the ranks, so every rank reduces the same tensor)."""
    size = torch.tensor([sum(p.numel() for p in parameters)], device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    results = []
    for floats in (1, int(size.item())):
        buffer = torch.zeros(floats, device=device)
        results.append((4 * floats, _timed(lambda: dist.all_reduce(buffer), device)))
    return results


def _ulysses_times(config: TrainConfig, sizes: dict[int, list[int]],
                   device: torch.device) -> list[tuple[int, float, float, float]]:
    """``(cp, hidden bytes, ulysses_s, local_s)`` per cp size and microbatch size of
    ``sizes``: the median seconds of one layer's forward + backward with Ulysses attention
    over cp ranks on this rank's contiguous share of the sequence, and of the same layer
    with local attention on as many tokens shaped as ``layer_curve`` prices them, the two
    taken in turn. The cp groups take turns too, the other ranks waiting at a barrier, so
    that a group shares the machine with nobody."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = _layer(config, device)
    results = []
    for cp, microbatch_sizes in sizes.items():
        groups = [dist.new_group(list(range(first, first + cp))) for first in range(0, world, cp)]
        member, place = divmod(rank, cp)
        share = config.seq_len // cp
        attentions = {"ulysses": UlyssesAttention(group=groups[member]),
                      "local": LocalAttention()}
        for size in microbatch_sizes:
            inputs = {"ulysses": (
                torch.randn(size, share, config.dim, requires_grad=True, device=device),
                torch.arange(place * share, (place + 1) * share, device=device))}
            rows, length = _priced_shape(config, size * share)
            inputs["local"] = (
                torch.randn(rows, length, config.dim, requires_grad=True, device=device),
                torch.arange(length, device=device))
            for turn in range(len(groups)):
                if turn == member:
                    medians = _medians_in_turn(layer, attentions, inputs, groups[member],
                                               device)
                dist.barrier()
            results.append((cp, 4.0 * config.dim * size * share,
                            medians["ulysses"], medians["local"]))
    return results


def _medians_in_turn(layer: torch.nn.Module, attentions: dict[str, torch.nn.Module],
                     inputs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     group: dist.ProcessGroup, device: torch.device) -> dict[str, float]:
    """Median seconds of ``layer``'s forward + backward with each of ``attentions`` on its
    ``inputs``, the attentions taken in turn, ``REPEATS`` times after a warm-up round; the
    ranks of ``group`` start each call together."""
    seconds: dict[str, list[float]] = {name: [] for name in attentions}
    for repeat in range(REPEATS + 1):
        for name, attention in attentions.items():
            layer.attention.core_attention = attention
            hidden, positions = inputs[name]
            call_s = _clocked(lambda: layer(hidden, positions, None).sum().backward(), device,
                              lambda: dist.barrier(group))
            if repeat:
                seconds[name].append(call_s)
    return {name: statistics.median(times) for name, times in seconds.items()}


def _ulysses_links(times: list[tuple[int, float, float, float]],
                   cores: float | None) -> tuple[tuple[int, Link], ...]:
    """Per cp: Ulysses' overhead over local attention (``_ulysses_times``) as a line in the
    hidden bytes, each time as if its ranks ran alone (a group of more ranks than ``cores``
    ran at ``cores / cp`` of their speed: ``simulate(..., cores=)`` slows them again)."""
    points: dict[int, list[tuple[float, float]]] = {}
    for cp, size, ulysses_s, local_s in times:
        speed = 1.0 if cores is None else min(1.0, cores / cp)
        points.setdefault(cp, []).append((size, max(0.0, ulysses_s - local_s) * speed))
    return tuple((cp, _link(sorted(found))) for cp, found in sorted(points.items()))


def _optimizer_seconds(trainer: Any) -> float:
    """One AdamW step over this rank's parameters (zero gradients: the run is thrown away)."""
    for _, param in trainer.parameters:
        param.grad = torch.zeros_like(param)
    return _timed(trainer.optimizer.step, trainer.device)


def _link(points: list[tuple[float, float]], factor: float = 1.0) -> Link:
    """The ``Link`` through the first and last ``(bytes, seconds)`` points (bytes
    increasing; ``factor``: the bytes each rank moves per byte given, as in an all-reduce);
    a single point, or times that do not grow with size, is all latency (their mean); no
    points (nothing was sent) is free."""
    if not points:
        return _UNMEASURED_LINK
    (small, small_s), (large, large_s) = points[0], points[-1]
    if large <= small or large_s <= small_s:
        return Link(latency=statistics.mean(s for _, s in points), bytes_per_s=1e15)
    per_byte = (large_s - small_s) / (factor * (large - small))
    return Link(latency=max(0.0, small_s - factor * small * per_byte), bytes_per_s=1 / per_byte)


def _measurement(layout: Layout, gathered: list[dict[str, Any]], sizes: Sequence[int] = (),
                 cores: float | None = None) -> Measurement:
    """Fit the costs of rank 0's pipeline from the steps after the first: F, B, the span
    and the step time from the first run, I and W from the ZB-H1 run if there was one,
    F + B at each microbatch size from the size runs (``_size_costs``); with ``cores``,
    each action's time is what it would take alone (``_alone``)."""
    stages = layout.pp * layout.vpp
    runs = {name: run for phase in measured_phases(layout, sizes) for name, run in phase.items()}
    fits = dict(zip(runs, (_fit_run(gathered, run, stages, cores) for run in range(len(runs)))))
    fused, fused_span, _ = fits["fused"]
    split = fits["split"][0] if "split" in fits else None
    hops = [hop for _, _, hop in fits.values() if hop is not None]
    world = len(gathered)
    backward = fused.per_stage("backward", stages)

    def forward_and_backward(name: str) -> float:
        costs = fits[name][0]
        return sum(costs.per_stage("forward", stages) + costs.per_stage("backward", stages))

    return Measurement(
        sizes=_size_costs(layout, {run.microbatch_size: forward_and_backward(name)
                                   for name, run in runs.items() if name.startswith("size")},
                          forward_and_backward("fused")),
        layout=layout, forward=fused.per_stage("forward", stages), backward=backward,
        backward_input=(split.per_stage("backward_input", stages) if split
                        else tuple(b / 2 for b in backward)),
        backward_weight=(split.per_stage("backward_weight", stages) if split
                         else tuple(b / 2 for b in backward)),
        pipeline_s=fused_span, message_s=statistics.median(hops) if hops else None,
        step_s=statistics.median(max(g["runs"][0][index]["seconds"] for g in gathered)
                                 for index in range(1, len(gathered[0]["runs"][0]))),
        message=_link(gathered[0]["message"]),
        all_reduce=_link(gathered[0]["all_reduce"], 2 * (world - 1) / world if world > 1
                         else 1.0),
        optimizer_s_per_parameter=statistics.median(g["optimizer_s_per_parameter"]
                                                    for g in gathered),
        ulysses=_ulysses_links(gathered[0]["ulysses"], cores))


def _size_costs(layout: Layout, measured: dict[int, float], base_s: float
                ) -> tuple[tuple[int, float], ...]:
    """F + B per microbatch size, ``measured`` (the size runs) scaled so that the base size
    costs ``base_s`` (the fused run's): the size runs give ratios, the base run the level;
    without size runs, the base size alone."""
    if not measured:
        return ((layout.microbatch_size, base_s),)
    scale = base_s / measured[layout.microbatch_size]
    return tuple((size, seconds * scale) for size, seconds in sorted(measured.items()))


def _fit_run(gathered: list[dict[str, Any]], run: int, stages: int,
             cores: float | None = None):
    """The costs (``fit_costs``), pipeline span and message time (``fit_message_seconds``)
    of run ``run``'s median step (by span) after the first, on rank 0's pipeline; with
    ``cores``, the costs of actions running alone (``_alone``)."""
    pipeline = gathered[0]["pipeline"]
    steps = [{rank: g["runs"][run][index]["actions"] for rank, g in enumerate(gathered)}
             for index in range(1, len(gathered[0]["runs"][run]))]

    def timeline(records: dict[int, list]) -> Timeline:
        return Timeline.from_records([(gathered[rank]["pp_rank"], *action)
                                      for rank in pipeline for action in records[rank]],
                                     num_ranks=len(pipeline))

    timelines = sorted(((timeline(records), records) for records in steps),
                       key=lambda pair: pair[0].makespan)
    median, records = timelines[len(timelines) // 2]
    alone = median if cores is None else timeline(_alone(records, cores))
    return fit_costs(alone, stages), median.makespan, fit_message_seconds(median)


def _alone(records: dict[int, list], cores: float) -> dict[int, list]:
    """Every rank's actions of one step, each shortened to what it would have taken alone:
    while ``n`` ranks computed at once on ``cores`` cores, each ran at ``min(1, cores / n)``
    (the processor sharing ``simulate(..., cores=)`` assumes)."""
    flat = [(rank, action) for rank, actions in records.items() for action in actions]
    starts = np.array([start for _, (_, start, _) in flat])
    ends = np.array([end for _, (_, _, end) in flat])
    speeds = mean_speeds(starts, ends, cores)
    alone: dict[int, list] = {rank: [] for rank in records}
    for (rank, (text, start, end)), speed in zip(flat, speeds):
        alone[rank].append((text, start, start + (end - start) * speed))
    return alone


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
