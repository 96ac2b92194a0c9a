"""The worker pool runs a function on every rank, reports failures and timeouts."""

import time

import pytest

from meshpipe.testing import DistributedTestError, get_pool, run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce_rank(rank, world_size, scale):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank) * scale])
    dist.all_reduce(value)
    return rank, world_size, value.item(), torch.get_num_threads()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def _sleep_on_rank_zero(rank, world_size, seconds):
    if rank == 0:
        time.sleep(seconds)
    return rank


def test_runs_on_every_rank_with_a_shared_group():
    results = run_distributed(2, _all_reduce_rank, 3.0)
    assert results == [(0, 2, 3.0, 1), (1, 2, 3.0, 1)]


def test_pool_is_reused_between_calls():
    pool = get_pool(2)
    run_distributed(2, _all_reduce_rank, 1.0)
    pids = [p.pid for p in pool._processes]
    run_distributed(2, _all_reduce_rank, 1.0)
    assert [p.pid for p in pool._processes] == pids


def test_a_raising_rank_is_reported_with_its_traceback():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(2, _raise_on_rank_one)
    assert set(info.value.failures) == {1}
    assert "boom on rank one" in str(info.value)
    assert run_distributed(2, _all_reduce_rank, 1.0)[0][2] == 1.0


def test_a_timeout_names_the_ranks_still_running():
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] still running after 2 s"):
        run_distributed(2, _sleep_on_rank_zero, 30.0, timeout=2.0)
    assert run_distributed(2, _all_reduce_rank, 1.0)[1][0] == 1


def test_closing_a_pool_whose_start_failed_does_not_raise():
    import multiprocessing

    from meshpipe.testing import WorkerPool

    pool = WorkerPool(2)
    pool._processes = [multiprocessing.get_context("spawn").Process(target=print)]
    pool.close()
    assert pool._processes == []
