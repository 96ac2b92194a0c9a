"""The parallel layout: how many ways each dimension is split and which ranks talk to which.

Axes, slowest to fastest varying in the global rank: pipeline (``pp``), data (``dp``), context
ring (``cp_ring``), context Ulysses (``cp_ulysses``), tensor (``tp``). Ulysses and tensor
parallelism are innermost because their collectives are the heaviest and belong on the fastest
links; pipeline is outermost because it only sends point-to-point.

Tensor parallelism is uniform (``tp``) or per pipeline position (``stage_tp``, VTP): position
``p`` then holds a block of ``dp x cp x stage_tp[p]`` consecutive ranks, laid out inside like
any other position. With equal sizes the two describe the same ranks.

``ParallelLayout`` is pure arithmetic (rank <-> coordinates); ``Topology.build`` creates the
process groups (every rank must call it, in the same order): from a ``DeviceMesh`` where the
sizes are uniform, as explicit groups where the positions differ, plus the flattened groups
the runtime needs (all of context parallelism; data x context for gradients; pipeline x
tensor for the global gradient norm).

torch is imported only where groups are built, so configuration code (and the schedule
command line) can use the layout arithmetic without loading torch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch.distributed as dist

AXES = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")
# The axes inside one pipeline position's block of ranks, slowest first.
_BLOCK_AXES = AXES[1:]


def _check_axes(axes) -> None:
    unknown = set(axes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; axes are {AXES}")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel axis; ``stage_tp`` gives each pipeline position its own tp.

    The world size is ``dp x cp_ring x cp_ulysses`` times the sum of the positions' tensor-
    parallel sizes (``pp x tp`` when uniform).
    """

    pp: int = 1
    dp: int = 1
    cp_ring: int = 1
    cp_ulysses: int = 1
    tp: int = 1
    stage_tp: tuple[int, ...] | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep"):
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"parallel size {axis}={size!r} must be an integer >= 1")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the data x context-parallel ranks "
                             f"of a stage, dp {self.dp} x cp {self.cp} = {self.dp * self.cp}: "
                             f"experts are sharded over ranks that hold the same stage; use "
                             f"an --ep that divides {self.dp * self.cp}")
        if self.stage_tp is None:
            return
        object.__setattr__(self, "stage_tp", tuple(self.stage_tp))
        if len(self.stage_tp) != self.pp:
            raise ValueError(f"stage_tp {list(self.stage_tp)} has {len(self.stage_tp)} sizes for "
                             f"pp {self.pp}; give one tensor-parallel size per pipeline rank")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.stage_tp):
            raise ValueError(f"stage_tp {list(self.stage_tp)} must hold integers >= 1")
        if self.tp != 1:
            raise ValueError(f"give either tp ({self.tp}) or stage_tp "
                             f"({list(self.stage_tp)}), not both")

    @property
    def is_uniform(self) -> bool:
        """Whether every pipeline position has the same tensor-parallel size."""
        return self.stage_tp is None or len(set(self.stage_tp)) == 1

    def tp_of(self, position: int) -> int:
        """The tensor-parallel size of pipeline position ``position``."""
        return self.tp if self.stage_tp is None else self.stage_tp[position]

    @property
    def max_tp(self) -> int:
        return self.tp if self.stage_tp is None else max(self.stage_tp)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every axis's size, for a uniform layout (a ``DeviceMesh`` shape)."""
        if not self.is_uniform:
            raise ValueError(f"the layout {self.describe()} has positions of different "
                             "tensor-parallel sizes, so it is no rectangular mesh")
        return (self.pp, self.dp, self.cp_ring, self.cp_ulysses, self.tp_of(0))

    @property
    def cp(self) -> int:
        return self.cp_ring * self.cp_ulysses

    def _block_sizes(self, position: int) -> tuple[int, ...]:
        return (self.dp, self.cp_ring, self.cp_ulysses, self.tp_of(position))

    @cached_property
    def _block_starts(self) -> tuple[int, ...]:
        blocks = [math.prod(self._block_sizes(p)) for p in range(self.pp)]
        return tuple(itertools.accumulate(blocks, initial=0))

    @property
    def world_size(self) -> int:
        return self._block_starts[-1]

    def describe(self) -> str:
        parts = [f"{axis} {getattr(self, axis)}" for axis in AXES[:-1]]
        tp = (f"tp {self.tp}" if self.stage_tp is None
              else "stage-tp " + ",".join(map(str, self.stage_tp)))
        return " x ".join(parts + [tp]) + (f" (ep {self.ep})" if self.ep > 1 else "")

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
        position = next(p for p in range(self.pp) if rank < self._block_starts[p + 1])
        offset = rank - self._block_starts[position]
        coords = {"pp": position}
        for axis, size in zip(reversed(_BLOCK_AXES), reversed(self._block_sizes(position))):
            offset, coords[axis] = divmod(offset, size)
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (missing axes count as 0)."""
        _check_axes(coords)
        position = coords.get("pp", 0)
        if not 0 <= position < self.pp:
            raise ValueError(f"pp coordinate {position} outside 0..{self.pp - 1}")
        offset = 0
        for axis, size in zip(_BLOCK_AXES, self._block_sizes(position)):
            index = coords.get(axis, 0)
            if not 0 <= index < size:
                raise ValueError(f"{axis} coordinate {index} outside 0..{size - 1}"
                                 + (f" at pipeline position {position}" if axis == "tp" else ""))
            offset = offset * size + index
        return self._block_starts[position] + offset

    def group_ranks(self, axes: Sequence[str]) -> list[list[int]]:
        """Every group of ranks that share their coordinates outside ``axes``, ranks sorted.

        Groups are ordered by those shared coordinates. Along ``pp`` with positions of
        different tensor-parallel sizes, a group holds the positions that have its tp index.
        """
        _check_axes(axes)
        fixed_axes = [axis for axis in AXES if axis not in axes]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coords(rank)
            groups.setdefault(tuple(coords[a] for a in fixed_axes), []).append(rank)
        return [groups[key] for key in sorted(groups)]

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """The expert-parallel groups and the expert-data-parallel groups.

        Inside the data x context ranks of one stage and tp index (in dp, ring, Ulysses
        order, the fastest last), ``ep`` consecutive ranks form an expert-parallel group and
        share the experts out; the ranks at the same place of every such group hold the same
        experts and sum those experts' gradients.
        """
        expert_parallel: list[list[int]] = []
        expert_data: list[list[int]] = []
        for replicas in self.group_ranks(["dp", "cp_ring", "cp_ulysses"]):
            expert_parallel += [replicas[i:i + self.ep]
                                for i in range(0, len(replicas), self.ep)]
            expert_data += [replicas[i::self.ep] for i in range(self.ep)]
        return expert_parallel, expert_data

    def peers(self, rank: int, axes: Sequence[str]) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except along ``axes``."""
        return next(g for g in self.group_ranks(axes) if rank in g)

    def stage_ranks(self, rank: int) -> list[list[int]]:
        """The ranks of every pipeline position, in tp order, that ``rank``'s data and context
        coordinates meet: the stages of its pipeline when positions differ in size."""
        coords = self.coords(rank)
        return [[self.rank_of(**{**coords, "pp": p, "tp": t}) for t in range(self.tp_of(p))]
                for p in range(self.pp)]


