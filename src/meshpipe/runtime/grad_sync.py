"""Gradient reduction across replicas of the same parameters (data and context parallel).

Gradients are flattened into one buffer per dtype so a step issues one all-reduce per dtype
rather than one per parameter. Every rank must hand the collective buffers of the same size,
so a parameter without a gradient on this rank contributes zeros. The same all-reduce counts
the ranks that had a gradient, and a parameter that none had one for gets ``.grad = None``
back: an optimizer then skips it (no weight decay, no moment update) exactly as it would
with a single replica.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from meshpipe.comm import ops

# Dtypes that hold a count of ranks exactly (integers up to 2**24), so the counts can ride
# in their buffer; without such a buffer the counts take one small all-reduce of their own.
_COUNTING_DTYPES = (torch.float32, torch.float64)


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter],
                         group: dist.ProcessGroup | None, *, scale: float = 1.0) -> None:
    """Sum every parameter's ``.grad`` over ``group``, then multiply by ``scale``.

    ``scale = 1 / dp`` averages over data-parallel replicas; context-parallel ranks hold
    partial sums of one sequence's gradient and are summed (scale 1 along that axis).
    A parameter that no rank of ``group`` has a gradient for keeps ``.grad = None``.
    """
    params = [p for p in parameters if p.requires_grad]
    if group is None or dist.get_world_size(group) == 1:
        if scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return
    if not params:
        return
    had_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                            device=params[0].device)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    ranks_with_grad = _all_reduce_buckets(params, had_grad, group, scale)
    for p, count in zip(params, ranks_with_grad.tolist()):
        if count == 0:
            p.grad = None


def _all_reduce_buckets(params: list[torch.nn.Parameter], had_grad: torch.Tensor,
                        group: dist.ProcessGroup, scale: float) -> torch.Tensor:
    """All-reduce the gradients one dtype at a time and ``had_grad`` alongside; returns
    how many ranks had a gradient for each parameter."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    counting = next((dtype for dtype in by_dtype if dtype in _COUNTING_DTYPES), None)
    for dtype, bucket in by_dtype.items():
        parts = [p.grad.reshape(-1) for p in bucket]
        if dtype == counting:
            parts.append(had_grad.to(dtype))
        flat = torch.cat(parts)
        ops.all_reduce(flat, group=group)
        grads_end = flat.numel() - (len(had_grad) if dtype == counting else 0)
        if scale != 1.0:
            flat[:grads_end].mul_(scale)
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
        if dtype == counting:
            ranks_with_grad = flat[grads_end:]
    if counting is None:
        ranks_with_grad = had_grad.clone()
        ops.all_reduce(ranks_with_grad, group=group)
    return ranks_with_grad
