"""What glibc's malloc does with a large block, for the host-memory tests."""

import ctypes

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
           "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def malloc_info() -> dict[str, int]:
    """glibc's ``mallinfo2()``: ``hblkhd`` is the bytes in blocks mapped on their own,
    ``arena`` the bytes of the heaps, ``fordblks`` the free bytes in them."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {name: getattr(info, name) for name in _FIELDS}


LARGE_BLOCK = 16 * 2**20


def where_large_blocks_go(count: int = 4) -> dict[str, bool]:
    """Allocate ``count`` blocks of ``LARGE_BLOCK`` bytes and free them all, as a step does:
    was any of them mapped on its own, and is their memory still in the heap (free, for
    reuse) once freed?"""
    before = malloc_info()
    blocks = [torch.empty(LARGE_BLOCK // 4).fill_(1.0) for _ in range(count)]
    during = malloc_info()
    del blocks
    after = malloc_info()
    return {"mapped": during["hblkhd"] > before["hblkhd"],
            "kept": after["fordblks"] >= count * LARGE_BLOCK}


class _PeakInUse(TorchDispatchMode):
    """Reads malloc's bytes in use after every torch op on this thread: their highest."""

    def __init__(self):
        super().__init__()
        self.start = self.peak = _in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _in_use())
        return out


def _in_use() -> int:
    info = malloc_info()
    return info["uordblks"] + info["hblkhd"]


def peak_bytes_during(fn):
    """``fn()`` and the most bytes malloc held beyond what it held before, read after every
    torch op ``fn`` runs on this thread (tensors are allocated only inside ops). The first
    dispatch mode costs tens of MB once: a mode and an op before ``fn`` pay for that."""
    with _PeakInUse():
        torch.zeros(1)
    with _PeakInUse() as probe:
        out = fn()
    return out, probe.peak - probe.start
