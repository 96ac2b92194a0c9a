"""Point-to-point transport for pipeline messages (activations forward, gradients backward).

A message is a pytree of tensors and small values (see :mod:`meshpipe.comm.message`);
nothing about its shapes or dtypes is declared. Messages travel on *channels*: a channel
is one stream of messages between an ordered pair of ranks, named by any hashable value
that sender and receiver agree on (the executor uses ``(kind, stage)``, e.g. "stage 3
forward activations"); calls without ``channel`` use the pair's default channel. Each
side remembers the layout (structure, dtypes, shapes) of the last message on every
channel: that is the layout the receiver *expects* for the next one.

Steady state, the layout is the expected one: the receiver posts, at ``post_recv`` time,
ONE receive of exactly a 48-byte header plus that layout's payload into one buffer, and
the sender sends exactly that in ONE send. The header (six int64: sequence number, slot,
metadata size, payload size, label digest, layout digest) sits in front of the payload in
the same buffer, so it travels with the payload on the payload group (NCCL on GPUs: the
header is read from the device after the wait). A steady message thus costs one send,
one receive and 48 bytes beyond the tensor data and its alignment padding; the tensors
arrive as views into the receive buffer.

Layout changes (and the first message of a channel): the sender still sends exactly the
size the receiver expects, but its header is a *layout-change notice*: it names a
metadata slot of a per-pair cache of :data:`METADATA_SLOTS` layouts (so streams that
alternate between layouts send their metadata once) and the new payload size. The
payload rides inside the notice when it fits in the expected size, else it follows on
the *slow path*; the metadata follows on the slow path when it is not cached. The slow
path is the meta group (gloo, CPU tensors) with its own tag, so it never interleaves with
the steady stream; the receiver fetches the follow-ups when it reads the notice in
``wait``.

Matching: between an ordered pair of ranks, messages are received in the order they were
sent, and the receiver must post its receives from a peer in the order that peer posted the
sends (the executor guarantees it), with the same channel on both sides. A receive can
only be posted once the layout of the previous message on its channel is known; while
that message is not resolved yet (read in a ``wait``), the receive is *deferred*, and so
is every later receive from that peer (point-to-point operations match in posting order;
NCCL has no tags). ``wait`` resolves a peer's messages strictly in posting order, posting
deferred receives as soon as they can be, so handles may be waited in any order. No
thread is involved: everything happens in ``post_*`` and ``wait`` calls. Messages to a
higher rank and messages to a lower rank may travel on two groups (``reverse_group``), as
NCCL needs: there, a receive posted early must not sit on the stream in front of sends.

Ranks are **global** ranks throughout (``dist.get_rank()`` numbering), also when a group
is given. All posting is non-blocking (``isend``/``irecv``); only ``wait`` blocks. Waits
time out through gloo, which then closes the connection to that peer: a timed-out wait
raises :class:`P2PTimeoutError` naming the peer and the message, and every later receive
from that peer fails at once with an error naming the first failure.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, fields
from datetime import timedelta
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from meshpipe.comm.message import (
    MessageLayout,
    UnsupportedMessageError,
    describe_difference,
    flatten,
    pack,
    pack_into,
    slot_views,
    tensor_paths,
    unflatten,
    unpack,
)

# Six little-endian int64; 48 bytes, a multiple of 16: the payload behind it stays aligned.
_HEADER_FORMAT = struct.Struct("<6q")
HEADER_NUMEL = 6
HEADER_NBYTES = _HEADER_FORMAT.size
METADATA_SLOTS = 8
# Slot value of a header whose message has the layout the receiver expects.
_STEADY_SLOT = -1
# Slot value of a VTP broadcast header that says the stage root failed to receive.
_ROOT_FAILED_SLOT = -2
# Tags of the steady stream and of the slow path (they share a group when the payload
# group is gloo); NCCL ignores tags, so the two never share an NCCL group.
_STEADY_TAG = 0
_SLOW_TAG = 1
_DIGEST_CACHE = 4096

GroupArg = ProcessGroup | Sequence[ProcessGroup] | None


class P2PError(RuntimeError):
    """A pipeline message could not be delivered or did not match what was expected."""


class P2PTimeoutError(P2PError, TimeoutError):
    """A wait ran out of time; the message names the peer and the label."""


class MessageMismatchError(P2PError):
    """The peer sent something other than what this rank expected."""


@dataclass
class TransportStats:
    """Counters of what a transport posted and moved, for tests and benchmarks."""

    messages_sent: int = 0
    messages_received: int = 0
    layout_changes_sent: int = 0
    layout_changes_received: int = 0
    metadata_sent: int = 0
    metadata_received: int = 0
    header_bytes_sent: int = 0
    header_bytes_received: int = 0
    metadata_bytes_sent: int = 0
    metadata_bytes_received: int = 0
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    sends_posted: int = 0
    recvs_posted: int = 0
    recvs_deferred: int = 0
    broadcasts: int = 0
    broadcast_metadata: int = 0

    def reset(self) -> None:
        for field in fields(self):
            setattr(self, field.name, 0)


class _Header(NamedTuple):
    seq: int
    slot: int
    metadata_nbytes: int
    payload_nbytes: int
    label_digest: int
    layout_digest: int

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(self, dtype=torch.int64)

    def write_into(self, buffer: torch.Tensor) -> None:
        """Write the header into the first bytes of a ``uint8`` buffer (on any device)."""
        if buffer.device.type == "cpu":
            _HEADER_FORMAT.pack_into(buffer.numpy(), 0, *self)
        else:
            packed = torch.frombuffer(bytearray(_HEADER_FORMAT.pack(*self)), dtype=torch.uint8)
            buffer[:HEADER_NBYTES].copy_(packed)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "_Header":
        return cls(*tensor.tolist())

    @classmethod
    def read_from(cls, buffer: torch.Tensor) -> "_Header":
        """The header in the first bytes of a ``uint8`` buffer (a device buffer is copied
        to the host, which waits for the stream that received it)."""
        host = buffer[:HEADER_NBYTES] if buffer.device.type == "cpu" else (
            buffer[:HEADER_NBYTES].cpu())
        return cls(*_HEADER_FORMAT.unpack_from(host.numpy()))


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


@lru_cache(maxsize=_DIGEST_CACHE)
def _label_digest(label: str) -> int:
    """64-bit digest of a label (0 for no label): lets the receiver check it cheaply."""
    return _digest(label.encode()) if label else 0


@lru_cache(maxsize=_DIGEST_CACHE)
def _layout_digest(encoded: bytes) -> int:
    return _digest(encoded)


def _describe(label: str) -> str:
    return repr(label) if label else "an unlabelled message"


@dataclass(frozen=True)
class _Expected:
    """The layout a receive on a channel is sized for, with its digest."""

    layout: MessageLayout
    digest: int

    @classmethod
    def of(cls, layout: MessageLayout) -> "_Expected":
        return cls(layout, _layout_digest(layout.encoded))


def _capacity(expected: _Expected | None) -> int:
    """Payload bytes that a message sized for ``expected`` has room for."""
    return 0 if expected is None else expected.layout.payload_nbytes


class _SenderSlots:
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


class _ReceiverSlots:
    """The receiver's side of the metadata cache: filled as the sender instructs."""

    def __init__(self) -> None:
        self._layouts: list[MessageLayout | None] = [None] * METADATA_SLOTS

    def store(self, slot: int, layout: MessageLayout) -> None:
        self._layouts[slot] = layout

    def lookup(self, slot: int) -> MessageLayout | None:
        return self._layouts[slot]