@dataclass
class Topology:
    """One rank's view of the layout with its process groups.

    ``model_group`` joins the ranks that hold different parts of one model replica (pipeline
    x tensor): the global gradient norm and the step's loss are reduced over it.
    ``ep_group`` shares the experts of a stage out; ``expert_dp_group`` joins the ranks that
    hold the same experts (their gradients are summed there).
    """

    layout: ParallelLayout
    rank: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cp_ring_group: dist.ProcessGroup
    cp_ulysses_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    model_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup | None = None
    expert_dp_group: dist.ProcessGroup | None = None

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def tp_size(self) -> int:
        return self.layout.tp_of(self.pp_rank)

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, indexed by pipeline position.

        Uniform tensor parallelism gives each tp rank a pipeline of its own; with positions
        of different sizes a pipeline is named by the positions' tp rank 0 (the transport
        connecting stages of different sizes routes from there).
        """
        if self.layout.stage_tp is None:
            return self.layout.peers(self.rank, ["pp"])
        return [ranks[0] for ranks in self.layout.stage_ranks(self.rank)]

    @staticmethod
    def build(layout: ParallelLayout, device_type: str = "cpu") -> Topology:
        """Create every process group of ``layout``; a collective call on all ranks."""
        import torch.distributed as dist

        layout.check_world_size(dist.get_world_size())
        rank = dist.get_rank()
        if layout.is_uniform:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device_type, layout.sizes, mesh_dim_names=AXES)
            axis_groups = {axis: mesh.get_group(axis) for axis in AXES}
        else:
            axis_groups = {axis: new_groups(layout.group_ranks([axis]), rank) for axis in AXES}
        return Topology(
            layout=layout,
            rank=rank,
            pp_group=axis_groups["pp"],
            dp_group=axis_groups["dp"],
            cp_ring_group=axis_groups["cp_ring"],
            cp_ulysses_group=axis_groups["cp_ulysses"],
            tp_group=axis_groups["tp"],
            cp_group=new_groups(layout.group_ranks(["cp_ring", "cp_ulysses"]), rank),
            dp_cp_group=new_groups(layout.group_ranks(["dp", "cp_ring", "cp_ulysses"]), rank),
            model_group=new_groups(layout.group_ranks(["pp", "tp"]), rank),
            **_expert_groups(layout, rank),
        )


def _expert_groups(layout: ParallelLayout, rank: int) -> dict[str, dist.ProcessGroup | None]:
    """The expert groups of ``rank`` (none without expert parallelism)."""
    if layout.ep == 1:
        return {}
    expert_parallel, expert_data = layout.expert_groups()
    return {"ep_group": new_groups(expert_parallel, rank),
            "expert_dp_group": new_groups(expert_data, rank)}


def new_groups(rank_lists: Sequence[Sequence[int]], rank: int,
               backend: str | None = None) -> dist.ProcessGroup | None:
    """Create one group per list of ranks and return ``rank``'s (None if it is in none).

    A collective call: every process must create every group, in the same order.
    """
    import torch.distributed as dist

    mine = None
    for ranks in rank_lists:
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks:
            mine = group
    return mine
