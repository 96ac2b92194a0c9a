"""Each local CPU rank's share of the cores (``runtime.host_cores``)."""

import pytest

from meshpipe.runtime.host_cores import cores_for_rank


def test_ranks_get_disjoint_contiguous_shares_of_the_cores():
    available = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [cores_for_rank(rank, 2, available) for rank in range(2)] == [
        [0, 1, 2, 3], [4, 5, 6, 7]]
    assert [cores_for_rank(rank, 8, available) for rank in range(8)] == [
        [core] for core in available]


def test_the_first_ranks_take_the_remainder():
    assert [cores_for_rank(rank, 3, [0, 1, 2, 3, 4, 5, 6, 7]) for rank in range(3)] == [
        [0, 1, 2], [3, 4, 5], [6, 7]]


def test_shares_come_from_the_cores_the_process_may_use():
    assert [cores_for_rank(rank, 2, [9, 3, 5, 7]) for rank in range(2)] == [[3, 5], [7, 9]]


def test_too_few_cores_leave_the_ranks_unbound():
    assert cores_for_rank(0, 4, [0, 1]) is None
    assert cores_for_rank(0, 2, [0, 1, 2], threads=2) is None
    assert cores_for_rank(1, 2, [0, 1, 2, 3], threads=2) == [2, 3]


def test_a_rank_outside_the_world_is_an_error():
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2 ranks"):
        cores_for_rank(2, 2, [0, 1])