class _Outbox:
    """Sender state towards one peer: what the peer expects next on each channel."""

    def __init__(self) -> None:
        self.seq = 0
        self.slots = _SenderSlots()
        self.expected: dict[Hashable, _Expected] = {}


@dataclass
class _Part:
    """One point-to-point operation of a message send."""

    name: str
    tensor: torch.Tensor
    group: ProcessGroup | None
    tag: int


class _Incoming:
    """One expected message from one peer, from ``post_recv`` until it is resolved."""

    def __init__(self, peer: int, group: ProcessGroup | None, meta_group: ProcessGroup | None,
                 label: str, channel: Hashable) -> None:
        self.peer = peer
        self.group = group
        self.meta_group = meta_group
        self.label = label
        self.digest = _label_digest(label)
        self.channel = channel
        self.expected: _Expected | None = None  # what the posted receive is sized for
        self.buffer: torch.Tensor | None = None
        self.work: Any = None
        self.layout: MessageLayout | None = None
        self.payload: torch.Tensor | None = None
        self.error: P2PError | None = None
        self.resolved = False


class _ChannelInbox:
    """Receiver state of one channel from one peer."""

    def __init__(self) -> None:
        self.expected: _Expected | None = None  # layout of the last resolved message
        self.outstanding = 0                    # receives posted and not resolved


class _Inbox:
    """Receiver state for one peer: its unresolved messages in posting order.

    ``queue`` holds every unresolved message; its first ``len(queue) - len(deferred)``
    entries have their receive posted, the rest (``deferred``) wait for the layout of an
    earlier message of their channel.
    """

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.seq = 0
        self.slots = _ReceiverSlots()
        self.channels: dict[Hashable, _ChannelInbox] = {}
        self.queue: deque[_Incoming] = deque()
        self.deferred: deque[_Incoming] = deque()
        self.failure: P2PError | None = None

    def channel(self, channel: Hashable) -> _ChannelInbox:
        state = self.channels.get(channel)
        if state is None:
            state = self.channels[channel] = _ChannelInbox()
        return state


@dataclass(frozen=True)
class _GroupInfo:
    """What the transport needs to know about a process group (looked up once)."""

    members: frozenset[int]
    uses_nccl: bool
    carries_cpu: bool

    @classmethod
    def of(cls, group: ProcessGroup | None) -> "_GroupInfo":
        group = group if group is not None else dist.group.WORLD
        backend = str(dist.get_backend(group)).lower()
        return cls(frozenset(dist.get_process_group_ranks(group)), "nccl" in backend,
                   "gloo" in backend or "nccl" not in backend)


@dataclass
class _PostedSend:
    work: Any
    peer: int
    group: ProcessGroup | None
    part: str


class SendHandle:
    """Handle of a posted message send (to one or several peers).

    The transport sends from buffers of its own, filled when the send is posted: the
    caller may free, resize or overwrite the message's tensors as soon as ``post_send``
    returns (the executor frees sent activations right away). The handle keeps those
    buffers alive until the send has completed. Gloo reports completion only through
    ``wait``; NCCL also through ``is_completed``. Dropping the handle does not cancel the
    send: the transport keeps it until it is waited here or by
    :meth:`P2PTransport.wait_sends`.
    """

    def __init__(self, transport: "P2PTransport | None", sends: list[_PostedSend],
                 keep_alive: list[torch.Tensor], label: str) -> None:
        self._transport = transport
        self._sends = sends
        self._keep_alive = keep_alive
        self._label = label

    @classmethod
    def completed(cls) -> "SendHandle":
        """A handle for a send that posted nothing (e.g. a VTP rank that is not stage root)."""
        return cls(None, [], [], "")

    def wait(self, timeout: float | None = None) -> None:
        """Block until every part of the send has completed (or raise ``P2PTimeoutError``)."""
        if not self._sends:
            return
        transport = self._transport
        deadline = transport._deadline(timeout)
        for send in self._sends:
            transport._wait_work(
                send.work, deadline, send.group, send.peer,
                lambda send=send: f"the {send.part} of {_describe(self._label)} sent to "
                                  f"rank {send.peer} to be received")
        self._release()

    def is_completed(self) -> bool:
        """True once every part has completed; never blocks."""
        if self._sends and all(send.work.is_completed() for send in self._sends):
            for send in self._sends:
                send.work.wait()
            self._release()
        return not self._sends

    def _release(self) -> None:
        self._sends = []
        self._keep_alive = []
        if self._transport is not None:
            self._transport._pending_sends.pop(self, None)


