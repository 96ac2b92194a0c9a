"""Context-parallel collectives against a single-process reference, forward and backward.

Every rank builds the same full tensor from a shared seed, runs the collective on its part,
and compares with a reference computed locally from plain tensor slicing
(``tensor_split`` splits like ``split_sizes``: the first ranks get one extra element).
Hypothesis draws many cases per example; all of them run inside one ``run_distributed``
call so a worker pool of each size is reused.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from meshpipe.comm import collectives as cc
from meshpipe.comm import ops
from meshpipe.comm.checks import CHECK_ENV
from meshpipe.context import shards
from meshpipe.context import split_gather as sg
from meshpipe.testing import keep_across_calls, run_distributed
from meshpipe.topology import ParallelLayout, Topology

SPLIT_OPS = ("split", "zigzag_split", "packed_split", "hybrid_split", "packed_hybrid_split")
GATHER_OPS = ("gather", "zigzag_gather", "packed_gather", "hybrid_gather",
              "packed_hybrid_gather")
CASES_PER_EXAMPLE = 60


# ------------------------------------------------------------------- reference slicing


def _contiguous_ref(t: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    return list(t.tensor_split(parts, dim))


def _zigzag_ref(t: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    if parts == 1:
        return [t]
    chunks = t.tensor_split(2 * parts, dim)
    return [torch.cat([chunks[r], chunks[2 * parts - 1 - r]], dim) for r in range(parts)]


def _packed_ref(t: torch.Tensor, seq_lens: list[int], parts: int,
                dim: int) -> list[torch.Tensor]:
    pieces = [doc.tensor_split(parts, dim) for doc in t.split(seq_lens, dim)]
    return [torch.cat([doc_pieces[r] for doc_pieces in pieces], dim) for r in range(parts)]


def _reference_shards(case: dict, t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """Every rank's shard of ``t`` along ``dim``, in (ring, ulysses) rank order."""
    layout = case["layout"]
    ring, ulysses = case.get("ring", 1), case.get("ulysses", 1)
    if layout == "contiguous" and case.get("sizes") is not None:
        return list(t.split(case["sizes"], dim))
    if layout == "contiguous":
        return _contiguous_ref(t, case["world"], dim)
    if layout == "zigzag":
        return _zigzag_ref(t, case["world"], dim)
    if layout == "packed":
        return _packed_ref(t, case["seq_lens"], case["world"], dim)
    ring_shards = (_zigzag_ref(t, ring, dim) if layout == "hybrid"
                   else _packed_ref(t, case["seq_lens"], ring, dim))
    return [part for shard in ring_shards for part in _contiguous_ref(shard, ulysses, dim)]


def _reassemble_ref(case: dict, shards: list[torch.Tensor], total: int) -> torch.Tensor:
    """Differentiably put the shards back in sequence order (inverse of the reference)."""
    order = torch.cat(_reference_shards(case, torch.arange(total), 0))
    return torch.cat(shards, case["dim"]).index_select(case["dim"], torch.argsort(order))


# --------------------------------------------------------------------------- case draw


def _layout_of(op: str) -> str:
    for layout in ("packed_hybrid", "hybrid", "zigzag", "packed"):
        if op.startswith(layout):
            return layout
    return "contiguous"


