"""The pipeline P2P transport on real gloo processes."""

import gc
import random
import weakref
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from meshpipe.comm.message import UnsupportedMessageError
from meshpipe.comm.p2p import (
    HEADER_NBYTES,
    MessageMismatchError,
    P2PError,
    P2PTimeoutError,
    P2PTransport,
    VTPTransport,
)
from meshpipe.testing import run_distributed
from test_p2p_message import assert_same_message

pytestmark = pytest.mark.distributed

TIMEOUT = 30.0


def make_message(src: int, index: int, requires_grad: bool = False):
    """Message number ``index`` from rank ``src``: its sequence length differs every time."""
    seq = 3 + (5 * index + 2 * src) % 7
    gen = torch.Generator().manual_seed(1000 * src + index)
    hidden = torch.randn(2, seq, 4, generator=gen).requires_grad_(requires_grad)
    return (
        hidden,
        {"lowp": torch.randn(seq, 3, generator=gen).to(torch.bfloat16),
         "ids": torch.randint(0, 100, (2, seq), generator=gen),
         "mask": torch.rand(seq, generator=gen) > 0.5,
         "skip": None},
        [None, index, f"microbatch {index}", 0.5 * src, True],
        torch.randn(seq, 2, generator=gen).t(),
        torch.tensor(float(index)),
        torch.empty(0, seq),
    )


def _label(src: int, dst: int, index: int) -> str:
    return f"rank {src} -> {dst}, microbatch {index}"


@contextmanager
def counting_p2p_calls():
    """Count the isend/irecv calls actually made (the transport calls them through dist)."""
    counts = Counter()
    originals = {"isend": dist.isend, "irecv": dist.irecv}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    dist.isend, dist.irecv = counted("isend"), counted("irecv")
    try:
        yield counts
    finally:
        dist.isend, dist.irecv = originals["isend"], originals["irecv"]


# -- multi-tensor messages -------------------------------------------------------------

def _ring(rank, world_size, members, messages):
    group = dist.new_group(members) if len(members) < world_size else None
    if rank not in members:
        return None
    transport = P2PTransport(group, timeout=TIMEOUT)
    position = members.index(rank)
    nxt, prev = members[(position + 1) % len(members)], members[position - 1]
    sends = [transport.post_send(make_message(rank, i, requires_grad=True), nxt,
                                 label=_label(rank, nxt, i)) for i in range(messages)]
    recvs = [transport.post_recv(prev, label=_label(prev, rank, i)) for i in range(messages)]
    order = list(range(messages))
    random.Random(rank).shuffle(order)
    for i in order:
        assert_same_message(recvs[i].wait(), make_message(prev, i))
    for handle in sends:
        handle.wait()
        assert handle.is_completed()
    return order


@pytest.mark.parametrize("world_size, members", [
    (2, [0, 1]),
    (3, [0, 1, 2]),
    (4, [0, 1, 2, 3]),
    (4, [1, 3, 2]),  # a subgroup: peers are still named by global rank
])
def test_a_ring_exchanges_multi_tensor_messages_with_changing_shapes(world_size, members):
    orders = [order for order in run_distributed(world_size, _ring, members, 6) if order]
    assert len(orders) == len(members)
    assert any(order != sorted(order) for order in orders)  # waited out of order


def _reverse_waits(rank, world_size):
    transport = P2PTransport(timeout=TIMEOUT)
    peer = 1 - rank
    messages = [torch.ones(3), torch.ones(3), (torch.ones(5), 1), torch.ones(3), None,
                {"x": torch.arange(4)}]
    for i, message in enumerate(messages):  # handles dropped: the transport keeps the sends
        transport.post_send(message, peer, label=f"{rank}:{i}")
    recvs = [transport.post_recv(peer, label=f"{peer}:{i}") for i in range(len(messages))]
    received = [recvs[i].wait() for i in reversed(range(len(messages)))][::-1]
    assert_same_message(received, messages)
    transport.wait_sends()
    assert not transport._pending_sends
    return transport.stats.metadata_received


def test_receives_waited_in_reverse_order_resolve_in_posting_order():
    # four layouts among six messages: metadata travelled four times each way
    assert run_distributed(2, _reverse_waits) == [4, 4]


# -- metadata caching and operation counts ---------------------------------------------

