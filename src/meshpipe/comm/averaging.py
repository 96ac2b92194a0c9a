"""The mean of several sources' messages: a stage fed by several pipeline groups (fan-in)
averages what its links sent."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from meshpipe.comm.errors import MessageMismatchError
from meshpipe.comm.wire import (MessageLayout, describe_difference, describe_label, flatten,
                                tensor_paths, unflatten)


def average_messages(messages: Sequence[Any], peers: Sequence[int], label: str = "", *,
                     rank: int | None = None,
                     passthrough: Callable[[Any], bool] | None = None) -> Any:
    """The mean of several sources' messages (``peers[i]`` sent ``messages[i]``).

    The messages must have one layout: floating (and complex) tensors are averaged with
    float32 (or wider) accumulation and returned in their own dtype; integer and bool
    tensors and non-tensor leaves must be equal in every source and pass through;
    otherwise :class:`MessageMismatchError` names the sources and the first difference.
    The first message for which ``passthrough(message)`` is true is returned as it is
    (e.g. the executor's stop notice standing in for a message that will never come).
    ``rank`` (default: this process's global rank) names the receiver in errors.
    """
    if len(messages) != len(peers) or not messages:
        raise ValueError(f"average_messages needs one peer per message, got {len(messages)} "
                         f"messages from peers {list(peers)}")
    if passthrough is not None:
        for message in messages:
            if passthrough(message):
                return message
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    return average_flattened([flatten(message) for message in messages], list(peers), label,
                              rank)


def average_flattened(parts: list[tuple[MessageLayout, list[torch.Tensor]]],
                       peers: list[int], label: str, rank: int) -> Any:
    reference = parts[0][0]
    if len(parts) == 1:
        return unflatten(reference, parts[0][1])
    for (layout, _), peer in zip(parts[1:], peers[1:]):
        difference = describe_difference(reference, layout)
        if difference:
            raise MessageMismatchError(
                f"rank {rank} cannot average {describe_label(label)} from ranks {peers}: "
                f"the messages of rank {peers[0]} and rank {peer} differ: {difference}")
    columns = list(zip(*(tensors for _, tensors in parts)))
    averaged = []
    for path, column in zip(tensor_paths(reference), columns):
        if column[0].dtype.is_floating_point or column[0].dtype.is_complex:
            averaged.append(_mean(column))
            continue
        for peer, tensor in zip(peers[1:], column[1:]):
            if not torch.equal(column[0], tensor):
                raise MessageMismatchError(
                    f"rank {rank} cannot average {describe_label(label)} from ranks "
                    f"{peers}: {path} is a {column[0].dtype} tensor whose values differ "
                    f"between rank {peers[0]} and rank {peer}; integer and bool tensors "
                    "are not averaged and must be equal in every source")
        averaged.append(column[0])
    return unflatten(reference, averaged)


def _mean(column: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean of same-shape floating tensors, accumulated in at least float32."""
    accumulate = torch.promote_types(column[0].dtype, torch.float32)
    total = column[0].to(accumulate, copy=True)
    for tensor in column[1:]:
        total.add_(tensor.to(accumulate))
    return total.div_(len(column)).to(column[0].dtype)
