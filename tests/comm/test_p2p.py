"""The pipeline P2P transport on real gloo processes."""

import gc
import random
import weakref
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from meshpipe.comm.errors import MessageMismatchError, P2PError, P2PTimeoutError
from meshpipe.comm.p2p import P2PTransport
from meshpipe.comm.vtp import VTPTransport
from meshpipe.comm.wire import HEADER_NBYTES, UnsupportedMessageError, flatten
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


class P2PCalls(list):
    """The isend/irecv calls made, each as (name, peer, group, tag), and their counts."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def add(self, name, peer, group, tag):
        self.append((name, peer, group, tag))
        self.counts[name] += 1


@contextmanager
def recording_p2p_calls():
    """Record the isend/irecv calls actually made (the transport calls them through dist)."""
    calls = P2PCalls()
    originals = {"isend": dist.isend, "irecv": dist.irecv}

    def recorded(name, peer_key):
        def call(*args, **kwargs):
            calls.add(name, kwargs.get(peer_key), kwargs.get("group"), kwargs.get("tag"))
            return originals[name](*args, **kwargs)
        return call

    dist.isend, dist.irecv = recorded("isend", "dst"), recorded("irecv", "src")
    try:
        yield calls
    finally:
        dist.isend, dist.irecv = originals["isend"], originals["irecv"]


@contextmanager
def counting_p2p_calls():
    """Count the isend/irecv calls actually made, live."""
    with recording_p2p_calls() as calls:
        yield calls.counts


# -- multi-tensor messages -------------------------------------------------------------

def _ring(rank, world_size, members, messages, mode="async"):
    group = dist.new_group(members) if len(members) < world_size else None
    if rank not in members:
        return None
    transport = P2PTransport(group, timeout=TIMEOUT, mode=mode)
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


@pytest.mark.parametrize("world_size, members, mode", [
    (2, [0, 1], "async"),
    (3, [0, 1, 2], "async"),
    (4, [0, 1, 2, 3], "async"),
    (4, [1, 3, 2], "async"),  # a subgroup: peers are still named by global rank
    (3, [0, 1, 2], "batched"),  # never flushed: the waits flush
    (4, [1, 3, 2], "batched"),
])
def test_a_ring_exchanges_multi_tensor_messages_with_changing_shapes(world_size, members, mode):
    orders = [order for order in run_distributed(world_size, _ring, members, 6, mode)
              if order]
    assert len(orders) == len(members)
    assert any(order != sorted(order) for order in orders)  # waited out of order


def _reverse_waits(rank, world_size, mode="async"):
    transport = P2PTransport(timeout=TIMEOUT, mode=mode)
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


@pytest.mark.parametrize("mode", ["async", "batched"])
def test_receives_waited_in_reverse_order_resolve_in_posting_order(mode):
    # four layouts among six messages: metadata travelled four times each way
    assert run_distributed(2, _reverse_waits, mode) == [4, 4]


# -- the steady path, layout changes and operation counts ----------------------------

def _steady_stream(rank, world_size):
    transport = P2PTransport(timeout=TIMEOUT)

    def message(seq, value):
        return (torch.full((2, seq), value), torch.ones(seq, dtype=torch.bfloat16),
                torch.arange(seq), torch.ones(seq, dtype=torch.bool), None, 4)

    def exchange(seq, value, channel=None):
        if rank == 0:
            transport.post_send(message(seq, value), 1, label=f"s{seq}", channel=channel).wait()
        else:
            received = transport.post_recv(0, label=f"s{seq}", channel=channel).wait()
            assert_same_message(received, message(seq, value))

    def measured(run):
        transport.stats.reset()
        with counting_p2p_calls() as calls:
            run()
        stats = transport.stats
        return {"calls": dict(calls), "changes": stats.layout_changes_sent
                + stats.layout_changes_received, "metadata": stats.metadata_sent
                + stats.metadata_received, "header bytes": stats.header_bytes_sent
                + stats.header_bytes_received, "payload bytes": stats.payload_bytes_sent
                + stats.payload_bytes_received}

    first = measured(lambda: exchange(5, 0.0))  # nothing expected yet: the slow path
    steady = measured(lambda: [exchange(5, float(value)) for value in range(1, 6)])
    changed = measured(lambda: exchange(7, 1.0))  # bigger: the payload takes the slow path
    shrunk = measured(lambda: exchange(5, 2.0))   # smaller: it rides inside the notice
    # two channels keep their own expected layouts: interleaving them stays steady...
    exchange(7, 0.0, channel="wide")
    channels = measured(lambda: [exchange(7 if value % 2 else 5, float(value),
                                          channel="wide" if value % 2 else None)
                                 for value in range(4)])
    # ...while one channel alternating between them changes layout every time, with the
    # metadata of both cached
    alternating = measured(lambda: [exchange(5 if value % 2 else 7, float(value))
                                    for value in range(4)])
    return first, steady, changed, shrunk, channels, alternating


def test_a_steady_message_is_one_send_and_one_receive_and_changes_take_the_slow_path():
    sender, receiver = run_distributed(2, _steady_stream)
    first, steady, changed, shrunk, channels, alternating = zip(sender, receiver)
    # float32 2x5 (40 bytes + 8 alignment), bfloat16 (10 + 6), int64 (40 + 8), bool (5)
    payload_bytes = 48 + 16 + 48 + 5
    # the first message: a notice the size of a header, then metadata and payload
    assert first[0]["calls"] == {"isend": 3} and first[1]["calls"] == {"irecv": 3}
    assert steady[0]["calls"] == {"isend": 5} and steady[1]["calls"] == {"irecv": 5}
    for side in steady:
        assert side["changes"] == side["metadata"] == 0
        assert side["header bytes"] == 5 * HEADER_NBYTES == 5 * 48
        assert side["payload bytes"] == 5 * payload_bytes
    assert changed[0]["calls"] == {"isend": 3} and changed[1]["calls"] == {"irecv": 3}
    assert changed[0]["changes"] == changed[0]["metadata"] == 1
    assert shrunk[0]["calls"] == {"isend": 1} and shrunk[1]["calls"] == {"irecv": 1}
    assert shrunk[0]["changes"] == 1 and shrunk[0]["metadata"] == 0  # slot cache hit
    assert channels[0]["calls"] == {"isend": 4} and channels[1]["calls"] == {"irecv": 4}
    assert channels[0]["changes"] == 0
    assert alternating[0]["changes"] == 4 and alternating[0]["metadata"] == 0
    # 5 -> 7 needs the slow path for the payload, 7 -> 5 fits in the notice
    assert alternating[0]["calls"] == {"isend": 6} and alternating[1]["calls"] == {"irecv": 6}


def _posted_ahead(rank, world_size):
    """Receives posted ahead on one channel wait for the layout of the one before."""
    transport = P2PTransport(timeout=TIMEOUT)
    shapes = [(4, 3), (4, 3), (4, 3), (4, 3), (6, 3), (6, 3), (2, 3), (2, 3)]
    messages = [torch.full(shape, float(i)) for i, shape in enumerate(shapes)]
    if rank == 0:
        transport.post_send(torch.zeros(4, 3), 1, label="warm-up", channel="F")
        for i, message in enumerate(messages):
            transport.post_send(message, 1, label=f"mb {i}", channel="F")
        transport.wait_sends()
        return None
    transport.post_recv(0, label="warm-up", channel="F").wait()
    transport.stats.reset()
    with counting_p2p_calls() as calls:
        handles = [transport.post_recv(0, label=f"mb {i}", channel="F") for i in range(3)]
        posted_at_once = dict(calls)
        received = [handles[0].wait()]
        for i in range(3, len(messages)):  # keep three receives posted, as a pipeline does
            handles.append(transport.post_recv(0, label=f"mb {i}", channel="F"))
            received.append(handles[i - 2].wait())
        received += [handle.wait() for handle in handles[-2:]]
    for actual, expected in zip(received, messages):
        assert_same_message(actual, expected)
    stats = transport.stats
    return (posted_at_once, dict(calls), stats.recvs_deferred, stats.layout_changes_received,
            stats.metadata_received)


def test_receives_posted_ahead_are_deferred_until_the_previous_layout_is_known():
    posted_at_once, calls, deferred, changes, metadata = run_distributed(2, _posted_ahead)[1]
    assert posted_at_once == {"irecv": 1}  # the other two wait for the first one's layout
    assert deferred == len(range(1, 8))
    assert changes == 2 and metadata == 2  # 4x3 -> 6x3 -> 2x3
    # one receive per message, plus the slow-path payload and metadata of 6x3, plus the
    # metadata of 2x3, whose payload fitted in the notice
    assert calls == {"irecv": 8 + 2 + 1}


def _scripted_traffic(rank, world_size, scripts, plans, mode="async"):
    """Each rank sends its script to the other, then receives the other's by its plan."""
    transport = P2PTransport(timeout=TIMEOUT, mode=mode)
    peer = 1 - rank
    for index, (channel, kind) in enumerate(scripts[rank]):
        transport.post_send(_scripted_message(rank, index, kind), peer,
                            label=f"{rank}:{index}", channel=channel)
    expected = [_scripted_message(peer, index, kind)
                for index, (_, kind) in enumerate(scripts[peer])]
    handles: dict[int, object] = {}
    for batch, wait_order in plans[rank]:
        for index in batch:
            handles[index] = transport.post_recv(peer, label=f"{peer}:{index}",
                                                 channel=scripts[peer][index][0])
        for index in wait_order:
            assert_same_message(handles.pop(index).wait(), expected[index])
    transport.wait_sends()
    return transport.stats


