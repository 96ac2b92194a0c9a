"""How a pipeline message travels: its packed layout and payload, and the header in front.

A message is a nested ``tuple`` / ``list`` / ``dict`` whose leaves are tensors or small
non-tensor values (``None``, ``bool``, ``int``, ``float``, ``str``). On the wire it is two
things:

* a :class:`MessageLayout` (the "metadata"): the tree structure with the non-tensor values
  in place, and for every tensor its dtype, shape and byte offset in the payload. It
  encodes to compact JSON bytes, so two layouts are equal exactly when their encodings are.
* a payload: every tensor's bytes packed into one flat ``uint8`` buffer, each tensor at an
  offset aligned to :data:`PAYLOAD_ALIGNMENT`. One buffer means one point-to-point
  operation per message whatever the number and dtypes of its tensors.

On arrival the tensors are contiguous views into the received buffer.

:func:`flatten` remembers the layouts it built by the message's *signature* (structure,
values, dtypes, shapes), so a stream of same-shaped messages builds and encodes its
layout once. CPU buffers are written and read through numpy (:func:`new_buffer`,
:func:`host_message`, :func:`host_views`), whose per-call overhead is a fraction of
torch's: a message's few small copies and views sit on a pipeline's critical path.

In front of the payload travels a 48-byte :class:`Header` (sequence number, metadata slot,
metadata size, payload size, label digest, layout digest). Layouts are cached per link in
:data:`METADATA_SLOTS` slots (:class:`SenderSlots` / :class:`ReceiverSlots`), so a stream
that alternates between layouts sends each one's metadata once; :func:`layout_for` turns a
received header into its layout. The transports (:mod:`meshpipe.comm.p2p`,
:mod:`meshpipe.comm.vtp`) decide when each part is sent; this module only says what is on
the wire.

One module because it is one format: the layout's encoding, the header and the packing of
the payload are read and written together, and each part's byte offsets depend on the
others'.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Callable, Iterator, NamedTuple

import numpy
import torch

# Every tensor starts at a multiple of this many bytes in the payload: enough for a
# ``view(dtype)`` of any dtype (complex128 is 16 bytes) and for vectorised GPU loads.
PAYLOAD_ALIGNMENT = 16

SCALAR_TYPES: tuple[type, ...] = (type(None), bool, int, float, str)
_DICT_KEY_TYPES: tuple[type, ...] = (str, int)
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2,
                        torch.quint2x4})
# The numpy dtype of each torch dtype that numpy has.
_NUMPY_DTYPES = {torch.bool: numpy.bool_, torch.uint8: numpy.uint8, torch.int8: numpy.int8,
                 torch.int16: numpy.int16, torch.int32: numpy.int32, torch.int64: numpy.int64,
                 torch.float16: numpy.float16, torch.float32: numpy.float32,
                 torch.float64: numpy.float64, torch.complex64: numpy.complex64,
                 torch.complex128: numpy.complex128}

# Spec node tags: tuple, list, dict, tensor, value.
_TUPLE, _LIST, _DICT, _TENSOR, _VALUE = "t", "l", "d", "T", "v"


class UnsupportedMessageError(TypeError):
    """A message holds something the transport cannot carry (a leaf type, dtype or layout)."""


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of a message lives in the payload."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @cached_property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class MessageLayout:
    """A message's metadata: structure, non-tensor leaves, tensor dtypes/shapes/offsets."""

    spec: Any
    tensors: tuple[TensorSlot, ...]
    payload_nbytes: int
    encoded: bytes

    @cached_property
    def is_lone_tensor(self) -> bool:
        """Whether the message is one bare tensor (unpacked without walking the tree)."""
        return self.spec[0] == _TENSOR

    @classmethod
    def build(cls, spec: Any, dtypes_and_shapes: list[tuple[torch.dtype, tuple[int, ...]]],
              encoded: bytes | None = None) -> "MessageLayout":
        slots, offset = [], 0
        for dtype, shape in dtypes_and_shapes:
            slot = TensorSlot(dtype, shape, offset)
            slots.append(slot)
            offset = _align(offset + slot.nbytes)
        payload_nbytes = slots[-1].offset + slots[-1].nbytes if slots else 0
        if encoded is None:
            wire = {"s": spec, "t": [[_dtype_name(d), list(s)] for d, s in dtypes_and_shapes]}
            encoded = json.dumps(wire, separators=(",", ":")).encode()
        return cls(spec, tuple(slots), payload_nbytes, encoded)

    @classmethod
    def decode(cls, data: bytes) -> "MessageLayout":
        """Inverse of :attr:`encoded`; raises ``ValueError`` on bytes that are no layout."""
        try:
            wire = json.loads(data.decode())
            entries = [(_dtype_from_name(name), tuple(int(s) for s in shape))
                       for name, shape in wire["t"]]
            spec = wire["s"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                ValueError) as error:
            raise ValueError(f"metadata bytes do not decode to a message layout: {error}"
                             ) from error
        return cls.build(spec, entries, encoded=bytes(data))


