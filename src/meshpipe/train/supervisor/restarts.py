"""``--max-restarts N``: a failed job starts again by itself from its newest checkpoint.

The local launcher stops every rank on a fault as without restarts (``launch``); then, while
restarts are left, the job is planned again with ``--resume`` (or from step 1 when no
checkpoint was saved yet) and started, with one line saying which fault, from which step and
how many restarts are left. Under torchrun, whose own ``--max-restarts`` starts the script
again, a restarted script (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the run's newest
checkpoint by itself (``resumed_under_torchrun``).

A crash loop stops the restarts: when ``CRASH_LOOP_RESTARTS`` restarts in a row gained no step
(the job failed having done no more steps than at the failure before), the job ends with
``CrashLoop`` and the exit status ``CRASH_LOOP_EXIT_STATUS``.
"""

from __future__ import annotations

import dataclasses
import os

from meshpipe.train.checkpoints.resume import checkpoint_root
from meshpipe.train.checkpoints.store import newest
from meshpipe.train.config import TrainConfig
from meshpipe.train.outputs.metrics import steps_done
from meshpipe.train.supervisor.launch import LaunchError

CRASH_LOOP_RESTARTS = 2
CRASH_LOOP_EXIT_STATUS = 3


class CrashLoop(LaunchError):
    """Restarts that gained no step: the fault comes back at the same place."""

    exit_code = CRASH_LOOP_EXIT_STATUS


class Restarts:
    """The restarts of one job: ``after(error)`` decides what follows a failure."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.done = 0
        self.failed_at: list[int] = []  # the steps done at each failure
        self.without_gain = 0

    def after(self, error: LaunchError) -> TrainConfig:
        """The config of the next attempt, with its one line printed; ``error`` raised again
        when no restart is left, ``CrashLoop`` when restarts gain nothing."""
        config = self.config
        reached = steps_done(config.out_dir)
        if self.failed_at and reached <= self.failed_at[-1]:
            self.without_gain += 1
        else:
            self.without_gain = 0
        self.failed_at.append(reached)
        if self.done >= config.max_restarts:
            raise error
        if self.without_gain >= CRASH_LOOP_RESTARTS:
            raise CrashLoop(
                f"crash loop: {self.without_gain + 1} failures in a row at step {reached + 1} "
                f"gained no step, so the job stops after {self.done} of --max-restarts "
                f"{config.max_restarts} restarts (exit status {CRASH_LOOP_EXIT_STATUS}); the "
                f"last failure: {error}", error.rank, error.details)
        self.done += 1
        saved = newest(checkpoint_root(config))
        where = (f"resuming from step {saved.step} ({saved.directory.name})" if saved
                 else "starting again from step 1 (no checkpoint saved yet)")
        print(f"meshpipe: restart {self.done} of {config.max_restarts} after: {error}; "
              f"{where}", flush=True)
        return dataclasses.replace(config, resume=saved is not None, check=False)


def resumed_under_torchrun(config: TrainConfig) -> TrainConfig:
    """Under torchrun's ``--max-restarts``, a restarted script continues from the run's
    newest checkpoint (the first start runs as asked)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or config.resume:
        return config
    saved = newest(checkpoint_root(config))
    if saved is None:
        return config
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"meshpipe: torchrun restarted the job (restart "
              f"{os.environ['TORCHELASTIC_RESTART_COUNT']}); resuming from step {saved.step} "
              f"({saved.directory.name})", flush=True)
    return dataclasses.replace(config, resume=True, check=False)