class RecvHandle:
    """Handle of a posted receive; ``wait`` returns the message.

    From one peer it returns that peer's message; from several peers with
    ``average=True`` their mean; from several peers without, a list in peer order.
    """

    _PENDING = object()

    def __init__(self, transport: "P2PTransport", incomings: list[_Incoming], label: str,
                 average: bool, single: bool) -> None:
        self._transport = transport
        self._incomings = incomings
        self._label = label
        self._average = average
        self._single = single
        self._result: Any = self._PENDING

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the message has arrived and return it."""
        if self._result is self._PENDING:
            transport = self._transport
            deadline = transport._deadline(timeout)
            parts = [transport._complete(incoming, deadline) for incoming in self._incomings]
            peers = [incoming.peer for incoming in self._incomings]
            if self._single:
                self._result = unpack(*parts[0])
            elif self._average:
                self._result = transport._average(parts, peers, self._label)
            else:
                self._result = [unpack(*part) for part in parts]
            self._incomings = []
        return self._result


class P2PTransport:
    """Sends and receives pipeline messages between ranks with non-blocking point-to-point ops.

    ``group`` carries the steady messages, header and payload in one buffer (default: the
    default group), from lower to higher ranks; ``reverse_group`` (default: ``group``) the
    ones from higher to lower ranks. On NCCL the two must be different groups over the same
    ranks: NCCL runs a pair of ranks' point-to-point operations in posting order on one
    stream, where a receive posted early from a peer would hold up every later send to that
    peer (both ranks doing so is a deadlock); with a group per direction a stream carries
    one direction's messages, which both sides post in the same order. ``meta_group``
    carries the slow path (metadata and payloads of layout changes) and must be able to
    carry CPU tensors (gloo). It defaults to ``group`` when that one can; an NCCL payload
    group needs an explicit gloo ``meta_group`` over the same ranks. Payload buffers live on
    ``device``. ``timeout`` (seconds) is the default of every ``wait``; None leaves it to the
    process group's own timeout. With ``check_labels``, a receive whose label differs from
    the label the peer sent with (both non-empty) raises :class:`MessageMismatchError`: give
    a send and its receive the same label.

    A wait that times out raises :class:`P2PTimeoutError`; gloo has then closed the group's
    connection to that peer, so later receives from it fail at once (see the module doc).
    """

    def __init__(self, group: ProcessGroup | None = None, *,
                 reverse_group: ProcessGroup | None = None,
                 meta_group: ProcessGroup | None = None,
                 device: torch.device | str = "cpu", timeout: float | None = None,
                 check_labels: bool = True) -> None:
        if not dist.is_initialized():
            raise RuntimeError("P2PTransport needs torch.distributed to be initialised: call "
                               "dist.init_process_group first")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive seconds or None, got {timeout}")
        self.rank = dist.get_rank()
        self._groups: dict[Any, _GroupInfo] = {}
        self.group = group
        self.reverse_group = self._checked_reverse_group(group, reverse_group)
        if meta_group is None:
            if not self._group_info(group).carries_cpu:
                raise ValueError(
                    f"rank {self.rank}: the payload group uses {dist.get_backend(group)}, "
                    "which cannot carry the CPU metadata; pass meta_group=<a gloo group over "
                    "the same ranks> (dist.new_group(ranks, backend='gloo'))")
            meta_group = group
        elif not self._group_info(meta_group).carries_cpu:
            raise ValueError(f"rank {self.rank}: meta_group must be a CPU (gloo) group, got "
                             f"backend {dist.get_backend(meta_group)}")
        self.meta_group = meta_group
        self.device = _resolve_device(device)
        self.timeout = timeout
        self.check_labels = check_labels
        self.stats = TransportStats()
        self._outboxes: dict[int, _Outbox] = {}
        self._inboxes: dict[int, _Inbox] = {}
        # In-flight sends, oldest first: gloo cancels a send whose work object is destroyed,
        # so the transport, not the caller, keeps every send alive until it is waited.
        self._pending_sends: dict[SendHandle, None] = {}

    # -- sending -----------------------------------------------------------------------

    def post_send(self, message: Any, dst: int | Sequence[int], *, label: str = "",
                  group: GroupArg = None, channel: Hashable = None) -> SendHandle:
        """Post the send of ``message`` to global rank ``dst`` (or to each of several).

        ``group`` overrides the payload group (one per destination when a sequence).
        ``channel`` names the stream the message belongs to; the receiver must post its
        receive with the same channel (see the module doc). Raises
        :class:`UnsupportedMessageError` before posting anything if the message holds
        something the transport cannot carry.
        """
        peers, groups = self._routes(dst, group, "dst")
        try:
            layout, tensors = flatten(message)
        except UnsupportedMessageError as error:
            raise UnsupportedMessageError(
                f"rank {self.rank}: cannot send {_describe(label)} to rank(s) {peers}: {error}"
            ) from None
        label_digest = _label_digest(label)
        sends: list[_PostedSend] = []
        keep_alive: list[torch.Tensor] = []
        for peer, payload_group in zip(peers, groups):
            outbox = self._outboxes.get(peer) or self._outboxes.setdefault(peer, _Outbox())
            parts = self._wire_parts(outbox, channel, layout, tensors, label_digest,
                                     payload_group)
            outbox.seq += 1
            for part in parts:
                work = dist.isend(part.tensor, dst=peer, group=part.group, tag=part.tag)
                sends.append(_PostedSend(work, peer, part.group, part.name))
                keep_alive.append(part.tensor)
        handle = SendHandle(self, sends, keep_alive, label)
        self._pending_sends[handle] = None
        return handle

    def _wire_parts(self, outbox: _Outbox, channel: Hashable, layout: MessageLayout,
                    tensors: list[torch.Tensor], label_digest: int,
                    payload_group: ProcessGroup | None) -> list[_Part]:
        """The operations that carry one message to one peer; updates what it expects."""
        expected = outbox.expected.get(channel)
        capacity = _capacity(expected)
        buffer = torch.empty(HEADER_NBYTES + capacity, dtype=torch.uint8, device=self.device)
        body = buffer[HEADER_NBYTES:]
        payload_nbytes = layout.payload_nbytes
        if expected is not None and expected.layout.encoded == layout.encoded:
            _Header(outbox.seq, _STEADY_SLOT, 0, payload_nbytes, label_digest,
                    expected.digest).write_into(buffer)
            pack_into(layout, tensors, body)
            stats = self.stats  # the steady path counts inline: it runs for every message
            stats.messages_sent += 1
            stats.sends_posted += 1
            stats.header_bytes_sent += HEADER_NBYTES
            stats.payload_bytes_sent += payload_nbytes
            return [_Part("message", buffer, payload_group, _STEADY_TAG)]
        changed = outbox.expected[channel] = _Expected.of(layout)
        slot, is_new = outbox.slots.assign(layout.encoded)
        metadata_nbytes = len(layout.encoded) if is_new else 0
        _Header(outbox.seq, slot, metadata_nbytes, payload_nbytes, label_digest,
                changed.digest).write_into(buffer)
        meta_group = self._meta_group_for(payload_group)
        parts = [_Part("layout-change notice", buffer, payload_group, _STEADY_TAG)]
        if is_new:
            metadata = torch.frombuffer(bytearray(layout.encoded), dtype=torch.uint8)
            parts.append(_Part("metadata", metadata, meta_group, _SLOW_TAG))
        if payload_nbytes <= capacity:
            pack_into(layout, tensors, body)
        else:
            payload = torch.empty(payload_nbytes, dtype=torch.uint8)
            pack_into(layout, tensors, payload)
            parts.append(_Part("payload", payload, meta_group, _SLOW_TAG))
        self._count(messages_sent=1, layout_changes_sent=1, sends_posted=len(parts),
                    header_bytes_sent=HEADER_NBYTES, metadata_sent=int(is_new),
                    metadata_bytes_sent=metadata_nbytes, payload_bytes_sent=payload_nbytes)
        return parts

    def wait_sends(self, timeout: float | None = None) -> None:
        """Wait for every send posted so far that has not been waited (e.g. at step end)."""
        deadline = self._deadline(timeout)
        for handle in list(self._pending_sends):
            remaining = _remaining(deadline)
            handle.wait(remaining)

    # -- receiving ---------------------------------------------------------------------

    def post_recv(self, src: int | Sequence[int], *, label: str = "", group: GroupArg = None,
                  average: bool = False, channel: Hashable = None) -> RecvHandle:
        """Post the receive of one message from global rank ``src`` (or from each of several).

        ``channel`` must be the one the peer sends the message on. With several sources
        (each with its own group when ``group`` is a sequence, as when one stage is fed by
        several pipeline groups), ``average=True`` makes ``wait`` return the mean: floating
        tensors are averaged with float32 (or wider) accumulation and returned in their own
        dtype; integer and bool tensors and non-tensor leaves must be equal across sources
        and pass through.
        """
        peers, groups = self._routes(src, group, "src")
        inboxes = [self._inboxes.get(peer) or self._inboxes.setdefault(peer, _Inbox(peer))
                   for peer in peers]
        for inbox in inboxes:
            self._raise_if_failed(inbox, label)
        incomings = []
        for inbox, payload_group in zip(inboxes, groups):
            incoming = _Incoming(inbox.peer, payload_group, self._meta_group_for(payload_group),
                                 label, channel)
            inbox.queue.append(incoming)
            if inbox.deferred or inbox.channel(channel).outstanding:
                inbox.deferred.append(incoming)
                self._count(recvs_deferred=1)
            else:
                self._post_steady_recv(inbox, incoming)
            incomings.append(incoming)
        return RecvHandle(self, incomings, label, average, single=isinstance(src, int))

    def _post_steady_recv(self, inbox: _Inbox, incoming: _Incoming) -> None:
        """Post the one receive of ``incoming``, sized for its channel's expected layout."""
        state = inbox.channel(incoming.channel)
        incoming.expected = state.expected
        incoming.buffer = torch.empty(HEADER_NBYTES + _capacity(state.expected),
                                      dtype=torch.uint8, device=self.device)
        incoming.work = dist.irecv(incoming.buffer, src=incoming.peer, group=incoming.group,
                                   tag=_STEADY_TAG)
        state.outstanding += 1
        self.stats.recvs_posted += 1

    def _complete(self, incoming: _Incoming, deadline: float | None
                  ) -> tuple[MessageLayout, torch.Tensor]:
        """Resolve the peer's messages up to ``incoming``; its layout and payload."""
        inbox = self._inboxes[incoming.peer]
        while not incoming.resolved:
            self._raise_if_failed(inbox, incoming.label)
            self._resolve_next(inbox, incoming, deadline)
        if incoming.error is not None:
            raise incoming.error
        return incoming.layout, incoming.payload

    def _resolve_next(self, inbox: _Inbox, waited: _Incoming, deadline: float | None) -> None:
        """Wait for the peer's oldest unresolved message and read it (its receive is posted:
        a deferred receive is posted as soon as every earlier message is resolved)."""
        head = inbox.queue[0]

        def describe() -> str:
            what = f"{_describe(waited.label)} from rank {head.peer}"
            if head is waited:
                return what
            return (f"{what}, behind the earlier message {_describe(head.label)} (messages "
                    "from one rank are resolved in posting order)")

        def fail(error: P2PError) -> None:
            inbox.failure = error

        self._wait_work(head.work, deadline, head.group, head.peer, describe, on_failure=fail)
        try:
            self._read(inbox, head, deadline)
        except P2PError as error:
            fail(error)
            raise
        inbox.seq += 1
        inbox.queue.popleft()
        state = inbox.channel(head.channel)
        state.outstanding -= 1
        head.resolved = True
        head.buffer = head.work = None
        while inbox.deferred and not inbox.channel(inbox.deferred[0].channel).outstanding:
            self._post_steady_recv(inbox, inbox.deferred.popleft())

    def _read(self, inbox: _Inbox, head: _Incoming, deadline: float | None) -> None:
        """Read the arrived message ``head``: its header, layout, payload and label check."""
        peer = head.peer

        def corrupt(reason: str) -> MessageMismatchError:
            return MessageMismatchError(
                f"rank {self.rank} receiving {_describe(head.label)} from rank {peer}: "
                f"{reason}. The two ranks' transports are out of step (was one of them "
                "re-created, do they name the message's channel alike, or does another "
                "component use the same group for sends?)")

        header = _Header.read_from(head.buffer)
        if header.seq != inbox.seq:
            raise corrupt(f"the header says message #{header.seq}, expected #{inbox.seq}")
        body = head.buffer[HEADER_NBYTES:]
        state = inbox.channel(head.channel)
        if header.slot == _STEADY_SLOT:
            expected = head.expected
            if expected is None or (header.layout_digest, header.payload_nbytes) != (
                    expected.digest, expected.layout.payload_nbytes):
                raise corrupt("the message claims the layout this rank expected on its "
                              "channel, but it is not that layout")
            head.layout, head.payload = expected.layout, body
        else:
            head.layout = _layout_for(header, inbox.slots,
                                      lambda nbytes: self._fetch_metadata(head, nbytes,
                                                                          deadline),
                                      corrupt)
            expected = _Expected.of(head.layout)
            nbytes = header.payload_nbytes
            head.payload = (body[:nbytes] if nbytes <= body.numel()
                            else self._fetch_payload(head, nbytes, deadline))
            self._count(layout_changes_received=1)
        state.expected = expected
        stats = self.stats
        stats.messages_received += 1
        stats.header_bytes_received += HEADER_NBYTES
        stats.payload_bytes_received += header.payload_nbytes
        if self.check_labels and head.digest and header.label_digest and (
                head.digest != header.label_digest):
            head.error = MessageMismatchError(
                f"rank {self.rank} expected {_describe(head.label)} from rank {peer}, but "
                f"the message rank {peer} sent at this point (#{header.seq} between "
                "them) carries a different label: the two ranks post their sends and "
                "receives in different orders; check that their schedules match")

    def _fetch_metadata(self, head: _Incoming, nbytes: int, deadline: float | None
                        ) -> torch.Tensor:
        data = self._fetch_slow(head, torch.empty(nbytes, dtype=torch.uint8), "metadata",
                                deadline)
        self._count(metadata_received=1, metadata_bytes_received=nbytes)
        return data

    def _fetch_payload(self, head: _Incoming, nbytes: int, deadline: float | None
                       ) -> torch.Tensor:
        payload = self._fetch_slow(head, torch.empty(nbytes, dtype=torch.uint8), "payload",
                                   deadline)
        return payload.to(self.device)

    def _fetch_slow(self, head: _Incoming, buffer: torch.Tensor, part: str,
                    deadline: float | None) -> torch.Tensor:
        """Receive one slow-path follow-up of ``head`` into the CPU ``buffer``."""
        work = dist.irecv(buffer, src=head.peer, group=head.meta_group, tag=_SLOW_TAG)
        self._count(recvs_posted=1)
        self._wait_work(work, deadline, head.meta_group, head.peer,
                        lambda: f"the {part} of {_describe(head.label)} from rank {head.peer}")
        return buffer

    def _average(self, parts: list[tuple[MessageLayout, torch.Tensor]], peers: list[int],
                 label: str) -> Any:
        reference = parts[0][0]
        for (layout, _), peer in zip(parts[1:], peers[1:]):
            difference = describe_difference(reference, layout)
            if difference:
                raise MessageMismatchError(
                    f"rank {self.rank} cannot average {_describe(label)} from ranks {peers}: "
                    f"the messages of rank {peers[0]} and rank {peer} differ: {difference}")
        columns = list(zip(*(slot_views(layout, payload) for layout, payload in parts)))
        averaged = []
        for path, column in zip(tensor_paths(reference), columns):
            if column[0].dtype.is_floating_point or column[0].dtype.is_complex:
                averaged.append(_mean(column))
                continue
            for peer, tensor in zip(peers[1:], column[1:]):
                if not torch.equal(column[0], tensor):
                    raise MessageMismatchError(
                        f"rank {self.rank} cannot average {_describe(label)} from ranks "
                        f"{peers}: {path} is a {column[0].dtype} tensor whose values differ "
                        f"between rank {peers[0]} and rank {peer}; integer and bool tensors "
                        "are not averaged and must be equal in every source")
            averaged.append(column[0])
        return unflatten(reference, averaged)

    # -- shared helpers ----------------------------------------------------------------

    def _routes(self, peers: int | Sequence[int], group: GroupArg, role: str
                ) -> tuple[list[int], list[ProcessGroup | None]]:
        peer_list = [peers] if isinstance(peers, int) else list(peers)
        if not peer_list:
            raise ValueError(f"rank {self.rank}: {role} names no rank")
        if group is None:
            groups = [self._default_group(peer, role) for peer in peer_list]
        elif isinstance(group, ProcessGroup):
            groups = [group] * len(peer_list)
        else:
            groups = list(group)
            if len(groups) != len(peer_list):
                raise ValueError(f"rank {self.rank}: {len(peer_list)} {role} ranks "
                                 f"{peer_list} but {len(groups)} groups; give one per rank")
        for peer, payload_group in zip(peer_list, groups):
            if type(peer) is not int:
                raise TypeError(f"rank {self.rank}: {role} must be a global rank (int), got "
                                f"{peer!r}")
            if peer == self.rank:
                raise ValueError(f"rank {self.rank}: {role}={peer} is this rank itself; "
                                 "pipeline messages go to another rank")
            for needed in (payload_group, self._meta_group_for(payload_group)):
                members = self._group_info(needed).members
                if peer not in members or self.rank not in members:
                    raise ValueError(
                        f"rank {self.rank}: {role}={peer} is not reachable through group "
                        f"with global ranks {sorted(members)}; ranks are global ranks")
        return peer_list, groups

    def _checked_reverse_group(self, group: ProcessGroup | None,
                               reverse_group: ProcessGroup | None) -> ProcessGroup | None:
        forward = self._group_info(group)
        if reverse_group is None or reverse_group is group:
            if forward.uses_nccl:
                raise ValueError(
                    f"rank {self.rank}: the payload group uses NCCL, where messages in both "
                    "directions between two ranks would share one stream and an early "
                    "receive could block the sends behind it; pass reverse_group=<a second "
                    "NCCL group over the same ranks> (dist.new_group(ranks, backend='nccl'))")
            return group
        reverse = self._group_info(reverse_group)
        if reverse.members != forward.members:
            raise ValueError(f"rank {self.rank}: reverse_group has ranks "
                             f"{sorted(reverse.members)} but group has "
                             f"{sorted(forward.members)}; give both the same ranks")
        return reverse_group

    def _default_group(self, peer: int, role: str) -> ProcessGroup | None:
        """The payload group of the message's direction: ``group`` from lower to higher
        ranks, ``reverse_group`` from higher to lower."""
        sender, receiver = (self.rank, peer) if role == "dst" else (peer, self.rank)
        return self.group if sender < receiver else self.reverse_group

    def _meta_group_for(self, payload_group: ProcessGroup | None) -> ProcessGroup | None:
        if (payload_group is self.group or payload_group is self.reverse_group
                or not self._group_info(payload_group).carries_cpu):
            return self.meta_group
        return payload_group

    def _group_info(self, group: ProcessGroup | None) -> _GroupInfo:
        info = self._groups.get(group)
        if info is None:
            info = self._groups[group] = _GroupInfo.of(group)
        return info

    def _raise_if_failed(self, inbox: _Inbox, label: str) -> None:
        if inbox.failure is not None:
            raise P2PError(
                f"rank {self.rank}: cannot receive {_describe(label)} from rank {inbox.peer}: "
                f"receiving from it failed earlier ({inbox.failure})") from inbox.failure

    def _count(self, **amounts: int) -> None:
        stats = self.stats
        for name, amount in amounts.items():
            setattr(stats, name, getattr(stats, name) + amount)

    def _deadline(self, timeout: float | None) -> float | None:
        seconds = self.timeout if timeout is None else timeout
        return None if seconds is None else time.monotonic() + seconds

    def _wait_work(self, work: Any, deadline: float | None, group: ProcessGroup | None,
                   peer: int, describe: Callable[[], str],
                   on_failure: Callable[[P2PError], None] | None = None) -> None:
        """Wait for one posted operation, turning timeouts and failures into named errors."""
        stream_ordered = self.device.type == "cuda" and self._group_info(group).uses_nccl
        try:
            if deadline is None or stream_ordered:
                work.wait()
            else:
                remaining = _remaining(deadline)
                work.wait(timedelta(seconds=remaining))
        except RuntimeError as cause:
            timed_out = (deadline is not None and time.monotonic() >= deadline) or (
                "timed out" in str(cause).lower())
            if timed_out:
                error: P2PError = P2PTimeoutError(
                    f"rank {self.rank} timed out waiting for {describe()}: rank {peer} did "
                    "not post the matching operation in time; check that both ranks run "
                    f"matching schedules and that rank {peer} is alive. The connection to "
                    f"rank {peer} is unusable now")
            else:
                error = P2PError(f"rank {self.rank} failed waiting for {describe()}: {cause}")
            if on_failure is not None:
                on_failure(error)
            raise error from cause