@st.composite
def _cases(draw, world: int) -> dict:
    op = draw(st.sampled_from(("all_to_all", *SPLIT_OPS, *GATHER_OPS)))
    ndim = draw(st.integers(2 if op == "all_to_all" else 1, 4))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    case = dict(op=op, world=world, seed=draw(st.integers(0, 2**31 - 1)))
    if op == "all_to_all":
        scatter_dim, gather_dim = draw(st.permutations(range(ndim)))[:2]
        shape[scatter_dim] = draw(st.integers(1, 3 * world + 1))
        shape[gather_dim] = draw(st.integers(1, 3 * world + 1))
        aligned_gather = shape[gather_dim] % world == 0
        case.update(scatter_dim=scatter_dim - ndim * draw(st.booleans()),
                    gather_dim=gather_dim, shape=shape,
                    pass_gather_size=not aligned_gather or draw(st.booleans()))
        return case
    dim = draw(st.integers(0, ndim - 1))
    layout = _layout_of(op)
    ring, ulysses = draw(st.sampled_from([(r, world // r) for r in range(1, world + 1)
                                          if world % r == 0]))
    if layout == "contiguous" and draw(st.booleans()):
        case["sizes"] = draw(st.lists(st.integers(0, 4), min_size=world, max_size=world))
        shape[dim] = sum(case["sizes"])
    elif layout == "contiguous":
        shape[dim] = draw(st.integers(0, 3 * world + 1))
    elif layout == "zigzag":
        shape[dim] = 2 * world * draw(st.integers(1, 2))
    elif layout == "hybrid":
        shape[dim] = (2 * ring * draw(st.integers(1, 2)) if ring > 1
                      else draw(st.integers(1, 3 * world + 1)))
    else:
        case["seq_lens"] = draw(st.lists(st.integers(0, 2 * world + 1), min_size=1,
                                         max_size=4))
        shape[dim] = sum(case["seq_lens"])
    case.update(dim=dim - ndim * draw(st.booleans()), shape=shape, layout=layout,
                ring=ring, ulysses=ulysses,
                grad_scale=draw(st.sampled_from(["up", "down", None, "default"])),
                pass_sizes=draw(st.booleans()))
    return case


# ------------------------------------------------------------------------ worker side


_GROUPS: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _cp_groups(ring: int, ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ring group, ulysses group) of this rank; every rank builds all of them in order."""
    if not _GROUPS:
        world = dist.get_world_size()
        for r in range(1, world + 1):
            if world % r == 0:
                topo = Topology.build(ParallelLayout(cp_ring=r, cp_ulysses=world // r))
                _GROUPS[r, world // r] = (topo.cp_ring_group, topo.cp_ulysses_group)
                keep_across_calls(*_GROUPS[r, world // r])
    return _GROUPS[ring, ulysses]


def _documented_scale(case: dict) -> float:
    """The factor seed 004 documents: 'up' x size, 'down' / size; splits default to 'down'."""
    size = case["world"]
    grad_scale = case["grad_scale"]
    if grad_scale == "default":
        grad_scale = "down" if case["op"] in SPLIT_OPS else "up"
    return {"up": size, "down": 1 / size, None: 1.0}[grad_scale]


def _grad_scale_kwargs(case: dict) -> dict:
    return {} if case["grad_scale"] == "default" else {"grad_scale": case["grad_scale"]}


def _apply_op(case: dict, x: torch.Tensor, rank: int, total: int) -> torch.Tensor:
    op, dim, world = case["op"], case.get("dim"), case["world"]
    scale = _grad_scale_kwargs(case) if op != "all_to_all" else {}
    if op == "all_to_all":
        gather_size = case["shape"][case["gather_dim"]] if case["pass_gather_size"] else None
        return cc.all_to_all(x, None, case["scatter_dim"], case["gather_dim"], gather_size)
    ring_group, ulysses_group = _cp_groups(case["ring"], case["ulysses"])
    sizes = case.get("sizes") or cc.split_sizes(total, world)
    if not case["pass_sizes"] and not (op == "split" and "sizes" in case):
        sizes = None  # split's default, or gather learning the sizes from its peers
    calls = {
        "split": lambda: sg.split(x, None, dim, sizes, **scale),
        "gather": lambda: sg.gather(x, None, dim, sizes, **scale),
        "zigzag_split": lambda: sg.zigzag_split(x, None, dim, **scale),
        "zigzag_gather": lambda: sg.zigzag_gather(x, None, dim, **scale),
        "packed_split": lambda: sg.packed_split(x, None, case["seq_lens"], dim, **scale),
        "packed_gather": lambda: sg.packed_gather(x, None, case["seq_lens"], dim, **scale),
        "hybrid_split": lambda: sg.hybrid_split(x, ring_group, ulysses_group, dim, **scale),
        "hybrid_gather": lambda: sg.hybrid_gather(x, ring_group, ulysses_group, dim, total,
                                                  **scale),
        "packed_hybrid_split": lambda: sg.packed_hybrid_split(
            x, ring_group, ulysses_group, case["seq_lens"], dim, **scale),
        "packed_hybrid_gather": lambda: sg.packed_hybrid_gather(
            x, ring_group, ulysses_group, case["seq_lens"], dim, **scale),
    }
    return calls[op]()


def _reference(case: dict, full: torch.Tensor, weights: list[torch.Tensor]):
    """(every rank's input, every rank's output, every rank's input grad) on one process."""
    op, world = case["op"], case["world"]
    if op == "all_to_all":
        inputs = [p.detach().requires_grad_()
                  for p in full.tensor_split(world, case["gather_dim"])]
        gathered = torch.cat(inputs, case["gather_dim"])
        outputs = list(gathered.tensor_split(world, case["scatter_dim"]))
        loss = sum((out * w).sum() for out, w in zip(outputs, weights))
        return inputs, outputs, torch.autograd.grad(loss, inputs, allow_unused=True)
    total = full.size(case["dim"])
    if op in SPLIT_OPS:
        replicated = full.detach().requires_grad_()
        outputs = _reference_shards(case, replicated, case["dim"])
        loss = sum((out * w).sum() for out, w in zip(outputs, weights))
        (grad,) = torch.autograd.grad(loss, replicated, allow_unused=True)
        grad = torch.zeros_like(full) if grad is None else grad
        return [full] * world, outputs, [grad * _documented_scale(case)] * world
    inputs = [p.detach().requires_grad_() for p in _reference_shards(case, full, case["dim"])]
    output = _reassemble_ref(case, inputs, total)
    # The gathered output is replicated: one loss, seen identically by every rank.
    grads = torch.autograd.grad((output * weights[0]).sum(), inputs, allow_unused=True)
    grads = [torch.zeros_like(i) if g is None else g * _documented_scale(case)
             for i, g in zip(inputs, grads)]
    return inputs, [output] * world, grads


def _check_cases(rank: int, world_size: int, cases: list[dict]) -> list[str]:
    """Run every case; return the failures (after all cases, so no rank skips a collective)."""
    failures = []
    for case in cases:
        gen = torch.Generator().manual_seed(case["seed"])
        full = torch.randn(case["shape"], generator=gen)
        out_shapes = _output_shapes(case, full)
        weights = [torch.randn(shape, generator=gen) for shape in out_shapes]
        if case["op"] in GATHER_OPS:
            weights = [weights[0]] * world_size
        inputs, outputs, grads = _reference(case, full, weights)
        x = inputs[rank].detach().clone().requires_grad_()
        total = full.size(case["dim"]) if "dim" in case else None
        out = _apply_op(case, x, rank, total)
        (out * weights[rank]).sum().backward()
        try:
            torch.testing.assert_close(out, outputs[rank])
            if case["op"] in SPLIT_OPS:
                local = full.index_select(case["dim"], _positions(case, total, rank))
                torch.testing.assert_close(out, local, msg="positions disagree with the shard")
            expected = grads[rank] if grads[rank] is not None else torch.zeros_like(x)
            torch.testing.assert_close(x.grad, expected)
        except AssertionError as error:
            failures.append(f"rank {rank}, case {case}: {error}")
    return failures


def _positions(case: dict, total: int, rank: int) -> torch.Tensor:
    """The bookkeeping functions' answer for the tokens this rank holds."""
    world, seq_lens = case["world"], case.get("seq_lens")
    ring_rank, ulysses_rank = divmod(rank, case["ulysses"])
    hybrid = (case["ring"], ring_rank, case["ulysses"], ulysses_rank)
    return {
        "contiguous": lambda: shards.ShardLayout.contiguous(
            case.get("sizes") or cc.split_sizes(total, world)).positions(rank),
        "zigzag": lambda: shards.zigzag_positions(total, world, rank),
        "packed": lambda: shards.packed_positions(seq_lens, world, rank),
        "hybrid": lambda: shards.hybrid_positions(total, *hybrid),
        "packed_hybrid": lambda: shards.packed_hybrid_positions(seq_lens, *hybrid),
    }[case["layout"]]()


def _output_shapes(case: dict, full: torch.Tensor) -> list[torch.Size]:
    with torch.no_grad():
        if case["op"] == "all_to_all":
            return [o.shape for o in full.tensor_split(case["world"], case["scatter_dim"])]
        if case["op"] in SPLIT_OPS:
            return [o.shape for o in _reference_shards(case, full, case["dim"])]
        return [full.shape] * case["world"]


# ------------------------------------------------------------------------------ tests


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
@settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_collectives_equal_single_process_reference(world, data):
    cases = data.draw(st.lists(_cases(world), min_size=CASES_PER_EXAMPLE,
                               max_size=CASES_PER_EXAMPLE))
    failures = run_distributed(world, _check_cases, cases)
    assert failures == [[]] * world, "\n".join(f for per_rank in failures for f in per_rank)


# ------------------------------------------------------------- no padding on the wire


def _record_exchanges(rank: int, world_size: int) -> dict[str, list[tuple]]:
    """Run unaligned and aligned collectives, recording what reaches torch.distributed."""
    calls: list[tuple] = []
    original_all_to_all, original_all_gather = dist.all_to_all_single, ops._gather_into

    def recording_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None,
                             group=None, async_op=False):
        calls.append((input.numel(), output.numel(), input_split_sizes, output_split_sizes))
        return original_all_to_all(output, input, output_split_sizes, input_split_sizes,
                                   group=group, async_op=async_op)

    def recording_all_gather(output, input, group=None, async_op=False):
        calls.append((input.numel(), output.numel(), None, None))
        return original_all_gather(output, input, group=group, async_op=async_op)

    recorded = {}
    dist.all_to_all_single, ops._gather_into = recording_all_to_all, recording_all_gather
    try:
        # scatter 5 and gather 7 over 3 ranks: neither divides
        x = torch.randn(5, cc.split_sizes(7, world_size)[rank], 2, requires_grad=True)
        cc.all_to_all(x, None, 0, 1, gather_size=7).sum().backward()
        recorded["unaligned all_to_all"], calls[:] = list(calls), []
        x = torch.randn(6, 2, 2, requires_grad=True)
        cc.all_to_all(x, None, 0, 1).sum().backward()
        recorded["aligned all_to_all"], calls[:] = list(calls), []
        part = torch.randn(2, rank + 1, 3, requires_grad=True)
        sg.gather(part, None, 1, sizes=[r + 1 for r in range(world_size)]).sum().backward()
        recorded["unequal gather"], calls[:] = list(calls), []
    finally:
        dist.all_to_all_single, ops._gather_into = original_all_to_all, original_all_gather
    return recorded


def _exact_counts(rows: list[int], row_elements: list[int]) -> list[int]:
    return [n * e for n, e in zip(rows, row_elements)]


@pytest.mark.distributed
def test_unaligned_sizes_send_exactly_the_data_and_no_padding():
    world = 3
    scatter, gather_ = [2, 2, 1], [3, 2, 2]  # tensor_split of 5 and 7 over 3 ranks
    for rank, recorded in enumerate(run_distributed(world, _record_exchanges)):
        forward, backward = recorded["unaligned all_to_all"]
        # forward: to peer p go its scatter rows x my gather rows x 2
        assert forward == (5 * gather_[rank] * 2, scatter[rank] * 7 * 2,
                           [s * gather_[rank] * 2 for s in scatter],
                           [g * scatter[rank] * 2 for g in gather_])
        # backward is the reverse all-to-all, again exact
        assert backward == (scatter[rank] * 7 * 2, 5 * gather_[rank] * 2,
                            [g * scatter[rank] * 2 for g in gather_],
                            [s * gather_[rank] * 2 for s in scatter])
        # aligned sizes take the fast path: equal splits, no per-peer sizes
        assert recorded["aligned all_to_all"] == [(24, 24, None, None)] * 2
        # unequal gather: my rows to every peer, every peer's rows back; backward is local
        (gathered,) = recorded["unequal gather"]
        mine = 2 * (rank + 1) * 3
        assert gathered == (world * mine, 2 * 6 * 3, [mine] * world,
                            [2 * (r + 1) * 3 for r in range(world)])


# ------------------------------------------------------------------ gradient scaling


def _split_and_gather_gradients(rank: int, world_size: int) -> dict:
    full = torch.arange(1.0, 8.0)
    weight = torch.linspace(-1.0, 2.0, 7)
    grads = {}
    for mode in ("up", "down", None, "default"):
        kwargs = {} if mode == "default" else {"grad_scale": mode}
        x = full.clone().requires_grad_()
        local = sg.split(x, None, 0, **kwargs)
        (local * weight.tensor_split(world_size)[rank]).sum().backward()
        grads["split", mode] = x.grad
        part = full.tensor_split(world_size)[rank].clone().requires_grad_()
        (sg.gather(part, None, 0, **kwargs) * weight).sum().backward()
        grads["gather", mode] = part.grad
    return grads


@pytest.mark.distributed
def test_grad_scale_up_down_none_and_the_documented_defaults():
    world = 2
    weight = torch.linspace(-1.0, 2.0, 7)
    factors = {"up": world, "down": 1 / world, None: 1.0}
    for rank, grads in enumerate(run_distributed(world, _split_and_gather_gradients)):
        for mode, factor in factors.items():
            # split: every rank's shard gradient gathered, i.e. the whole weight
            torch.testing.assert_close(grads["split", mode], weight * factor)
            # gather: this rank's part of the output gradient
            torch.testing.assert_close(grads["gather", mode],
                                       weight.tensor_split(world)[rank] * factor)
        # seed 004's defaults: splits scale down, gathers scale up
        torch.testing.assert_close(grads["split", "default"], grads["split", "down"])
        torch.testing.assert_close(grads["gather", "default"], grads["gather", "up"])


# ---------------------------------------------------------------------------- errors


def _error_of(call) -> str:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _bad_inputs(rank: int, world_size: int) -> dict[str, str]:
    x = torch.randn(6, 4)
    errors = {
        "zigzag length": _error_of(lambda: sg.zigzag_split(x, None, 0)),
        "split sizes count": _error_of(lambda: sg.split(x, None, 0, sizes=[6])),
        "split sizes sum": _error_of(lambda: sg.split(x, None, 0, sizes=[3, 2])),
        "grad_scale": _error_of(lambda: sg.split(x, None, 0, grad_scale="sideways")),
        "same dims": _error_of(lambda: cc.all_to_all(x, None, 1, 1)),
        "gather_size": _error_of(lambda: cc.all_to_all(x[:, :1], None, 0, 1, gather_size=7)),
        "one dim": _error_of(lambda: cc.all_to_all(torch.ones(4), None, 0, 0)),
        "hybrid total": _error_of(lambda: sg.hybrid_gather(x, None, None, 0, total=6)),
        # the ranks exchange shapes, so a rank whose other dims differ fails everywhere
        "gather shapes": _error_of(lambda: sg.gather(torch.ones(2, 3 + rank), None, 0)),
    }
    os.environ[CHECK_ENV] = "1"
    try:
        errors["checked all_to_all"] = _error_of(
            lambda: cc.all_to_all(torch.ones(4, 2 + rank, 3), None, 0, 2))
        errors["checked gather sizes"] = _error_of(
            lambda: sg.gather(torch.ones(2 + rank, 3), None, 0, sizes=[2, 2]))
    finally:
        del os.environ[CHECK_ENV]
    return errors


@pytest.mark.distributed
def test_bad_inputs_raise_clear_errors_on_every_rank_without_hanging():
    for rank, errors in enumerate(run_distributed(2, _bad_inputs)):
        assert errors["zigzag length"].startswith("ValueError") and "length 6" in errors[
            "zigzag length"] and "multiple of 4" in errors["zigzag length"]
        assert "1 sizes [6] given for a group of 2 ranks" in errors["split sizes count"]
        assert "sum to 5 but the tensor has 6" in errors["split sizes sum"]
        assert "'up', 'down' or None" in errors["grad_scale"]
        assert "must differ" in errors["same dims"]
        assert f"rank {rank} of 2 holds 1 elements along gather dim 1" in errors["gather_size"]
        assert "needs distinct scatter and gather dims" in errors["one dim"]
        assert "not a multiple of 4" in errors["hybrid total"]
        assert errors["gather shapes"].startswith("CollectiveShapeError")
        assert "[[2, 3], [2, 4]]" in errors["gather shapes"]
        assert "[[4, 2, 3], [4, 3, 3]]" in errors["checked all_to_all"]
        assert "CollectiveShapeError" in errors["checked all_to_all"]
        assert "hold [2, 3] elements along dim 0" in errors["checked gather sizes"]


def _reduce_alone_and_together(rank, world_size):
    calls = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}
    for name, call in real.items():
        setattr(dist, name, lambda *a, call=call, name=name, **k: calls.append(name) or
                call(*a, **k))
    try:
        own = [dist.new_group([r]) for r in range(world_size)][rank]
        alone, together = torch.full((2,), rank + 1.0), torch.full((2,), rank + 1.0)
        ops.all_reduce(alone, group=own)
        ops.broadcast(alone, src=rank, group=own)
        alone_calls = list(calls)
        ops.all_reduce(together)
        ops.broadcast(together, src=0)
    finally:  # the worker serves later tests
        for name, call in real.items():
            setattr(dist, name, call)
    return alone.tolist(), alone_calls, together.tolist(), calls[len(alone_calls):]


