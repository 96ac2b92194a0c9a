"""The learning-rate schedule: linear warm-up to ``--lr``, then a cosine decay that reaches
``--min-lr`` at ``--steps``, and how a resume that changes ``--steps`` re-spans it.

The decay's *progress* runs from 0 (the end of warm-up, rate ``lr``) to 1 (step ``steps``,
rate ``min_lr``); the rate is ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``.
Progress is linear between an *anchor* (a step and the progress there) and 1 at ``steps``.
A fresh run anchors at the end of warm-up with progress 0, which is the plain cosine.

A resume at step ``s`` with another ``--steps`` re-anchors at the last step trained, ``s - 1``,
with the progress the saved schedule had there, and spreads the rest of the decay over the
new remaining steps: extending a run slows the decay down from where it stands, shortening
it speeds it up, and neither jumps. With the same ``--steps`` re-anchoring gives the same
rates, so the anchor is kept. The anchor is saved in each checkpoint, so resumes chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshpipe.train.config import TrainConfig


@dataclass(frozen=True)
class LearningRate:
    lr: float
    min_lr: float
    warmup_steps: int
    steps: int
    anchor_step: int
    anchor_progress: float = 0.0

    @classmethod
    def of(cls, config: TrainConfig, anchor: dict[str, Any] | None = None) -> "LearningRate":
        """``config``'s schedule, anchored where ``anchor`` (a checkpoint's record) says, or
        at the end of warm-up."""
        where = anchor or {"step": config.warmup_steps, "progress": 0.0}
        return cls(config.lr, config.min_lr, config.warmup_steps, config.steps,
                   int(where["step"]), float(where["progress"]))

    @property
    def anchor(self) -> dict[str, Any]:
        """The anchor as a checkpoint records it."""
        return {"step": self.anchor_step, "progress": self.anchor_progress}

    def progress(self, step: int) -> float:
        """How far the decay is at ``step``: 0 at the anchor's start, 1 at ``steps``."""
        if step <= self.anchor_step:
            return self.anchor_progress
        span = max(1, self.steps - self.anchor_step)
        return min(1.0, self.anchor_progress
                   + (1.0 - self.anchor_progress) * (step - self.anchor_step) / span)

    def at(self, step: int) -> float:
        """The learning rate of ``step`` (counted from 0)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        cosine = 0.5 * (1 + math.cos(math.pi * self.progress(step)))
        return self.min_lr + (self.lr - self.min_lr) * cosine

    def respanned(self, start_step: int, config: TrainConfig) -> "LearningRate":
        """The schedule of a run resumed at ``start_step`` with ``config``: re-anchored at the
        last step trained where its ``--steps`` differs and the decay had begun by then."""
        last_trained = start_step - 1
        anchor = self.anchor
        if config.steps != self.steps and last_trained > self.anchor_step:
            anchor = {"step": last_trained, "progress": self.progress(last_trained)}
        return LearningRate.of(config, anchor)

    def describe_change(self, start_step: int, new: "LearningRate") -> str:
        """What a changed ``--steps`` does to the rate, in one clause."""
        if start_step < new.warmup_steps:
            return (f"warm-up goes on, then the cosine decay reaches --min-lr {new.min_lr:g} at "
                    f"step {new.steps} (was {self.steps})")
        return (f"the cosine decay goes on from step {start_step + 1} at lr "
                f"{new.at(start_step):.3g} ({100 * new.progress(start_step):.0f}% decayed) and "
                f"reaches --min-lr {new.min_lr:g} at step {new.steps} (was {self.steps})")
