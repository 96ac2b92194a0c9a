"""Decide a run once: everything that follows from a config, before any rank starts.

``plan_run(config)`` is what the launcher does before starting processes: it checks what can
fail in one line (``MESHPIPE_FAULT``, the layout against the model's sizes and heads, the
output directory, a ``--resume``, the model and data sources, whose text it tokenizes into
the cache), builds the schedule and its forward-only twin, splits the layers over the
stages, places the ranks on devices and names the run. The ranks receive the ``RunPlan``
and build from it; none rebuilds or re-decides. Under torchrun every rank is its own
launcher and plans identically.

``plan_for_rank`` makes the same decisions for a rank that no launcher planned for (a
``Trainer`` built directly, as tests and notebooks do): no output checks, no tokenizing.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from meshpipe.schedules import Schedule, build
from meshpipe.schedules.placement import (layers_beside_first_cost, stage_layers,
                                          wraparound_placement)
from meshpipe.train.checkpoints import store as checkpoint
from meshpipe.train.checkpoints.resume import ResumePlan, plan_resume
from meshpipe.train.config import TrainConfig
from meshpipe.train.outputs import tensorboard
from meshpipe.train.run import sources
from meshpipe.train.run.devices import DevicePlan, local_ranks, plan_devices
from meshpipe.train.supervisor import faults
from meshpipe.train.supervisor.launch import PROCESS_GROUP_TIMEOUT_S

# With --check, the other ranks wait while rank 0 recomputes the whole step in one process.
CHECK_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class RunPlan:
    """One run, decided: what every rank builds from.

    ``schedule`` is the training schedule and ``eval_schedule`` its forward-only twin (both
    compute-only; an executor lowers its own), ``layers`` each stage's layer count,
    ``devices`` where the ranks compute and how they talk, ``resume`` the checkpoint to
    continue from (None for a fresh run), ``run_id`` the name of this run's own checkpoints
    (the only ones it rotates), ``notes`` the one-line notes for the user.
    """

    config: TrainConfig
    schedule: Schedule
    eval_schedule: Schedule
    layers: tuple[int, ...]
    devices: DevicePlan
    resume: ResumePlan | None = None
    run_id: str = "local"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def process_group_timeout(self) -> float:
        return process_group_timeout(self.config)


def plan_run(config: TrainConfig) -> RunPlan:
    """The launcher's plan (see the module docstring); a one-line ValueError for a run that
    cannot work, before any process starts."""
    faults.check_environment(config.world_size)
    schedule = build_schedule(config)
    check_model_layout(config, schedule)
    devices = plan_devices(config.device, config.backend, local_ranks(config.world_size))
    out = check_out_dir(config.out_dir)
    resume = plan_resume(config) if config.resume else None
    data_notes = sources.check_sources(config)
    if config.tensorboard:
        tensorboard.check_available()
    notes = list(resume.notes if resume is not None else _earlier_checkpoints_note(out))
    notes.extend(data_notes)
    for notice in (devices.notice(), _zero_notice(config), strict_notice()):
        if notice:
            notes.append(notice)
    # A resumed run continues its checkpoint's run: --keep-checkpoints counts them together.
    run_id = resume.checkpoint.run_id if resume is not None else uuid.uuid4().hex[:12]
    return _decided(config, schedule, devices, resume, run_id, tuple(notes))


def strict_notice() -> str | None:
    """The one line that says the strict communication mode is on."""
    from meshpipe.comm import strict

    if not strict.requested():
        return None
    return (f"strict communication mode on ({strict.ENVIRONMENT_VARIABLE}=1): every pair's "
            "sends and receives and every group's collectives run in posting order, as NCCL "
            "runs them; an order that would deadlock there fails here (a test mode: slower)")


def _zero_notice(config: TrainConfig) -> str | None:
    """What --zero does where a weight has no other replica to shard over."""
    replicas = config.dp * config.layout.cp
    if config.zero == 0 or replicas > 1:
        return None
    return (f"--zero {config.zero}: each weight has one replica (dp x cp = 1), so there is "
            "nothing to shard; the run is the same as --zero 0")


def plan_for_rank(config: TrainConfig, resume: ResumePlan | None = None,
                  run_id: str = "local", devices: DevicePlan | None = None) -> RunPlan:
    """The plan of a rank that no launcher planned for, on the process group it is in:
    ``devices`` default to ``config.device`` on that group's backend, and with
    ``config.resume`` and no ``resume`` given, the newest complete checkpoint."""
    if devices is None:
        backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        devices = plan_devices(config.device, backend, local_ranks(dist.get_world_size()))
    if resume is None and config.resume:
        resume = plan_resume(config)
    return _decided(config, build_schedule(config), devices, resume, run_id, ())


def _decided(config: TrainConfig, schedule: Schedule, devices: DevicePlan,
             resume: ResumePlan | None, run_id: str, notes: tuple[str, ...]) -> RunPlan:
    return RunPlan(config=config, schedule=schedule,
                   eval_schedule=build_schedule(config, forward_only=True),
                   layers=tuple(layers_per_stage(config, schedule)), devices=devices,
                   resume=resume, run_id=run_id, notes=notes)


def build_schedule(config: TrainConfig, forward_only: bool = False) -> Schedule:
    """The run's schedule; fails if the model has too few layers for its stages."""
    schedule = build(config.schedule, config.pp, config.microbatches,
                     stages_per_rank=config.vpp, placement=config.placement_arg,
                     forward_only=forward_only)
    layers_per_stage(config, schedule)
    return schedule


