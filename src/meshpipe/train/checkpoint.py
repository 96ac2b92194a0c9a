"""Checkpoints with ``torch.distributed.checkpoint``, keyed by full-model parameter names.

Each rank writes the parameters of its stages and their AdamW state under the names the
unsplit model uses (``layers.5.attention.wq.weight``), so a checkpoint does not depend on the
layout that wrote it: a run saved with pp 2 resumes with pp 4, another schedule or more
data-parallel replicas (replicated entries are written once).

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


def _state_dict(parameters: NamedParameters, optimizer: torch.optim.Optimizer,
                step: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {"meta.step": torch.tensor(step)}
    for name, param in parameters:
        state[f"model.{name}"] = param.data
        adam = _adam_state(optimizer, param)
        state[f"optim.{name}.step"] = adam["step"]
        for key in _ADAM_STATE:
            state[f"optim.{name}.{key}"] = adam[key]
    return state


def save(root: Path, parameters: NamedParameters, optimizer: torch.optim.Optimizer,
         step: int) -> Path:
    """Write the checkpoint of ``step`` under ``root`` (a collective call on every rank)."""
    root = Path(root)
    directory = root / f"step-{step:06d}"
    dcp.save(_state_dict(parameters, optimizer, step), checkpoint_id=str(directory))
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


def load(root: Path, parameters: NamedParameters, optimizer: torch.optim.Optimizer) -> int:
    """Fill parameters and optimizer state in place from the newest checkpoint; return its step."""
    directory = latest(root)
    if directory is None:
        raise FileNotFoundError(f"no checkpoint in {root}: run once without --resume, "
                                f"or point --out-dir at the run to continue")
    state = _state_dict(parameters, optimizer, step=-1)
    dcp.load(state, checkpoint_id=str(directory))
    return int(state["meta.step"])