_SCRIPT_KINDS = {
    "small": lambda gen: torch.randn(2, 3, generator=gen),
    "same bytes, other dtype": lambda gen: torch.randint(0, 9, (2, 3), generator=gen,
                                                         dtype=torch.int32),
    "large": lambda gen: torch.randn(5, 7, generator=gen),
    "tuple": lambda gen: (torch.randn(2, 3, generator=gen), None, 3,
                          torch.ones(4, dtype=torch.bfloat16)),
    "notice": lambda gen: {"stop": {"rank": 1, "reason": "a peer failed"}},
}


def _scripted_message(src, index, kind):
    return _SCRIPT_KINDS[kind](torch.Generator().manual_seed(100 * src + index))


def _script(rng, length):
    """Messages over three channels, each mostly keeping its layout, sometimes changing."""
    current = {channel: rng.choice(list(_SCRIPT_KINDS)) for channel in ("F", "B", None)}
    script = []
    for _ in range(length):
        channel = rng.choice(list(current))
        if rng.random() < 0.3:
            current[channel] = rng.choice(list(_SCRIPT_KINDS))
        script.append((channel, current[channel]))
    return script


def _plan(rng, length):
    """Receives posted in batches, with some of the open ones waited in random order."""
    plan, open_, next_index = [], [], 0
    while next_index < length or open_:
        size = min(rng.randint(0, 3), length - next_index)
        batch = list(range(next_index, next_index + size))
        next_index += size
        open_ += batch
        waited = rng.sample(open_, rng.randint(0 if next_index < length else len(open_),
                                               len(open_)))
        open_ = [index for index in open_ if index not in waited]
        plan.append((batch, waited))
    return plan


