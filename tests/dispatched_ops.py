"""``DispatchedOps``: the aten ops a block of code runs, by name and in order (on a GPU each
op that computes is a kernel launch, so tests of launch counts run on the CPU)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """Inside ``with DispatchedOps() as ops:`` every aten op is noted in ``ops.called``
    (``"aten.mm"``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.called: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.called.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
