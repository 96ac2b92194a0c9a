"""A model built on the meta device (its skeleton), made real part by part.

A rank cuts its tensor-parallel shards and keeps its experts on the skeleton, where that
costs nothing, and only then gives the parts it holds real tensors: read from the weight
files (``hf.materialize``) or drawn (``Transformer``). A real parameter carries the tags of
the meta parameter it replaces (shard dim and parts, sequence parallel, expert), and takes
its place in every module holding it, so that tied weights stay one tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from meshpipe.models.moe import is_expert_param, mark_expert_parallel
from meshpipe.parallel import (is_sequence_parallel_param, mark_fused, mark_sequence_parallel,
                               shard_dim, shard_parts)
from meshpipe.parallel.tensor import _SHARD_ATTR


def real_parameter(meta: nn.Parameter, values: Tensor) -> nn.Parameter:
    """A parameter of ``values`` with ``meta``'s tags and ``requires_grad``."""
    real = nn.Parameter(values, requires_grad=meta.requires_grad)
    if shard_dim(meta) is not None:
        setattr(real, _SHARD_ATTR, shard_dim(meta))
    if shard_parts(meta) is not None:
        mark_fused(real, shard_parts(meta))
    if is_sequence_parallel_param(meta):
        mark_sequence_parallel(real)
    if is_expert_param(meta):
        mark_expert_parallel(real)
    return real


def replace_parameters(owners: Iterable[nn.Module], real: dict[int, nn.Parameter]) -> None:
    """In each of ``owners``, put ``real[id(p)]`` where a parameter ``p`` was."""
    for owner in owners:
        for attribute, param in list(owner.named_parameters(recurse=False)):
            if id(param) in real:
                setattr(owner, attribute, real[id(param)])
