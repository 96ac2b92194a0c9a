"""Catch tensors created on the wrong device without a GPU.

On a GPU a tensor made without an explicit device (``torch.arange(n)``, ``torch.zeros(k)``)
lands on the CPU while the model's tensors are on CUDA, and the first op that mixes them
fails, or worse, copies silently. On the CPU such a bug is invisible: both land on the CPU.

``device_audit()`` makes it visible there: inside it the default device is ``meta``, so a
tensor created without a device is a meta tensor, and any op that mixes a meta tensor with
a tensor on a real device raises :class:`StrayDeviceError` naming the op and the line that
called it. Build the model and its inputs on the CPU outside, then run forward and
backward (and whatever else should be device-clean) inside.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StrayDeviceError(RuntimeError):
    """An op mixed a tensor created without a device with the run's own tensors."""


class _MixedDevices(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {leaf.device.type for leaf in tree_leaves((args, kwargs))
                   if isinstance(leaf, torch.Tensor)}
        if "meta" in devices and len(devices) > 1:
            raise StrayDeviceError(
                f"{func} mixes a tensor created without a device (meta under the audit) with "
                f"tensors on {sorted(devices - {'meta'})}; called from "
                f"{_caller()}")
        return func(*args, **kwargs)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _caller() -> str:
    """The innermost line of the stack outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "torch itself"


@contextlib.contextmanager
def device_audit() -> Iterator[None]:
    """Tensors created without a device become meta tensors; mixing one with a real
    tensor raises :class:`StrayDeviceError` (see the module docstring)."""
    with torch.device("meta"), _MixedDevices():
        yield