def _expected_traffic(script):
    """(layout changes, payloads too big for their notice) of a script, from its layouts."""
    last: dict = {}
    changes = slow_payloads = 0
    for index, (channel, kind) in enumerate(script):
        layout, _ = flatten(_scripted_message(0, index, kind))
        previous = last.get(channel)
        if previous is None or previous.encoded != layout.encoded:
            changes += 1
            capacity = 0 if previous is None else previous.payload_nbytes
            slow_payloads += layout.payload_nbytes > capacity
        last[channel] = layout
    return changes, slow_payloads


@pytest.mark.parametrize("mode", ["async", "batched"])
def test_random_traffic_on_several_channels_arrives_intact_in_any_wait_order(mode):
    rng = random.Random(2024)
    scripts = [_script(rng, 40), _script(rng, 40)]
    plans = [_plan(rng, 40), _plan(rng, 40)]
    stats = run_distributed(2, _scripted_traffic, scripts, plans, mode)
    for rank in (0, 1):
        sent, received = stats[rank], stats[1 - rank]
        changes, slow_payloads = _expected_traffic(scripts[rank])
        assert sent.messages_sent == received.messages_received == 40
        assert sent.layout_changes_sent == received.layout_changes_received == changes
        assert sent.sends_posted == 40 + sent.metadata_sent + slow_payloads
        assert received.recvs_posted == 40 + received.metadata_received + slow_payloads
    assert 0 < changes < 40 and stats[0].recvs_deferred > 0