def _steady_stream(rank, world_size):
    transport = P2PTransport(timeout=TIMEOUT)

    def message(seq, value):
        return (torch.full((2, seq), value), torch.ones(seq, dtype=torch.bfloat16),
                torch.arange(seq), torch.ones(seq, dtype=torch.bool), None, 4)

    def exchange(seq, value):
        if rank == 0:
            transport.post_send(message(seq, value), 1, label=f"s{seq}").wait()
        else:
            received = transport.post_recv(0, label=f"s{seq}").wait()
            assert_same_message(received, message(seq, value))

    exchange(5, 0.0)  # first message: metadata travels
    transport.stats.reset()
    with counting_p2p_calls() as calls:
        for value in range(1, 6):
            exchange(5, float(value))
    steady = (dict(calls), transport.stats.metadata_sent + transport.stats.metadata_received,
              transport.stats.header_bytes_sent + transport.stats.header_bytes_received,
              transport.stats.payload_bytes_sent + transport.stats.payload_bytes_received)
    transport.stats.reset()
    exchange(7, 1.0)                      # a new sequence length: metadata again
    changed = transport.stats.metadata_sent + transport.stats.metadata_received
    transport.stats.reset()
    for value in range(4):                # two interleaved streams stay cached
        exchange(7 if value % 2 else 5, float(value))
    interleaved = transport.stats.metadata_sent + transport.stats.metadata_received
    return steady, changed, interleaved


def test_a_steady_stream_sends_only_headers_and_one_payload_per_message():
    (sender, changed_0, interleaved_0), (receiver, changed_1, interleaved_1) = run_distributed(
        2, _steady_stream)
    # float32 2x5 (40 bytes + 8 alignment), bfloat16 (10 + 6), int64 (40 + 8), bool (5)
    payload_bytes = 48 + 16 + 48 + 5
    assert sender[0] == {"isend": 10}  # a header and a payload for each of 5 messages
    assert receiver[0] == {"irecv": 10}
    for _, metadata, header_bytes, payload in (sender, receiver):
        assert metadata == 0
        assert header_bytes == 5 * HEADER_NBYTES == 200
        assert payload == 5 * payload_bytes
    assert changed_0 == changed_1 == 1
    assert interleaved_0 == interleaved_1 == 0


# -- several pipeline groups -----------------------------------------------------------

def _average_from_groups(rank, world_size):
    sources = list(range(world_size - 1))
    receiver = world_size - 1
    groups = [dist.new_group([src, receiver]) for src in sources]
    gen = torch.Generator().manual_seed(7)
    shared_ids = torch.randint(0, 50, (4,), generator=gen)
    per_source = [(torch.randn(3, 4, generator=gen), torch.randn(64, generator=gen).bfloat16())
                  for _ in sources]
    transport = P2PTransport(timeout=TIMEOUT)
    result = None
    if rank == receiver:
        averaged = transport.post_recv(sources, group=groups, average=True, label="avg").wait()
        listed = transport.post_recv(sources, group=groups, label="list").wait()
        result = averaged, listed
    else:
        message = {"h": per_source[rank][0], "lowp": per_source[rank][1], "ids": shared_ids,
                   "none": None, "step": 3}
        transport.post_send(message, receiver, group=groups[rank], label="avg").wait()
        transport.post_send(message, receiver, group=groups[rank], label="list").wait()
    for group in groups:
        dist.destroy_process_group(group)
    return result, per_source, shared_ids


@pytest.mark.parametrize("world_size", [3, 4])
def test_receiving_from_several_pipeline_groups_averages_in_float32(world_size):
    (averaged, listed), per_source, shared_ids = run_distributed(
        world_size, _average_from_groups)[-1]
    hidden = torch.stack([h for h, _ in per_source]).mean(0)
    lowp = torch.stack([lowp.float() for _, lowp in per_source]).mean(0).bfloat16()
    expected = {"h": hidden, "lowp": lowp, "ids": shared_ids, "none": None, "step": 3}
    torch.testing.assert_close(averaged["h"], expected["h"])
    assert_same_message({k: v for k, v in averaged.items() if k != "h"},
                        {k: v for k, v in expected.items() if k != "h"})
    if world_size == 4:  # three sources: accumulating in bfloat16 would round differently
        naive = (per_source[0][1] + per_source[1][1] + per_source[2][1]) / 3
        assert not torch.equal(naive, averaged["lowp"])
    for i, message in enumerate(listed):
        assert torch.equal(message["h"], per_source[i][0])


def _fan_out(rank, world_size):
    if rank == 0:
        transport = P2PTransport(timeout=TIMEOUT)
        handle = transport.post_send(make_message(0, 1), [1, 2, 3], label="fan out")
        handle.wait()
        return transport.stats.messages_sent, transport.stats.sends_posted
    transport = P2PTransport(timeout=TIMEOUT, check_labels=rank != 3)
    label = "fan out" if rank != 3 else "a label the sender did not use"
    assert_same_message(transport.post_recv(0, label=label).wait(), make_message(0, 1))
    return None


def test_one_send_reaches_several_peers_and_label_checks_can_be_turned_off():
    messages, sends = run_distributed(4, _fan_out)[0]
    assert messages == 3
    assert sends == 9  # header, metadata and payload for each peer, packed once


