"""The errors of pipeline message transport: a message that could not be delivered, a wait
that ran out of time, a peer that closed its connection, a message other than the one
expected."""

from __future__ import annotations


class P2PError(RuntimeError):
    """A pipeline message could not be delivered or did not match what was expected.

    ``peer`` is the global rank on the other end, where the error is about one."""

    def __init__(self, message: str, *, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class P2PTimeoutError(P2PError, TimeoutError):
    """A wait ran out of time; the message names the peer and the label."""


class P2PConnectionError(P2PError):
    """The peer closed the connection (its process exited or crashed, or it destroyed the
    process group), so nothing more travels to or from it; ``peer`` names it."""


# How gloo reports a connection that the other end closed (its process exited or crashed,
# or it destroyed the group), as opposed to one this rank closed itself after a timeout.
CLOSED_BY_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe")


def closed_by_peer(cause: BaseException) -> bool:
    text = str(cause).lower()
    return any(sign in text for sign in CLOSED_BY_PEER)


class MessageMismatchError(P2PError):
    """The peer sent something other than what this rank expected."""
