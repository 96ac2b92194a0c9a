"""Tensor parallelism against single-process references, forward and backward.

Workers run the TP code and send back their local outputs and gradient shards; the test
process rebuilds every rank's inputs from the same seeds, computes the reference with plain
torch (nn.Linear, nn.Embedding, F.cross_entropy) and compares, unsharding the gradients.
On 4 ranks the layers also run on two TP groups of 2 (ranks {0, 1} and {2, 3}), where a
rank's TP rank differs from its global rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshpipe.parallel import (ColumnParallelLinear, RowParallelLinear,
                               VocabParallelEmbedding, copy_to_tp, gather_from_sequence,
                               gather_rows_summing_gradients, gather_rows_to_replicate,
                               gather_to_replicate,
                               is_sequence_parallel_param, mark_sequence_parallel,
                               reduce_from_tp, reduce_scatter_to_sequence,
                               scatter_to_sequence, shard, shard_dim, tp_rank_and_size,
                               unshard, vocab_parallel_cross_entropy)
from meshpipe.comm.checks import CHECK_ENV
from meshpipe.parallel import tp_comm
from meshpipe.testing import keep_across_calls, run_distributed

B, S, D, H, V = 2, 8, 8, 16, 16
IGNORE = -100

# ------------------------------------------------------------------------ shared data


def _where(context: str):
    """An assert_close message that keeps torch's own description of the mismatch."""
    return lambda detail: f"{context}: {detail}"


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _mlp_layers(seed: int) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    return nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)


def _lm_data(seed: int) -> dict:
    """Embedding, a norm-like weight, tokens and targets with some ignored positions."""
    torch.manual_seed(seed)
    embedding = nn.Embedding(V, D)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    targets = torch.randint(0, V, (B, S), generator=gen)
    targets[0, 1] = targets[1, 5] = targets[1, 6] = IGNORE
    return dict(embedding=embedding, gamma=1 + 0.1 * _randn(seed + 2, D), tokens=tokens,
                targets=targets, weights=_randn(seed + 3, B, S))


_GROUPS: dict[str, dist.ProcessGroup] = {}


def _group(kind: str) -> dist.ProcessGroup | None:
    """'world', 'pairs' (TP groups of 2 on 4 ranks), 'single' (one-rank groups) or 'none'."""
    if kind == "none":
        return None
    if kind == "world":
        return dist.group.WORLD
    if not _GROUPS:  # every rank creates every group once, in the same order
        world = dist.get_world_size()
        _GROUPS["single"] = dist.new_subgroups(group_size=1)[0]
        if world % 2 == 0:
            _GROUPS["pairs"] = dist.new_subgroups(group_size=2)[0]
        keep_across_calls(*_GROUPS.values())
    return _GROUPS[kind]


def _members(kind: str, world: int) -> list[list[int]]:
    size = {"world": world, "pairs": 2, "single": 1}[kind]
    return [list(range(start, start + size)) for start in range(0, world, size)]


def _by_tp_rank(results: list[dict], ranks: list[int]) -> list[dict]:
    ordered = sorted((results[r] for r in ranks), key=lambda res: res["tp_rank"])
    assert [res["tp_rank"] for res in ordered] == list(range(len(ranks)))
    return ordered


# ---------------------------------------------------------------- autograd collectives