# -- VTP: stages of different tensor-parallel sizes --------------------------------------

def _vtp(rank, world_size, stage_ranks, indices):
    """Forward through a chain of stages, then backward, for each message index."""
    groups = [dist.new_group(list(ranks)) for ranks in stage_ranks]
    mine = next(s for s, ranks in enumerate(stage_ranks) if rank in ranks)
    last = len(stage_ranks) - 1
    transport = VTPTransport(stage_ranks, groups[mine], timeout=TIMEOUT)
    prev = stage_ranks[mine - 1][-1] if mine > 0 else None  # any member names its stage
    nxt = stage_ranks[mine + 1][-1] if mine < last else None
    with counting_p2p_calls() as calls:
        for i in indices:
            if mine > 0:
                received = transport.post_recv(prev, label=f"F{mine - 1}:{i}").wait()
                assert_same_message(received, make_message(mine - 1, i))
            if mine < last:
                transport.post_send(make_message(mine, i), nxt, label=f"F{mine}:{i}").wait()
                received = transport.post_recv(nxt, label=f"B{mine + 1}:{i}").wait()
                assert_same_message(received, make_message(mine + 1, i))
            if mine > 0:
                transport.post_send(make_message(mine, i), prev, label=f"B{mine}:{i}").wait()
    for group in groups:
        dist.destroy_process_group(group)
    stats = transport.stats
    return dict(calls), stats.broadcasts, stats.broadcast_metadata, transport.is_stage_root


@pytest.mark.parametrize("world_size, stage_ranks", [
    (3, [[0, 1], [2]]),
    (4, [[0], [1, 2, 3]]),
    (4, [[0, 1], [2], [3]]),
])
def test_vtp_stage_roots_talk_and_broadcast_inside_their_stage(world_size, stage_ranks):
    indices = [0, 1, 2, 0]  # the repeated layout of message 0 is still cached
    results = run_distributed(world_size, _vtp, stage_ranks, indices)
    for rank, (calls, broadcasts, broadcast_metadata, is_root) in enumerate(results):
        stage = next(s for s, ranks in enumerate(stage_ranks) if rank in ranks)
        if not is_root:
            assert calls == {}  # members of a stage post no point-to-point operation
        neighbours = (stage > 0) + (stage < len(stage_ranks) - 1)
        several = len(stage_ranks[stage]) > 1
        assert broadcasts == (neighbours * len(indices) if several else 0)
        assert broadcast_metadata == (neighbours * 3 if several else 0)


def _vtp_root_failure(rank, world_size):
    groups = [dist.new_group([0, 1]), dist.new_group([2])]
    transport = VTPTransport([[0, 1], [2]], groups[0] if rank < 2 else groups[1],
                             timeout=TIMEOUT)
    seen = {}
    if rank == 2:
        transport.post_send(torch.ones(2), 0, label="B0").wait()
        transport.post_send(torch.ones(3), 0, label="B1").wait()
    else:
        error_type = MessageMismatchError if rank == 0 else P2PError
        seen["error"] = _expect(error_type, transport.post_recv(2, label="B1").wait)
        seen["next"] = transport.post_recv(2, label="B1").wait().tolist()
    for group in groups:
        dist.destroy_process_group(group)
    return seen


def test_a_vtp_stage_root_that_cannot_receive_makes_its_stage_fail_fast():
    root, member, _ = run_distributed(3, _vtp_root_failure)
    assert root["error"].startswith("rank 0 expected 'B1' from rank 2, but")
    assert member["error"].startswith("rank 1 cannot receive 'B1': its stage root rank 0 "
                                      "failed to receive")
    assert root["next"] == member["next"] == [1.0, 1.0, 1.0]  # the stage stays in step


# -- keeping sent data alive, then releasing it -------------------------------------------

def _sender_frees_after_posting(rank, world_size):
    transport = P2PTransport(timeout=TIMEOUT)
    if rank == 0:
        activation = torch.arange(1000, dtype=torch.float32)
        storage = weakref.ref(activation.untyped_storage())
        handle = transport.post_send(activation, 1, label="single")
        activation.data = torch.empty(0)  # the executor's way of freeing a sent activation
        del activation
        gc.collect()
        kept_while_in_flight = storage() is not None
        first, second = torch.ones(10), torch.ones(10)
        packed_sources = weakref.ref(first.untyped_storage())
        packed = transport.post_send((first, second), 1, label="packed")
        del first, second
        gc.collect()
        sources_released_at_once = packed_sources() is None
        dist.barrier()
        handle.wait()
        packed.wait()
        gc.collect()
        return kept_while_in_flight, storage() is None, sources_released_at_once
    dist.barrier()  # receive only after the sender dropped its references
    single = transport.post_recv(0, label="single").wait()
    pair = transport.post_recv(0, label="packed").wait()
    assert torch.equal(single, torch.arange(1000, dtype=torch.float32))
    assert_same_message(pair, (torch.ones(10), torch.ones(10)))
    return None


