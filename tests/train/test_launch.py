"""The local launcher runs every rank and stops the run when one rank fails."""

import json
import os
import re
import sys
import time

import pytest

from meshpipe.train.run.devices import DevicePlan
from meshpipe.train.supervisor.launch import LaunchError, Supervision, launch

pytestmark = pytest.mark.distributed


def _write_rank(out_dir):
    import torch
    import torch.distributed as dist
    from malloc_probe import where_large_blocks_go

    cores = sorted(os.sched_getaffinity(0))
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    with open(f"{out_dir}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"sum": value.item(), "threads": torch.get_num_threads(),
                   "world": dist.get_world_size(), "large blocks": where_large_blocks_go(),
                   "cores": cores}, f)


def _fail_on_rank_one_while_others_wait():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("stage 1 microbatch 0: deliberate failure")
    dist.all_reduce(torch.ones(1))


def _stop_rank_one_inside_step_seven():
    import signal

    import torch
    import torch.distributed as dist

    from meshpipe.runtime import activity

    if dist.get_rank() == 1:
        with activity.doing("step 7", step=7):
            with activity.doing("1F0", stage=1, microbatch=0, action="1F0"):
                os.kill(os.getpid(), signal.SIGSTOP)
    with activity.waiting("a message", peer=1):
        dist.recv(torch.ones(1), src=1)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_rank_is_reported_at_the_step_it_stopped_in():
    """Rank 1 stops itself as it enters step 7, before its reporter writes that: the report
    takes the place from its where-file and the reason from /proc."""
    with pytest.raises(LaunchError) as info:
        launch(_stop_rank_one_inside_step_seven, 2, supervision=Supervision(hang_timeout=4.0))
    assert info.value.rank == 1
    assert re.fullmatch(r"rank 1 is stopped \(SIGSTOP or a debugger\); last seen \d+ s ago at "
                        r"step 7, stage 1, microbatch 0, action 1F0; rank 0 waits on it",
                        str(info.value)), info.value.details


def test_every_rank_runs_in_an_initialised_group(tmp_path):
    """... each with one thread, a malloc that keeps freed memory (``runtime.host_memory``)
    and, with a core for each, cores of its own (``runtime.host_cores``): here half of the
    cores the test may use each."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("needs 2 cores for 2 ranks to get cores of their own")
    half = (len(available) + 1) // 2
    launch(_write_rank, 2, str(tmp_path))
    for rank, cores in enumerate([available[:half], available[half:]]):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "sum": 1.0, "threads": 1, "world": 2,
            "large blocks": {"mapped": False, "kept": True}, "cores": cores}


def test_ranks_stay_unbound_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPIPE_BIND_CORES", "0")
    launch(_write_rank, 2, str(tmp_path))
    for rank in range(2):
        written = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert written["cores"] == sorted(os.sched_getaffinity(0))


class _RankOneSlowToStart(DevicePlan):
    """Rank 1 reaches the rendezvous 3.5 s after rank 0 (imports on a busy machine)."""

    def device(self, local_rank: int):
        if local_rank == 1:
            time.sleep(3.5)
        return super().device(local_rank)


@pytest.mark.slow
def test_waiting_at_the_rendezvous_for_a_slow_rank_is_no_hang(tmp_path):
    """Rank 0 waits at the rendezvous longer than the hang timeout: not a hang, since a
    rank that never comes ends the rendezvous with the process group's own timeout."""
    launch(_write_rank, 2, str(tmp_path), supervision=Supervision(hang_timeout=1.5),
           devices=_RankOneSlowToStart.cpu(2))
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["sum"] for r in (0, 1)] == [
        1.0, 1.0]


def test_a_failing_rank_stops_the_others_and_is_named():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 failed") as info:
        launch(_fail_on_rank_one_while_others_wait, 3)
    assert info.value.rank == 1
    assert "deliberate failure" in str(info.value)
    assert time.monotonic() - start < 60


def test_nccl_ranks_record_their_collectives_for_the_watchdog(tmp_path):
    """NCCL's flight recorder is on for NCCL ranks (as defaults a user's settings override),
    dumping under the run's logs, and a hang report names the dumps when there are some."""
    from meshpipe.train.supervisor.launch import _flight_recorder_note, nccl_flight_recorder

    settings = nccl_flight_recorder(tmp_path)
    assert settings["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(settings["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert settings["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl-trace-rank-")
    assert _flight_recorder_note(tmp_path) == ""
    (tmp_path / "nccl-trace-rank-1").write_bytes(b"trace")
    assert "flight recorder wrote 1 rank(s)' collectives" in _flight_recorder_note(tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_torchrun_agents_train_like_two_nodes(tmp_path):
    """Two torchrun agents of two processes each meet at a c10d rendezvous on 127.0.0.1,
    as two nodes would, and train pp 2 x dp 2 with --check."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "run"
    train = ["-m", "meshpipe", "train", "--layers", "2", "--dim", "32", "--heads", "2",
             "--kv-heads", "1", "--seq-len", "16", "--microbatches", "2", "--pp", "2",
             "--dp", "2", "--steps", "2", "--check", "--no-progress", "--eval-every", "0",
             "--timeline-step", "0", "--device", "cpu", "--out-dir", str(out)]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
         "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "two-nodes", *train], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [err[-2000:] for _, err in outputs]
    said = "".join(stdout for stdout, _ in outputs)
    assert "--check step 1 vs one process" in said and ": PASS" in said, said[-2000:]