class StageRecvHandle:
    """Handle of a receive by a VTP stage: the stage root receives, then broadcasts."""

    _PENDING = object()

    def __init__(self, transport: "VTPTransport", inner: RecvHandle | None, label: str) -> None:
        self._transport = transport
        self._inner = inner
        self._label = label
        self._result: Any = self._PENDING

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the message has arrived on this rank and return it.

        Every rank of the receiving stage must wait its stage's receives in the same order
        (the broadcast inside the stage is a collective).
        """
        if self._result is self._PENDING:
            self._result = self._transport._deliver(self._inner, self._label, timeout)
            self._inner = None
        return self._result


class VTPTransport:
    """Pipeline messages between stages of different tensor-parallel sizes (seed 001's VTP).

    ``stage_ranks[s]`` lists the global ranks of stage ``s``; its first rank is the stage
    root. Only stage roots talk to each other (through a :class:`P2PTransport` over
    ``group``); a receiving stage's root then broadcasts the message (structure and tensors)
    to the other ranks of its stage over ``intra_group`` when the handle is waited. Sends
    by ranks that are not stage roots post nothing. ``dst``/``src`` are global ranks of any
    member of the peer stage. ``intra_group`` is this rank's stage group (needed when the
    stage has several ranks); ``intra_meta_group`` carries its headers and metadata and
    defaults to ``intra_group`` when that one is a CPU group.
    """

    def __init__(self, stage_ranks: Sequence[Sequence[int]],
                 intra_group: ProcessGroup | None = None, *,
                 group: ProcessGroup | None = None,
                 reverse_group: ProcessGroup | None = None,
                 meta_group: ProcessGroup | None = None,
                 intra_meta_group: ProcessGroup | None = None,
                 device: torch.device | str = "cpu", timeout: float | None = None,
                 check_labels: bool = True) -> None:
        self.p2p = P2PTransport(group, reverse_group=reverse_group, meta_group=meta_group,
                                device=device, timeout=timeout, check_labels=check_labels)
        self.rank = self.p2p.rank
        self.stats = self.p2p.stats
        self.stage_ranks = _validate_stages(stage_ranks)
        self._stage_of = {rank: s for s, ranks in enumerate(self.stage_ranks) for rank in ranks}
        if self.rank not in self._stage_of:
            raise ValueError(f"rank {self.rank} is in no stage of stage_ranks "
                             f"{[list(r) for r in self.stage_ranks]}")
        self.stage_index = self._stage_of[self.rank]
        members = self.stage_ranks[self.stage_index]
        self.stage_root = members[0]
        self.is_stage_root = self.rank == self.stage_root
        self.intra_group = intra_group
        self.intra_meta_group = intra_meta_group
        if len(members) > 1:
            if intra_group is None:
                raise ValueError(f"rank {self.rank}: stage {self.stage_index} has ranks "
                                 f"{list(members)}; pass intra_group, a group of exactly them")
            actual = sorted(dist.get_process_group_ranks(intra_group))
            if actual != sorted(members):
                raise ValueError(f"rank {self.rank}: intra_group has ranks {actual} but stage "
                                 f"{self.stage_index} is {list(members)}")
            if intra_meta_group is None:
                if not self.p2p._group_info(intra_group).carries_cpu:
                    raise ValueError(f"rank {self.rank}: intra_group cannot carry CPU "
                                     "headers; pass intra_meta_group (a gloo stage group)")
                self.intra_meta_group = intra_group
        self._broadcast_seq = 0
        self._broadcast_sender_slots = _SenderSlots()
        self._broadcast_receiver_slots = _ReceiverSlots()
        self._broadcast_failure: P2PError | None = None

    def post_send(self, message: Any, dst: int | Sequence[int], *, label: str = "",
                  group: GroupArg = None, channel: Hashable = None) -> SendHandle:
        """Post a send to the stage(s) holding global rank(s) ``dst``; only the root posts."""
        roots = self._roots(dst)
        if not self.is_stage_root:
            try:
                flatten(message)
            except UnsupportedMessageError as error:
                raise UnsupportedMessageError(
                    f"rank {self.rank}: cannot send {_describe(label)}: {error}") from None
            return SendHandle.completed()
        return self.p2p.post_send(message, roots, label=label, group=group, channel=channel)

    def post_recv(self, src: int | Sequence[int], *, label: str = "", group: GroupArg = None,
                  average: bool = False, channel: Hashable = None) -> StageRecvHandle:
        """Post a receive from the stage(s) holding ``src``; see ``P2PTransport.post_recv``."""
        roots = self._roots(src)
        inner = (self.p2p.post_recv(roots, label=label, group=group, average=average,
                                    channel=channel)
                 if self.is_stage_root else None)
        return StageRecvHandle(self, inner, label)

    def wait_sends(self, timeout: float | None = None) -> None:
        """Wait for every send this rank posted and has not waited."""
        self.p2p.wait_sends(timeout)

    def _roots(self, peers: int | Sequence[int]) -> int | list[int]:
        def root_of(rank: Any) -> int:
            stage = self._stage_of.get(rank) if type(rank) is int else None
            if stage is None:
                raise ValueError(f"rank {self.rank}: peer {rank!r} is in no stage of "
                                 f"{[list(r) for r in self.stage_ranks]}")
            if stage == self.stage_index:
                raise ValueError(f"rank {self.rank}: peer {rank} is in this rank's own stage "
                                 f"{stage}; pipeline messages go to another stage")
            return self.stage_ranks[stage][0]

        if isinstance(peers, int):
            return root_of(peers)
        return [root_of(rank) for rank in peers]

    def _deliver(self, inner: RecvHandle | None, label: str, timeout: float | None) -> Any:
        deadline = self.p2p._deadline(timeout)
        if len(self.stage_ranks[self.stage_index]) == 1:
            return inner.wait(timeout)
        if self._broadcast_failure is not None:
            raise P2PError(f"rank {self.rank}: cannot deliver {_describe(label)} inside stage "
                           f"{self.stage_index}: an earlier broadcast failed "
                           f"({self._broadcast_failure})") from self._broadcast_failure
        if self.is_stage_root:
            remaining = _remaining(deadline)
            try:
                message = inner.wait(remaining)
            except P2PError:
                self._broadcast_root_failure(label, deadline)
                raise
            self._broadcast_from_root(message, label, deadline)
            return message
        return self._broadcast_to_member(label, deadline)

    def _broadcast_root_failure(self, label: str, deadline: float | None) -> None:
        """Tell the stage's other ranks that the root could not receive, so they fail fast."""
        header = _Header(self._broadcast_seq, _ROOT_FAILED_SLOT, 0, 0, _label_digest(label), 0)
        self._broadcast_seq += 1
        self._broadcast(header.to_tensor(), self.intra_meta_group, deadline, "header", label)

    def _broadcast_from_root(self, message: Any, label: str, deadline: float | None) -> None:
        layout, tensors = flatten(message)
        slot, is_new = self._broadcast_sender_slots.assign(layout.encoded)
        header = _Header(self._broadcast_seq, slot, len(layout.encoded) if is_new else 0,
                         layout.payload_nbytes, _label_digest(label),
                         _layout_digest(layout.encoded))
        self._broadcast_seq += 1
        self._broadcast(header.to_tensor(), self.intra_meta_group, deadline, "header", label)
        if is_new:
            metadata = torch.frombuffer(bytearray(layout.encoded), dtype=torch.uint8)
            self._broadcast(metadata, self.intra_meta_group, deadline, "metadata", label)
            self.p2p._count(broadcast_metadata=1)
        if layout.payload_nbytes:
            self._broadcast(pack(layout, tensors, self.p2p.device), self.intra_group, deadline,
                            "payload", label)
        self.p2p._count(broadcasts=1)

    def _broadcast_to_member(self, label: str, deadline: float | None) -> Any:
        raw_header = torch.empty(HEADER_NUMEL, dtype=torch.int64)
        self._broadcast(raw_header, self.intra_meta_group, deadline, "header", label)
        header = _Header.from_tensor(raw_header)

        def corrupt(reason: str) -> MessageMismatchError:
            self._broadcast_failure = MessageMismatchError(
                f"rank {self.rank} receiving {_describe(label)} inside stage "
                f"{self.stage_index} from rank {self.stage_root}: {reason}; the ranks of the "
                "stage are out of step")
            return self._broadcast_failure

        def fetch_metadata(nbytes: int) -> torch.Tensor:
            data = torch.empty(nbytes, dtype=torch.uint8)
            self._broadcast(data, self.intra_meta_group, deadline, "metadata", label)
            self.p2p._count(broadcast_metadata=1)
            return data

        if header.seq != self._broadcast_seq:
            raise corrupt(f"broadcast #{header.seq} arrived, expected #{self._broadcast_seq}")
        self._broadcast_seq += 1
        if header.slot == _ROOT_FAILED_SLOT:
            raise P2PError(f"rank {self.rank} cannot receive {_describe(label)}: its stage "
                           f"root rank {self.stage_root} failed to receive the message that "
                           "it would have broadcast; see rank "
                           f"{self.stage_root}'s error")
        layout = _layout_for(header, self._broadcast_receiver_slots, fetch_metadata, corrupt)
        payload = torch.empty(header.payload_nbytes, dtype=torch.uint8, device=self.p2p.device)
        if header.payload_nbytes:
            self._broadcast(payload, self.intra_group, deadline, "payload", label)
        self.p2p._count(broadcasts=1)
        digest = _label_digest(label)
        if self.p2p.check_labels and digest and header.label_digest and (
                digest != header.label_digest):
            raise MessageMismatchError(
                f"rank {self.rank} waited {_describe(label)} but its stage root rank "
                f"{self.stage_root} broadcast a message with a different label: the ranks "
                f"of stage {self.stage_index} must wait their receives in the same order")
        return unpack(layout, payload)

    def _broadcast(self, tensor: torch.Tensor, group: ProcessGroup | None,
                   deadline: float | None, part: str, label: str) -> None:
        work = dist.broadcast(tensor, src=self.stage_root, group=group, async_op=True)

        def fail(error: P2PError) -> None:
            self._broadcast_failure = error

        self.p2p._wait_work(
            work, deadline, group, self.stage_root,
            lambda: f"the {part} of {_describe(label)} broadcast inside stage "
                    f"{self.stage_index} by rank {self.stage_root}",
            on_failure=fail)


