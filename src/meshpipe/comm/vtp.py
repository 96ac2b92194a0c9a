"""Pipeline messages between stages of different tensor-parallel sizes (VTP).

``stage_ranks[s]`` lists the global ranks of pipeline position ``s`` (its tensor-parallel
ranks, in tp-rank order). Tensor parallelism makes a stage's output identical on all its
ranks, so a message between two positions can travel two ways:

* :class:`VTPTransport` (*root*): only the first rank of each position (its root) talks to
  other positions; a receiving position's root then broadcasts the message inside its
  position. One transfer per message between positions, plus a broadcast.
* :class:`FanoutTransport` (*fanout*): every rank is linked to ranks of the neighbouring
  position (:meth:`FanoutTransport.links`); a send goes to every linked rank and a receive
  from several links returns their mean. No collective inside a position, more transfers.

Both are built on :class:`~meshpipe.comm.p2p.P2PTransport` through its public API only
(``post_send``, ``post_recv``, ``wait_sends``, ``flush`` and the hooks ``deadline``,
``wait_work``, ``count``, ``carries_cpu``), take its ``mode`` ("async" or "batched") and
have the interface the executor needs (``post_send``, ``post_recv``, ``wait_sends``,
``flush``). Positions are named by any of their global ranks. Nothing assumes that a
message goes from a lower to a higher position: the wrap-around placement (the last
position sends back to position 0) works like any other.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from meshpipe.comm.averaging import average_messages
from meshpipe.comm.errors import MessageMismatchError, P2PError
from meshpipe.comm.handles import RecvHandle, SendHandle
from meshpipe.comm.p2p import GroupArg, P2PTransport, remaining
from meshpipe.comm.p2p_records import TransportStats
from meshpipe.comm.transport import is_stop_notice
from meshpipe.comm.wire import (
    HEADER_NUMEL,
    ROOT_FAILED_SLOT,
    Header,
    ReceiverSlots,
    SenderSlots,
    UnsupportedMessageError,
    describe_label,
    flatten,
    label_digest,
    layout_digest,
    layout_for,
    pack,
)


def validate_stages(stage_ranks: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``stage_ranks`` as tuples, after checking that every position has distinct global
    ranks that no other position has."""
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


