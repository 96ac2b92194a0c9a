"""Parallel layout arithmetic and process-group construction."""

import pytest

from meshpipe.testing import run_distributed
from meshpipe.topology import ParallelLayout, Topology

pytestmark = pytest.mark.distributed


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


def test_stage_tp_gives_each_position_a_block_of_its_own_size():
    layout = ParallelLayout(pp=3, dp=2, stage_tp=[2, 1, 3])
    assert layout.world_size == 12 and not layout.is_uniform
    assert [layout.coords(r)["pp"] for r in range(12)] == [0] * 4 + [1] * 2 + [2] * 6
    assert layout.coords(5) == {"pp": 1, "dp": 1, "cp_ring": 0, "cp_ulysses": 0, "tp": 0}
    assert layout.coords(9) == {"pp": 2, "dp": 1, "cp_ring": 0, "cp_ulysses": 0, "tp": 0}
    for rank in range(layout.world_size):
        assert layout.rank_of(**layout.coords(rank)) == rank
    assert layout.stage_ranks(5) == [[2, 3], [5], [9, 10, 11]]
    assert layout.group_ranks(["tp"]) == [[0, 1], [2, 3], [4], [5], [6, 7, 8], [9, 10, 11]]
    assert layout.group_ranks(["pp", "tp"]) == [[0, 1, 4, 6, 7, 8], [2, 3, 5, 9, 10, 11]]
    assert "stage-tp 2,1,3" in layout.describe()


def test_equal_stage_tp_is_the_uniform_layout():
    uniform = ParallelLayout(pp=2, dp=2, tp=2)
    staged = ParallelLayout(pp=2, dp=2, stage_tp=(2, 2))
    assert staged.is_uniform and staged.sizes == uniform.sizes
    assert [staged.coords(r) for r in range(8)] == [uniform.coords(r) for r in range(8)]
    assert staged.group_ranks(["pp"]) == uniform.group_ranks(["pp"])


@pytest.mark.parametrize("bad,message", [
    (dict(pp=2, stage_tp=[1]), "has 1 sizes for pp 2"),
    (dict(pp=2, stage_tp=[1, 0]), "integers >= 1"),
    (dict(pp=2, tp=2, stage_tp=[1, 2]), "either tp"),
])
def test_bad_stage_tp_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**bad)


def test_a_ragged_layout_is_no_mesh():
    with pytest.raises(ValueError, match="no rectangular mesh"):
        ParallelLayout(pp=2, stage_tp=[1, 2]).sizes


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


def _vtp_groups(rank, world_size):
    import torch
    import torch.distributed as dist

    topo = Topology.build(ParallelLayout(pp=2, stage_tp=[1, 3]))
    sums = {}
    for name in ("tp_group", "model_group", "pp_group"):
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=getattr(topo, name))
        sums[name] = value.item()
    return topo.pp_rank, topo.tp_rank, topo.tp_size, topo.pipeline_ranks, sums


def test_groups_of_positions_with_different_tp_sizes():
    results = run_distributed(4, _vtp_groups)
    assert [r[:3] for r in results] == [(0, 0, 1), (1, 0, 3), (1, 1, 3), (1, 2, 3)]
    assert all(r[3] == [0, 1] for r in results)
    assert [r[4]["tp_group"] for r in results] == [0, 6, 6, 6]
    assert [r[4]["model_group"] for r in results] == [6, 6, 6, 6]
    # along pp, positions meet by tp index: position 0 has only tp index 0
    assert [r[4]["pp_group"] for r in results] == [1, 1, 2, 3]
