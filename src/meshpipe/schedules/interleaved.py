"""Interleaved 1F1B (virtual pipeline stages) in the exact order of Megatron-Core, and
combined 1F1B, which pairs the steady-state forward and backward of that order.

Rank r holds ``v`` model chunks (stages ``r, r + p, ..., r + (v-1) p``: the loop placement).
Its work is a sequence of ``v * m`` *virtual microbatches*; a lookup table maps virtual
microbatch k to (microbatch, chunk): microbatches go in groups of ``N``
(``microbatch_group_size``, Megatron's ``microbatch_group_size_per_vp_stage``, default p),
and each group runs through chunk 0, then chunk 1, ..., before the next group starts; the
last group holds whatever is left. With ``N = p`` and m a multiple of p the chunk of virtual
microbatch k is ``(k mod (p v)) div p``. Backward k runs the same microbatch on the mirrored
chunk ``v - 1 - chunk``.

Rank r runs ``W_r = 2 (p - r - 1) + (v - 1) N`` forwards of warmup (capped at ``v m``: when
it covers everything, the rank runs all forwards, then all backwards), then ``v m - W_r``
steady steps of forward ``W_r + k`` followed by backward ``k``, then the remaining backwards.

Megatron-Core accepts ``N`` only in ``[p, m]`` and rejects a last group with fewer than p
microbatches (``0 < m mod N < p``), which would stall the pipeline on dependencies; the
builders here raise ValueError for the same inputs when v > 1. With v = 1 there is one chunk
and no group to stall on: any m >= 1 is accepted (and N is not taken).
"""

from __future__ import annotations

import numpy as np

from meshpipe.schedules._building import check_count, warmup_steady_cooldown
from meshpipe.schedules.schedule import Schedule
from meshpipe.schedules.placement import loop_placement
from meshpipe.schedules.table import B_CODE, F_CODE, ActionTable, concatenated, stacked


def virtual_microbatch_table(num_microbatches: int, stages_per_rank: int,
                             group_size: int) -> list[tuple[int, int]]:
    """Megatron-Core's schedule table: entry k is (microbatch, chunk) of virtual microbatch k."""
    table = []
    for first in range(0, num_microbatches, group_size):
        group = range(first, min(first + group_size, num_microbatches))
        table.extend((microbatch, chunk) for chunk in range(stages_per_rank)
                     for microbatch in group)
    return table


def _valid_microbatch_counts_near(num_microbatches: int, num_ranks: int,
                                  group_size: int) -> list[int]:
    """The closest valid microbatch counts below and above ``num_microbatches``."""
    def valid(m: int) -> bool:
        return m >= group_size and (m % group_size == 0 or m % group_size >= num_ranks)
    below = next((m for m in range(num_microbatches - 1, group_size - 1, -1) if valid(m)), None)
    above = next(m for m in range(max(num_microbatches + 1, group_size), 2 * group_size
                                  + num_microbatches + 1) if valid(m))
    return [m for m in (below, above) if m is not None]


def check_group_size(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int,
                     microbatch_group_size: int | None) -> int:
    """The microbatch group size, after Megatron-Core's checks on it (ValueError otherwise)."""
    check_count("num_ranks", num_ranks)
    check_count("num_microbatches", num_microbatches)
    check_count("stages_per_rank", stages_per_rank)
    group = num_ranks if microbatch_group_size is None else microbatch_group_size
    check_count("microbatch_group_size", group)
    if group < num_ranks:
        raise ValueError(f"{name}: microbatch_group_size must be >= num_ranks ({num_ranks}), "
                         f"got {group}; use microbatch_group_size={num_ranks}")
    remainder = num_microbatches % group
    if num_microbatches < group or 0 < remainder < num_ranks:
        choices = " or ".join(str(m) for m in
                              _valid_microbatch_counts_near(num_microbatches, num_ranks, group))
        raise ValueError(
            f"{name} with {num_ranks} ranks and microbatch_group_size {group} needs "
            f"num_microbatches >= {group} whose remainder modulo {group} is 0 or >= "
            f"{num_ranks} (a smaller last group stalls the pipeline), got {num_microbatches}; "
            f"use {choices} microbatches, or schedule '1f1b'")
    return group


