"""Placement of pipeline stages on ranks: ``placement[stage] = rank``.

Three named layouts, and any explicit stage -> rank sequence:

- **loop**: stage ``s`` on rank ``s mod p`` (``stages_per_rank`` rounds over the ranks; the
  layout of interleaved 1F1B);
- **V**: two stages per rank, down then back up (stage ``s < p`` on rank ``s``, stage
  ``2p-1-s`` on rank ``s``), so rank 0 holds the first and the last stage (ZB-V, DualPipeV);
- **wrap-around**: ``p + 1`` stages, stage ``s`` on rank ``s`` and the end stage back on
  rank 0; data flows last rank -> first rank ("layerwise disaggregated" training: the first
  rank holds the embedding and also the head).

The layers of a model spread over the stages the same way everywhere (the trainer, the
tuner, ``models.split``): ``balanced_layers``, and ``stage_layers`` for a placement.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from meshpipe.schedules._building import check_count

PLACEMENTS: tuple[str, ...] = ("loop", "v", "wraparound")


def loop_placement(num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """``num_ranks * stages_per_rank`` stages, stage ``s`` on rank ``s mod num_ranks``."""
    check_count("num_ranks", num_ranks)
    check_count("stages_per_rank", stages_per_rank)
    return tuple(stage % num_ranks for stage in range(num_ranks * stages_per_rank))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """``2 * num_ranks`` stages: down the ranks, then back up (rank r holds r and 2p-1-r)."""
    check_count("num_ranks", num_ranks)
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def wraparound_placement(num_ranks: int) -> tuple[int, ...]:
    """``num_ranks + 1`` stages, stage s on rank s and the end stage back on rank 0."""
    check_count("num_ranks", num_ranks)
    return tuple(range(num_ranks)) + (0,)


def stages_by_rank(placement: Sequence[int]) -> list[list[int]]:
    """Per rank (0 .. the highest rank named), the stages it holds, in stage order."""
    held: list[list[int]] = [[] for _ in range(max(placement, default=-1) + 1)]
    for stage, rank in enumerate(placement):
        held[rank].append(stage)
    return held


def check_placement(placement: Sequence[int], num_ranks: int) -> tuple[int, ...]:
    """``placement`` as a tuple, after checking that it maps stages onto all ``num_ranks``.

    Every entry must be a rank in ``0..num_ranks-1`` and every rank must hold a stage (a
    rank without work is almost certainly a wrong map).
    """
    check_count("num_ranks", num_ranks)
    if isinstance(placement, (str, bytes)) or not isinstance(placement, Sequence):
        raise TypeError(f"placement must be a sequence of ranks (placement[stage] = rank), "
                        f"got {placement!r}")
    result = tuple(placement)
    if not result:
        raise ValueError("placement is empty: it must name the rank of every stage")
    for stage, rank in enumerate(result):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_ranks:
            raise ValueError(f"placement[{stage}] = {rank!r} is not a rank in "
                             f"0..{num_ranks - 1}")
    idle = sorted(set(range(num_ranks)) - set(result))
    if idle:
        raise ValueError(f"placement {result} leaves ranks {idle} without a stage; "
                         f"use {num_ranks} ranks that all hold stages")
    return result


def resolve_placement(placement: str | Sequence[int] | None, num_ranks: int,
                      stages_per_rank: int = 1) -> tuple[int, ...]:
    """A placement from a name ("loop", "v", "wraparound"), a sequence, or None (loop).

    ``stages_per_rank`` applies to the loop layout; V always holds 2 stages per rank,
    wrap-around a ragged 2-then-1, and an explicit sequence as many as it says (the most
    stages any rank holds), so for those ``stages_per_rank`` is 1 (unset) or that number:
    anything else is an error.
    """
    check_count("stages_per_rank", stages_per_rank)
    if placement is None or placement == "loop":
        return loop_placement(num_ranks, stages_per_rank)
    if placement == "v":
        if stages_per_rank not in (1, 2):
            raise ValueError(f"the V placement holds 2 stages per rank, not {stages_per_rank}; "
                             f"use stages_per_rank=2 or placement 'loop'")
        return v_placement(num_ranks)
    if placement == "wraparound":
        if stages_per_rank != 1:
            raise ValueError(f"the wrap-around placement has {num_ranks + 1} stages on "
                             f"{num_ranks} ranks (rank 0 holds two); stages_per_rank="
                             f"{stages_per_rank} does not apply, leave it at 1")
        return wraparound_placement(num_ranks)
    if isinstance(placement, str):
        raise ValueError(f"unknown placement {placement!r}; use one of {PLACEMENTS} "
                         f"or an explicit stage -> rank sequence")
    stages = check_placement(placement, num_ranks)
    most = max(Counter(stages).values())
    if stages_per_rank not in (1, most):
        raise ValueError(f"placement {stages} holds up to {most} stages per rank, but "
                         f"stages_per_rank={stages_per_rank}; an explicit placement sets the "
                         f"stages per rank itself: leave stages_per_rank unset (1) or give a "
                         f"placement with {stages_per_rank} stages on a rank")
    return stages


def balanced_layers(n_layers: int, num_stages: int) -> list[int]:
    """Layer counts that differ by at most one, the larger counts on the earlier stages."""
    base, extra = divmod(n_layers, num_stages)
    return [base + 1 if stage < extra else base for stage in range(num_stages)]


def layers_beside_first_cost(n_layers: int, num_stages: int, first_cost: float) -> list[int]:
    """Layer counts that even out each stage's work when the first also carries
    ``first_cost`` layers' worth of other work (a vision tower): the first gets that much
    fewer layers, down to none; the others share the rest as ``balanced_layers`` does."""
    even = balanced_layers(n_layers, num_stages)
    if num_stages == 1:
        return even
    share = (n_layers + first_cost) / num_stages
    first = min(even[0], max(0, round(share - first_cost)))
    return [first] + balanced_layers(n_layers - first, num_stages - 1)


def stage_layers(n_layers: int, placement: Sequence[int]) -> list[int] | None:
    """Each stage's layer count on ``placement``: balanced; a wrap-around end stage (the
    first rank again) may hold only the final norm and the head, as in layerwise
    disaggregated training, so with fewer layers than stages the layers go to the others.
    None when the layers cannot fill the stages."""
    stages = len(placement)
    if n_layers >= stages:
        return balanced_layers(n_layers, stages)
    num_ranks = max(placement) + 1
    if tuple(placement) == wraparound_placement(num_ranks) and n_layers >= stages - 1:
        return balanced_layers(n_layers, stages - 1) + [0]
    return None
