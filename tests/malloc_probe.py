"""What glibc's malloc does with a large block, for the host-memory tests."""

import ctypes

import torch

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