def _group_size(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int,
                microbatch_group_size: int | None) -> int:
    """The microbatch group size of the table. With one stage per rank the table is the
    microbatches in order whatever the groups, so any m >= 1 runs and the group size is not
    taken; with several, Megatron-Core's checks apply (``check_group_size``)."""
    if stages_per_rank != 1:
        return check_group_size(name, num_ranks, num_microbatches, stages_per_rank,
                                microbatch_group_size)
    check_count("num_ranks", num_ranks)
    check_count("num_microbatches", num_microbatches)
    if microbatch_group_size is not None:
        raise ValueError(f"{name}: microbatch_group_size applies to interleaved pipelining "
                         f"(stages_per_rank > 1); leave it unset")
    return num_ranks


def _rank_order(rank: int, num_ranks: int, stages_per_rank: int, table: _Table,
                warmup: int, combined: bool, forward_only: bool) -> ActionTable:
    """Warmup forwards, steady forward/backward pairs, cooldown backwards of one rank, as a
    one-rank table (forward-only: the forwards in table order)."""
    total = table.microbatch.size
    forwards = np.arange(total)
    if forward_only:
        return table.actions(F_CODE, forwards, rank, num_ranks, stages_per_rank)
    steady = total - warmup
    if combined:
        steps = np.arange(steady)
        return concatenated([
            table.actions(F_CODE, forwards[:warmup], rank, num_ranks, stages_per_rank),
            table.actions(F_CODE, warmup + steps, rank, num_ranks, stages_per_rank).paired_with(
                table.actions(B_CODE, steps, rank, num_ranks, stages_per_rank)),
            table.actions(B_CODE, np.arange(steady, total), rank, num_ranks, stages_per_rank)])
    kind, index = warmup_steady_cooldown(warmup, total)
    return table.actions(kind, index, rank, num_ranks, stages_per_rank)


def _interleaved_warmup(rank: int, num_ranks: int, stages_per_rank: int, group: int) -> int:
    return 2 * (num_ranks - rank - 1) + (stages_per_rank - 1) * group


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int, *,
                     microbatch_group_size: int | None = None,
                     forward_only: bool = False) -> Schedule:
    """Interleaved 1F1B (Megatron-Core's virtual pipeline schedule), loop placement.

    Constraints (v > 1): ``p <= N <= m`` and ``m mod N`` is 0 or ``>= p``
    (N = microbatch_group_size, default p: then m must be a multiple of p). With v = 1 any
    m >= 1 runs and N is not taken: the last-group rule guards the chunk changes of v > 1,
    and one chunk has none. Warmup ``2 (p-r-1) + (v-1) N`` on rank r.

    Bubble (closed form, m a multiple of p, N = p, chunk costs F/v and B/v, free
    communication): ``(p-1) / (v m + p - 1)``, for any ratio of B to F. Simulated at
    F = I = W (each chunk costing 1/v of a full forward and 2/v of a full backward) the
    figure is exactly that closed form. With stages_per_rank = 1 this is Megatron's
    interleaved code path with one chunk: warmup ``2 (p-r-1)``, the same bubble as 1F1B,
    ``(p-1) / (m + p - 1)`` for any m, at up to twice its activation memory.

    The forward-only variant runs the forwards in the same table order (Megatron's
    all-warmup mode).
    """
    return _build_interleaved("interleaved", num_ranks, num_microbatches, stages_per_rank,
                              microbatch_group_size, forward_only, combined=False)


