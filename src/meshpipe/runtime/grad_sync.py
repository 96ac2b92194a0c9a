"""Gradient reduction across replicas of the same parameters (data and context parallel).

Gradients are flattened into one buffer per dtype so a step issues one all-reduce per dtype
rather than one per parameter. A parameter without a gradient on this rank contributes zeros:
every rank must hand the collective buffers of the same size, or the collective would hang.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter],
                         group: dist.ProcessGroup | None, *, scale: float = 1.0) -> None:
    """Sum every parameter's ``.grad`` over ``group``, then multiply by ``scale``.

    ``scale = 1 / dp`` averages over data-parallel replicas; context-parallel ranks hold
    partial sums of one sequence's gradient and are summed (scale 1 along that axis).
    """
    params = [p for p in parameters if p.requires_grad]
    if group is None or dist.get_world_size(group) == 1:
        if scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for bucket in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