@pytest.mark.distributed
def test_a_reduction_over_a_group_of_one_rank_is_skipped():
    """Over a group of this rank alone a sum or a broadcast leaves the tensor as it is: no
    collective runs (gloo's thread costs about 1 ms a call); over two ranks it does."""
    for rank, (alone, alone_calls, together, calls) in enumerate(
            run_distributed(2, _reduce_alone_and_together)):
        assert alone == [rank + 1.0] * 2 and alone_calls == []
        assert together == [3.0, 3.0] and calls == ["all_reduce", "broadcast"]


# ------------------------------------------------------------ bookkeeping, no processes


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 200), parts=st.integers(1, 16))
def test_split_sizes_are_balanced_and_front_loaded(total, parts):
    sizes = cc.split_sizes(total, parts)
    assert sum(sizes) == total and len(sizes) == parts
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert sizes == [len(t) for t in torch.arange(total).tensor_split(parts)]


def _layout_positions(kind: str, lengths: list[int], ring: int, ulysses: int
                      ) -> list[torch.Tensor]:
    seq_len = sum(lengths)
    if kind == "contiguous":
        return [shards.contiguous_positions(seq_len, ring, r) for r in range(ring)]
    if kind == "zigzag":
        return [shards.zigzag_positions(seq_len, ring, r) for r in range(ring)]
    if kind == "packed":
        return [shards.packed_positions(lengths, ring, r) for r in range(ring)]
    if kind == "hybrid":
        return [shards.hybrid_positions(seq_len, ring, r, ulysses, u)
                for r in range(ring) for u in range(ulysses)]
    return [shards.packed_hybrid_positions(lengths, ring, r, ulysses, u)
            for r in range(ring) for u in range(ulysses)]


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["contiguous", "zigzag", "packed", "hybrid", "packed_hybrid"]),
       ring=st.integers(1, 4), ulysses=st.integers(1, 4), chunks=st.integers(1, 3),
       lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5))
