"""``DispatchedOps``: the aten ops a block of code runs, by name and in order (on a GPU each
op that computes is a kernel launch, so tests of launch counts run on the CPU)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """Inside ``with DispatchedOps() as ops:`` every aten op is noted in ``ops.called``
    (``"aten.mm"``, ...), and those that compute (not views) in ``ops.computing``."""

    def __init__(self) -> None:
        super().__init__()
        self.called: list[str] = []
        self.computing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.called.append(name)
        if not func.is_view:
            self.computing.append(name)
        return func(*args, **(kwargs or {}))
