"""The handles ``P2PTransport`` returns: a send's keeps its buffers alive until it completed,
a receive's ``wait`` returns the message (one peer's, or several peers' averaged or listed).
A handle holds its transport (a ``P2PTransport``) and calls its hooks: ``flush``,
``deadline``, ``wait_work``, ``received`` and ``forget_send``."""

from __future__ import annotations

from typing import Any

import torch

from meshpipe.comm.averaging import average_flattened
from meshpipe.comm.p2p_records import Incoming, PostedSend
from meshpipe.comm.wire import describe_label, slot_views, unpack


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

    def __init__(self, transport: Any, sends: list[PostedSend],
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
        """Block until every part of the send has completed (or raise ``P2PTimeoutError``).

        In batched mode the transport's queued operations are issued first."""
        if not self._sends:
            return
        transport = self._transport
        transport.flush()
        deadline = transport.deadline(timeout)
        for send in self._sends:
            transport.wait_work(
                send.work, deadline, send.group, send.peer,
                lambda send=send: f"the {send.part} of {describe_label(self._label)} sent "
                                  f"to rank {send.peer} to be received")
        self._release()

    def is_completed(self) -> bool:
        """True once every part has completed; never blocks (it may issue queued parts)."""
        if any(send.work is None for send in self._sends):
            self._transport.flush()
        if self._sends and all(send.work.is_completed() for send in self._sends):
            for send in self._sends:
                send.work.wait()
            self._release()
        return not self._sends

    def _release(self) -> None:
        self._sends = []
        self._keep_alive = []
        if self._transport is not None:
            self._transport.forget_send(self)


class RecvHandle:
    """Handle of a posted receive; ``wait`` returns the message.

    From one peer it returns that peer's message; from several peers with
    ``average=True`` their mean; from several peers without, a list in peer order.
    """

    _PENDING = object()

    def __init__(self, transport: Any, incomings: list[Incoming], label: str,
                 average: bool, single: bool) -> None:
        self._transport = transport
        self._incomings = incomings
        self._label = label
        self._average = average
        self._single = single
        self._result: Any = self._PENDING

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the message has arrived and return it (in batched mode the
        transport's queued operations are issued first)."""
        if self._result is self._PENDING:
            transport = self._transport
            transport.flush()
            deadline = transport.deadline(timeout)
            parts = [transport.received(incoming, deadline) for incoming in self._incomings]
            peers = [incoming.peer for incoming in self._incomings]
            if self._single:
                self._result = unpack(*parts[0])
            elif self._average:
                self._result = average_flattened(
                    [(layout, slot_views(layout, payload, start))
                     for layout, payload, start, _ in parts],
                    peers, self._label, transport.rank)
            else:
                self._result = [unpack(*part) for part in parts]
            self._incomings = []
        return self._result