def _layout_for(header: _Header, slots: _ReceiverSlots,
                fetch_metadata: Callable[[int], torch.Tensor],
                corrupt: Callable[[str], MessageMismatchError]) -> MessageLayout:
    """The layout a header announces: fetched and cached if it travels, else looked up."""
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
    if _layout_digest(layout.encoded) != header.layout_digest:
        raise corrupt(f"metadata slot {header.slot} holds another layout than the one the "
                      "header announces")
    return layout


def _validate_stages(stage_ranks: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    stages = tuple(tuple(ranks) for ranks in stage_ranks)
    seen: set[int] = set()
    for index, ranks in enumerate(stages):
        if not ranks:
            raise ValueError(f"stage {index} of stage_ranks has no rank")
        for rank in ranks:
            if type(rank) is not int or rank < 0:
                raise ValueError(f"stage {index} lists {rank!r}, not a global rank")
            if rank in seen:
                raise ValueError(f"rank {rank} appears in more than one stage of stage_ranks")
            seen.add(rank)
    return stages


def _mean(column: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean of same-shape floating tensors, accumulated in at least float32."""
    accumulate = torch.promote_types(column[0].dtype, torch.float32)
    total = column[0].to(accumulate, copy=True)
    for tensor in column[1:]:
        total.add_(tensor.to(accumulate))
    return total.div_(len(column)).to(column[0].dtype)


def _remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (at least a millisecond); None without a deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
