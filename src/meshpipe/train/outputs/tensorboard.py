"""``--tensorboard``: every metric of ``metrics.jsonl`` as TensorBoard scalars under
``<out-dir>/tensorboard``, written by rank 0 through torch's own ``SummaryWriter``.

Each record's numeric values become scalars at the record's step, tagged by what they are:
``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/step_seconds``,
``train/tokens_per_s``, ``train/loss_scale``, ``train/skipped`` (0 or 1), ``val/loss``,
``moe/<count>``, ``bubble/measured``, ``bubble/simulated`` and, for a mixture of sources,
``data/share_<source>``, ``data/loss_<source>``, ``val/share_<source>``,
``val/loss_<source>``. A value that was not finite
(null in the JSON) is left out. A resumed run writes a new event file in the same directory
and purges what the interrupted run logged from its first step on, so the curves continue
as one.

The ``tensorboard`` package comes with ``pip install 'meshpipe[tb]'``; ``check_available``
says so in one line before any process starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

DIRECTORY = "tensorboard"
_MOE_KEYS = ("dropped_tokens",)


def check_available() -> None:
    """A one-line ValueError when the tensorboard package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package: pip install "
                         "'meshpipe[tb]' (or pip install tensorboard), or drop --tensorboard")


def tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key."""
    for prefix, group in (("val_", "val"), ("bubble_", "bubble"), ("data_", "data")):
        if key.startswith(prefix):
            return f"{group}/{key[len(prefix):]}"
    if key.startswith("moe_") or "expert" in key or key in _MOE_KEYS:
        return f"moe/{key}"
    return f"train/{key}"


class TensorBoardLog:
    """Scalars of metrics records into ``out_dir/tensorboard``; ``start_step`` > 0 (the steps
    a resumed run has done) continues the curves of an earlier run there (its events of
    later steps are purged)."""

    def __init__(self, out_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(out_dir) / DIRECTORY
        self._writer = SummaryWriter(log_dir=str(self.directory),
                                     purge_step=start_step + 1 if start_step else None)

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key == "step" or value is None or isinstance(value, str):
                continue
            self._writer.add_scalar(tag(key), float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