def linked_ranks(stage_ranks: Sequence[Sequence[int]], rank: int, stage: int) -> list[int]:
    """The global ranks of position ``stage`` that ``rank`` is linked to by the fanout rule,
    in tp-rank order: tp rank ``j`` of the bigger of two positions (sizes ``big`` and
    ``small``) is linked to tp rank ``j * small // big`` of the smaller one."""
    own = next((s for s, ranks in enumerate(stage_ranks) if rank in ranks), None)
    if own is None:
        raise ValueError(f"rank {rank} is in no stage of {[list(r) for r in stage_ranks]}")
    if not 0 <= stage < len(stage_ranks) or stage == own:
        raise ValueError(f"stage {stage} is not another stage of {len(stage_ranks)} for rank "
                         f"{rank} (in stage {own})")
    mine, theirs = stage_ranks[own], stage_ranks[stage]
    j, a, b = list(mine).index(rank), len(mine), len(theirs)
    if a >= b:
        return [theirs[j * b // a]]
    return [theirs[k] for k in range(b) if k * a // b == j]


class _Stages:
    """The map of positions to ranks shared by both transports."""

    def __init__(self, stage_ranks: Sequence[Sequence[int]], rank: int) -> None:
        self.rank = rank
        self.stage_ranks = validate_stages(stage_ranks)
        self._stage_of = {r: s for s, ranks in enumerate(self.stage_ranks) for r in ranks}
        if rank not in self._stage_of:
            raise ValueError(f"rank {rank} is in no stage of stage_ranks {self._listed()}")
        self.stage_index = self._stage_of[rank]

    def _listed(self) -> list[list[int]]:
        return [list(ranks) for ranks in self.stage_ranks]

    def stage_of(self, rank: Any) -> int:
        stage = self._stage_of.get(rank) if type(rank) is int else None
        if stage is None:
            raise ValueError(f"rank {self.rank}: peer {rank!r} is in no stage of "
                             f"{self._listed()}")
        return stage

    def peer_stage(self, rank: Any) -> int:
        stage = self.stage_of(rank)
        if stage == self.stage_index:
            raise ValueError(f"rank {self.rank}: peer {rank} is in this rank's own stage "
                             f"{stage}; pipeline messages go to another stage")
        return stage


# -- root: the stage root talks, then broadcasts inside its stage --------------------------

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
    """Pipeline messages between stages of different tensor-parallel sizes, root + broadcast.

    ``stage_ranks[s]`` lists the global ranks of stage ``s``; its first rank is the stage
    root. Only stage roots talk to each other (through a :class:`P2PTransport` over
    ``group``); a receiving stage's root then broadcasts the message (structure and tensors)
    to the other ranks of its stage over ``intra_group`` when the handle is waited. Sends
    by ranks that are not stage roots post nothing. ``dst``/``src`` are global ranks of any
    member of the peer stage. ``intra_group`` is this rank's stage group (needed when the
    stage has several ranks); ``intra_meta_group`` carries its headers and metadata and
    defaults to ``intra_group`` when that one is a CPU group. ``mode`` is the
    :class:`P2PTransport` mode ("async" or "batched").
    """

    def __init__(self, stage_ranks: Sequence[Sequence[int]],
                 intra_group: ProcessGroup | None = None, *,
                 group: ProcessGroup | None = None,
                 reverse_group: ProcessGroup | None = None,
                 meta_group: ProcessGroup | None = None,
                 intra_meta_group: ProcessGroup | None = None,
                 device: torch.device | str = "cpu", timeout: float | None = None,
                 check_labels: bool = True, mode: str = "async",
                 deliver_to: torch.device | str | None = None) -> None:
        self.p2p = P2PTransport(group, reverse_group=reverse_group, meta_group=meta_group,
                                device=device, timeout=timeout, check_labels=check_labels,
                                mode=mode, deliver_to=deliver_to)
        self.rank = self.p2p.rank
        self.mode = mode
        self.stats: TransportStats = self.p2p.stats
        self._stages = _Stages(stage_ranks, self.rank)
        self.stage_ranks = self._stages.stage_ranks
        self.stage_index = self._stages.stage_index
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
                if not self.p2p.carries_cpu(intra_group):
                    raise ValueError(f"rank {self.rank}: intra_group cannot carry CPU "
                                     "headers; pass intra_meta_group (a gloo stage group)")
                self.intra_meta_group = intra_group
        self._broadcast_seq = 0
        self._broadcast_sender_slots = SenderSlots()
        self._broadcast_receiver_slots = ReceiverSlots()
        self._broadcast_failure: P2PError | None = None

    def stage_of(self, rank: int) -> int:
        """The stage (pipeline position) of global rank ``rank``."""
        return self._stages.stage_of(rank)

    def post_send(self, message: Any, dst: int | Sequence[int], *, label: str = "",
                  group: GroupArg = None, channel: Hashable = None) -> SendHandle:
        """Post a send to the stage(s) holding global rank(s) ``dst``; only the root posts."""
        roots = self._roots(dst)
        if not self.is_stage_root:
            try:
                flatten(message)
            except UnsupportedMessageError as error:
                raise UnsupportedMessageError(
                    f"rank {self.rank}: cannot send {describe_label(label)}: {error}"
                ) from None
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

    @property
    def timeout(self) -> float | None:
        """The default timeout of every wait (the inner transport's)."""
        return self.p2p.timeout

    def flush(self) -> None:
        """Issue the queued operations (batched mode; see ``P2PTransport.flush``)."""
        self.p2p.flush()

    def _roots(self, peers: int | Sequence[int]) -> int | list[int]:
        if isinstance(peers, int):
            return self.stage_ranks[self._stages.peer_stage(peers)][0]
        return [self.stage_ranks[self._stages.peer_stage(rank)][0] for rank in peers]

    def _deliver(self, inner: RecvHandle | None, label: str, timeout: float | None) -> Any:
        deadline = self.p2p.deadline(timeout)
        if len(self.stage_ranks[self.stage_index]) == 1:
            return inner.wait(timeout)
        if self._broadcast_failure is not None:
            raise P2PError(f"rank {self.rank}: cannot deliver {describe_label(label)} inside "
                           f"stage {self.stage_index}: an earlier broadcast failed "
                           f"({self._broadcast_failure})") from self._broadcast_failure
        if self.is_stage_root:
            try:
                message = inner.wait(remaining(deadline))
            except P2PError:
                self._broadcast_root_failure(label, deadline)
                raise
            self._broadcast_from_root(message, label, deadline)
            return message
        return self._broadcast_to_member(label, deadline)

    def _broadcast_root_failure(self, label: str, deadline: float | None) -> None:
        """Tell the stage's other ranks that the root could not receive, so they fail fast."""
        header = Header(self._broadcast_seq, ROOT_FAILED_SLOT, 0, 0, label_digest(label), 0)
        self._broadcast_seq += 1
        self._broadcast(header.to_tensor(), self.intra_meta_group, deadline, "header", label)

    def _broadcast_from_root(self, message: Any, label: str, deadline: float | None) -> None:
        layout, tensors = flatten(message)
        slot, is_new = self._broadcast_sender_slots.assign(layout.encoded)
        header = Header(self._broadcast_seq, slot, len(layout.encoded) if is_new else 0,
                        layout.payload_nbytes, label_digest(label),
                        layout_digest(layout.encoded))
        self._broadcast_seq += 1
        self._broadcast(header.to_tensor(), self.intra_meta_group, deadline, "header", label)
        if is_new:
            metadata = torch.frombuffer(bytearray(layout.encoded), dtype=torch.uint8)
            self._broadcast(metadata, self.intra_meta_group, deadline, "metadata", label)
            self.p2p.count(broadcast_metadata=1)
        if layout.payload_nbytes:
            self._broadcast(pack(layout, tensors, self.p2p.device), self.intra_group, deadline,
                            "payload", label)
        self.p2p.count(broadcasts=1)

    def _broadcast_to_member(self, label: str, deadline: float | None) -> Any:
        raw_header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device="cpu")
        self._broadcast(raw_header, self.intra_meta_group, deadline, "header", label)
        header = Header.from_tensor(raw_header)

        def corrupt(reason: str) -> MessageMismatchError:
            self._broadcast_failure = MessageMismatchError(
                f"rank {self.rank} receiving {describe_label(label)} inside stage "
                f"{self.stage_index} from rank {self.stage_root}: {reason}; the ranks of the "
                "stage are out of step")
            return self._broadcast_failure

        def fetch_metadata(nbytes: int) -> torch.Tensor:
            data = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
            self._broadcast(data, self.intra_meta_group, deadline, "metadata", label)
            self.p2p.count(broadcast_metadata=1)
            return data

        if header.seq != self._broadcast_seq:
            raise corrupt(f"broadcast #{header.seq} arrived, expected #{self._broadcast_seq}")
        self._broadcast_seq += 1
        if header.slot == ROOT_FAILED_SLOT:
            raise P2PError(f"rank {self.rank} cannot receive {describe_label(label)}: its "
                           f"stage root rank {self.stage_root} failed to receive the message "
                           "that it would have broadcast; see rank "
                           f"{self.stage_root}'s error")
        layout = layout_for(header, self._broadcast_receiver_slots, fetch_metadata, corrupt)
        payload = torch.empty(header.payload_nbytes, dtype=torch.uint8, device=self.p2p.device)
        if header.payload_nbytes:
            self._broadcast(payload, self.intra_group, deadline, "payload", label)
        self.p2p.count(broadcasts=1)
        digest = label_digest(label)
        if self.p2p.check_labels and digest and header.label_digest and (
                digest != header.label_digest):
            raise MessageMismatchError(
                f"rank {self.rank} waited {describe_label(label)} but its stage root rank "
                f"{self.stage_root} broadcast a message with a different label: the ranks "
                f"of stage {self.stage_index} must wait their receives in the same order")
        return self.p2p.unpack(layout, payload)

    def _broadcast(self, tensor: torch.Tensor, group: ProcessGroup | None,
                   deadline: float | None, part: str, label: str) -> None:
        work = dist.broadcast(tensor, src=self.stage_root, group=group, async_op=True)

        def fail(error: P2PError) -> None:
            self._broadcast_failure = error

        self.p2p.wait_work(
            work, deadline, group, self.stage_root,
            lambda: f"the {part} of {describe_label(label)} broadcast inside stage "
                    f"{self.stage_index} by rank {self.stage_root}",
            on_failure=fail)


# -- fanout: every rank linked to ranks of the neighbour stage ----------------------------

class FanoutRecvHandle:
    """Handle of a fan-in: ``wait`` returns the mean of the linked ranks' messages."""

    _PENDING = object()

    def __init__(self, transport: "FanoutTransport", inner: RecvHandle, peers: list[int],
                 label: str) -> None:
        self._transport = transport
        self._inner = inner
        self._peers = peers
        self._label = label
        self._result: Any = self._PENDING

    def wait(self, timeout: float | None = None) -> Any:
        """Block until every linked rank's message has arrived; their mean (the message
        itself from a single link; a stop notice from any link is returned as it is)."""
        if self._result is self._PENDING:
            received = self._inner.wait(timeout)
            if len(self._peers) == 1:
                self._result = received
            else:
                transport = self._transport
                self._result = average_messages(received, self._peers, self._label,
                                                rank=transport.rank,
                                                passthrough=transport.passthrough)
            self._inner = None
        return self._result


class FanoutTransport:
    """Pipeline messages between stages of different tensor-parallel sizes, without a root.

    ``stage_ranks[s]`` lists the global ranks of pipeline position ``s`` in tp-rank order.
    Between positions of sizes ``a`` and ``b`` (``big = max``, ``small = min``), tp rank
    ``j`` of the bigger one is linked to tp rank ``j * small // big`` of the smaller one:
    each rank of the bigger position has one link there, each rank of the smaller one about
    ``big / small`` (equal sizes: ``j <-> j``). ``post_send(message, dst)`` (``dst``: any
    global rank of the peer position) sends to every linked rank of that position;
    ``post_recv(src)`` receives from every linked rank of it and ``wait`` returns their
    mean (:func:`~meshpipe.comm.averaging.average_messages`: floating tensors averaged in
    float32, everything else must be equal), or the one message of a single link. A
    message for which ``passthrough(message)`` is true (default: the executor's stop
    notice) is returned from a fan-in as it is, so a failure crosses it.

    ``group``, ``reverse_group``, ``meta_group``, ``device``, ``timeout``, ``check_labels``
    and ``mode`` are those of :class:`~meshpipe.comm.p2p.P2PTransport`; the groups must
    hold every rank of ``stage_ranks`` (default: the default group).
    """

    def __init__(self, stage_ranks: Sequence[Sequence[int]], *,
                 group: ProcessGroup | None = None,
                 reverse_group: ProcessGroup | None = None,
                 meta_group: ProcessGroup | None = None,
                 device: torch.device | str = "cpu", timeout: float | None = None,
                 check_labels: bool = True, mode: str = "async",
                 deliver_to: torch.device | str | None = None,
                 passthrough: Callable[[Any], bool] | None = is_stop_notice) -> None:
        self.p2p = P2PTransport(group, reverse_group=reverse_group, meta_group=meta_group,
                                device=device, timeout=timeout, check_labels=check_labels,
                                mode=mode, deliver_to=deliver_to)
        self.rank = self.p2p.rank
        self.mode = mode
        self.passthrough = passthrough
        self.stats: TransportStats = self.p2p.stats
        self._stages = _Stages(stage_ranks, self.rank)
        self.stage_ranks = self._stages.stage_ranks
        self.stage_index = self._stages.stage_index
        self.tp_index = self.stage_ranks[self.stage_index].index(self.rank)
        self._links: dict[int, list[int]] = {}

    @property
    def timeout(self) -> float | None:
        """The default timeout of every wait (the inner transport's)."""
        return self.p2p.timeout

    def stage_of(self, rank: int) -> int:
        """The stage (pipeline position) of global rank ``rank``."""
        return self._stages.stage_of(rank)

    def links(self, stage: int, rank: int | None = None) -> list[int]:
        """The global ranks of ``stage`` that ``rank`` (default: this rank) is linked to,
        in tp-rank order (see :func:`linked_ranks`)."""
        if rank is not None:
            return linked_ranks(self.stage_ranks, rank, stage)
        linked = self._links.get(stage)
        if linked is None:
            linked = self._links[stage] = linked_ranks(self.stage_ranks, self.rank, stage)
        return linked

    def post_send(self, message: Any, dst: int | Sequence[int], *, label: str = "",
                  group: ProcessGroup | None = None, channel: Hashable = None) -> SendHandle:
        """Post the send of ``message`` to every linked rank of the stage(s) holding ``dst``."""
        peers = self._linked(dst)
        return self.p2p.post_send(message, peers, label=label, group=group, channel=channel)

    def post_recv(self, src: int | Sequence[int], *, label: str = "",
                  group: ProcessGroup | None = None, channel: Hashable = None
                  ) -> FanoutRecvHandle:
        """Post the receive of one message from every linked rank of the stage(s) holding
        ``src``; ``wait`` returns their mean."""
        peers = self._linked(src)
        inner = self.p2p.post_recv(peers[0] if len(peers) == 1 else peers, label=label,
                                   group=group, channel=channel)
        return FanoutRecvHandle(self, inner, peers, label)

    def wait_sends(self, timeout: float | None = None) -> None:
        """Wait for every send this rank posted and has not waited."""
        self.p2p.wait_sends(timeout)

    def flush(self) -> None:
        """Issue the queued operations (batched mode; see ``P2PTransport.flush``)."""
        self.p2p.flush()

    def _linked(self, peers: int | Sequence[int]) -> list[int]:
        ranks = [peers] if isinstance(peers, int) else list(peers)
        linked: list[int] = []
        for rank in ranks:
            for peer in self.links(self._stages.peer_stage(rank)):
                if peer not in linked:
                    linked.append(peer)
        if not linked:
            raise ValueError(f"rank {self.rank}: no peer rank given")
        return linked
