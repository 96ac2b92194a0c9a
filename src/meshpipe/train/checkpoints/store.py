"""Checkpoints with ``torch.distributed.checkpoint``, keyed by full-model parameter names.

Each rank writes the parameters of its stages and their AdamW state under the names the
unsplit model uses (``layers.5.attention.wq.weight``), so a checkpoint does not depend on the
layout that wrote it: a run saved with pp 2 resumes with pp 4, another schedule, more
data-parallel replicas or another tensor-parallel size (replicated entries are written once).
Tensor-parallel shards are gathered into the whole tensor for writing, and each rank keeps
its own slice of what it reads.

A checkpoint cannot be torn: every save writes into ``step-NNNNNN.partial-<run id>``, rank 0
adds ``meta.json`` (step, run id, time, the config) once every rank's part is on disk, and
only then renames the directory to ``step-NNNNNN``. A directory of that name holding both
``meta.json`` and dcp's ``.metadata`` is complete by construction; anything else under the
checkpoint root (a save killed half-way, junk) is ignored, and partial directories are removed
by the next save. There is no pointer file: the checkpoint to resume from is the complete one
saved last (``newest``), which is what a new, shorter run into a reused directory needs.
Each run rotates only its own checkpoints (``keep`` newest); other runs' are left alone. A
resumed run keeps the run id of the checkpoint it resumes (``plan.plan_run``), so its saves
and the earlier ones count together.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from meshpipe.comm import ops
from meshpipe.parallel import own_shard, shard_dim, shard_parts, tp_rank_and_size, unshard
from meshpipe.parallel.zero import ADAM_MOMENTS, Bucket, OptimizerMoments
from meshpipe.runtime import activity
from meshpipe.runtime.precision import DynamicLossScaler

FORMAT = 1
META_FILE = "meta.json"
DCP_METADATA = ".metadata"  # written last by dcp's coordinator: the data files are complete
PARTIAL_MARK = ".partial-"
_COMPLETE_NAME = re.compile(r"step-(\d{6,})")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]+")

NamedParameters = Sequence[tuple[str, torch.nn.Parameter]]
_ADAM_STATE = ADAM_MOMENTS


def _gathered(shard: torch.Tensor, dim: int, group: dist.ProcessGroup,
              parts: tuple[int, ...] | None) -> torch.Tensor:
    """The whole tensor of which every rank of ``group`` holds the ``dim`` shard."""
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    ops.all_gather(pieces, shard.contiguous(), group=group)
    return unshard(pieces, dim, parts)


def _whole_shape(param: torch.nn.Parameter, tp_size: int) -> tuple[int, ...] | None:
    dim = shard_dim(param)
    if dim is None or tp_size == 1:
        return None
    shape = list(param.shape)
    shape[dim] *= tp_size
    return tuple(shape)


def _state_dict(parameters: NamedParameters, moments: OptimizerMoments, step: int,
                tp_group: dist.ProcessGroup | None, *, for_loading: bool
                ) -> dict[str, torch.Tensor]:
    """Entries under full-model names; a tensor-parallel shard's entries are whole tensors:
    gathered when saving, empty buffers of the whole shape when loading."""
    _, tp_size = tp_rank_and_size(tp_group)
    state: dict[str, torch.Tensor] = {"meta.step": torch.tensor(step, device="cpu")}
    for name, param in parameters:
        tensors = {f"model.{name}": moments.value_of(param)}
        if param.requires_grad:  # a frozen weight has no optimizer state
            adam = moments.of(param)
            state[f"optim.{name}.step"] = adam["step"]
            tensors.update({f"optim.{name}.{key}": adam[key] for key in _ADAM_STATE})
        whole = _whole_shape(param, tp_size)
        for key, tensor in tensors.items():
            if whole is None:
                state[key] = tensor
            elif for_loading:
                state[key] = torch.empty(whole, dtype=tensor.dtype, device=tensor.device)
            else:
                state[key] = _gathered(tensor, shard_dim(param), tp_group, shard_parts(param))
    return state


def _keep_own_slices(state: dict[str, torch.Tensor], parameters: NamedParameters,
                     moments: OptimizerMoments, tp_group: dist.ProcessGroup | None) -> None:
    """Copy this rank's slice of every whole tensor read for a shard into the shard."""
    tp_rank, tp_size = tp_rank_and_size(tp_group)
    for name, param in parameters:
        if _whole_shape(param, tp_size) is None:
            continue
        dim = shard_dim(param)
        adam = moments.of(param)
        targets = {f"model.{name}": moments.value_of(param),
                   **{f"optim.{name}.{key}": adam[key] for key in _ADAM_STATE}}
        for key, target in targets.items():
            target.copy_(own_shard(state[key], dim, tp_rank, tp_size, shard_parts(param)))


