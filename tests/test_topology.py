"""Parallel layout arithmetic and process-group construction."""

import pytest

from meshpipe.testing import run_distributed
from meshpipe.topology import ParallelLayout, StageGroups, Topology


def test_rank_and_coordinates_are_inverse():
    layout = ParallelLayout(pp=2, dp=3, cp_ring=2, cp_ulysses=2)
    assert layout.world_size == 24 and layout.cp == 4
    for rank in range(layout.world_size):
        assert layout.rank_of(**layout.coords(rank)) == rank


def test_ulysses_is_innermost_and_pipeline_outermost():
    layout = ParallelLayout(pp=2, dp=2, cp_ulysses=2)
    assert layout.coords(1) == {"pp": 0, "dp": 0, "cp_ring": 0, "cp_ulysses": 1, "tp": 0}
    assert layout.coords(4)["pp"] == 1
    assert layout.group_ranks(["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group_ranks(["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.peers(5, ["dp", "cp_ulysses"]) == [4, 5, 6, 7]


def test_wrong_world_size_fails_fast_with_the_fix():
    with pytest.raises(ValueError, match="6 processes launched but the layout .* needs 4; "
                                         "launch 4 processes"):
        ParallelLayout(pp=2, cp_ring=2).check_world_size(6)


@pytest.mark.parametrize("bad", [dict(pp=0), dict(dp=-1), dict(cp_ring=1.5)])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        ParallelLayout(**bad)


def test_stage_blocks_for_heterogeneous_stages():
    assert StageGroups.layout([2, 1, 3]) == [[0, 1], [2], [3, 4, 5]]
    with pytest.raises(ValueError, match="stage sizes must be >= 1"):
        StageGroups.layout([2, 0])


def _build_and_reduce(rank, world_size):
    import torch
    import torch.distributed as dist

    topo = Topology.build(ParallelLayout(pp=2, cp_ring=1, cp_ulysses=2))
    sums = {}
    for name in ("pp_group", "dp_group", "cp_ulysses_group", "cp_group", "dp_cp_group"):
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=getattr(topo, name))
        sums[name] = value.item()
    return topo.pp_rank, topo.pipeline_ranks, sums


def test_groups_reduce_over_the_right_ranks():
    results = run_distributed(4, _build_and_reduce)
    assert [r[0] for r in results] == [0, 0, 1, 1]
    assert [r[1] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r[2]["pp_group"] for r in results] == [2, 4, 2, 4]
    assert [r[2]["cp_ulysses_group"] for r in results] == [1, 1, 5, 5]
    assert [r[2]["cp_group"] for r in results] == [1, 1, 5, 5]
    assert [r[2]["dp_group"] for r in results] == [0, 1, 2, 3]
    assert [r[2]["dp_cp_group"] for r in results] == [1, 1, 5, 5]


def _stage_groups(rank, world_size):
    import torch
    import torch.distributed as dist

    groups = StageGroups.build([1, 3])
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=groups.intra_group)
    return groups.stage, groups.is_leader, groups.leaders, value.item()


def test_stage_groups_for_vtp():
    results = run_distributed(4, _stage_groups)
    assert results == [(0, True, [0, 1], 0.0), (1, True, [0, 1], 6.0),
                       (1, False, [0, 1], 6.0), (1, False, [0, 1], 6.0)]
