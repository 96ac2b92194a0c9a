"""Checkpoints with ``torch.distributed.checkpoint``, keyed by full-model parameter names.

Each rank writes the parameters of its stages and their AdamW state under the names the
unsplit model uses (``layers.5.attention.wq.weight``), so a checkpoint does not depend on the
layout that wrote it: a run saved with pp 2 resumes with pp 4, another schedule, more
data-parallel replicas or another tensor-parallel size (replicated entries are written once).
Tensor-parallel shards are gathered into the whole tensor for writing, and each rank keeps
its own slice of what it reads.

Every save goes to its own ``step-NNNNNN`` directory; the file ``latest`` names the newest
complete one and is only rewritten after the save finished, so an interrupted save never
damages the checkpoint a resume would use. The two newest checkpoints are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshpipe.parallel import shard_dim, tp_rank_and_size
from meshpipe.runtime.precision import DynamicLossScaler

NamedParameters = Sequence[tuple[str, torch.nn.Parameter]]
_ADAM_STATE = ("exp_avg", "exp_avg_sq")
KEEP_LAST = 2


def _adam_state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> dict:
    """The parameter's AdamW state, created empty if the optimizer has not stepped yet."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0)
        for key in _ADAM_STATE:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _gathered(shard: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor of which every rank of ``group`` holds the ``dim`` slice."""
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    return torch.cat(pieces, dim)


def _whole_shape(param: torch.nn.Parameter, tp_size: int) -> tuple[int, ...] | None:
    dim = shard_dim(param)
    if dim is None or tp_size == 1:
        return None
    shape = list(param.shape)
    shape[dim] *= tp_size
    return tuple(shape)


def _state_dict(parameters: NamedParameters, optimizer: torch.optim.Optimizer, step: int,
                tp_group: dist.ProcessGroup | None, *, for_loading: bool
                ) -> dict[str, torch.Tensor]:
    """Entries under full-model names; a tensor-parallel shard's entries are whole tensors:
    gathered when saving, empty buffers of the whole shape when loading."""
    _, tp_size = tp_rank_and_size(tp_group)
    state: dict[str, torch.Tensor] = {"meta.step": torch.tensor(step)}
    for name, param in parameters:
        adam = _adam_state(optimizer, param)
        state[f"optim.{name}.step"] = adam["step"]
        tensors = {f"model.{name}": param.data,
                   **{f"optim.{name}.{key}": adam[key] for key in _ADAM_STATE}}
        whole = _whole_shape(param, tp_size)
        for key, tensor in tensors.items():
            if whole is None:
                state[key] = tensor
            elif for_loading:
                state[key] = torch.empty(whole, dtype=tensor.dtype, device=tensor.device)
            else:
                state[key] = _gathered(tensor, shard_dim(param), tp_group)
    return state


def _keep_own_slices(state: dict[str, torch.Tensor], parameters: NamedParameters,
                     optimizer: torch.optim.Optimizer, tp_group: dist.ProcessGroup | None
                     ) -> None:
    """Copy this rank's slice of every whole tensor read for a shard into the shard."""
    tp_rank, tp_size = tp_rank_and_size(tp_group)
    for name, param in parameters:
        if _whole_shape(param, tp_size) is None:
            continue
        dim = shard_dim(param)
        adam = optimizer.state[param]
        targets = {f"model.{name}": param.data,
                   **{f"optim.{name}.{key}": adam[key] for key in _ADAM_STATE}}
        for key, target in targets.items():
            target.copy_(state[key].chunk(tp_size, dim)[tp_rank])


_SCALER_PREFIX = "meta.loss_scaler."


def _scaler_entries(scaler: DynamicLossScaler) -> dict[str, torch.Tensor]:
    return {_SCALER_PREFIX + key: torch.tensor(float(value))
            for key, value in scaler.state_dict().items()}


def save(root: Path, parameters: NamedParameters, optimizer: torch.optim.Optimizer,
         step: int, tp_group: dist.ProcessGroup | None = None,
         scaler: DynamicLossScaler | None = None) -> Path:
    """Write the checkpoint of ``step`` under ``root`` (a collective call on every rank).

    ``tp_group`` is this rank's tensor-parallel group when its parameters are shards;
    ``scaler`` the fp16 loss scaler whose state a resume continues from.
    """
    root = Path(root)
    directory = root / f"step-{step:06d}"
    state = _state_dict(parameters, optimizer, step, tp_group, for_loading=False)
    if scaler is not None:
        state.update(_scaler_entries(scaler))
    dcp.save(state, checkpoint_id=str(directory))
    dist.barrier()
    if dist.get_rank() == 0:
        pointer = root / "latest.tmp"
        pointer.write_text(directory.name)
        pointer.replace(root / "latest")
        for old in expired(root):
            shutil.rmtree(old)
    dist.barrier()
    return directory


def expired(root: Path, keep: int = KEEP_LAST) -> list[Path]:
    """Checkpoint directories older than the ``keep`` newest (by step number, not name)."""
    by_step = sorted(Path(root).glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
    return by_step[:-keep]


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = Path(root) / "latest"
    return Path(root) / pointer.read_text().strip() if pointer.exists() else None


def load(root: Path, parameters: NamedParameters, optimizer: torch.optim.Optimizer,
         tp_group: dist.ProcessGroup | None = None,
         scaler: DynamicLossScaler | None = None) -> int:
    """Fill parameters and optimizer state in place from the newest checkpoint; return its step.

    A ``scaler`` continues from the saved loss-scaler state when the checkpoint has one (an
    fp16 run resumed from an fp32 or bf16 checkpoint starts at the scaler's initial scale).
    """
    directory = latest(root)
    if directory is None:
        raise FileNotFoundError(f"no checkpoint in {root}: run once without --resume, "
                                f"or point --out-dir at the run to continue")
    state = _state_dict(parameters, optimizer, -1, tp_group, for_loading=True)
    saved_keys = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    scaler_entries = _scaler_entries(scaler) if scaler is not None else {}
    has_scaler = bool(scaler_entries) and all(key in saved_keys for key in scaler_entries)
    if has_scaler:
        state.update(scaler_entries)
    dcp.load(state, checkpoint_id=str(directory))
    _keep_own_slices(state, parameters, optimizer, tp_group)
    if has_scaler:
        saved = {key.removeprefix(_SCALER_PREFIX): state[key].item() for key in scaler_entries}
        scaler.load_state_dict(saved)
    return int(state["meta.step"])