_SCALER_PREFIX = "meta.loss_scaler."


def _scaler_entries(scaler: DynamicLossScaler) -> dict[str, torch.Tensor]:
    return {_SCALER_PREFIX + key: torch.tensor(float(value), device="cpu")
            for key, value in scaler.state_dict().items()}


def step_name(step: int) -> str:
    """The directory name of the complete checkpoint after step ``step`` (steps count from
    1: ``step-000003`` holds the state after three steps)."""
    return f"step-{step:06d}"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its directory and what its ``meta.json`` records."""

    directory: Path
    step: int
    run_id: str
    saved_at: float
    config: dict[str, Any]
    learning_rate: dict[str, Any] | None = None  # the schedule's anchor (learning_rate.py)


def read_info(directory: Path) -> CheckpointInfo | None:
    """The checkpoint in ``directory`` if it is complete (a ``step-NNNNNN`` directory with a
    readable ``meta.json`` and dcp's ``.metadata``), else None."""
    directory = Path(directory)
    if not _COMPLETE_NAME.fullmatch(directory.name) or not directory.is_dir():
        return None
    if not (directory / DCP_METADATA).is_file():
        return None
    try:
        meta = json.loads((directory / META_FILE).read_text())
        return CheckpointInfo(directory=directory, step=int(meta["step"]),
                              run_id=str(meta["run_id"]), saved_at=float(meta["saved_at"]),
                              config=dict(meta["config"]),
                              learning_rate=meta.get("learning_rate"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Every complete checkpoint under ``root``, oldest save first (partial directories,
    directories without ``meta.json`` or ``.metadata`` and other files are left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (read_info(path) for path in root.iterdir())
    return sorted((info for info in found if info is not None),
                  key=lambda info: (info.saved_at, info.step))


def newest(root: Path) -> CheckpointInfo | None:
    """The complete checkpoint saved last under ``root`` (by time, not step: a new, shorter
    run into a reused directory resumes from its own newest save), or None."""
    checkpoints = complete_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def incomplete_checkpoints(root: Path) -> list[Path]:
    """Directories under ``root`` that look like checkpoints but are not complete: saves that
    were interrupted (``*.partial-*``) or ``step-NNNNNN`` without ``meta.json``/``.metadata``."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if path.is_dir() and (
        PARTIAL_MARK in path.name and path.name.startswith("step-")
        or _COMPLETE_NAME.fullmatch(path.name) and read_info(path) is None))


def _fsync_directory(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (where the platform allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    # Some filesystems do not fsync directories; the rename happened all the same.
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def _write_json_durably(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as stream:
        json.dump(value, stream, indent=2)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)
    _fsync_directory(path.parent)


def remove_partial(root: Path) -> list[Path]:
    """Delete the directories of interrupted saves under ``root`` (any run's); return them.
    Only safe while no save into ``root`` is under way (saves are collective, so at the
    start of one every earlier save of the job has ended)."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = [path for path in root.iterdir()
               if path.name.startswith("step-") and PARTIAL_MARK in path.name]
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


def _discard(directory: Path, why: str, run_id: str) -> None:
    """Delete a complete checkpoint without ever leaving a torn one: it is first renamed to
    a partial name (atomic), so a crash half-way through the deletion leaves a directory that
    nothing resumes from and the next save removes."""
    doomed = directory.with_name(f"{directory.name}{PARTIAL_MARK}{run_id}.{why}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _publish(partial: Path, final: Path, run_id: str) -> None:
    """Rename the finished ``partial`` to ``final``; a ``final`` already there (another run
    that reached the same step) is moved aside first and deleted after the rename."""
    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}{PARTIAL_MARK}{run_id}.replaced")
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
    os.replace(partial, final)
    _fsync_directory(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _rotate(root: Path, run_id: str, keep: int) -> list[Path]:
    """Delete this run's checkpoints older than its ``keep`` newest; return them."""
    own = [info for info in complete_checkpoints(root) if info.run_id == run_id]
    expired = [info.directory for info in own[:-keep]]
    for directory in expired:
        _discard(directory, "expired", run_id)
    return expired


def save(root: Path, parameters: NamedParameters, optimizer: torch.optim.Optimizer,
         step: int, tp_group: dist.ProcessGroup | None = None,
         scaler: DynamicLossScaler | None = None, *, config: dict[str, Any], run_id: str,
         keep: int = 2, after_write: Callable[[int], None] | None = None,
         learning_rate: dict[str, Any] | None = None, buckets: Sequence[Bucket] = ()) -> Path:
    """Write the checkpoint of ``step`` under ``root`` whole or not at all (a collective
    call on every rank); return its directory ``root/step-NNNNNN``.

    ``tp_group`` is this rank's tensor-parallel group when its parameters are shards;
    ``scaler`` the fp16 loss scaler whose state a resume continues from. ``config`` (the
    run's TrainConfig as a dict), ``run_id`` and ``learning_rate`` (the schedule's anchor) are
    recorded in ``meta.json``; of the checkpoints of ``run_id`` the ``keep`` newest stay,
    other runs' are never deleted. ``buckets`` are the run's gradient buckets: the optimizer
    states of sharded ones (``--zero 1/2``) are gathered and saved whole, under the same
    full-model names as unsharded ones, so a checkpoint resumes at any zero level.
    ``after_write(step)`` runs on every rank once its part is written, before the checkpoint
    is published (fault injection: a save that dies there leaves only a partial directory).
    """
    state = snapshot(parameters, optimizer, step, tp_group, scaler, buckets)
    return write(root, state, step, config=config, run_id=run_id, keep=keep,
                 after_write=after_write, learning_rate=learning_rate)


def snapshot(parameters: NamedParameters, optimizer: torch.optim.Optimizer, step: int,
             tp_group: dist.ProcessGroup | None = None, scaler: DynamicLossScaler | None = None,
             buckets: Sequence[Bucket] = ()) -> dict[str, torch.Tensor]:
    """What the checkpoint of ``step`` holds, as dcp writes it (a collective where shards
    are gathered: tensor-parallel weights, ``--zero`` states); live tensors, not copies."""
    state = _state_dict(parameters, OptimizerMoments(optimizer, buckets), step, tp_group,
                        for_loading=False)
    if scaler is not None:
        state.update(_scaler_entries(scaler))
    return state


def write(root: Path, state: dict[str, torch.Tensor], step: int, *, config: dict[str, Any],
          run_id: str, keep: int = 2, after_write: Callable[[int], None] | None = None,
          learning_rate: dict[str, Any] | None = None,
          group: dist.ProcessGroup | None = None) -> Path:
    """``state`` (a ``snapshot``) written as the checkpoint of ``step``, whole or not at all,
    coordinating over ``group`` (None: the default group; a background write has a group
    of its own, so that it never interleaves with training's collectives)."""
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id {run_id!r} must be letters, digits, '-' or '_' (it is part "
                         "of a directory name)")
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the checkpoint just written), got {keep}")
    root = Path(root)
    final = root / step_name(step)
    partial = final.with_name(f"{final.name}{PARTIAL_MARK}{run_id}")
    is_main = dist.get_rank() == 0
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        remove_partial(root)
    dist.barrier(group=group)  # the leftovers are gone before any rank writes
    # Into a fresh directory: dcp warns on every rank when it overwrites a checkpoint (what
    # saving a step again after a resume did when saves went straight to step-NNNNNN).
    with warnings.catch_warnings():  # torch 2.9's writer reads its storages the old way
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        _dcp().save(state, checkpoint_id=str(partial), process_group=group)
    if after_write is not None:
        after_write(step)
    dist.barrier(group=group)
    if is_main:
        _write_json_durably(partial / META_FILE, {
            "step": step, "run_id": run_id, "saved_at": time.time(), "config": config,
            "learning_rate": learning_rate, "format": FORMAT})
        _publish(partial, final, run_id)
        _rotate(root, run_id, keep)
    dist.barrier(group=group)
    return final


def load(directory: Path, parameters: NamedParameters, optimizer: torch.optim.Optimizer,
         tp_group: dist.ProcessGroup | None = None,
         scaler: DynamicLossScaler | None = None, *, buckets: Sequence[Bucket] = ()) -> int:
    """Fill parameters and optimizer state in place from the checkpoint in ``directory``
    (pick it with ``newest``); return its step.

    A ``scaler`` continues from the saved loss-scaler state when the checkpoint has one (an
    fp16 run resumed from an fp32 or bf16 checkpoint starts at the scaler's initial scale).
    """
    directory = Path(directory)
    if not (directory / DCP_METADATA).is_file():
        raise FileNotFoundError(f"{directory} is not a complete checkpoint (no {DCP_METADATA}): "
                                "resume from one that checkpoint.newest() lists")
    moments = OptimizerMoments(optimizer, buckets, for_loading=True)
    state = _state_dict(parameters, moments, -1, tp_group, for_loading=True)
    saved_keys = _dcp().FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    scaler_entries = _scaler_entries(scaler) if scaler is not None else {}
    has_scaler = bool(scaler_entries) and all(key in saved_keys for key in scaler_entries)
    if has_scaler:
        state.update(scaler_entries)
    _dcp().load(state, checkpoint_id=str(directory))
    _keep_own_slices(state, parameters, moments, tp_group)
    moments.loaded()
    if has_scaler:
        saved = {key.removeprefix(_SCALER_PREFIX): state[key].item() for key in scaler_entries}
        scaler.load_state_dict(saved)
    return int(state["meta.step"])


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported when a checkpoint is first written or
    read: the import (DTensor's operator tables) took about 1 s of every rank's 3.6 s start
    on this project's CPUs, in runs that save nothing or only later."""
    import torch.distributed.checkpoint as dcp

    return dcp


def find(path: Path) -> CheckpointInfo:
    """The complete checkpoint at ``path``: the checkpoint itself, or the newest under a
    checkpoint root or a run's out-dir; a one-line ValueError if there is none."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist: give a step-NNNNNN directory, or the out-dir "
                         "of a run that saved one")
    found = read_info(path) or newest(path) or newest(path / "checkpoint")
    if found is None:
        raise ValueError(f"{path} holds no complete checkpoint: give a step-NNNNNN directory, "
                         "or the out-dir of a run that saved one")
    return found


def read_tensors(directory: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a complete checkpoint whose key starts with ``prefix`` (weights are
    ``model.<name>``; the optimizer's and the loss scale's have keys of their own), whole,
    read in this one process (no process group)."""
    directory = Path(directory)
    if read_info(directory) is None:
        raise ValueError(f"{directory} is not a complete checkpoint (no {META_FILE} and "
                         f"{DCP_METADATA}): give a step-NNNNNN directory under "
                         "<out-dir>/checkpoint")
    saved = _dcp().FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype,
                             device="cpu")
             for key, entry in saved.items()
             if key.startswith(prefix) and hasattr(entry, "size")}
    with warnings.catch_warnings():  # dcp warns that it loads in one process: the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        _dcp().load(state, checkpoint_id=str(directory), no_dist=True)
    return state


def read_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every model weight of a complete checkpoint, whole, by full-model name: what an
    export writes."""
    return {key.removeprefix("model."): tensor
            for key, tensor in read_tensors(directory, "model.").items()}


class Checkpointer:
    """A run's saves and its resume, marked in the rank's activity record with ``patience``
    seconds (a save or load of a large model is slow, not hung). ``saved_step`` is the
    number of the newest step on disk of this run (the steps done before a resume)."""

    def __init__(self, root: Path, parameters: NamedParameters,
                 optimizer: torch.optim.Optimizer, tp_group: dist.ProcessGroup | None,
                 scaler: DynamicLossScaler | None, *, config: dict[str, Any], run_id: str,
                 keep: int, patience: float, after_write: Callable[[int], None] | None = None,
                 learning_rate: dict[str, Any] | None = None, buckets: Sequence[Bucket] = (),
                 background: bool = False):
        from meshpipe.train.checkpoints.background import BackgroundWrites

        self.root = Path(root)
        # --checkpoint-async: writes go to a thread (``background``); None: synchronous.
        self.writes = BackgroundWrites() if background else None
        self.parameters = parameters
        self.optimizer = optimizer
        self.tp_group = tp_group
        self.scaler = scaler
        self.config = config
        self.run_id = run_id
        self.keep = keep
        self.patience = patience
        self.after_write = after_write
        self.learning_rate = learning_rate
        self.buckets = buckets
        self.saved_step = 0

    def load(self, directory: Path, start_step: int) -> None:
        with activity.doing("loading the checkpoint", limit=self.patience):
            load(directory, self.parameters, self.optimizer, self.tp_group, self.scaler,
                 buckets=self.buckets)
        self.saved_step = start_step

    def save(self, step: int) -> None:
        """The checkpoint after step number ``step`` (that many steps done), written whole
        or not at all (``save``); with background writes, snapshotted to the host and
        written while training goes on (``background``)."""
        with activity.doing(f"saving the checkpoint of step {step}", limit=self.patience,
                            action="checkpoint save"):
            if self.writes is not None:
                self.writes.wait()  # at most one write in flight
            state = snapshot(self.parameters, self.optimizer, step, self.tp_group,
                             self.scaler, self.buckets)
            options = dict(config=self.config, run_id=self.run_id, keep=self.keep,
                           after_write=self.after_write, learning_rate=self.learning_rate)
            if self.writes is None:
                write(self.root, state, step, **options)
            else:
                self.writes.start(state, step, lambda copy, group: write(
                    self.root, copy, step, group=group, **options))
        self.saved_step = step

    def finish(self) -> None:
        """Wait for a background write still in flight (the end of training)."""
        if self.writes is not None:
            with activity.doing(f"writing the checkpoint of step {self.writes.step}",
                                limit=self.patience, action="checkpoint save"):
                self.writes.wait()
