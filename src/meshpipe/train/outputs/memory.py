"""Each rank's memory in ``metrics.json`` (``memory``, a record per rank): the bytes its
optimizer state takes (AdamW's two float32 moments and step per parameter, or per piece of
its shard under ``--zero 1/2``), counted from the state tensors and, on CUDA, read from the
caching allocator across the step that created them (what the device gave, rounding
included); and on CUDA the peak the allocator reached. A run resumed from a checkpoint loads
its state before any step: its allocator figure is None.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class OptimizerMemory:
    """Watches ``optimizer``'s steps until one creates its state, and reports it."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.device = device
        self.allocator_bytes: int | None = None
        self._before: int | None = None
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step)]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not optimizer.state and self.device.type == "cuda":
            self._before = torch.cuda.memory_allocated(self.device)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._before is not None:
            self.allocator_bytes = torch.cuda.memory_allocated(self.device) - self._before
        if optimizer.state:
            for hook in self._hooks:
                hook.remove()

    def record(self) -> dict[str, Any]:
        """This rank's figures now."""
        state = sum(value.nbytes for state in self.optimizer.state.values()
                    for value in state.values() if torch.is_tensor(value))
        peak = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                else None)
        return {"optimizer_state_bytes": state,
                "optimizer_state_allocator_bytes": self.allocator_bytes,
                "peak_allocated_bytes": peak}

    def gathered(self, is_main: bool) -> list[dict[str, Any]] | None:
        """Every rank's ``record`` on rank 0, in rank order (None elsewhere): a collective."""
        records: list[Any] | None = [None] * dist.get_world_size() if is_main else None
        dist.gather_object(self.record(), records, dst=0)
        return [{"rank": rank, **record} for rank, record in enumerate(records)] if (
            is_main) else None