def test_every_layout_holds_each_position_exactly_once(kind, ring, ulysses, chunks, lengths):
    if kind in ("zigzag", "hybrid"):
        lengths = [2 * ring * chunks]
    positions = _layout_positions(kind, lengths, ring, ulysses)
    reference = _reference_shards(
        dict(layout=kind, world=ring, ring=ring, ulysses=ulysses, seq_lens=lengths),
        torch.arange(sum(lengths)), 0)
    assert [p.tolist() for p in positions] == [r.tolist() for r in reference]
    assert sorted(torch.cat(positions).tolist()) == list(range(sum(lengths)))


def test_zigzag_keeps_chunks_r_and_mirror():
    # 16 tokens over 4 ranks: chunks of 2, rank 1 holds chunks 1 and 6
    assert shards.zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="sequence length 10 is not a multiple of 8"):
        shards.zigzag_positions(10, 4, 0)
    with pytest.raises(ValueError, match="rank 4 is outside a group of 4"):
        shards.zigzag_positions(16, 4, 4)


def test_document_ids_and_positions_in_document_for_a_shard():
    seq_lens = [3, 0, 5, 2]
    positions = shards.packed_positions(seq_lens, 2, 1)  # pieces: [2], [], [8, 9], [9]
    assert positions.tolist() == [2, 6, 7, 9]
    assert shards.document_ids(seq_lens, positions).tolist() == [0, 2, 2, 3]
    assert shards.positions_in_document(seq_lens, positions).tolist() == [2, 3, 4, 1]
    with pytest.raises(ValueError, match="positions must lie in 0..9"):
        shards.document_ids(seq_lens, torch.tensor([10]))
