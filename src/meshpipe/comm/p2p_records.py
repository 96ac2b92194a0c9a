"""What a ``P2PTransport`` keeps per peer and per message: its counters, the sender's and
receiver's state towards each peer, one expected message from posting to resolution, the
operations of a send and those queued for a batch. Plain records; the transport alone
changes them."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import numpy
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from meshpipe.comm.errors import P2PError
from meshpipe.comm.wire import Expected, MessageLayout, ReceiverSlots, SenderSlots, label_digest


@dataclass
class TransportStats:
    """Counters of what a transport posted and moved, for tests and benchmarks.

    ``sends_posted`` / ``recvs_posted`` count point-to-point operations however they were
    issued; ``batches_posted`` counts ``batch_isend_irecv`` calls (batched mode) and
    ``ops_batched`` the operations they carried.
    """

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
    batches_posted: int = 0
    ops_batched: int = 0
    broadcasts: int = 0
    broadcast_metadata: int = 0

    def reset(self) -> None:
        for field in fields(self):
            setattr(self, field.name, 0)


class Outbox:
    """Sender state towards one peer: what the peer expects next on each channel."""

    def __init__(self) -> None:
        self.seq = 0
        self.slots = SenderSlots()
        self.expected: dict[Hashable, Expected] = {}


@dataclass
class Part:
    """One point-to-point operation of a message send."""

    name: str
    tensor: torch.Tensor
    group: ProcessGroup | None
    tag: int


class Incoming:
    """One expected message from one peer, from ``post_recv`` until it is resolved."""

    def __init__(self, peer: int, group: ProcessGroup | None, meta_group: ProcessGroup | None,
                 label: str, channel: Hashable) -> None:
        self.peer = peer
        self.group = group
        self.meta_group = meta_group
        self.label = label
        self.digest = label_digest(label)
        self.channel = channel
        self.expected: Expected | None = None  # what the posted receive is sized for
        self.buffer: torch.Tensor | None = None
        self.host: numpy.ndarray | None = None  # the CPU buffer's memory, as numpy sees it
        self.work: Any = None                  # None while queued for a batch
        self.layout: MessageLayout | None = None
        # The buffer the payload is in, its first byte there, and the buffer's numpy array.
        self.payload: tuple[torch.Tensor, int, numpy.ndarray | None] | None = None
        self.error: P2PError | None = None
        self.resolved = False


class ChannelInbox:
    """Receiver state of one channel from one peer."""

    def __init__(self) -> None:
        self.expected: Expected | None = None  # layout of the last resolved message
        self.outstanding = 0                   # receives posted and not resolved


class Inbox:
    """Receiver state for one peer: its unresolved messages in posting order.

    ``queue`` holds every unresolved message; its first ``len(queue) - len(deferred)``
    entries have their receive posted, the rest (``deferred``) wait for the layout of an
    earlier message of their channel.
    """

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.seq = 0
        self.slots = ReceiverSlots()
        self.channels: dict[Hashable, ChannelInbox] = {}
        self.queue: deque[Incoming] = deque()
        self.deferred: deque[Incoming] = deque()
        self.failure: P2PError | None = None

    def channel(self, channel: Hashable) -> ChannelInbox:
        state = self.channels.get(channel)
        if state is None:
            state = self.channels[channel] = ChannelInbox()
        return state


@dataclass(frozen=True)
class GroupInfo:
    """What the transport needs to know about a process group (looked up once)."""

    members: frozenset[int]
    uses_nccl: bool
    carries_cpu: bool

    @classmethod
    def of(cls, group: ProcessGroup | None) -> "GroupInfo":
        group = group if group is not None else dist.group.WORLD
        backend = str(dist.get_backend(group)).lower()
        return cls(frozenset(dist.get_process_group_ranks(group)), "nccl" in backend,
                   "gloo" in backend or "nccl" not in backend)


@dataclass
class PostedSend:
    work: Any  # None while queued for a batch
    peer: int
    group: ProcessGroup | None
    part: str


@dataclass
class Queued:
    """A steady-stream operation waiting for the next ``flush`` (batched mode)."""

    is_send: bool
    tensor: torch.Tensor
    peer: int
    group: ProcessGroup | None
    target: PostedSend | Incoming  # receives the work object once issued


class AllOf:
    """The works of a batch that a backend returned in another number than its operations:
    each operation waits for all of them."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)
