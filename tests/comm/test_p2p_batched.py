"""The transport's batched mode: steady operations queued until flush, one batch per group."""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from meshpipe.comm.p2p import P2PTransport
from meshpipe.comm.wire import SLOW_TAG
from meshpipe.testing import run_distributed
from test_p2p import recording_p2p_calls
from test_p2p_message import assert_same_message

pytestmark = pytest.mark.distributed

TIMEOUT = 30.0


@contextmanager
def recording_batches():
    """Record each batch_isend_irecv call as (number of ops, group of its ops)."""
    batches = []
    original = dist.batch_isend_irecv

    def recorded(ops):
        batches.append((len(ops), ops[0].group))
        return original(ops)

    dist.batch_isend_irecv = recorded
    try:
        yield batches
    finally:
        dist.batch_isend_irecv = original


def _message(rank, index):
    return (torch.full((3, 4), float(10 * rank + index)), {"kind": "activation"})


def _queued_until_flush(rank, world_size):
    transport = P2PTransport(timeout=TIMEOUT, mode="batched")
    peer = 1 - rank
    seen = {}
    # the first message of the channel: its notice is queued, its metadata and payload
    # (slow path) go out at once
    with recording_p2p_calls() as calls, recording_batches() as batches:
        first_send = transport.post_send(_message(rank, 0), peer, label="m0")
        first_recv = transport.post_recv(peer, label="m0")
        seen["first posted"] = ([(name, tag) for name, _, _, tag in calls], list(batches))
        assert_same_message(first_recv.wait(), _message(peer, 0))  # the wait flushes
        first_send.wait()
        seen["first waited"] = len(batches)
    transport.stats.reset()
    # steady messages: nothing is issued until the flush, which issues all in one batch
    with recording_p2p_calls() as calls, recording_batches() as batches:
        sends = [transport.post_send(_message(rank, i), peer, label=f"m{i}")
                 for i in range(1, 4)]
        recvs = [transport.post_recv(peer, label=f"m{i}") for i in range(1, 4)]
        seen["before flush"] = (len(calls), len(batches), transport.stats.batches_posted)
        transport.flush()
        transport.flush()  # nothing left: a no-op
        seen["after flush"] = (len(calls), [n for n, _ in batches])
        for i, handle in enumerate(recvs, start=1):
            assert_same_message(handle.wait(), _message(peer, i))
        transport.wait_sends()
        assert all(handle.is_completed() for handle in sends)
        seen["after waits"] = [name for name, _, _, _ in calls]
    stats = transport.stats
    seen["stats"] = (stats.batches_posted, stats.ops_batched, stats.sends_posted,
                     stats.recvs_posted, stats.recvs_deferred)
    return seen


def test_steady_operations_wait_for_flush_and_go_out_in_one_batch():
    for seen in run_distributed(2, _queued_until_flush):
        # metadata and payload went out by themselves at once; notice and receive wait
        assert seen["first posted"] == ([("isend", SLOW_TAG)] * 2, [])
        assert seen["first waited"] == 1
        assert seen["before flush"] == (0, 0, 0)
        # three sends and the first receive in one call; the next two receives are deferred
        # until the layout of the one before is known, then posted one by one in the waits
        assert seen["after flush"] == (0, [4])
        assert seen["after waits"] == ["irecv", "irecv"]
        assert seen["stats"] == (1, 4, 3, 3, 2)


def _one_batch_per_group(rank, world_size):
    up, down = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    transport = P2PTransport(up, reverse_group=down, timeout=TIMEOUT, mode="batched")
    names = {id(up): "up", id(down): "down"}
    neighbours = [peer for peer in (rank - 1, rank + 1) if 0 <= peer < world_size]
    result = []
    for round_ in range(3):  # the first round's notices carry layouts, the others are steady
        with recording_batches() as batches:
            recvs = {peer: transport.post_recv(peer, label=f"{peer}->{rank}:{round_}")
                     for peer in neighbours}
            for peer in neighbours:
                transport.post_send(_message(rank, round_), peer,
                                    label=f"{rank}->{peer}:{round_}")
            transport.flush()
            for peer, handle in recvs.items():
                assert_same_message(handle.wait(), _message(peer, round_))
            transport.wait_sends()
        result.append(sorted((names[id(group)], n) for n, group in batches))
    for group in (up, down):
        dist.destroy_process_group(group)
    return result


def test_a_flush_issues_one_batch_per_payload_group():
    """torch needs one group per batch_isend_irecv call: the messages of each direction
    (group up the ranks, reverse_group down) go out in a batch of their own."""
    first, middle, last = run_distributed(3, _one_batch_per_group)
    for rounds in (first, middle, last):
        assert rounds[1] == rounds[2] == rounds[0]
    # rank 0 receives from and sends to rank 1: receive on down, send on up
    assert first[0] == [("down", 1), ("up", 1)]
    # rank 1 receives from 0 (up) and 2 (down), sends to 0 (down) and 2 (up)
    assert middle[0] == [("down", 2), ("up", 2)]
    assert last[0] == [("down", 1), ("up", 1)]


def _modes(rank, world_size):
    seen = {}
    try:
        P2PTransport(mode="sync")
    except ValueError as error:
        seen["bad mode"] = str(error)
    peer = 1 - rank
    asynchronous = P2PTransport(timeout=TIMEOUT)
    handle = asynchronous.post_recv(peer, label="a")
    asynchronous.post_send(torch.ones(2), peer, label="a")
    asynchronous.flush()  # nothing is ever queued
    handle.wait()
    asynchronous.wait_sends()
    seen["async batches"] = asynchronous.stats.batches_posted
    batched = P2PTransport(timeout=TIMEOUT, mode="batched")
    send = batched.post_send(torch.ones(2), peer, label="b")
    recv = batched.post_recv(peer, label="b")
    send.is_completed()  # never blocks, but issues what is queued
    seen["is_completed issues"] = batched.stats.batches_posted
    recv.wait()
    send.wait()
    seen["modes"] = (asynchronous.mode, batched.mode)
    return seen


def test_async_mode_never_batches_and_a_bad_mode_is_refused():
    for seen in run_distributed(2, _modes):
        assert "mode must be one of 'async', 'batched', got 'sync'" in seen["bad mode"]
        assert seen["async batches"] == 0
        assert seen["is_completed issues"] == 1  # polling a queued send issues it
        assert seen["modes"] == ("async", "batched")