# -- several pipeline groups -----------------------------------------------------------

def _directional_groups(rank, world_size):
    up, down = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    transport = P2PTransport(up, reverse_group=down, timeout=TIMEOUT)
    neighbours = [peer for peer in (rank - 1, rank + 1) if 0 <= peer < world_size]
    with recording_p2p_calls() as calls:
        recvs = {(peer, i): transport.post_recv(peer, label=_label(peer, rank, i))
                 for i in range(3) for peer in neighbours}
        sends = [transport.post_send(make_message(rank, i), peer, label=_label(rank, peer, i))
                 for i in range(3) for peer in neighbours]
        for (peer, i), handle in recvs.items():
            assert_same_message(handle.wait(), make_message(peer, i))
        for handle in sends:
            handle.wait()
    names = {id(up): "up", id(down): "down"}
    return [(name, peer, names.get(id(group), "other")) for name, peer, group, tag in calls
            if tag == 0]


def test_each_direction_has_its_own_payload_group():
    """Receives from a peer posted before the sends to it (as the executor does) never share
    a payload group with those sends: on NCCL that keeps them off one stream."""
    for rank, calls in enumerate(run_distributed(3, _directional_groups)):
        assert calls, f"rank {rank} recorded no steady-tag payload operation"
        for name, peer, group in calls:
            sender, receiver = (rank, peer) if name == "isend" else (peer, rank)
            assert group == ("up" if sender < receiver else "down"), (rank, name, peer, group)


def _reverse_group_errors(rank, world_size):
    fewer = dist.new_group([0, 1])
    seen = {"members": _expect(ValueError, lambda: P2PTransport(reverse_group=fewer))}
    real_backend = dist.get_backend
    nccl_like = dist.new_group(backend="gloo")
    meta = dist.new_group(backend="gloo")
    dist.get_backend = lambda group=None: "nccl" if group is nccl_like else real_backend(group)
    try:
        seen["nccl"] = _expect(ValueError, lambda: P2PTransport(nccl_like, meta_group=meta))
        seen["nccl same"] = _expect(ValueError, lambda: P2PTransport(
            nccl_like, reverse_group=nccl_like, meta_group=meta))
    finally:
        dist.get_backend = real_backend
    return seen


def test_a_reverse_group_must_match_and_nccl_needs_one():
    seen = run_distributed(3, _reverse_group_errors)[0]
    assert "reverse_group has ranks [0, 1] but group has [0, 1, 2]" in seen["members"]
    for case in ("nccl", "nccl same"):
        assert "payload group uses NCCL" in seen[case] and "reverse_group=" in seen[case]


def _average_from_groups(rank, world_size, mode="async"):
    sources = list(range(world_size - 1))
    receiver = world_size - 1
    groups = [dist.new_group([src, receiver]) for src in sources]
    gen = torch.Generator().manual_seed(7)
    shared_ids = torch.randint(0, 50, (4,), generator=gen)
    per_source = [(torch.randn(3, 4, generator=gen), torch.randn(64, generator=gen).bfloat16())
                  for _ in sources]
    transport = P2PTransport(timeout=TIMEOUT, mode=mode)
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


