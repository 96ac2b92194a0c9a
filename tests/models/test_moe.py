"""The mixture-of-experts layer against a dense reference, with and without expert parallelism."""

import math

import pytest
import torch

from meshpipe.models.moe import MoE, is_expert_param
from meshpipe.testing import run_distributed

pytestmark = pytest.mark.distributed

DIM, HIDDEN, EXPERTS = 16, 24, 4


def _moe(top_k: int, capacity_factor: float = 0.0) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k, capacity_factor)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.3)
    return moe


def _dense_reference(moe: MoE, x: torch.Tensor, dropped: set[tuple[int, int]] = frozenset()
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert on every token, weighted by the token's renormalised top-k gate (zero
    for experts it did not pick, or whose pick was dropped); the Switch load-balancing loss."""
    tokens = x.reshape(-1, DIM)
    probabilities = moe.router(tokens).float().softmax(-1)
    top, chosen = probabilities.topk(moe.top_k, dim=-1)
    gates = top / top.sum(-1, keepdim=True)
    weights = torch.zeros_like(probabilities)
    for t in range(tokens.shape[0]):
        for k in range(moe.top_k):
            if (t, k) not in dropped:
                weights[t, chosen[t, k]] = weights[t, chosen[t, k]] + gates[t, k]
    outputs = torch.stack([moe.experts[str(e)](tokens) for e in range(EXPERTS)], dim=1)
    y = (outputs * weights.unsqueeze(-1)).sum(1).view_as(x)
    share = torch.bincount(chosen.reshape(-1), minlength=EXPERTS).float() / chosen.numel()
    aux = EXPERTS * (share * probabilities.mean(0)).sum()
    return y, aux


def _grads(module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_equals_every_expert_weighted_by_its_gate(top_k):
    moe = _moe(top_k)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    upstream = torch.randn(2, 5, DIM)
    y, aux = moe(x)
    (y * upstream).sum().add(0.7 * aux).backward()
    got, got_x = _grads(moe), x.grad.clone()
    moe.zero_grad()
    x.grad = None
    ref_y, ref_aux = _dense_reference(moe, x)
    (ref_y * upstream).sum().add(0.7 * ref_aux).backward()
    torch.testing.assert_close(y, ref_y)
    torch.testing.assert_close(aux, ref_aux)
    torch.testing.assert_close(got_x, x.grad)
    for name, grad in _grads(moe).items():
        torch.testing.assert_close(got[name], grad, msg=name)
    assert got["router.weight"].abs().sum() > 0


def _saved_bytes_and_grads(moe: MoE, x: torch.Tensor) -> tuple[int, dict, torch.Tensor]:
    """The bytes a forward keeps for backward (outside recomputed regions, whose own saves
    checkpointing takes), then its gradients."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    x = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y, aux = moe(x)
    (y.square().sum() + aux).backward()
    grads = _grads(moe)
    moe.zero_grad()
    return sum(saved), grads, x.grad


@pytest.mark.parametrize("grouped", [False, True], ids=["one-by-one", "grouped"])
def test_recompute_keeps_none_of_the_experts_activations_and_changes_no_gradient(grouped):
    """With ``recompute`` the experts' products run again in backward: their hidden
    activations (gate, up, their product: 3 x HIDDEN per row) are not kept."""
    from meshpipe.models import grouped_experts

    moe = _moe(top_k=2)
    if grouped:
        assert grouped_experts.lay_out([moe]) == 1
    x = torch.randn(2, 8, DIM)
    kept, grads, x_grad = _saved_bytes_and_grads(moe, x)
    moe.recompute = True
    recomputed, recomputed_grads, recomputed_x_grad = _saved_bytes_and_grads(moe, x)
    rows = 2 * 8 * 2  # tokens x top-k
    assert kept - recomputed >= rows * 3 * HIDDEN * 4
    torch.testing.assert_close(recomputed_x_grad, x_grad)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, msg=name)


def test_capacity_drops_the_latest_picks_of_a_full_expert_and_counts_them():
    moe = _moe(2, capacity_factor=0.5)
    x = torch.randn(1, 12, DIM)
    y, _ = moe(x)
    chosen = moe.router(x.reshape(-1, DIM)).float().softmax(-1).topk(2, dim=-1).indices
    capacity = math.ceil(0.5 * 12 * 2 / EXPERTS)
    seen = [0] * EXPERTS
    dropped = set()
    for t in range(12):
        for k in range(2):
            e = int(chosen[t, k])
            seen[e] += 1
            if seen[e] > capacity:
                dropped.add((t, k))
    assert dropped, "the test needs some picks beyond capacity"
    ref_y, _ = _dense_reference(moe, x, dropped)
    torch.testing.assert_close(y, ref_y)
    stats = moe.take_stats()
    assert int(stats.dropped) == len(dropped)
    assert stats.tokens_per_expert.tolist() == seen
    assert int(moe.take_stats().dropped) == 0


def _expert_parallel_against_dense(rank, world_size, top_k):
    import torch.distributed as dist

    moe = _moe(top_k)
    whole = _moe(top_k)
    moe.shard(dist.group.WORLD, None)
    torch.manual_seed(100 + rank)
    x = torch.randn(2, 3 + rank, DIM, requires_grad=True)
    upstream = torch.randn_like(x)
    y, aux = moe(x)
    (y * upstream).sum().add(aux).backward()
    ref_y, ref_aux = _dense_reference(whole, x.detach())
    (ref_y * upstream).sum().add(ref_aux).backward()
    # An expert's gradient collects every rank's tokens routed to it; the router's stays local.
    for param in whole.experts.parameters():
        dist.all_reduce(param.grad)
    reference = _grads(whole)
    def close(a, b):  # float32 rounding of sums taken in another order, at b's scale
        return bool((a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max().item()))

    checks = {"y": close(y, ref_y), "aux": close(aux, ref_aux),
              "experts": sorted(moe.experts), "tagged": all(
                  is_expert_param(p) for p in moe.experts.parameters())}
    for name, grad in _grads(moe).items():
        checks[name] = close(grad, reference[name])
    return checks


@pytest.mark.parametrize("top_k", [1, 2])
def test_expert_parallel_moe_equals_the_dense_reference_on_each_rank(top_k):
    results = run_distributed(2, _expert_parallel_against_dense, top_k)
    assert results[0]["experts"] == ["0", "1"] and results[1]["experts"] == ["2", "3"]
    for checks in results:
        assert [k for k, v in checks.items() if not v] == [], str(checks)


def test_full_recompute_reaches_the_reference_models_experts():
    from meshpipe.models import Transformer, TransformerConfig

    config = TransformerConfig(vocab_size=64, dim=DIM, n_layers=2, n_heads=4, moe_experts=4)
    for recompute, expected in (("full", True), ("selective", False), ("none", False)):
        model = Transformer(config, recompute=recompute)
        assert [layer.mlp.recompute for layer in model.layers] == [expected] * 2, recompute
