"""What a pipeline transport offers the executor, and the stop notice that travels on it.

``P2PTransport`` (one pipeline), ``VTPTransport`` and ``FanoutTransport`` (stages of
different tensor-parallel sizes) implement ``Transport``; the executor is typed for it, and a
transport of your own needs these five members (``flush`` may do nothing, ``timeout`` may be
None). Ranks are global ranks; ``channel`` names the stream a message belongs to on both
sides; a send's handle is kept by the transport until waited.

The stop notice is the one message the executor sends outside the schedule: a rank that
fails (or learns that a peer failed) sends it in place of the messages its neighbours wait
for, so they stop at once with the first failure's rank and reason instead of timing out.
It is made and recognised here only; a fan-in that averages several links passes it
through unaveraged.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol, runtime_checkable

STOP_NOTICE_KEY = "meshpipe.executor.stopped"


class SendHandle(Protocol):
    def wait(self, timeout: float | None = None) -> None: ...

    def is_completed(self) -> bool: ...


class RecvHandle(Protocol):
    def wait(self, timeout: float | None = None) -> Any: ...


@runtime_checkable
class Transport(Protocol):
    """Posts pipeline messages between global ranks without blocking; only waits block."""

    @property
    def timeout(self) -> float | None:
        """Seconds a wait gives up after by default (None: the process group's timeout)."""
        ...

    def post_send(self, message: Any, dst: int, *, label: str = "",
                  channel: Hashable = None) -> SendHandle: ...

    def post_recv(self, src: int, *, label: str = "", channel: Hashable = None) -> RecvHandle:
        ...

    def flush(self) -> None:
        """Issue what was queued since the last flush; never blocks."""
        ...

    def wait_sends(self, timeout: float | None = None) -> None:
        """Wait for every send posted and not yet waited."""
        ...


def stop_notice(rank: int, reason: str) -> dict[str, dict[str, Any]]:
    """The message that tells a peer to stop: global ``rank`` failed first, for ``reason``."""
    return {STOP_NOTICE_KEY: {"rank": rank, "reason": reason}}


def is_stop_notice(message: Any) -> bool:
    """Whether ``message`` is a stop notice (a dict of exactly its one key)."""
    return isinstance(message, dict) and message.keys() == {STOP_NOTICE_KEY}


def stopped_by(notice: dict[str, dict[str, Any]]) -> tuple[int, str]:
    """The failed rank and the reason a stop notice carries."""
    sender = notice[STOP_NOTICE_KEY]
    return sender["rank"], sender["reason"]