def _collectives(rank: int, world_size: int, seed: int, dtype: torch.dtype) -> dict:
    """Every collective on WORLD with per-rank inputs; outputs and input grads."""
    group = dist.group.WORLD
    out = {}

    def run(name, fn, x, grad):
        x = x.to(dtype, copy=True).requires_grad_()
        y = fn(x, group)
        y.backward(grad.to(dtype))
        out[name] = (y.detach(), x.grad)

    full = _randn(seed, B, S, D)                      # replicated input
    mine = _randn(seed + 1 + rank, B, S, D)           # this rank's full-size input
    part = _randn(seed + 1 + rank, B, S // world_size, D)  # this rank's sequence chunk
    g_full = _randn(seed + 100 + rank, B, S, D)
    g_part = _randn(seed + 100 + rank, B, S // world_size, D)
    run("copy_to_tp", copy_to_tp, full, g_full)
    run("reduce_from_tp", reduce_from_tp, mine, g_full)
    run("scatter_to_sequence", scatter_to_sequence, full, g_part)
    run("gather_from_sequence", gather_from_sequence, part, g_full)
    run("gather_to_replicate", gather_to_replicate, part, g_full)
    run("reduce_scatter_to_sequence", reduce_scatter_to_sequence, mine, g_part)
    return out


def _expected_collectives(world: int, seed: int, rank: int, dtype: torch.dtype) -> dict:
    """The definitions, summed in float32 from inputs rounded to ``dtype``."""
    def randn(seed, *shape):
        return _randn(seed, *shape).to(dtype).float()

    full = randn(seed, B, S, D)
    mine = [randn(seed + 1 + r, B, S, D) for r in range(world)]
    part = [randn(seed + 1 + r, B, S // world, D) for r in range(world)]
    g_full = [randn(seed + 100 + r, B, S, D) for r in range(world)]
    g_part = [randn(seed + 100 + r, B, S // world, D) for r in range(world)]
    chunk = lambda t, r: t.chunk(world, 1)[r]  # noqa: E731
    return {
        "copy_to_tp": (full, sum(g_full)),
        "reduce_from_tp": (sum(mine), g_full[rank]),
        "scatter_to_sequence": (chunk(full, rank), torch.cat(g_part, 1)),
        # backward: the sum over ranks of this rank's chunk of their output grads
        "gather_from_sequence": (torch.cat(part, 1), sum(chunk(g, rank) for g in g_full)),
        # backward: this rank's chunk of its own output grad (every rank's is the same there)
        "gather_to_replicate": (torch.cat(part, 1), chunk(g_full[rank], rank)),
        "reduce_scatter_to_sequence": (chunk(sum(mine), rank), torch.cat(g_part, 1)),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_forward_and_backward_match_their_definitions(world):
    for dtype in (torch.float32, torch.bfloat16):
        results = run_distributed(world, _collectives, 7, dtype)
        for rank, got in enumerate(results):
            for name, (value, grad) in _expected_collectives(world, 7, rank, dtype).items():
                out, x_grad = got[name]
                assert out.dtype == dtype and x_grad.dtype == dtype, name
                # bf16 inputs: the expected sum is in float32, rounded once at the end
                where = f"rank {rank}, {name}, {dtype}"
                torch.testing.assert_close(out, value.to(dtype), msg=_where(f"{where} forward"))
                torch.testing.assert_close(x_grad, grad.to(dtype),
                                           msg=_where(f"{where} backward"))


# Rows each rank has of the row gathers' input: uneven, one rank none.
ROWS = (3, 0, 5)


def _gathered_rows(rank: int, world_size: int, dtype: torch.dtype):
    out = {}
    for gather in (gather_rows_to_replicate, gather_rows_summing_gradients):
        x = _randn(200 + rank, ROWS[rank], D).to(dtype).requires_grad_()
        y = gather(x, dist.group.WORLD)
        y.backward(_randn(300 + rank, sum(ROWS), D).to(dtype))
        out[gather.__name__] = y.detach(), x.grad
    return out


@pytest.mark.distributed
def test_gathered_rows_of_uneven_counts_are_every_ranks_with_their_gradients():
    """Forward: every rank's rows in rank order. Backward: this rank's rows of its own
    gradient (replicated use), or of the ranks' gradients summed (partial use)."""
    for dtype in (torch.float32, torch.bfloat16):
        whole = torch.cat([_randn(200 + rank, count, D) for rank, count in enumerate(ROWS)])
        grads = [_randn(300 + rank, sum(ROWS), D).to(dtype) for rank in range(len(ROWS))]
        summed = sum(grad.float() for grad in grads).to(dtype)
        for rank, got in enumerate(run_distributed(len(ROWS), _gathered_rows, dtype)):
            mine = slice(sum(ROWS[:rank]), sum(ROWS[:rank + 1]))
            for name, grad in (("gather_rows_to_replicate", grads[rank]),
                               ("gather_rows_summing_gradients", summed)):
                out, x_grad = got[name]
                torch.testing.assert_close(out, whole.to(dtype), rtol=0, atol=0)
                torch.testing.assert_close(x_grad, grad[mine], msg=_where(f"{rank} {name}"))


def test_collectives_are_identities_without_a_group():
    x = torch.randn(B, S, D, requires_grad=True)
    for fn in (copy_to_tp, reduce_from_tp, scatter_to_sequence, gather_from_sequence,
               gather_to_replicate, gather_rows_to_replicate, gather_rows_summing_gradients,
               reduce_scatter_to_sequence):
        assert fn(x, None) is x
    assert tp_rank_and_size(None) == (0, 1)


def test_reductions_of_half_types_run_in_float32(monkeypatch):
    seen = []
    monkeypatch.setattr(tp_comm.ops, "alone", lambda group: False)  # a group of several ranks
    monkeypatch.setattr(tp_comm.dist, "all_reduce",
                        lambda t, op=None, group=None: seen.append(t.dtype))
    out = tp_comm._all_reduce_sum(torch.ones(3, dtype=torch.bfloat16), group=None)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------- MLP parity


def _mlp(rank: int, world_size: int, kinds: list[str], seed: int,
         autocast: bool = False) -> list[dict]:
    results = []
    fc1, fc2 = _mlp_layers(seed)
    x, w = _randn(seed + 1, B, S, D), _randn(seed + 2, B, S, D)
    for kind in kinds:
        group = _group(kind)
        tp_rank, _ = tp_rank_and_size(group)
        for sp in (False, True):
            col = ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=sp)
            row = RowParallelLinear.from_linear(fc2, group, sequence_parallel=sp)
            xin = (shard(x, 1, group) if sp else x.clone()).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = row(F.gelu(col(xin)))  # bf16 under autocast: reduced in float32
            # with sequence parallelism each rank holds a part of the loss, else all of it
            (y * (shard(w, 1, group) if sp else w)).sum().backward()
            results.append(dict(kind=kind, sp=sp, tp_rank=tp_rank, y=y.detach(),
                                x_grad=xin.grad, w1=col.weight.grad, w2=row.weight.grad,
                                dims=(shard_dim(col.weight), shard_dim(row.weight))))
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_mlp_column_then_row_equals_unsplit_linears(world):
    kinds = ["world", "single"] + (["pairs"] if world == 4 else [])
    _check_mlp(world, kinds, run_distributed(world, _mlp, kinds, 3), 3)


def _check_mlp(world: int, kinds: list[str], per_rank: list[list[dict]], seed: int,
               **tol) -> None:
    fc1, fc2 = _mlp_layers(seed)
    x = _randn(seed + 1, B, S, D).requires_grad_()
    y = fc2(F.gelu(fc1(x)))
    (y * _randn(seed + 2, B, S, D)).sum().backward()
    checked = 0
    for index in range(len(per_rank[0])):
        results = [per_rank[r][index] for r in range(world)]
        kind, sp = results[0]["kind"], results[0]["sp"]
        for ranks in _members(kind, world):
            group = _by_tp_rank(results, ranks)
            where = f"{kind} group {ranks}, sequence_parallel={sp}"
            assert all(res["dims"] == (0, 1) for res in group)
            torch.testing.assert_close(unshard([res["w1"] for res in group], 0), fc1.weight.grad,
                                       msg=_where(f"fc1 grad, {where}"), **tol)
            torch.testing.assert_close(unshard([res["w2"] for res in group], 1), fc2.weight.grad,
                                       msg=_where(f"fc2 grad, {where}"), **tol)
            if sp:
                torch.testing.assert_close(unshard([res["y"] for res in group], 1).float(),
                                           y.detach(),
                                           **tol)
                torch.testing.assert_close(unshard([res["x_grad"] for res in group], 1), x.grad,
                                           **tol)
            else:
                for res in group:
                    torch.testing.assert_close(res["y"].float(), y.detach(),
                                               msg=_where(f"output, {where}"), **tol)
                    torch.testing.assert_close(res["x_grad"], x.grad,
                                               msg=_where(f"x grad, {where}"), **tol)
            checked += 1
    assert checked == 2 * sum(len(_members(kind, world)) for kind in kinds)


def test_layers_without_a_group_are_the_plain_layers():
    fc1, fc2 = _mlp_layers(0)
    col, row = ColumnParallelLinear.from_linear(fc1, None), RowParallelLinear.from_linear(fc2, None)
    x = torch.randn(B, S, D)
    torch.testing.assert_close(row(col(x)), fc2(fc1(x)), rtol=0, atol=0)
    emb = nn.Embedding(V, D)
    tokens = torch.randint(0, V, (B, S))
    torch.testing.assert_close(VocabParallelEmbedding.from_embedding(emb, None)(tokens),
                               emb(tokens), rtol=0, atol=0)
    logits, targets = torch.randn(B, S, V), torch.randint(0, V, (B, S))
    targets[0, 0] = IGNORE
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(logits, targets, None),
        F.cross_entropy(logits.view(-1, V), targets.view(-1), reduction="none").view(B, S))
    assert shard_dim(torch.zeros(1)) is None and shard_dim(col.weight) == 0
    padded = nn.Embedding(V, D, padding_idx=3)
    vocab = VocabParallelEmbedding.from_embedding(padded, None)
    vocab(torch.tensor([[3, 3, 5]])).sum().backward()
    assert vocab.weight.grad[3].abs().sum() == 0 and vocab.weight.grad[5].abs().sum() > 0


def test_shard_and_unshard_round_trip_and_markers():
    t = torch.arange(24.0).view(2, 12)
    assert shard(t, 1, None) is not t and torch.equal(shard(t, 1, None), t)
    assert torch.equal(unshard(list(t.chunk(3, 1)), 1), t)
    p = nn.Parameter(torch.ones(3))
    assert not is_sequence_parallel_param(p)
    assert mark_sequence_parallel(p) is p and is_sequence_parallel_param(p)


# ------------------------------------------------- embedding, tied head, vocab loss


def _lm_forward(embed, head, gamma, tokens, targets, group, sp):
    """embedding -> (norm-like scale on the shard) -> tied column head -> vocab loss."""
    h = torch.tanh(embed(tokens)) * gamma
    logits = head(h)
    return logits, vocab_parallel_cross_entropy(logits, targets, group, ignore_index=IGNORE)


def _lm(rank: int, world_size: int, kinds: list[str], seed: int, autocast: bool) -> list[dict]:
    data = _lm_data(seed)
    results = []
    for kind in kinds:
        group = _group(kind)
        tp_rank, _ = tp_rank_and_size(group)
        for sp in (False, True):
            embed = VocabParallelEmbedding.from_embedding(data["embedding"], group,
                                                          sequence_parallel=sp)
            head = ColumnParallelLinear(D, V, group, sequence_parallel=sp)
            head.weight = embed.weight  # tied: one [V/tp, D] parameter
            gamma = nn.Parameter(data["gamma"].clone())
            if sp:
                mark_sequence_parallel(gamma)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits, loss = _lm_forward(embed, head, gamma, data["tokens"],
                                           data["targets"], group, sp)
            (loss * data["weights"]).sum().backward()
            if is_sequence_parallel_param(gamma) and group is not None:
                dist.all_reduce(gamma.grad, group=group)  # what the trainer does
            results.append(dict(kind=kind, sp=sp, tp_rank=tp_rank, loss=loss.detach(),
                                logits_dtype=logits.dtype, weight=embed.weight.grad,
                                tied=head.weight is embed.weight, gamma=gamma.grad))
    return results


def _lm_reference(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data = _lm_data(seed)
    embedding, gamma = data["embedding"], nn.Parameter(data["gamma"].clone())
    h = torch.tanh(embedding(data["tokens"])) * gamma
    logits = F.linear(h, embedding.weight)
    loss = F.cross_entropy(logits.view(-1, V), data["targets"].view(-1), reduction="none",
                           ignore_index=IGNORE).view(B, S)
    (loss * data["weights"]).sum().backward()
    return loss.detach(), embedding.weight.grad, gamma.grad


def _check_lm(world: int, per_rank: list[list[dict]], seed: int, **tolerance) -> None:
    loss, weight_grad, gamma_grad = _lm_reference(seed)
    assert (loss == 0).sum() >= 3  # the ignored tokens
    for index in range(len(per_rank[0])):
        results = [per_rank[r][index] for r in range(world)]
        kind, sp = results[0]["kind"], results[0]["sp"]
        for ranks in _members(kind, world):
            group = _by_tp_rank(results, ranks)
            where = f"{kind} group {ranks}, sequence_parallel={sp}"
            for res in group:
                assert res["tied"] and res["loss"].dtype == torch.float32
                assert torch.isfinite(res["loss"]).all()
                torch.testing.assert_close(res["loss"], loss, msg=_where(f"loss, {where}"),
                                           **tolerance)
                torch.testing.assert_close(res["gamma"], gamma_grad, msg=_where(f"gamma, {where}"),
                                           **tolerance)
            torch.testing.assert_close(unshard([res["weight"] for res in group], 0),
                                       weight_grad, msg=_where(f"tied weight grad, {where}"),
                                       **tolerance)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_embedding_tied_head_and_loss_equal_torch(world):
    kinds = ["world", "single"] + (["pairs"] if world == 4 else [])
    _check_lm(world, run_distributed(world, _lm, kinds, 11, False), 11)


@pytest.mark.distributed
def test_bf16_autocast_runs_and_stays_close():
    per_rank = run_distributed(2, _lm, ["world"], 11, True)
    assert all(res["logits_dtype"] == torch.bfloat16 for res in per_rank[0])
    _check_lm(2, per_rank, 11, rtol=0.05, atol=0.05)
    per_rank = run_distributed(2, _mlp, ["world"], 3, True)
    assert all(res["y"].dtype == torch.bfloat16 and torch.isfinite(res["y"]).all()
               for res in per_rank[0])
    _check_mlp(2, ["world"], per_rank, 3, rtol=0.05, atol=0.05)


# ------------------------------------------------------------------------------ errors


def _error_of(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def _bad_sizes(rank: int, world_size: int) -> dict[str, str]:
    group = dist.group.WORLD
    odd = torch.ones(B, 3, D)
    errors = {
        "column": _error_of(lambda: ColumnParallelLinear(D, 6, group)),
        "row": _error_of(lambda: RowParallelLinear(6, D, group)),
        "vocab": _error_of(lambda: VocabParallelEmbedding(10, D, group)),
        "shard": _error_of(lambda: shard(odd, 1, group)),
        "scatter": _error_of(lambda: scatter_to_sequence(odd, group)),
        "reduce_scatter": _error_of(lambda: reduce_scatter_to_sequence(odd, group)),
    }
    os.environ[CHECK_ENV] = "1"
    try:
        errors["gather shapes"] = _error_of(
            lambda: gather_from_sequence(torch.ones(B, 1 + rank, D), group))
    finally:
        del os.environ[CHECK_ENV]
    return errors


@pytest.mark.distributed
def test_non_divisible_sizes_raise_clear_errors():
    errors = run_distributed(4, _bad_sizes)[0]
    assert "out_features = 6" in errors["column"] and "TP size 4" in errors["column"]
    assert "in_features = 6" in errors["row"] and "divides" in errors["row"]
    assert "num_embeddings = 10" in errors["vocab"] and "pad the vocabulary" in errors["vocab"]
    assert "size 3" in errors["shard"] and "4 TP ranks" in errors["shard"]
    for name in ("scatter", "reduce_scatter"):
        assert "sequence length 3" in errors[name] and "TP size 4" in errors[name]
    assert "rank 0: (2, 1, 8), rank 1: (2, 2, 8)" in errors["gather shapes"]


def test_single_process_errors():
    with pytest.raises(ValueError, match="bias-free"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 4), None)
    with pytest.raises(ValueError, match="bias-free"):
        RowParallelLinear.from_linear(nn.Linear(4, 4), None)
    with pytest.raises(ValueError, match="plus a vocabulary dim"):
        vocab_parallel_cross_entropy(torch.ones(2, 3, V), torch.zeros(2, 4, dtype=torch.long),
                                     None)
