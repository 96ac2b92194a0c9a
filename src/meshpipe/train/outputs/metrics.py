"""``metrics.jsonl``: one strict-JSON line per step, per evaluation and for the timeline
step's bubble (measured and simulated), written as it happens.

A run that fails or is stopped keeps every line it wrote. A resumed run keeps the lines of
the steps before its checkpoint (a run that died after its last save wrote some it will
redo) and appends its own, so the file holds one history however often the run was resumed.
Values that are not finite (a NaN loss) are written as null: the file is strict JSON.
With ``tensorboard`` every record also goes to TensorBoard (``train.tensorboard``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

FILE_NAME = "metrics.jsonl"


def strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    return json.dumps(strict(value), allow_nan=False, **options)


class MetricsLog:
    """Appends records to ``out_dir/metrics.jsonl`` (and with ``tensorboard`` to TensorBoard
    scalars); ``start_step`` > 0 (the steps a resumed run has done) continues a history: its
    records of steps 1 to ``start_step`` are kept."""

    def __init__(self, out_dir: Path, start_step: int, *, tensorboard: bool = False):
        self.path = Path(out_dir) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)  # a Trainer used directly
        kept = [r for r in read(self.path) if r["step"] <= start_step] if start_step else []
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text("".join(dumps(r) + "\n" for r in kept))
        os.replace(temporary, self.path)
        self._stream = open(self.path, "a", encoding="utf-8")
        self._board = None
        if tensorboard:
            from meshpipe.train.outputs.tensorboard import TensorBoardLog

            self._board = TensorBoardLog(out_dir, start_step)

    def append(self, record: dict[str, Any]) -> None:
        self._stream.write(dumps(record) + "\n")
        self._stream.flush()
        if self._board is not None:
            self._board.write(strict(record))

    def close(self) -> None:
        self._stream.close()
        if self._board is not None:
            self._board.close()


def read(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none if it does not exist); a line cut by a crash
    mid-write is dropped."""
    if not Path(path).exists():
        return []
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def steps_done(out_dir: str | Path) -> int:
    """The number of the last training step ``out_dir/metrics.jsonl`` records (0: none)."""
    return max((record["step"] for record in read(Path(out_dir) / FILE_NAME)
                if "loss" in record), default=0)
