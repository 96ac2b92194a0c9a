"""The parallel layout: how many ways each dimension is split and which ranks talk to which.

Axes, slowest to fastest varying in the global rank: pipeline (``pp``), data (``dp``), context
ring (``cp_ring``), context Ulysses (``cp_ulysses``), tensor (``tp``). Ulysses and tensor
parallelism are innermost because their collectives are the heaviest and belong on the fastest
links; pipeline is outermost because it only sends point-to-point.

``ParallelLayout`` is pure arithmetic (rank <-> coordinates); ``Topology.build`` creates the
process groups (every rank must call it, in the same order) from a ``DeviceMesh`` plus the
flattened groups the runtime needs (all of context parallelism; data x context for gradients).
``StageGroups`` covers the heterogeneous case where pipeline stages have different sizes
(VTP: each stage is a block of ranks whose first rank talks to the neighbour stages).

torch is imported only where groups are built, so configuration code (and the schedule
command line) can use the layout arithmetic without loading torch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch.distributed as dist

AXES = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")


def _check_axes(axes) -> None:
    unknown = set(axes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; axes are {AXES}")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel axis; the world size is their product."""

    pp: int = 1
    dp: int = 1
    cp_ring: int = 1
    cp_ulysses: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"parallel size {axis}={size!r} must be an integer >= 1")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def cp(self) -> int:
        return self.cp_ring * self.cp_ulysses

    def describe(self) -> str:
        return " x ".join(f"{axis} {getattr(self, axis)}" for axis in AXES)

    def check_world_size(self, world_size: int) -> None:
        """Fail fast when the launched process count does not match the layout."""
        if world_size != self.world_size:
            raise ValueError(
                f"{world_size} processes launched but the layout {self.describe()} needs "
                f"{self.world_size}; launch {self.world_size} processes or change the sizes")

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1} ({self.describe()})")
        coords = {}
        for axis, size in zip(reversed(AXES), reversed(self.sizes)):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (missing axes count as 0)."""
        _check_axes(coords)
        rank = 0
        for axis, size in zip(AXES, self.sizes):
            index = coords.get(axis, 0)
            if not 0 <= index < size:
                raise ValueError(f"{axis} coordinate {index} outside 0..{size - 1}")
            rank = rank * size + index
        return rank

    def group_ranks(self, axes: Sequence[str]) -> list[list[int]]:
        """Every group that varies along ``axes`` with the other coordinates fixed, ranks sorted."""
        _check_axes(axes)
        fixed_axes = [axis for axis in AXES if axis not in axes]
        groups = []
        for fixed in itertools.product(*(range(getattr(self, a)) for a in fixed_axes)):
            base = dict(zip(fixed_axes, fixed))
            members = [self.rank_of(**base, **dict(zip(axes, varying)))
                       for varying in itertools.product(*(range(getattr(self, a)) for a in axes))]
            groups.append(sorted(members))
        return groups

    def peers(self, rank: int, axes: Sequence[str]) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except along ``axes``."""
        return next(g for g in self.group_ranks(axes) if rank in g)


@dataclass
class Topology:
    """One rank's view of the layout with its process groups."""

    layout: ParallelLayout
    rank: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cp_ring_group: dist.ProcessGroup
    cp_ulysses_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, indexed by pipeline position."""
        return self.layout.peers(self.rank, ["pp"])

    @staticmethod
    def build(layout: ParallelLayout, device_type: str = "cpu") -> Topology:
        """Create every process group of ``layout``; a collective call on all ranks."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        layout.check_world_size(dist.get_world_size())

        mesh = init_device_mesh(device_type, layout.sizes, mesh_dim_names=AXES)
        rank = dist.get_rank()
        return Topology(
            layout=layout,
            rank=rank,
            pp_group=mesh.get_group("pp"),
            dp_group=mesh.get_group("dp"),
            cp_ring_group=mesh.get_group("cp_ring"),
            cp_ulysses_group=mesh.get_group("cp_ulysses"),
            tp_group=mesh.get_group("tp"),
            cp_group=new_groups(layout.group_ranks(["cp_ring", "cp_ulysses"]), rank),
            dp_cp_group=new_groups(layout.group_ranks(["dp", "cp_ring", "cp_ulysses"]), rank),
        )


def new_groups(rank_lists: Sequence[Sequence[int]], rank: int) -> dist.ProcessGroup | None:
    """Create one group per list of ranks and return ``rank``'s (None if it is in none).

    A collective call: every process must create every group, in the same order.
    """
    import torch.distributed as dist

    mine = None
    for ranks in rank_lists:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine


@dataclass
class StageGroups:
    """Pipeline stages made of blocks of ranks of different sizes (VTP).

    Stage ``i`` holds the consecutive ranks ``stage_ranks[i]``; its first rank (the leader)
    exchanges messages with the neighbour stages' leaders and shares them inside the stage.
    """

    stage_ranks: list[list[int]]
    stage: int
    rank: int
    intra_group: dist.ProcessGroup | None

    @property
    def leaders(self) -> list[int]:
        return [ranks[0] for ranks in self.stage_ranks]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.stage_ranks[self.stage][0]

    @staticmethod
    def layout(stage_sizes: Sequence[int]) -> list[list[int]]:
        """Consecutive rank blocks for stages of the given sizes."""
        if not stage_sizes or any(size < 1 for size in stage_sizes):
            raise ValueError(f"stage sizes must be >= 1, got {list(stage_sizes)}")
        starts = list(itertools.accumulate(stage_sizes, initial=0))
        return [list(range(starts[i], starts[i + 1])) for i in range(len(stage_sizes))]

    @staticmethod
    def build(stage_sizes: Sequence[int]) -> StageGroups:
        """Create one intra-stage group per stage; a collective call on all ranks."""
        import torch.distributed as dist

        stage_ranks = StageGroups.layout(stage_sizes)
        world = dist.get_world_size()
        if sum(stage_sizes) != world:
            raise ValueError(f"stage sizes {list(stage_sizes)} cover {sum(stage_sizes)} ranks "
                             f"but {world} processes were launched")
        rank = dist.get_rank()
        stage = next(i for i, ranks in enumerate(stage_ranks) if rank in ranks)
        return StageGroups(stage_ranks, stage, rank, new_groups(stage_ranks, rank))
