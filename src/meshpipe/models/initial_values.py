"""A model's initial values: each parameter drawn from a normal distribution by a generator
of its own, seeded from the run's seed and the parameter's name.

So a parameter's values do not depend on the other parameters: a rank that builds only the
parts of the model it holds (``transformer.Held``) draws the values the whole model has. A
tensor-parallel shard is cut from its whole parameter's draw, one parameter at a time, so a
rank holds its shards and no more than one whole parameter per drawing thread. The
parameters are drawn on ``torch.get_num_threads()`` threads (``normal_`` releases the GIL):
one generator drew a 740M model's weights in 4 s on a 2-core CPU, two threads half that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Draw:
    """Parameter ``name``'s initial values, Normal(0, ``std``), into ``into``: all of them,
    or with ``cut`` the part ``cut(whole)`` of a draw ``whole`` of shape ``whole_shape``
    (``into`` is a tensor-parallel shard of the parameter)."""

    name: str
    into: Tensor
    std: float
    cut: Callable[[Tensor], Tensor] | None = None
    whole_shape: tuple[int, ...] | None = None


def draw_normal(draws: list[Draw], seed: int | None) -> None:
    """Fill each of ``draws`` from its own generator, or with ``seed`` None from the global
    one, in order."""
    threads = torch.get_num_threads()
    if seed is None or threads == 1:
        for draw in draws:
            _fill(draw, None if seed is None else _parameter_generator(seed, draw.name))
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda draw: _fill(draw, _parameter_generator(seed, draw.name)), draws))


def _parameter_generator(seed: int, name: str) -> torch.Generator:
    """The generator of parameter ``name``'s initial values: the same in every process."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _fill(draw: Draw, generator: torch.Generator | None) -> None:
    with torch.no_grad():  # per thread: a worker thread starts with gradients on
        if draw.cut is None:
            draw.into.normal_(0.0, draw.std, generator=generator)
            return
        whole = torch.empty(draw.whole_shape, dtype=draw.into.dtype)
        draw.into.copy_(draw.cut(whole.normal_(0.0, draw.std, generator=generator)))
