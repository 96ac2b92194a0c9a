"""Activation recompute: a piece of a forward whose activations backward recomputes instead
of keeping (non-reentrant checkpointing, which the split backward of zero-bubble schedules
supports)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def maybe_checkpoint(enabled: bool, fn, *args):
    """``fn(*args)``, recomputed in backward instead of saving its activations if enabled."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
