"""A model's initial values: each parameter drawn from a normal distribution by a generator
of its own, seeded from the run's seed and the parameter's name.

So a parameter's values do not depend on the other parameters: a rank that builds only the
parts of the model it holds (``transformer.Held``) draws the values the whole model has.
The parameters are drawn on ``torch.get_num_threads()`` threads (``normal_`` releases the
GIL): one generator drew a 740M model's weights in 4 s on a 2-core CPU, two threads half
that.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor


def draw_normal(draws: list[tuple[str, Tensor, float]], seed: int | None) -> None:
    """Fill each ``(name, parameter, std)`` of ``draws`` with Normal(0, std): from its own
    generator, or with ``seed`` None from the global one, in order."""
    if seed is None:
        for _, param, std in draws:
            _fill(param, std, None)
        return
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        list(pool.map(lambda draw: _fill(draw[1], draw[2], _parameter_generator(seed, draw[0])),
                      draws))


def _parameter_generator(seed: int, name: str) -> torch.Generator:
    """The generator of parameter ``name``'s initial values: the same in every process."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _fill(param: Tensor, std: float, generator: torch.Generator | None) -> None:
    with torch.no_grad():  # per thread: a worker thread starts with gradients on
        param.normal_(0.0, std, generator=generator)
