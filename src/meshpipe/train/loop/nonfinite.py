"""A step whose loss or gradients are not finite: every rank learns where it showed first,
and the step is skipped, or the run stops once more than ``--skip-nonfinite`` happened in a
row (before anything reaches the weights or a checkpoint)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from meshpipe.comm import ops
from meshpipe.train.config import TrainConfig


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite more often in a row than allowed.
    ``blamed_rank`` is the first rank where it showed; ``where`` the step and stage."""

    def __init__(self, message: str, blamed_rank: int, where: str):
        super().__init__(message)
        self.blamed_rank = blamed_rank
        self.where = where


class NonFiniteSteps:
    """Counts the non-finite steps in a row and decides each one (``skip_or_stop``)."""

    def __init__(self, config: TrainConfig, stages_of: Callable[[int], Any],
                 device: torch.device, is_main: bool):
        self.config = config
        self.stages_of = stages_of
        self.device = device
        self.is_main = is_main
        self.in_a_row = 0

    def finite(self) -> None:
        self.in_a_row = 0

    def skip_or_stop(self, step: int, locally_finite: tuple[bool, bool | torch.Tensor],
                     loss: float, grad_norm: float | None, collective) -> None:
        """Step index ``step`` was not finite: gather where (inside ``collective(what)``),
        then skip it with a note or raise ``NonFiniteError``."""
        loss_finite, grads_finite = locally_finite
        flags = torch.stack([torch.tensor(not loss_finite, device=self.device),
                             ~torch.as_tensor(grads_finite, device=self.device)]).int()
        gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
        with collective("the non-finite report"):
            ops.all_gather(gathered, flags)
        bad_loss = [r for r, f in enumerate(gathered) if f[0]]
        bad_grads = [r for r, f in enumerate(gathered) if f[1]]
        what, value = ("loss", loss) if bad_loss or not math.isfinite(loss) else (
            "gradient norm", grad_norm)
        blamed = (bad_loss or bad_grads or [0])[0]
        stages = list(self.stages_of(self.config.layout.coords(blamed)["pp"]))
        where = f"step {step + 1}, stage {stages[0] if len(stages) == 1 else stages}"
        message = f"step {step + 1}: the {what} is {value} (first seen on rank {blamed}, {where})"
        self.in_a_row += 1
        allowed = self.config.skip_nonfinite
        if self.in_a_row > allowed:
            raise NonFiniteError(
                f"{message}; stopped before it reached the weights or a checkpoint (the last "
                f"checkpoint is intact): find the cause, or let --skip-nonfinite N skip up to N "
                f"such steps in a row", blamed, where)
        if self.is_main:
            tqdm.write(f"meshpipe: {message}; step skipped ({self.in_a_row} in a "
                       f"row, --skip-nonfinite {allowed})")
