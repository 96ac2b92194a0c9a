"""Host memory: keep the memory a step frees for the next step instead of returning it.

A training step on CPU allocates and frees the same large blocks step after step. glibc's
malloc serves a block above its mmap threshold with a fresh mapping, and hands the free
top of its heap back to the system once it passes the trim threshold (both start at
128 KiB and grow only with the largest mapped block freed so far). Either way the next step
writes to new pages, and every 4 KiB page costs a fault and a clearing in the kernel: about
3,000 faults in each step of Ulysses cp 2 on the CP benchmark, several milliseconds of a
step that its kernels otherwise fill. ``keep_freed_memory`` raises both thresholds, so that
freed blocks stay in the heap and the next step reuses them, as PyTorch's CPU launcher
gets by preloading jemalloc or tcmalloc.
"""

from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 32 * 2**20
"""Blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit)."""

TRIM_THRESHOLD = 2**30
"""Up to this much freed memory at the top of the heap stays in the process."""

_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3

_USERS_OWN_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _users_own_malloc_settings() -> bool:
    """Whether the environment already tunes glibc's malloc (its own variables, or
    ``GLIBC_TUNABLES`` naming ``glibc.malloc``): those win, untouched."""
    return (any(name in os.environ for name in _USERS_OWN_SETTINGS)
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))


def keep_freed_memory() -> bool:
    """Have this process's malloc keep freed memory for reuse (see the module docstring).

    Returns whether the settings took: False off Linux, where the C library has no
    ``mallopt`` or refuses it, and where the user's own malloc settings are in the
    environment. Safe to call more than once; a preloaded jemalloc or tcmalloc does not
    read these settings and keeps its own behaviour.
    """
    if not sys.platform.startswith("linux") or _users_own_malloc_settings():
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