def test_a_send_keeps_its_payload_alive_until_complete_then_releases_it():
    kept, released, packed_released = run_distributed(2, _sender_frees_after_posting)[0]
    assert kept and released and packed_released


# -- bad input -------------------------------------------------------------------------

def _expect(error_type, call):
    try:
        call()
    except error_type as error:
        return str(error)
    raise AssertionError(f"expected {error_type.__name__}")


def _bad_input(rank, world_size):
    transport = P2PTransport(timeout=TIMEOUT)
    peer = 1 - rank
    seen = {
        "leaf": _expect(UnsupportedMessageError, lambda: transport.post_send(
            (torch.zeros(2), {"x": object()}), peer, label="stage 0 -> 1, microbatch 3")),
        "self": _expect(ValueError, lambda: transport.post_send(torch.zeros(1), rank)),
        "outside": _expect(ValueError, lambda: transport.post_recv(world_size + 3)),
        "groups": _expect(ValueError, lambda: transport.post_recv([peer], group=[None, None])),
    }
    seen["nothing posted"] = transport.stats.sends_posted + transport.stats.recvs_posted
    # a label mismatch raises on the receiver and leaves the stream usable
    if rank == 0:
        transport.post_send(torch.ones(2), 1, label="microbatch 1").wait()
        transport.post_send(torch.ones(3), 1, label="microbatch 2").wait()
    else:
        wrong = transport.post_recv(0, label="microbatch 2")
        seen["label"] = _expect(MessageMismatchError, wrong.wait)
        seen["next"] = transport.post_recv(0, label="microbatch 2").wait().tolist()
    return seen


def test_bad_input_raises_clear_errors_naming_ranks_and_labels():
    sender, receiver = run_distributed(2, _bad_input)
    assert sender["leaf"].startswith("rank 0: cannot send 'stage 0 -> 1, microbatch 3' to "
                                     "rank(s) [1]: message[1]['x'] is a builtins.object")
    assert "rank 0: dst=0 is this rank itself" in sender["self"]
    assert "src=5 is not reachable" in sender["outside"] and "global ranks" in sender["outside"]
    assert "1 src ranks [1] but 2 groups" in sender["groups"]
    assert sender["nothing posted"] == receiver["nothing posted"] == 0
    assert receiver["label"].startswith("rank 1 expected 'microbatch 2' from rank 0, but")
    assert receiver["next"] == [1.0, 1.0, 1.0]


def _average_mismatch(rank, world_size, case):
    transport = P2PTransport(timeout=TIMEOUT)
    if rank == 2:
        return _expect(MessageMismatchError, transport.post_recv(
            [0, 1], average=True, label="stage 1 -> 2, microbatch 0").wait)
    if case == "shape":
        message = (torch.zeros(2, 3 + rank), torch.arange(3))
    else:
        message = (torch.zeros(2, 3), torch.arange(3) + rank)
    transport.post_send(message, 2, label="stage 1 -> 2, microbatch 0").wait()
    return None


@pytest.mark.parametrize("case, expected", [
    ("shape", "the messages of rank 0 and rank 1 differ: message[0] has shape [2, 3] in one "
              "and [2, 4] in the other"),
    ("integers", "message[1] is a torch.int64 tensor whose values differ between rank 0 and "
                 "rank 1"),
])
def test_averaging_messages_that_differ_is_an_error(case, expected):
    error = run_distributed(3, _average_mismatch, case)[2]
    assert error.startswith("rank 2 cannot average 'stage 1 -> 2, microbatch 0' from ranks "
                            "[0, 1]")
    assert expected in error


def _timeout(rank, world_size):
    transport = P2PTransport(timeout=TIMEOUT)
    label = "stage 0 -> 1, microbatch 5, forward"
    seen = {}
    if rank == 1:
        handle = transport.post_recv(0, label=label)
        seen["timeout"] = _expect(P2PTimeoutError, lambda: handle.wait(timeout=0.3))
        dist.barrier()
        seen["late"] = handle.wait().tolist()  # the receive stayed posted
    else:
        dist.barrier()  # send only once the receiver has timed out
        transport.post_send(torch.ones(2), 1, label=label).wait()
    return seen


def test_a_wait_that_times_out_names_the_peer_and_the_label_and_can_be_retried():
    seen = run_distributed(2, _timeout)[1]
    assert seen["timeout"].startswith(
        "rank 1 timed out waiting for 'stage 0 -> 1, microbatch 5, forward' from rank 0: its "
        "header has not arrived; rank 0 has not posted the matching send")
    assert seen["late"] == [1.0, 1.0]