def combined_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1, *,
                  microbatch_group_size: int | None = None,
                  forward_only: bool = False) -> Schedule:
    """Combined 1F1B: every steady-state forward/backward pair runs as one OVERLAP action.

    The forward of one microbatch and the backward of another are co-scheduled (layer by
    layer, in the runtime) so that the expert-parallel all-to-all of one hides behind the
    compute of the other. On one rank with one stage this is "F0; B0+F1; B1+F2; ...;
    B(m-1)". With pipelining it is the interleaved 1F1B order above (same table, same
    constraints on microbatches when stages_per_rank > 1; any m >= 1 with one stage per
    rank) with **one extra warmup forward** on every rank, as Megatron-Core does when it
    overlaps the expert-parallel all-to-all: rank r warms up with
    ``2 (p-r-1) + (v-1) N + 1`` forwards. Without the extra one, the last rank's first
    steady step would pair F(s, m) with B(s, m), a backward that depends on the forward it
    is paired with. Megatron-Core offers the pairing for no pipelining and for interleaved
    pipelining; stages_per_rank = 1 with p > 1 is meshpipe's extension of the same rule. It
    keeps the interleaved warmup ``2 (p-r-1)``, not 1F1B's ``p-r-1``: with the shorter one
    each OVERLAP waits for the next rank's OVERLAP of the same step, which waits for this
    rank's previous step, and half of every rank's time is idle.

    Bubble at F = I = W with an OVERLAP costing F + B (no all-to-all: no overlap gain) and
    free communication: the same as the uncombined order, ``(p-1) / (v m + p - 1)`` (m a
    multiple of p when v > 1); simulated exactly so. Live activations: up to
    ``2 (p-r) + (v-1) N`` microbatches on rank r (twice 1F1B's for v = 1). The gain of
    combined 1F1B lies in the all-to-all time it hides: with ``CostModel.a2a`` > 0 a plain
    F or B waits for its all-to-alls while an OVERLAP costs ``max(F + B, a2a + a2a)``
    instead of ``F + B + 2 a2a``, so the step is shorter than interleaved 1F1B's; an
    explicit ``CostModel.overlap`` gives a measured figure instead. The forward-only variant
    is plain forwards in table order (nothing to pair).
    """
    return _build_interleaved("combined-1f1b", num_ranks, num_microbatches, stages_per_rank,
                              microbatch_group_size, forward_only, combined=True)


def _build_interleaved(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int,
                       microbatch_group_size: int | None, forward_only: bool, *,
                       combined: bool) -> Schedule:
    """The interleaved table order on every rank; ``combined`` pairs the steady state into
    OVERLAP actions after one extra warmup forward. Built as arrays, rank by rank."""
    group = _group_size(name, num_ranks, num_microbatches, stages_per_rank,
                        microbatch_group_size)
    table = _Table(virtual_microbatch_table(num_microbatches, stages_per_rank, group))
    total = table.microbatch.size
    ranks = [_rank_order(rank, num_ranks, stages_per_rank, table,
                         min(total, _interleaved_warmup(rank, num_ranks, stages_per_rank,
                                                        group) + int(combined)),
                         combined, forward_only)
             for rank in range(num_ranks)]
    return Schedule(num_ranks, num_ranks * stages_per_rank, num_microbatches,
                    loop_placement(num_ranks, stages_per_rank), stacked(ranks), name)


class _Table:
    """Megatron-Core's schedule table as two arrays, and the actions it names."""

    def __init__(self, entries: list[tuple[int, int]]) -> None:
        self.microbatch = np.array([m for m, _ in entries], np.int32)
        self.chunk = np.array([c for _, c in entries], np.int32)

    def actions(self, kind: int | np.ndarray, index: np.ndarray, rank: int, num_ranks: int,
                stages_per_rank: int) -> ActionTable:
        """Forward (kind F) or backward (B) of virtual microbatches ``index`` on ``rank``:
        a backward runs its microbatch's mirrored chunk."""
        chunk = self.chunk[index]
        kind = np.broadcast_to(np.asarray(kind, np.int8), index.shape)
        chunk = np.where(kind == F_CODE, chunk, stages_per_rank - 1 - chunk)
        return ActionTable.from_columns(kind, chunk * num_ranks + rank, self.microbatch[index],
                                        [index.size])
