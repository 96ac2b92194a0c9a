"""Point-to-point transport for pipeline messages (activations forward, gradients backward).

A message is a pytree of tensors and small values (see :mod:`meshpipe.comm.wire`);
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
metadata slot of a per-pair cache of :data:`~meshpipe.comm.wire.METADATA_SLOTS` layouts
(so streams that alternate between layouts send their metadata once) and the new payload
size. The payload rides inside the notice when it fits in the expected size, else it
follows on the *slow path*; the metadata follows on the slow path when it is not cached.
The slow path is the meta group (gloo, CPU tensors) with its own tag, so it never
interleaves with the steady stream; the receiver fetches the follow-ups when it reads the
notice in ``wait``.

Matching: between an ordered pair of ranks, messages are received in the order they were
sent, and the receiver must post its receives from a peer in the order that peer posted the
sends (the executor guarantees it), with the same channel on both sides. A receive can
only be posted once the layout of the previous message on its channel is known; while
that message is not resolved yet (read in a ``wait``), the receive is *deferred*, and so
is every later receive from that peer (point-to-point operations match in posting order;
NCCL has no tags). ``wait`` resolves a peer's messages strictly in posting order, posting
deferred receives as soon as they can be, so handles may be waited in any order. No
thread is involved: everything happens in ``post_*``, ``flush`` and ``wait`` calls.
Messages to a higher rank and messages to a lower rank may travel on two groups
(``reverse_group``), as NCCL needs: there, a receive posted early must not sit on the
stream in front of sends.

Modes: in ``"async"`` mode (the default) every operation is posted at once with
``isend``/``irecv``. In ``"batched"`` mode the steady-stream operations (the one send or
receive of each message on its payload group) are queued when posted and issued together
by :meth:`P2PTransport.flush`, one ``batch_isend_irecv`` per payload group: on NCCL that
is one grouped launch for all the transfers of a schedule's run of SEND/RECV actions.
Slow-path follow-ups and deferred receives are posted one by one. Every wait flushes
first, so a forgotten ``flush`` delays messages but never deadlocks a rank that goes on
to wait.

Ranks are **global** ranks throughout (``dist.get_rank()`` numbering), also when a group
is given. All posting is non-blocking; only ``wait`` blocks. Waits time out through gloo,
which then closes the connection to that peer: a timed-out wait raises
:class:`P2PTimeoutError` naming the peer and the message, and every later receive from
that peer fails at once with an error naming the first failure. An operation with a peer
that closed the connection itself (it exited, crashed or destroyed the group) raises
:class:`P2PConnectionError` naming that peer (``.peer``).

Transports built on this one (:mod:`meshpipe.comm.vtp`) use its public hooks only:
:meth:`P2PTransport.deadline`, :meth:`~P2PTransport.wait_work`,
:meth:`~P2PTransport.count`, :meth:`~P2PTransport.carries_cpu`, :func:`remaining` and
:func:`average_messages`.

Its errors (``errors``), the records it keeps per peer (``p2p_records``), the handles it
returns (``handles``) and the averaging of fan-ins (``averaging``) are modules of their own.
One module because what is left is one state machine: posting, batching, deferring and
resolving receives share each peer's inbox, outbox, expected layouts and queued operations,
which only the transport changes.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as _c10d

from meshpipe.comm.errors import (MessageMismatchError, P2PConnectionError, P2PError,
                                  P2PTimeoutError, closed_by_peer)
from meshpipe.comm.handles import RecvHandle, SendHandle
from meshpipe.comm.p2p_records import (AllOf, GroupInfo, Inbox, Incoming, Outbox, Part,
                                       PostedSend, Queued, TransportStats)
from meshpipe.comm.wire import (HEADER_NBYTES, SLOW_TAG, STEADY_SLOT, STEADY_TAG, Expected, Header,
                                MessageLayout, UnsupportedMessageError, capacity, describe_label,
                                flatten, host_message, label_digest, layout_for, new_buffer,
                                pack_into, unpack)

GroupArg = ProcessGroup | Sequence[ProcessGroup] | None
MODES = ("async", "batched")


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
    ``device``; received tensors are delivered on ``deliver_to`` (default ``device``): ranks
    that share a GPU over gloo send from host buffers (``device="cpu"``) and get their
    messages on the GPU (one copy of each payload). ``timeout`` (seconds) is the default of
    every ``wait``; None leaves it to the process group's own timeout. With
    ``check_labels``, a receive whose label differs from the label the peer sent with (both
    non-empty) raises :class:`MessageMismatchError`: give a send and its receive the same
    label. ``mode`` is ``"async"`` (post every operation at
    once) or ``"batched"`` (queue the steady operations until :meth:`flush`; see the module
    doc).

    A wait that times out raises :class:`P2PTimeoutError`; gloo has then closed the group's
    connection to that peer, so later receives from it fail at once (see the module doc).
    """

    def __init__(self, group: ProcessGroup | None = None, *,
                 reverse_group: ProcessGroup | None = None,
                 meta_group: ProcessGroup | None = None,
                 device: torch.device | str = "cpu", timeout: float | None = None,
                 check_labels: bool = True, mode: str = "async",
                 deliver_to: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("P2PTransport needs torch.distributed to be initialised: call "
                               "dist.init_process_group first")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive seconds or None, got {timeout}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        self.rank = dist.get_rank()
        self.mode = mode
        self._batched = mode == "batched"
        self._groups: dict[Any, GroupInfo] = {}
        self._route_cache: dict[tuple, tuple[list[int], list[ProcessGroup | None]]] = {}
        self.group = group
        self.reverse_group = self._checked_reverse_group(group, reverse_group)
        if meta_group is None:
            if not self.carries_cpu(group):
                raise ValueError(
                    f"rank {self.rank}: the payload group uses {dist.get_backend(group)}, "
                    "which cannot carry the CPU metadata; pass meta_group=<a gloo group over "
                    "the same ranks> (dist.new_group(ranks, backend='gloo'))")
            meta_group = group
        elif not self.carries_cpu(meta_group):
            raise ValueError(f"rank {self.rank}: meta_group must be a CPU (gloo) group, got "
                             f"backend {dist.get_backend(meta_group)}")
        self.meta_group = meta_group
        self.device = _resolve_device(device)
        self.deliver_to = self.device if deliver_to is None else _resolve_device(deliver_to)
        self.timeout = timeout
        self.check_labels = check_labels
        self.stats = TransportStats()
        self._outboxes: dict[int, Outbox] = {}
        self._inboxes: dict[int, Inbox] = {}
        # In-flight sends, oldest first: gloo cancels a send whose work object is destroyed,
        # so the transport, not the caller, keeps every send alive until it is waited.
        self._pending_sends: dict[SendHandle, None] = {}
        # Batched mode: steady operations posted since the last flush, in posting order.
        self._queued: list[Queued] = []

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
                f"rank {self.rank}: cannot send {describe_label(label)} to rank(s) {peers}: "
                f"{error}") from None
        digest = label_digest(label)
        sends: list[PostedSend] = []
        keep_alive: list[torch.Tensor] = []
        batched = self._batched
        for peer, payload_group in zip(peers, groups):
            outbox = self._outboxes.get(peer) or self._outboxes.setdefault(peer, Outbox())
            parts = self._wire_parts(outbox, channel, layout, tensors, digest, payload_group)
            outbox.seq += 1
            for part in parts:
                if batched and part.tag == STEADY_TAG:
                    send = PostedSend(None, peer, part.group, part.name)
                    self._queued.append(Queued(True, part.tensor, peer, part.group, send))
                else:
                    try:
                        work = dist.isend(part.tensor, dst=peer, group=part.group,
                                          tag=part.tag)
                    except RuntimeError as cause:
                        raise self._failure(cause, peer, f"posting the {part.name} of "
                                            f"{describe_label(label)} to rank {peer}"
                                            ) from cause
                    send = PostedSend(work, peer, part.group, part.name)
                sends.append(send)
                keep_alive.append(part.tensor)
        handle = SendHandle(self, sends, keep_alive, label)
        self._pending_sends[handle] = None
        return handle

    def _wire_parts(self, outbox: Outbox, channel: Hashable, layout: MessageLayout,
                    tensors: list[torch.Tensor], digest: int,
                    payload_group: ProcessGroup | None) -> list[Part]:
        """The operations that carry one message to one peer; updates what it expects.

        The first part is the steady-stream one (message or layout-change notice, on the
        payload group); the others are slow-path follow-ups on the meta group."""
        expected = outbox.expected.get(channel)
        payload_nbytes = layout.payload_nbytes
        if expected is not None and (expected.layout is layout
                                     or expected.layout.encoded == layout.encoded):
            buffer = self._message_buffer(
                Header(outbox.seq, STEADY_SLOT, 0, payload_nbytes, digest, expected.digest),
                layout, tensors)
            stats = self.stats  # the steady path counts inline: it runs for every message
            stats.messages_sent += 1
            stats.sends_posted += 1
            stats.header_bytes_sent += HEADER_NBYTES
            stats.payload_bytes_sent += payload_nbytes
            return [Part("message", buffer, payload_group, STEADY_TAG)]
        room = capacity(expected)
        buffer = torch.empty(HEADER_NBYTES + room, dtype=torch.uint8, device=self.device)
        body = buffer[HEADER_NBYTES:]
        changed = outbox.expected[channel] = Expected.of(layout)
        slot, is_new = outbox.slots.assign(layout.encoded)
        metadata_nbytes = len(layout.encoded) if is_new else 0
        Header(outbox.seq, slot, metadata_nbytes, payload_nbytes, digest,
               changed.digest).write_into(buffer)
        meta_group = self._meta_group_for(payload_group)
        parts = [Part("layout-change notice", buffer, payload_group, STEADY_TAG)]
        if is_new:
            metadata = torch.frombuffer(bytearray(layout.encoded), dtype=torch.uint8)
            parts.append(Part("metadata", metadata, meta_group, SLOW_TAG))
        if payload_nbytes <= room:
            pack_into(layout, tensors, body)
        else:
            payload = _host_bytes(payload_nbytes)
            pack_into(layout, tensors, payload)
            parts.append(Part("payload", payload, meta_group, SLOW_TAG))
        self.count(messages_sent=1, layout_changes_sent=1, sends_posted=len(parts),
                   header_bytes_sent=HEADER_NBYTES, metadata_sent=int(is_new),
                   metadata_bytes_sent=metadata_nbytes, payload_bytes_sent=payload_nbytes)
        return parts

    def _message_buffer(self, header: Header, layout: MessageLayout,
                        tensors: list[torch.Tensor]) -> torch.Tensor:
        """A steady message: ``header`` and the payload in one new buffer on the device."""
        if self.device.type == "cpu":
            return host_message(header, layout, tensors)
        buffer = torch.empty(HEADER_NBYTES + layout.payload_nbytes, dtype=torch.uint8,
                             device=self.device)
        header.write_into(buffer)
        pack_into(layout, tensors, buffer[HEADER_NBYTES:])
        return buffer

    def wait_sends(self, timeout: float | None = None) -> None:
        """Wait for every send posted so far that has not been waited (e.g. at step end)."""
        self.flush()
        deadline = self.deadline(timeout)
        for handle in list(self._pending_sends):
            handle.wait(remaining(deadline))

    # -- batching ----------------------------------------------------------------------

    def flush(self) -> None:
        """Issue the operations queued since the last flush (batched mode): one
        ``batch_isend_irecv`` per payload group, in posting order. Never blocks; a no-op in
        async mode or with nothing queued. Call it once a run of posts is complete (the
        executor does, after each run of SEND/RECV actions); every wait also calls it."""
        queued = self._queued
        if not queued:
            return
        self._queued = []
        batches: dict[Any, list[Queued]] = {}
        for item in queued:  # torch wants one group (and one device) per call
            batches.setdefault((item.group, item.tensor.device), []).append(item)
        for (group, _), items in batches.items():
            ops = [dist.P2POp(_c10d.isend if item.is_send else _c10d.irecv, item.tensor,
                              item.peer, group=group, tag=STEADY_TAG) for item in items]
            try:
                works = list(dist.batch_isend_irecv(ops))
            except RuntimeError as cause:
                peers = sorted({item.peer for item in items})
                raise self._failure(cause, peers[0] if len(peers) == 1 else None,
                                    f"posting a batch of {len(items)} operations with ranks "
                                    f"{peers}") from cause
            if len(works) != len(items):  # a coalescing backend (NCCL): one work per batch
                shared = works[0] if len(works) == 1 else AllOf(works)
                works = [shared] * len(items)
            for item, work in zip(items, works):
                item.target.work = work
            self.count(batches_posted=1, ops_batched=len(items))

    # -- receiving ---------------------------------------------------------------------

    def post_recv(self, src: int | Sequence[int], *, label: str = "", group: GroupArg = None,
                  average: bool = False, channel: Hashable = None) -> RecvHandle:
        """Post the receive of one message from global rank ``src`` (or from each of several).

        ``channel`` must be the one the peer sends the message on. With several sources
        (each with its own group when ``group`` is a sequence, as when one stage is fed by
        several pipeline groups), ``average=True`` makes ``wait`` return the mean (see
        :func:`average_messages`): floating tensors are averaged with float32 (or wider)
        accumulation and returned in their own dtype; integer and bool tensors and
        non-tensor leaves must be equal across sources and pass through.
        """
        peers, groups = self._routes(src, group, "src")
        inboxes = [self._inboxes.get(peer) or self._inboxes.setdefault(peer, Inbox(peer))
                   for peer in peers]
        for inbox in inboxes:
            self._raise_if_failed(inbox, label)
        incomings = []
        for inbox, payload_group in zip(inboxes, groups):
            incoming = Incoming(inbox.peer, payload_group, self._meta_group_for(payload_group),
                                 label, channel)
            inbox.queue.append(incoming)
            if inbox.deferred or inbox.channel(channel).outstanding:
                inbox.deferred.append(incoming)
                self.count(recvs_deferred=1)
            else:
                self._post_steady_recv(inbox, incoming, self._batched)
            incomings.append(incoming)
        return RecvHandle(self, incomings, label, average, single=isinstance(src, int))

    def _post_steady_recv(self, inbox: Inbox, incoming: Incoming, queue: bool) -> None:
        """Post (or queue for the next flush) the one receive of ``incoming``, sized for its
        channel's expected layout."""
        state = inbox.channel(incoming.channel)
        incoming.expected = state.expected
        incoming.buffer, incoming.host = new_buffer(HEADER_NBYTES + capacity(state.expected),
                                                    self.device)
        if queue:
            self._queued.append(Queued(False, incoming.buffer, incoming.peer, incoming.group,
                                        incoming))
        else:
            try:
                incoming.work = dist.irecv(incoming.buffer, src=incoming.peer,
                                           group=incoming.group, tag=STEADY_TAG)
            except RuntimeError as cause:
                raise self._failure(cause, incoming.peer, f"posting the receive of "
                                    f"{describe_label(incoming.label)} from rank "
                                    f"{incoming.peer}") from cause
        state.outstanding += 1
        self.stats.recvs_posted += 1

    def _complete(self, incoming: Incoming, deadline: float | None
                  ) -> tuple[MessageLayout, torch.Tensor, int, numpy.ndarray | None]:
        """Resolve the peer's messages up to ``incoming``; its layout, the buffer its
        payload is in, the payload's first byte there and the buffer's numpy array."""
        inbox = self._inboxes[incoming.peer]
        while not incoming.resolved:
            self._raise_if_failed(inbox, incoming.label)
            self._resolve_next(inbox, incoming, deadline)
        if incoming.error is not None:
            raise incoming.error
        return (incoming.layout, *incoming.payload)

    def _resolve_next(self, inbox: Inbox, waited: Incoming, deadline: float | None) -> None:
        """Wait for the peer's oldest unresolved message and read it (its receive is posted:
        a deferred receive is posted as soon as every earlier message is resolved)."""
        head = inbox.queue[0]
        if head.work is None:  # queued in batched mode
            self.flush()

        def describe() -> str:
            what = f"{describe_label(waited.label)} from rank {head.peer}"
            if head is waited:
                return what
            return (f"{what}, behind the earlier message {describe_label(head.label)} "
                    "(messages from one rank are resolved in posting order)")

        def fail(error: P2PError) -> None:
            inbox.failure = error

        self.wait_work(head.work, deadline, head.group, head.peer, describe, on_failure=fail)
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
        head.buffer = head.host = head.work = None
        while inbox.deferred and not inbox.channel(inbox.deferred[0].channel).outstanding:
            self._post_steady_recv(inbox, inbox.deferred.popleft(), queue=False)

    def _read(self, inbox: Inbox, head: Incoming, deadline: float | None) -> None:
        """Read the arrived message ``head``: its header, layout, payload and label check."""
        peer = head.peer

        def corrupt(reason: str) -> MessageMismatchError:
            return MessageMismatchError(
                f"rank {self.rank} receiving {describe_label(head.label)} from rank {peer}: "
                f"{reason}. The two ranks' transports are out of step (was one of them "
                "re-created, do they name the message's channel alike, or does another "
                "component use the same group for sends?)")

        header = Header.read_from(head.buffer, head.host)
        if header.seq != inbox.seq:
            raise corrupt(f"the header says message #{header.seq}, expected #{inbox.seq}")
        state = inbox.channel(head.channel)
        if header.slot == STEADY_SLOT:
            expected = head.expected
            if expected is None or (header.layout_digest, header.payload_nbytes) != (
                    expected.digest, expected.layout.payload_nbytes):
                raise corrupt("the message claims the layout this rank expected on its "
                              "channel, but it is not that layout")
            head.layout = expected.layout
            head.payload = (head.buffer, HEADER_NBYTES, head.host)
        else:
            head.layout = layout_for(header, inbox.slots,
                                     lambda nbytes: self._fetch_metadata(head, nbytes,
                                                                         deadline),
                                     corrupt)
            expected = Expected.of(head.layout)
            nbytes = header.payload_nbytes
            if HEADER_NBYTES + nbytes <= head.buffer.numel():
                head.payload = (head.buffer, HEADER_NBYTES, head.host)
            else:
                head.payload = (self._fetch_payload(head, nbytes, deadline), 0, None)
            self.count(layout_changes_received=1)
        state.expected = expected
        stats = self.stats
        stats.messages_received += 1
        stats.header_bytes_received += HEADER_NBYTES
        stats.payload_bytes_received += header.payload_nbytes
        if self.check_labels and head.digest and header.label_digest and (
                head.digest != header.label_digest):
            head.error = MessageMismatchError(
                f"rank {self.rank} expected {describe_label(head.label)} from rank {peer}, "
                f"but the message rank {peer} sent at this point (#{header.seq} between "
                "them) carries a different label: the two ranks post their sends and "
                "receives in different orders; check that their schedules match")

    def _fetch_metadata(self, head: Incoming, nbytes: int, deadline: float | None
                        ) -> torch.Tensor:
        data = self._fetch_slow(head, _host_bytes(nbytes), "metadata", deadline)
        self.count(metadata_received=1, metadata_bytes_received=nbytes)
        return data

    def _fetch_payload(self, head: Incoming, nbytes: int, deadline: float | None
                       ) -> torch.Tensor:
        payload = self._fetch_slow(head, _host_bytes(nbytes), "payload", deadline)
        return payload.to(self.device)

    def _fetch_slow(self, head: Incoming, buffer: torch.Tensor, part: str,
                    deadline: float | None) -> torch.Tensor:
        """Receive one slow-path follow-up of ``head`` into the CPU ``buffer``."""
        try:
            work = dist.irecv(buffer, src=head.peer, group=head.meta_group, tag=SLOW_TAG)
        except RuntimeError as cause:
            raise self._failure(cause, head.peer, f"posting the receive of the {part} of "
                                f"{describe_label(head.label)} from rank {head.peer}"
                                ) from cause
        self.count(recvs_posted=1)
        self.wait_work(work, deadline, head.meta_group, head.peer,
                       lambda: f"the {part} of {describe_label(head.label)} from rank "
                               f"{head.peer}")
        return buffer

    def received(self, incoming: Incoming, deadline: float | None
                 ) -> tuple[MessageLayout, torch.Tensor, int, numpy.ndarray | None]:
        """The message ``incoming`` once it arrived (every earlier one from its peer
        resolved first): its layout, and its payload on ``deliver_to``."""
        return self._delivered(*self._complete(incoming, deadline))

    def forget_send(self, handle: SendHandle) -> None:
        """``handle``'s send completed: the transport no longer keeps it alive."""
        self._pending_sends.pop(handle, None)

    def _delivered(self, layout: MessageLayout, payload: torch.Tensor, start: int,
                   host: numpy.ndarray | None
                   ) -> tuple[MessageLayout, torch.Tensor, int, numpy.ndarray | None]:
        """A received payload moved to ``deliver_to`` where it arrived elsewhere."""
        if payload.device == self.deliver_to or not layout.payload_nbytes:
            return layout, payload, start, host
        moved = payload[start:start + layout.payload_nbytes].to(self.deliver_to)
        return layout, moved, 0, None

    # -- hooks for transports built on this one (meshpipe.comm.vtp) --------------------

    def unpack(self, layout: MessageLayout, payload: torch.Tensor) -> Any:
        """The message of a payload this rank received by other means (a broadcast inside
        a stage), its tensors on ``deliver_to``."""
        return unpack(*self._delivered(layout, payload, 0, None))

    def deadline(self, timeout: float | None) -> float | None:
        """The ``time.monotonic()`` instant a wait with ``timeout`` seconds ends (None: the
        transport's default timeout; None when neither is set)."""
        seconds = self.timeout if timeout is None else timeout
        return None if seconds is None else time.monotonic() + seconds

    def wait_work(self, work: Any, deadline: float | None, group: ProcessGroup | None,
                  peer: int, describe: Callable[[], str],
                  on_failure: Callable[[P2PError], None] | None = None) -> None:
        """Wait for one posted operation (a ``Work``) until ``deadline``, turning timeouts
        and failures into :class:`P2PTimeoutError` / :class:`P2PError` that name ``peer``
        and ``describe()``; ``on_failure(error)`` runs before the error is raised."""
        stream_ordered = self.device.type == "cuda" and self._group_info(group).uses_nccl
        try:
            if deadline is None or stream_ordered:
                work.wait()
            else:
                work.wait(timedelta(seconds=remaining(deadline)))
        except RuntimeError as cause:
            timed_out = (deadline is not None and time.monotonic() >= deadline) or (
                "timed out" in str(cause).lower())
            if timed_out:
                error: P2PError = P2PTimeoutError(
                    f"rank {self.rank} timed out waiting for {describe()}: rank {peer} did "
                    "not post the matching operation in time; check that both ranks run "
                    f"matching schedules and that rank {peer} is alive. The connection to "
                    f"rank {peer} is unusable now", peer=peer)
            else:
                error = self._failure(cause, peer, f"waiting for {describe()}")
            if on_failure is not None:
                on_failure(error)
            raise error from cause

    def count(self, **amounts: int) -> None:
        """Add ``amounts`` to the :class:`TransportStats` counters of the same names."""
        stats = self.stats
        for name, amount in amounts.items():
            setattr(stats, name, getattr(stats, name) + amount)

    def carries_cpu(self, group: ProcessGroup | None) -> bool:
        """Whether ``group`` (None: the default group) can carry CPU tensors (gloo)."""
        return self._group_info(group).carries_cpu

    # -- shared helpers ----------------------------------------------------------------

    def _routes(self, peers: int | Sequence[int], group: GroupArg, role: str
                ) -> tuple[list[int], list[ProcessGroup | None]]:
        """The checked peers and their payload groups (don't modify them: the routes to
        one peer are remembered, as every message of a pipeline takes one of a few)."""
        if type(peers) is not int or not (group is None or isinstance(group, ProcessGroup)):
            return self._checked_routes(peers, group, role)
        key = (peers, group, role)
        routes = self._route_cache.get(key)
        if routes is None:
            routes = self._route_cache[key] = self._checked_routes(peers, group, role)
        return routes

    def _checked_routes(self, peers: int | Sequence[int], group: GroupArg, role: str
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
                or not self.carries_cpu(payload_group)):
            return self.meta_group
        return payload_group

    def _group_info(self, group: ProcessGroup | None) -> GroupInfo:
        info = self._groups.get(group)
        if info is None:
            info = self._groups[group] = GroupInfo.of(group)
        return info

    def _raise_if_failed(self, inbox: Inbox, label: str) -> None:
        if inbox.failure is not None:
            kind = (P2PConnectionError if isinstance(inbox.failure, P2PConnectionError)
                    else P2PError)
            raise kind(
                f"rank {self.rank}: cannot receive {describe_label(label)} from rank "
                f"{inbox.peer}: receiving from it failed earlier ({inbox.failure})",
                peer=inbox.peer) from inbox.failure

    def _failure(self, cause: BaseException, peer: int | None, doing: str) -> P2PError:
        """The error for an operation with ``peer`` that torch.distributed refused or failed
        (not a timeout): a :class:`P2PConnectionError` where the peer closed the connection."""
        if peer is not None and closed_by_peer(cause):
            return P2PConnectionError(
                f"rank {self.rank} failed {doing}: rank {peer} closed the connection (its "
                f"process exited or crashed, or it destroyed the process group): {cause}",
                peer=peer)
        return P2PError(f"rank {self.rank} failed {doing}: {cause}", peer=peer)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (at least a millisecond); None without a deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def _host_bytes(nbytes: int) -> torch.Tensor:
    """A CPU byte buffer for the slow path (the meta group is gloo, on the host)."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu")


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
