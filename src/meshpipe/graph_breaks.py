"""The places where ``--compile`` stops its graphs, marked without importing TorchDynamo.

``@graph_break`` marks a function that must run eager under ``torch.compile`` (it
communicates, or reads each microbatch's token layout, which compiled would recompile for
every new layout). Until ``install`` runs, the mark is a plain call, so a process that does
not compile never imports TorchDynamo (1.5 s of every process's start); ``install``, which
``meshpipe.models.compile`` calls before compiling, makes each marked function
``torch.compiler.disable``'d. ``MARKED`` lists them (the known graph breaks).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

MARKED: list[Callable[..., Any]] = []


def graph_break(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return call.target(*args, **kwargs)

    call.target = fn
    MARKED.append(call)
    return call


def install() -> None:
    """Make every marked function run eager under ``torch.compile`` (idempotent)."""
    import torch

    for call in MARKED:
        if call.target is call.__wrapped__:
            call.target = torch.compiler.disable(call.__wrapped__)