def layers_per_stage(config: TrainConfig, schedule: Schedule) -> list[int]:
    """Each stage's layer count (``placement.stage_layers``); a one-line ValueError when
    the model has too few layers for the stages."""
    layers = sources.num_layers(config)
    if config.stage_layers:
        return given_layers(config, layers, schedule.num_stages)
    counts = stage_layers(layers, schedule.placement)
    tower = sources.tower_cost(config)
    if counts is not None and tower and layers >= schedule.num_stages:
        return layers_beside_first_cost(layers, schedule.num_stages, tower)
    if counts is not None:
        return counts
    stages = schedule.num_stages
    wraps_around = schedule.placement == wraparound_placement(schedule.num_ranks)
    needed = stages - 1 if wraps_around else stages
    what = (f"the {layers} layers of --model {config.model}" if config.model
            else f"--layers {layers}")
    raise ValueError(f"{what} cannot fill the {stages} stages of {config.schedule} at pp "
                     f"{config.pp} x vpp {config.vpp}; use at least {needed} layers, or fewer "
                     "stages (--pp, --vpp)")


def given_layers(config: TrainConfig, layers: int, stages: int) -> list[int]:
    """``--stage-layers``: a count per stage, the first written ``vision+N`` (or ``vision``
    for none) where a vision-language model's tower shares it; a one-line ValueError for
    counts that do not fit the model and the stages."""
    text = config.stage_layers
    entries = text.split(",")
    tower = entries[0] == "vision" or entries[0].startswith("vision+")
    has_tower = bool(config.model) and sources.model_info(config.model).vision is not None
    if tower and not has_tower:
        raise ValueError(f"--stage-layers {text} names a vision tower, which the model has not: "
                         "give the layer counts alone")
    if tower:
        entries[0] = entries[0][len("vision+"):] if "+" in entries[0] else "0"
    try:
        counts = [int(entry) for entry in entries]
    except ValueError:
        raise ValueError(f"--stage-layers {text} is not a list of layer counts: write e.g. "
                         "vision+10,14 or 12,12") from None
    fewest = [0 if stage == 0 and has_tower else 1 for stage in range(len(counts))]
    if (len(counts) != stages or sum(counts) != layers
            or any(count < low for count, low in zip(counts, fewest))):
        raise ValueError(f"--stage-layers {text} must give each of the {stages} stages at least "
                         f"one layer (the tower's may have none) and all {layers} layers of the "
                         "model")
    return counts


def check_model_layout(config: TrainConfig, schedule: Schedule) -> None:
    """Fail before any process starts when the model cannot be split as the layout asks."""
    layout = config.layout
    for tp in sorted({layout.tp_of(p) for p in range(config.pp)}):
        if tp > 1:
            sources.check_tensor_parallel(config, tp)
        if config.cp_ulysses > 1:
            sources.check_ulysses(config, tp)
    if config.tie_embeddings and config.stage_tp:
        first, last = schedule.placement[0], schedule.placement[-1]
        if layout.tp_of(first) != layout.tp_of(last):
            raise ValueError(
                f"--tie-embeddings shares the embedding (pipeline rank {first}, --stage-tp "
                f"{layout.tp_of(first)}) with the head (pipeline rank {last}, --stage-tp "
                f"{layout.tp_of(last)}): give both the same tensor-parallel size")


def process_group_timeout(config: TrainConfig) -> float:
    """Longer than the hang timeout, so the launcher explains a hang before a collective or
    a receive gives up on its own (and longer still while --check runs on rank 0)."""
    timeout = max(PROCESS_GROUP_TIMEOUT_S, 2 * config.hang_timeout + 30)
    return max(timeout, CHECK_TIMEOUT_S) if config.check else timeout


def check_out_dir(out_dir: str) -> Path:
    """The output directory, created; a one-line ValueError if it cannot hold the run's
    files (a file in its place, no permission, a full disk) instead of failing at the first
    write after hours of training."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {out} is a file, not a directory: give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".meshpipe-write-probe-{os.getpid()}"
        with open(probe, "wb") as stream:
            stream.write(b"\0" * 65536)
            stream.flush()
            os.fsync(stream.fileno())
        probe.unlink()
    except OSError as error:
        raise ValueError(f"--out-dir {out} is not writable ({error.strerror or error}): give a "
                         "directory this user can write, on a disk with free space") from None
    return out


def _earlier_checkpoints_note(out: Path) -> list[str]:
    """A fresh run leaves the checkpoints of earlier runs in its --out-dir alone: say so."""
    earlier = checkpoint.complete_checkpoints(out / "checkpoint")
    if not earlier:
        return []
    return [f"{out / 'checkpoint'} holds {len(earlier)} checkpoint(s) of earlier runs; this "
            "run leaves them (one of the same step is replaced) and --resume will take this "
            "run's newest; remove them or use another --out-dir to free the space"]
