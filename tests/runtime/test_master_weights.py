"""bf16 weights with float32 masters: the model computes in bfloat16, a step's gradients
accumulate in float32 on the masters, and the masters reach the model before its next
forward."""

from __future__ import annotations

import torch
from torch import nn

from dispatched_ops import DispatchedOps
from meshpipe.parallel.tensor import mark_sequence_parallel, is_sequence_parallel_param
from meshpipe.runtime import MasterWeights, weights_dtype


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 11, bias=False))
    model[2].weight = model[0].weight  # tied: one parameter in two places
    return model


def test_the_model_becomes_bfloat16_and_keeps_float32_masters_with_its_marks():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    mark_sequence_parallel(model[1].bias)
    masters = MasterWeights(model.named_parameters(), torch.bfloat16)
    assert [name for name, _ in masters.named] == ["0.weight", "1.weight", "1.bias"]
    for name, master in masters.named:
        assert master.dtype == torch.float32 and master.requires_grad
        assert torch.equal(master, before[name])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model[2].weight is model[0].weight  # modules keep their parameter objects
    assert is_sequence_parallel_param(masters.master_of(model[1].bias))
    assert not is_sequence_parallel_param(masters.master_of(model[1].weight))


def test_gradients_of_several_microbatches_accumulate_in_float32_on_the_masters():
    model = _model()
    masters = MasterWeights(model.named_parameters(), torch.bfloat16)
    batches = [torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(i))
               for i in range(4)]
    expected = {name: torch.zeros_like(master) for name, master in masters.named}
    for tokens in batches:  # each microbatch's own bfloat16 gradients, summed in float32
        grads = torch.autograd.grad(model(tokens).float().square().mean(),
                                    [p for p in model.parameters()])
        for (name, _), grad in zip(masters.named, grads):
            expected[name] += grad.float()
    for tokens in batches:
        model(tokens).float().square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    for name, master in masters.named:
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, expected[name], rtol=0, atol=0)
    bfloat16_sum = sum(torch.autograd.grad(model(t).float().square().mean(),
                                           [model[1].weight])[0] for t in batches)
    assert not torch.equal(bfloat16_sum.float(), expected["1.weight"])  # what it saves


def test_refresh_copies_the_stepped_masters_into_the_stale_parameters_it_is_given():
    model = _model()
    masters = MasterWeights(model.named_parameters(), torch.bfloat16)
    optimizer = torch.optim.AdamW(masters.params, lr=0.1)
    model(torch.tensor([[1, 2, 3]])).float().sum().backward()
    optimizer.step()
    masters.updated()
    first, second = model[1].weight, model[1].bias
    masters.refresh([first])
    assert torch.equal(first, masters.master_of(first).to(torch.bfloat16))
    assert not torch.equal(second, masters.master_of(second).to(torch.bfloat16))
    with torch.no_grad():
        first.zero_()
    with DispatchedOps() as ops:
        masters.refresh(model.parameters())  # the first is no longer stale: left as it is
    assert not first.any()
    assert torch.equal(second, masters.master_of(second).to(torch.bfloat16))
    assert ops.called == ["aten._foreach_copy_"]  # one op for every stale parameter


def test_only_bf16_runs_get_low_precision_weights():
    assert weights_dtype("bf16") is torch.bfloat16
    assert weights_dtype("fp16") is torch.float32
    assert weights_dtype("fp32") is torch.float32
