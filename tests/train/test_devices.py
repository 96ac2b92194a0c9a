"""Where ranks compute and how they talk (``--device``, ``--backend``), and the host-staged
collectives of ranks sharing a GPU, tested on the CPU.

The GPU itself is simulated where it must be: the plan's GPU count by monkeypatching
torch.cuda, the host staging by making ``ops.through_host`` say yes for CPU tensors (then
every collective of a real training step runs on host copies and copies the results back,
which must not change a bit of the step), and the transport's delivery onto another device
with the meta device standing in for the GPU.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from meshpipe.comm import ops
from meshpipe.comm.collectives import post_transfers
from meshpipe.comm.p2p import P2PTransport
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.run.devices import DevicePlan, plan_devices
from trainer_cases import SMALL, check_first_step

pytestmark = pytest.mark.distributed


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("device, backend, ranks, gpus, expected", [
    ("auto", "auto", 4, 0, ("cpu", "gloo", False)),
    ("cpu", "auto", 4, 2, ("cpu", "gloo", False)),
    ("auto", "auto", 1, 1, ("cuda", "nccl", False)),
    ("auto", "auto", 2, 2, ("cuda", "nccl", False)),
    ("auto", "auto", 4, 1, ("cuda", "gloo", True)),
    ("cuda", "gloo", 2, 2, ("cuda", "gloo", True)),
])
def test_the_plan_follows_the_machine(monkeypatch, device, backend, ranks, gpus, expected):
    _gpus(monkeypatch, gpus)
    plan = plan_devices(device, backend, ranks)
    assert (plan.device_type, plan.backend, plan.shares_gpus) == expected
    assert (plan.notice() is not None) == plan.shares_gpus


def test_ranks_share_the_gpus_round_robin_and_say_so(monkeypatch):
    _gpus(monkeypatch, 2)
    plan = plan_devices("auto", "auto", 5)
    assert [plan.device(rank) for rank in range(5)] == [
        torch.device("cuda", index) for index in (0, 1, 0, 1, 0)]
    assert plan.notice().startswith("5 ranks share 2 GPU(s) (up to 3 per GPU) over gloo")
    assert DevicePlan.cpu(3).device(2) == torch.device("cpu")


@pytest.mark.parametrize("device, backend, gpus, message", [
    ("cuda", "auto", 0, "--device cuda: torch .* sees no CUDA device"),
    ("cpu", "nccl", 1, "--backend nccl needs CUDA devices"),
    ("auto", "nccl", 1, "--backend nccl: 2 ranks on this machine but 1 GPU"),
    ("tpu", "auto", 1, "--device must be one of auto, cuda, cpu"),
])
def test_a_plan_this_machine_cannot_give_is_one_line(monkeypatch, device, backend, gpus,
                                                     message):
    _gpus(monkeypatch, gpus)
    with pytest.raises(ValueError, match=message) as raised:
        plan_devices(device, backend, 2)
    assert "\n" not in str(raised.value)


def test_device_cuda_without_cuda_fails_before_any_process_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "meshpipe", "train", "--device", "cuda",
                           "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--device cuda" in lines[0] and "sees no CUDA device" in lines[0]
    assert not (tmp_path / "logs").exists()


# ------------------------------------------------------------ collectives through the host

def _staged_collectives(rank, world_size):
    """Every collective of ``ops`` and the ring's transfers, once on the tensors and once
    forced through host copies; the host path must hand the collective other tensors than
    the caller's and give the same results."""
    seen = []
    real = {name: getattr(dist, name) for name in (
        "all_reduce", "broadcast", "all_gather", "all_to_all_single", "batch_isend_irecv")}

    def spy(name):
        def call(*args, **kwargs):
            seen.append((name, [id(a) for a in args if isinstance(a, torch.Tensor)]))
            return real[name](*args, **kwargs)
        return call

    x = torch.arange(4, dtype=torch.float32) + 10 * rank

    def run_all():
        reduced = x.clone()
        ops.all_reduce(reduced)
        broadcast = x.clone()
        ops.broadcast(broadcast, src=1)
        gathered = torch.empty(4 * world_size)
        ops.all_gather_into(gathered, x)
        listed = [torch.empty(4) for _ in range(world_size)]
        ops.all_gather(listed, x)
        scattered = torch.empty(4 // world_size)
        ops.reduce_scatter_into(scattered, x)
        exchanged = torch.empty(4)
        ops.all_to_all_single(exchanged, x)
        uneven = torch.empty(3 if rank == 0 else 5)
        ops.all_to_all_single(uneven, x, output_split_sizes=[1, 2] if rank == 0 else [3, 2],
                              input_split_sizes=[1, 3] if rank == 0 else [2, 2])
        started = torch.empty(4)  # Ulysses' head groups start theirs and wait later
        ops.all_to_all_single_started(started, x).wait()
        peer = 1 - rank
        received = torch.empty(4)
        (shifted,) = post_transfers([(peer, x)], [(peer, received)], None, tag=7).wait()
        return [t.tolist() for t in (reduced, broadcast, gathered, *listed, scattered,
                                     exchanged, uneven, started, shifted)]

    direct = run_all()
    original = ops.through_host
    try:
        ops.through_host = lambda tensor, group: True
        for name in real:
            setattr(dist, name, spy(name))
        staged = run_all()
    finally:
        ops.through_host = original
        for name, function in real.items():
            setattr(dist, name, function)
    caller_tensor_reached_a_collective = any(id(x) in ids for _, ids in seen)
    return direct, staged, caller_tensor_reached_a_collective, sorted({n for n, _ in seen})


def test_collectives_through_host_copies_give_the_same_results():
    for direct, staged, leaked, names in run_distributed(2, _staged_collectives):
        assert staged == direct
        assert not leaked
        assert "all_reduce" in names and "batch_isend_irecv" in names


SHARED_LAYOUTS = {
    "pp2": dict(pp=2),
    "ring2": dict(pp=1, schedule="none", cp_ring=2),
    "ulysses2": dict(pp=1, schedule="none", cp_ulysses=2),
    "tp2-sequence-parallel-dp2": dict(pp=1, schedule="none", tp=2, sequence_parallel=True,
                                      dp=2),
    "ep2-dp2": dict(pp=1, schedule="none", dp=2, moe_experts=4, moe_top_k=2, ep=2),
    "pp2-stage-tp-2-1": dict(pp=2, stage_tp="2,1"),
}


def _check_through_host(rank, world_size, config):
    original = ops.through_host
    ops.through_host = lambda tensor, group: True
    try:
        return check_first_step(rank, world_size, config)
    finally:
        ops.through_host = original


@pytest.mark.parametrize("layout", SHARED_LAYOUTS.values(), ids=SHARED_LAYOUTS.keys())
def test_a_step_whose_collectives_go_through_the_host_matches_one_process(layout):
    config = TrainConfig(**{**SMALL, **layout})
    report = run_distributed(config.world_size, _check_through_host, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def _delivered_elsewhere(rank, world_size):
    """Rank 0 sends from host buffers; rank 1's transport delivers onto the meta device
    (standing in for its GPU): shapes, dtypes and the device are what arrives."""
    transport = P2PTransport(device="cpu", deliver_to="meta" if rank == 1 else "cpu")
    message = (torch.randn(2, 3), {"ids": torch.arange(5), "half": torch.ones(4).bfloat16()},
               "text")
    if rank == 0:
        transport.post_send(message, 1, label="F0")
        transport.post_send(message[0][:, :2].contiguous(), 1, label="F1")  # new layout
        transport.wait_sends()
        return None
    first = transport.post_recv(0, label="F0").wait()
    second = transport.post_recv(0, label="F1").wait()
    return ([(t.device.type, t.dtype, tuple(t.shape))
             for t in (first[0], first[1]["ids"], first[1]["half"], second)], first[2])


def test_a_transport_delivers_host_messages_onto_its_compute_device():
    received, text = run_distributed(2, _delivered_elsewhere)[1]
    assert received == [("meta", torch.float32, (2, 3)), ("meta", torch.int64, (5,)),
                        ("meta", torch.bfloat16, (4,)), ("meta", torch.float32, (2, 2))]
    assert text == "text"


def test_batches_go_to_cuda_through_pinned_memory_without_waiting(monkeypatch):
    """A batch copied from pageable memory would hold the host until the device finished the
    previous step; to CUDA it goes pinned and non-blocking (recorded here, as this build has
    no CUDA), elsewhere as it is."""
    from meshpipe.context.derived import to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self: calls.append("pin_memory") or self)
    monkeypatch.setattr(torch.Tensor, "to",
                        lambda self, *args, **kwargs: calls.append((args, kwargs)) or self)
    tokens = torch.arange(6)
    to_device(tokens, torch.device("cuda", 0))
    to_device(tokens, torch.device("cpu"))
    assert calls == ["pin_memory", ((torch.device("cuda", 0),), {"non_blocking": True}),
                     ((torch.device("cpu"),), {})]
