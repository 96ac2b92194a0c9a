"""What attention derives from a microbatch's token layout, computed once per microbatch.

Every layer of a microbatch gets the same ``positions`` / ``doc_ids`` tensor objects (and a
recomputed forward gets them again). What attention reads from them (whether the sequence
is plain, the runs of a pack's documents, its mask) would otherwise be derived again in
every layer, and on a GPU each of those reads waits for the device: a host synchronisation
per layer. ``derived`` keeps each value beside the tensors it came from, for as long as they
live and are not modified in place, and drops it with them.

Once per microbatch is still a wait per microbatch: reading a layout off the device waits
for the work queued before it (the previous microbatch's backward), and the device then
idles while the host queues the next forward. A loader that copies a layout from the host
keeps the host tensor beside the device one (``keep_host_copy``); the readers of layouts
read ``on_host(tensor)``, which is that copy while the device tensor is unchanged, and need
no wait at all.
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

_Key = tuple[Hashable, ...]
_VALUES: dict[_Key, tuple[tuple[weakref.ref | None, ...], tuple[int, ...], object]] = {}


def derived(name: Hashable, tensors: tuple[Tensor | None, ...], compute: Callable[[], T]) -> T:
    """``compute()`` for ``tensors``, or the value it gave for these same tensor objects (at
    their current versions) under ``name`` before."""
    key = (name, *(id(tensor) for tensor in tensors))
    versions = tuple(-1 if tensor is None else tensor._version for tensor in tensors)
    entry = _VALUES.get(key)
    if entry is not None and entry[1] == versions and all(
            (ref is None) if tensor is None else (ref is not None and ref() is tensor)
            for ref, tensor in zip(entry[0], tensors)):
        return entry[2]  # type: ignore[return-value]
    value = compute()
    forget = _forgetter(key)
    _VALUES[key] = (tuple(None if tensor is None else weakref.ref(tensor, forget)
                          for tensor in tensors), versions, value)
    return value


def _forgetter(key: _Key) -> Callable[[weakref.ref], None]:
    """A weakref callback that drops ``key``'s value once one of its tensors is freed (unless
    the key already holds a newer value for other tensors)."""
    def forget(dead: weakref.ref) -> None:
        entry = _VALUES.get(key)
        if entry is not None and any(ref is dead for ref in entry[0]):
            _VALUES.pop(key, None)
    return forget


def held() -> int:
    """How many derived values are held (for tests)."""
    return len(_VALUES)


_HOST_COPIES: dict[int, tuple[weakref.ref, int, Tensor]] = {}


def keep_host_copy(tensor: Tensor, host: Tensor) -> Tensor:
    """``tensor``, noted as holding the values of the host tensor ``host`` (which the caller
    no longer modifies) for as long as it lives unmodified."""
    if tensor is not host:
        key = id(tensor)
        _HOST_COPIES[key] = (weakref.ref(tensor, lambda _: _HOST_COPIES.pop(key, None)),
                             tensor._version, host)
    return tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``, keeping ``host`` as its host copy. To CUDA through pinned
    memory without waiting: a copy from pageable memory holds the host until the device has
    done the work queued before it."""
    if device.type == "cuda":
        moved = host.pin_memory().to(device, non_blocking=True)
    else:
        moved = host.to(device)
    return keep_host_copy(moved, host)


def on_host(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """The host copies of ``tensors`` (``keep_host_copy``) if each one (None aside) has one
    and is unchanged since, else ``tensors`` as they are (never a mix, whose devices would
    differ): what a reader of their values reads without waiting for the device."""
    copies = tuple(None if tensor is None else _host_copy(tensor) for tensor in tensors)
    if any(copy is None and tensor is not None for copy, tensor in zip(copies, tensors)):
        return tensors
    return copies


def _host_copy(tensor: Tensor) -> Tensor | None:
    entry = _HOST_COPIES.get(id(tensor))
    if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
        return entry[2]
    return None