def _align(offset: int) -> int:
    return -(-offset // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype in _QUANTIZED:
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def _check_tensor(tensor: torch.Tensor, path: str) -> None:
    if tensor.layout != torch.strided or tensor.is_nested:
        raise UnsupportedMessageError(
            f"{path} is a {tensor.layout} tensor{' (nested)' if tensor.is_nested else ''}; "
            "only dense (strided) tensors can be sent: convert it with .to_dense() first")
    if tensor.dtype in _QUANTIZED:
        raise UnsupportedMessageError(
            f"{path} has quantized dtype {tensor.dtype}, which the transport cannot carry: "
            "send its int_repr() and quantisation parameters instead")
    if tensor.device.type == "meta":
        raise UnsupportedMessageError(f"{path} is a meta tensor and has no data to send")


def flatten(message: Any) -> tuple[MessageLayout, list[torch.Tensor]]:
    """Split a message into its layout and its tensors (in depth-first order).

    A message whose signature (structure, values, dtypes, shapes) was seen before reuses
    that layout: a pipeline sends the same layout over and over, and building one (the
    JSON encoding) is a large share of a send's CPU time.
    """
    signature, tensors = _signature(message)
    layout = _LAYOUTS.get(signature) if signature is not None else None
    if layout is None:
        layout, tensors = _flatten_checked(message)
        if signature is not None:
            _remember_layout(signature, layout)
    return layout, tensors


# Layouts by message signature (see :func:`_signature`), oldest first; bounded, since a
# stream of messages whose values keep changing has a new signature every time.
_LAYOUTS: dict[tuple, MessageLayout] = {}
_LAYOUT_CACHE_SIZE = 1024


def _remember_layout(signature: tuple, layout: MessageLayout) -> None:
    if len(_LAYOUTS) >= _LAYOUT_CACHE_SIZE:
        del _LAYOUTS[next(iter(_LAYOUTS))]
    _LAYOUTS[signature] = layout


def _signature(message: Any) -> tuple[tuple | None, list[torch.Tensor]]:
    """A hashable key equal for two messages exactly when their layouts are equal, and the
    message's tensors; ``(None, [])`` when the message holds anything :func:`flatten` must
    check (or reject) on its slow path.

    The key is the tree in prefix order: a tag per node, a length per container, the key
    of each dict item, each value with its type (so ``1``, ``True`` and ``1.0`` differ; a
    float by its hex form, so ``-0.0`` and NaN are exact), each tensor's dtype and shape.
    """
    key: list[Any] = []
    tensors: list[torch.Tensor] = []
    if not _sign(message, key, tensors):
        return None, []
    return tuple(key), tensors


# The walks over a message and its layout are module functions that take what they collect
# as arguments: a nested function that calls itself is a reference cycle, which would keep
# the message's tensors (activations, gradients) alive until Python's cyclic collector runs
# instead of until the last reference goes (tests/comm/test_p2p_message.py).

def _sign(node: Any, key: list[Any], tensors: list[torch.Tensor]) -> bool:
    """Append ``node``'s part of the signature to ``key`` and its tensors to ``tensors``;
    False at the first thing only the checked path may take."""
    if isinstance(node, torch.Tensor):
        if node.layout is not torch.strided or node.is_nested or node.is_meta:
            return False
        key.extend((_TENSOR, node.dtype, node.shape))
        tensors.append(node)
        return True
    kind = type(node)
    if kind in SCALAR_TYPES:
        key.extend((_VALUE, kind, node.hex() if kind is float else node))
        return True
    if kind is tuple or kind is list:
        key.extend((kind, len(node)))
        return all(_sign(item, key, tensors) for item in node)
    if kind is dict:
        key.extend((_DICT, len(node)))
        for item_key, value in node.items():
            if type(item_key) not in _DICT_KEY_TYPES:
                return False
            key.append(item_key)
            if not _sign(value, key, tensors):
                return False
        return True
    return False


def _flatten_checked(message: Any) -> tuple[MessageLayout, list[torch.Tensor]]:
    """:func:`flatten` without the cache: builds the layout, and raises
    :class:`UnsupportedMessageError` naming the first thing it cannot carry."""
    tensors: list[torch.Tensor] = []
    spec = _checked_spec(message, "message", tensors)
    layout = MessageLayout.build(spec, [(t.dtype, tuple(t.shape)) for t in tensors])
    return layout, tensors


def _checked_spec(node: Any, path: str, tensors: list[torch.Tensor]) -> Any:
    """The layout spec of ``node`` (at ``path``), appending its tensors to ``tensors``."""
    if isinstance(node, torch.Tensor):
        _check_tensor(node, path)
        tensors.append(node)
        return [_TENSOR]
    if type(node) in SCALAR_TYPES:
        return [_VALUE, node]
    if type(node) is tuple:
        return [_TUPLE, [_checked_spec(item, f"{path}[{i}]", tensors)
                         for i, item in enumerate(node)]]
    if type(node) is list:
        return [_LIST, [_checked_spec(item, f"{path}[{i}]", tensors)
                        for i, item in enumerate(node)]]
    if type(node) is dict:
        items = []
        for key, value in node.items():
            if type(key) not in _DICT_KEY_TYPES:
                raise UnsupportedMessageError(
                    f"{path} has a dict key {key!r} of type {type(key).__name__}; "
                    "dict keys in a message must be str or int")
            items.append([key, _checked_spec(value, f"{path}[{key!r}]", tensors)])
        return [_DICT, items]
    raise UnsupportedMessageError(
        f"{path} is a {type(node).__module__}.{type(node).__qualname__}; a message is "
        "made of tuple, list and dict (exact types, no subclasses such as namedtuple) "
        "holding tensors, None, bool, int, float or str")


def unflatten(layout: MessageLayout, tensors: list[torch.Tensor | None]) -> Any:
    """Rebuild a message from its layout and one tensor per slot."""
    return _build(layout.spec, iter(tensors))


def _build(node: Any, remaining: Iterator[torch.Tensor | None]) -> Any:
    """The message part ``node`` describes, its tensors taken from ``remaining``."""
    tag = node[0]
    if tag == _TENSOR:
        return next(remaining)
    if tag == _VALUE:
        return node[1]
    if tag == _TUPLE:
        return tuple(_build(child, remaining) for child in node[1])
    if tag == _LIST:
        return [_build(child, remaining) for child in node[1]]
    if tag == _DICT:
        return {key: _build(child, remaining) for key, child in node[1]}
    raise ValueError(f"unknown node tag {tag!r} in message layout")


def pack(layout: MessageLayout, tensors: list[torch.Tensor], device: torch.device
         ) -> torch.Tensor:
    """The payload of a message as one ``uint8`` buffer on ``device``.

    A message whose only tensor is already contiguous on ``device`` is sent without a copy
    (the buffer is a byte view of that tensor); otherwise the tensors are copied in.
    """
    if len(tensors) == 1 and tensors[0].device == device and tensors[0].is_contiguous():
        return tensors[0].detach().reshape(-1).view(torch.uint8)
    buffer = torch.empty(layout.payload_nbytes, dtype=torch.uint8, device=device)
    pack_into(layout, tensors, buffer)
    return buffer


def pack_into(layout: MessageLayout, tensors: list[torch.Tensor], buffer: torch.Tensor) -> None:
    """Copy the message's tensors into ``buffer``, a ``uint8`` tensor of at least
    ``layout.payload_nbytes`` bytes whose start is aligned to :data:`PAYLOAD_ALIGNMENT`
    (e.g. a slice of a larger buffer that also holds a header)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < layout.payload_nbytes:
        raise ValueError(f"pack_into needs a 1-d uint8 buffer of at least "
                         f"{layout.payload_nbytes} bytes, got {buffer.dtype} "
                         f"{list(buffer.shape)}")
    for tensor, slot in zip(tensors, layout.tensors):
        if slot.nbytes:
            _slot_view(buffer, slot).copy_(tensor.detach())


def unpack(layout: MessageLayout, payload: torch.Tensor, start: int = 0,
           host: numpy.ndarray | None = None) -> Any:
    """The message whose payload starts at byte ``start`` of ``payload``: its tensors are
    views into the buffer (made through ``host``, the buffer's numpy array, where given)."""
    views = (slot_views(layout, payload, start) if host is None
             else host_views(layout, payload, start, host))
    if layout.is_lone_tensor:
        return views[0]
    return unflatten(layout, views)


def slot_views(layout: MessageLayout, payload: torch.Tensor, start: int = 0
               ) -> list[torch.Tensor]:
    """The message's tensors, in slot order, as views into its payload buffer (the
    payload starting at byte ``start`` of it)."""
    return [_slot_view(payload, slot, start) for slot in layout.tensors]


def _slot_view(buffer: torch.Tensor, slot: TensorSlot, start: int = 0) -> torch.Tensor:
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype, device=buffer.device)
    begin = start + slot.offset
    return buffer[begin:begin + slot.nbytes].view(slot.dtype).view(slot.shape)


def describe_difference(a: MessageLayout, b: MessageLayout) -> str | None:
    """A sentence naming the first place where two layouts differ, or None if equal."""
    if a.encoded == b.encoded:
        return None
    slots_a, slots_b = iter(a.tensors), iter(b.tensors)
    return _first_difference(a.spec, b.spec, "message", slots_a, slots_b) or (
        "the layouts differ")


def _first_difference(x: Any, y: Any, path: str, slots_x: Iterator[TensorSlot],
                      slots_y: Iterator[TensorSlot]) -> str | None:
    kinds = {_TUPLE: "a tuple", _LIST: "a list", _DICT: "a dict", _TENSOR: "a tensor",
             _VALUE: "a value"}
    if x[0] != y[0]:
        return f"{path} is {kinds.get(x[0], x[0])} in one and {kinds.get(y[0], y[0])} in the other"
    tag = x[0]
    if tag == _TENSOR:
        sx, sy = next(slots_x), next(slots_y)
        if sx.dtype != sy.dtype:
            return f"{path} has dtype {sx.dtype} in one and {sy.dtype} in the other"
        if sx.shape != sy.shape:
            return f"{path} has shape {list(sx.shape)} in one and {list(sy.shape)} in the other"
        return None
    if tag == _VALUE:
        if x[1] != y[1] or type(x[1]) is not type(y[1]):
            return f"{path} is {x[1]!r} in one and {y[1]!r} in the other"
        return None
    if tag == _DICT:
        keys_x, keys_y = [k for k, _ in x[1]], [k for k, _ in y[1]]
        if keys_x != keys_y:
            return f"{path} has keys {keys_x} in one and {keys_y} in the other"
        children = [(f"{path}[{k!r}]", cx, cy) for (k, cx), (_, cy) in zip(x[1], y[1])]
    else:
        if len(x[1]) != len(y[1]):
            return f"{path} has {len(x[1])} items in one and {len(y[1])} in the other"
        children = [(f"{path}[{i}]", cx, cy) for i, (cx, cy) in enumerate(zip(x[1], y[1]))]
    for child_path, cx, cy in children:
        found = _first_difference(cx, cy, child_path, slots_x, slots_y)
        if found:
            return found
    return None


def tensor_paths(layout: MessageLayout) -> list[str]:
    """The path of every tensor slot, in slot order (for error messages)."""
    paths: list[str] = []
    _walk_paths(layout.spec, "message", paths)
    return paths


def _walk_paths(node: Any, path: str, paths: list[str]) -> None:
    tag = node[0]
    if tag == _TENSOR:
        paths.append(path)
    elif tag == _DICT:
        for key, child in node[1]:
            _walk_paths(child, f"{path}[{key!r}]", paths)
    elif tag in (_TUPLE, _LIST):
        for i, child in enumerate(node[1]):
            _walk_paths(child, f"{path}[{i}]", paths)


# -- the header and the metadata caches ---------------------------------------------------

# Six little-endian int64; 48 bytes, a multiple of 16: the payload behind it stays aligned.
_HEADER_FORMAT = struct.Struct("<6q")
HEADER_NUMEL = 6
HEADER_NBYTES = _HEADER_FORMAT.size
METADATA_SLOTS = 8
# Slot value of a header whose message has the layout the receiver expects.
STEADY_SLOT = -1
# Slot value of a VTP broadcast header that says the stage root failed to receive.
ROOT_FAILED_SLOT = -2
# Tags of the steady stream and of the slow path (they share a group when the payload
# group is gloo); NCCL ignores tags, so the two never share an NCCL group.
STEADY_TAG = 0
SLOW_TAG = 1
_DIGEST_CACHE = 4096


class Header(NamedTuple):
    """The 48 bytes in front of every message (and of every VTP broadcast)."""

    seq: int
    slot: int
    metadata_nbytes: int
    payload_nbytes: int
    label_digest: int
    layout_digest: int

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(self, dtype=torch.int64, device="cpu")

    def write_into(self, buffer: torch.Tensor) -> None:
        """Write the header into the first bytes of a ``uint8`` buffer (on any device)."""
        if buffer.device.type == "cpu":
            _HEADER_FORMAT.pack_into(buffer.numpy(), 0, *self)
        else:
            packed = torch.frombuffer(bytearray(_HEADER_FORMAT.pack(*self)), dtype=torch.uint8)
            buffer[:HEADER_NBYTES].copy_(packed)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "Header":
        return cls(*tensor.tolist())

    @classmethod
    def read_from(cls, buffer: torch.Tensor, host: numpy.ndarray | None = None) -> "Header":
        """The header in the first bytes of a ``uint8`` buffer, read through ``host`` where
        given (its numpy array, see :func:`new_buffer`); a device buffer is copied to the
        host, which waits for the stream that received it."""
        if host is None:
            host = (buffer if buffer.device.type == "cpu" else buffer[:HEADER_NBYTES].cpu()
                    ).numpy()
        return cls(*_HEADER_FORMAT.unpack_from(host))


# -- CPU buffers, written and read through numpy ------------------------------------
# A torch operation costs several times a numpy one in per-call overhead, and the few
# small copies and views of a message sit on a pipeline's critical path.


def new_buffer(nbytes: int, device: torch.device
               ) -> tuple[torch.Tensor, numpy.ndarray | None]:
    """An uninitialised ``uint8`` buffer on ``device`` and, for a CPU one, the numpy array
    sharing its memory, through which the header of what arrives in it is read."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None
    host = numpy.empty(nbytes, dtype=numpy.uint8)
    return torch.from_numpy(host), host


def host_message(header: Header, layout: MessageLayout, tensors: list[torch.Tensor]
                 ) -> torch.Tensor:
    """A new CPU ``uint8`` buffer holding ``header`` and then the message's payload."""
    data = numpy.empty(HEADER_NBYTES + layout.payload_nbytes, dtype=numpy.uint8)
    _HEADER_FORMAT.pack_into(data, 0, *header)
    for tensor, slot in zip(tensors, layout.tensors):
        if slot.nbytes:
            start = HEADER_NBYTES + slot.offset
            data[start:start + slot.nbytes] = _host_bytes(tensor, slot)
    return torch.from_numpy(data)


def _host_bytes(tensor: torch.Tensor, slot: TensorSlot) -> numpy.ndarray:
    """The tensor's values as contiguous bytes on the host (a dtype numpy lacks, such as
    bfloat16, goes through a torch copy)."""
    if tensor.dtype in _NUMPY_DTYPES:
        return tensor.numpy(force=True).reshape(-1).view(numpy.uint8)
    staging = torch.empty(slot.shape, dtype=slot.dtype, device="cpu").copy_(tensor.detach())
    return staging.reshape(-1).view(torch.uint8).numpy()


def host_views(layout: MessageLayout, payload: torch.Tensor, start: int,
               host: numpy.ndarray) -> list[torch.Tensor]:
    """:func:`slot_views` of a CPU payload, made through its numpy array ``host`` where
    numpy knows the dtype."""
    views = []
    for slot in layout.tensors:
        numpy_dtype = _NUMPY_DTYPES.get(slot.dtype)
        if numpy_dtype is None or not slot.nbytes:
            views.append(_slot_view(payload, slot, start))
        else:
            begin = start + slot.offset
            views.append(torch.from_numpy(
                host[begin:begin + slot.nbytes].view(numpy_dtype).reshape(slot.shape)))
    return views


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


@lru_cache(maxsize=_DIGEST_CACHE)
def label_digest(label: str) -> int:
    """64-bit digest of a label (0 for no label): lets the receiver check it cheaply."""
    return _digest(label.encode()) if label else 0


@lru_cache(maxsize=_DIGEST_CACHE)
def layout_digest(encoded: bytes) -> int:
    """64-bit digest of an encoded layout: a header names its layout by it."""
    return _digest(encoded)


def describe_label(label: str) -> str:
    """A label as error messages quote it."""
    return repr(label) if label else "an unlabelled message"


@dataclass(frozen=True)
class Expected:
    """The layout a receive on a channel is sized for, with its digest."""

    layout: MessageLayout
    digest: int

    @classmethod
    def of(cls, layout: MessageLayout) -> "Expected":
        return cls(layout, layout_digest(layout.encoded))


def capacity(expected: Expected | None) -> int:
    """Payload bytes that a message sized for ``expected`` has room for."""
    return 0 if expected is None else expected.layout.payload_nbytes


class SenderSlots:
    """The sender's side of the metadata cache: which layout sits in which slot."""

    def __init__(self) -> None:
        self._slot_of: dict[bytes, int] = {}
        self._owner: list[bytes | None] = [None] * METADATA_SLOTS
        self._last_use = [0] * METADATA_SLOTS
        self._clock = 0

    def assign(self, encoded: bytes) -> tuple[int, bool]:
        """The slot for this layout, and whether it is new (its metadata must travel)."""
        self._clock += 1
        slot = self._slot_of.get(encoded)
        is_new = slot is None
        if slot is None:
            slot = min(range(METADATA_SLOTS), key=self._last_use.__getitem__)
            evicted = self._owner[slot]
            if evicted is not None:
                del self._slot_of[evicted]
            self._owner[slot] = encoded
            self._slot_of[encoded] = slot
        self._last_use[slot] = self._clock
        return slot, is_new


class ReceiverSlots:
    """The receiver's side of the metadata cache: filled as the sender instructs."""

    def __init__(self) -> None:
        self._layouts: list[MessageLayout | None] = [None] * METADATA_SLOTS

    def store(self, slot: int, layout: MessageLayout) -> None:
        self._layouts[slot] = layout

    def lookup(self, slot: int) -> MessageLayout | None:
        return self._layouts[slot]


def layout_for(header: Header, slots: ReceiverSlots,
               fetch_metadata: Callable[[int], torch.Tensor],
               corrupt: Callable[[str], Exception]) -> MessageLayout:
    """The layout a header announces: fetched and cached if it travels, else looked up.

    ``fetch_metadata(nbytes)`` receives the metadata bytes; ``corrupt(reason)`` builds the
    error raised when the header and what this rank holds disagree.
    """
    if not 0 <= header.slot < METADATA_SLOTS:
        raise corrupt(f"the header names metadata slot {header.slot}")
    if header.metadata_nbytes:
        data = fetch_metadata(header.metadata_nbytes)
        try:
            layout = MessageLayout.decode(data.numpy().tobytes())
        except ValueError as error:
            raise corrupt(str(error)) from None
        slots.store(header.slot, layout)
    else:
        layout = slots.lookup(header.slot)
        if layout is None:
            raise corrupt(f"the header refers to cached metadata slot {header.slot}, which "
                          "this rank never received")
    if layout.payload_nbytes != header.payload_nbytes:
        raise corrupt(f"the header announces {header.payload_nbytes} payload bytes but the "
                      f"metadata describes {layout.payload_nbytes}")
    if layout_digest(layout.encoded) != header.layout_digest:
        raise corrupt(f"metadata slot {header.slot} holds another layout than the one the "
                      "header announces")
    return layout