@pytest.mark.parametrize("world_size, mode", [(3, "async"), (4, "async"), (4, "batched")])
def test_receiving_from_several_pipeline_groups_averages_in_float32(world_size, mode):
    (averaged, listed), per_source, shared_ids = run_distributed(
        world_size, _average_from_groups, mode)[-1]
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
                received = transport.post_recv(prev, label=f"F{mine - 1}:{i}",
                                               channel=("F", mine - 1)).wait()
                assert_same_message(received, make_message(mine - 1, i))
            if mine < last:
                transport.post_send(make_message(mine, i), nxt, label=f"F{mine}:{i}",
                                    channel=("F", mine)).wait()
                received = transport.post_recv(nxt, label=f"B{mine + 1}:{i}",
                                               channel=("B", mine + 1)).wait()
                assert_same_message(received, make_message(mine + 1, i))
            if mine > 0:
                transport.post_send(make_message(mine, i), prev, label=f"B{mine}:{i}",
                                    channel=("B", mine)).wait()
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


# -- the caller's tensors are free once a send is posted ---------------------------------

def _sender_frees_after_posting(rank, world_size):
    transport = P2PTransport(timeout=TIMEOUT)
    originals = [torch.arange(1000, dtype=torch.float32), torch.arange(1000.0) * 2]
    if rank == 1:
        dist.barrier()  # receive only after the sender freed and overwrote its tensors
        for i, original in enumerate(originals):  # the first takes the slow path
            for label in (f"freed {i}", f"overwritten {i}"):
                assert torch.equal(transport.post_recv(0, label=label).wait(), original)
        return None
    released_at_once, handles = [], []
    for i, original in enumerate(originals):
        activation = original.clone()
        storage = weakref.ref(activation.untyped_storage())
        handles.append(transport.post_send(activation, 1, label=f"freed {i}"))
        activation.data = torch.empty(0)  # the executor's way of freeing a sent activation
        del activation
        gc.collect()
        released_at_once.append(storage() is None)
        reused = original.clone()
        handles.append(transport.post_send(reused, 1, label=f"overwritten {i}"))
        reused.zero_()
    dist.barrier()
    handles[0].wait()
    still_pending = len(transport._pending_sends)
    transport.wait_sends()
    return released_at_once, still_pending, len(transport._pending_sends)


def test_a_sender_may_free_or_overwrite_its_tensors_as_soon_as_the_send_is_posted():
    released_at_once, still_pending, pending_at_end = run_distributed(
        2, _sender_frees_after_posting)[0]
    assert released_at_once == [True, True]
    assert still_pending == 3 and pending_at_end == 0  # handles release their buffers


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
    # a group of its own: gloo closes the timed-out connection, the default group lives on
    group = dist.new_group([0, 1])
    transport = P2PTransport(group, timeout=TIMEOUT)
    label = "stage 0 -> 1, microbatch 5, forward"
    seen = {}
    if rank == 1:
        handle = transport.post_recv(0, label=label, channel="F")
        behind = transport.post_recv(0, label="microbatch 6", channel="F")
        seen["timeout"] = _expect(P2PTimeoutError, lambda: behind.wait(timeout=0.3))
        seen["again"] = _expect(P2PError, handle.wait)
        seen["later"] = _expect(P2PError, lambda: transport.post_recv(0, label="microbatch 7"))
    dist.barrier()
    dist.destroy_process_group(group)
    return seen


def test_a_wait_that_times_out_names_the_peer_and_the_label_and_stops_that_peer():
    seen = run_distributed(2, _timeout)[1]
    assert seen["timeout"].startswith(
        "rank 1 timed out waiting for 'microbatch 6' from rank 0, behind the earlier message "
        "'stage 0 -> 1, microbatch 5, forward' (messages from one rank are resolved in "
        "posting order): rank 0 did not post the matching operation in time")
    assert "The connection to rank 0 is unusable now" in seen["timeout"]
    for later in (seen["again"], seen["later"]):
        assert "from rank 0: receiving from it failed earlier (rank 1 timed out" in later
