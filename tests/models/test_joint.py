"""Joint projections (``meshpipe.models.joint``): once laid out, an attention's q/k/v and a
SwiGLU's gate/up are one matrix product forward and two backward, with the values and
gradients of the separate products; anything else falls back to those."""

from __future__ import annotations

import copy

import pytest
import torch

from dispatched_ops import DispatchedOps
from meshpipe.models import Transformer, TransformerConfig, joint
from meshpipe.models.mlp import SwiGLU

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           max_seq_len=16)


def _model(dtype=torch.float32) -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG).to(dtype)


def _step(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    out = model(tokens)
    out.float().square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return out.detach(), grads


def _products(called: list[str]) -> int:
    return sum(op in ("aten.mm", "aten.addmm", "aten.bmm") for op in called)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_laid_out_projections_are_one_product_with_the_same_results(dtype):
    tokens = torch.randint(0, 64, (2, 16))
    separate, laid = _model(dtype), _model(dtype)
    assert joint.lay_out([laid]) == 2 * CONFIG.n_layers  # an attention and a SwiGLU each
    with DispatchedOps() as apart:
        expected, expected_grads = _step(separate, tokens)
    with DispatchedOps() as together:
        out, grads = _step(laid, tokens)
    # Per layer, forward: q/k/v 3 -> 1, gate/up 2 -> 1; backward: twice that, each.
    assert _products(apart.called) - _products(together.called) == CONFIG.n_layers * 3 * 3
    # The forward's products are the same dot products; the input's gradient sums the
    # three products' in another order (one product over their rows).
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=name)


def test_jointly_projected_queries_and_keys_rotate_as_one(monkeypatch):
    """One rotation a layer (queries and keys side by side) where apart they take two, with
    the same values."""
    from meshpipe.models.rotary import RotaryEmbedding

    rotations = []
    rotate = RotaryEmbedding.forward
    monkeypatch.setattr(RotaryEmbedding, "forward",
                        lambda module, x, positions: rotations.append(x.shape[2])
                        or rotate(module, x, positions))
    tokens = torch.randint(0, 64, (2, 16))
    separate, laid = _model(), _model()
    joint.lay_out([laid])
    with DispatchedOps() as apart:
        expected, expected_grads = _step(separate, tokens)
    assert rotations == [CONFIG.n_heads, CONFIG.n_kv_heads] * CONFIG.n_layers
    rotations.clear()
    with DispatchedOps() as together:
        out, grads = _step(laid, tokens)
    assert rotations == [CONFIG.n_heads + CONFIG.n_kv_heads] * CONFIG.n_layers
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=name)
    # a rotation multiplies twice forward and twice backward; the products take no
    # multiplication apart or joint
    assert apart.computing.count("aten.mul") - together.computing.count("aten.mul") == (
        4 * CONFIG.n_layers)


def test_lay_out_keeps_the_parameters_and_makes_them_rows_of_one_storage():
    model = _model()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    joint.lay_out([model])
    assert {name: p for name, p in model.named_parameters()} == {
        name: p for name, (p, _) in before.items()}
    for name, (param, value) in before.items():
        assert torch.equal(param, value), name
    attention = model.layers[0].attention
    wq, wk, wv = (attention.wq.weight, attention.wk.weight, attention.wv.weight)
    assert wk.data_ptr() == wq.data_ptr() + wq.numel() * wq.element_size()
    assert wv.data_ptr() == wk.data_ptr() + wk.numel() * wk.element_size()


def test_weights_no_longer_in_one_storage_or_a_casting_autocast_take_separate_products():
    x = torch.randn(2, 5, 8)
    mlp = SwiGLU(8, 12)
    for weight in (mlp.w_gate.weight, mlp.w_up.weight, mlp.w_down.weight):
        torch.nn.init.normal_(weight)
    expected = mlp(x)
    joint.lay_out([mlp])
    with DispatchedOps() as laid:
        mlp(x)
    assert _products(laid.called) == 2  # gate/up, down
    with torch.autocast("cpu", dtype=torch.bfloat16), DispatchedOps() as autocast:
        mlp(x)
    assert _products(autocast.called) == 3
    mlp.w_up.weight.data = mlp.w_up.weight.data.clone()  # e.g. moved by someone else
    with DispatchedOps() as moved:
        out = mlp(x)
    assert _products(moved.called) == 3
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_frozen_input_and_frozen_weights_get_no_gradient_products():
    mlp = SwiGLU(8, 12)
    for weight in (mlp.w_gate.weight, mlp.w_up.weight, mlp.w_down.weight):
        torch.nn.init.normal_(weight)
    joint.lay_out([mlp])
    frozen = copy.deepcopy(mlp)
    joint.lay_out([frozen])
    for weight in (frozen.w_gate.weight, frozen.w_up.weight):
        weight.requires_grad_(False)
    x = torch.randn(2, 5, 8, requires_grad=True)
    (grad_x,) = torch.autograd.grad(frozen(x).sum(), x)
    torch.testing.assert_close(grad_x, torch.autograd.grad(mlp(x).sum(), x)[0])
    assert frozen.w_gate.weight.grad is None and frozen.w_up.weight.grad is None


def test_a_split_backward_takes_the_joint_products_apart():
    """The input half runs the input's products only, the weight half the weights' only,
    and together they give the full backward's gradients."""
    from meshpipe.models import split
    from meshpipe.runtime import Stage

    whole, halves = _model(), _model()
    stages = [Stage(split(model, 2)[1], 1, 2) for model in (whole, halves)]
    assert joint.lay_out([stage.module for stage in stages]) == 2 * 2  # a layer each
    hidden, upstream = torch.randn(2, 8, 32), torch.randn(2, 8, 64)
    for stage in stages:
        stage.forward(0, (hidden.clone(), None, None))
    with DispatchedOps() as full:
        stages[0].backward(0, upstream)
    with DispatchedOps() as input_half:
        stages[1].backward_input(0, upstream)
    assert all(p.grad is None for p in halves.parameters())
    with DispatchedOps() as weight_half:
        stages[1].backward_weight(0)
    # The layer's 4 products (q/k/v, output, gate/up, down) and the head's: 5 each way.
    counts = [_products(ops.called) for ops in (full, input_half, weight_half)]
    assert counts == [10, 5, 5]
    for (name, want), got in zip(whole.named_parameters(), halves.parameters()):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, msg=name)


def _joint_modules(rank, world_size, config):
    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    return sorted({type(module).__name__: getattr(module, "joint", False)
                   for stage in trainer.stages.values()
                   for module in stage.module.modules()
                   if hasattr(module, joint.JOINT_ATTRIBUTE)}.items())


@pytest.mark.distributed
@pytest.mark.parametrize("mode, laid", [("on", True), ("auto", False), ("off", False)])
def test_the_trainer_lays_out_the_projections_as_asked(mode, laid):
    """Laid out after the weights have their dtype (here bf16 with float32 masters); auto is
    off on this CPU."""
    from meshpipe.testing import run_distributed
    from meshpipe.train.config import TrainConfig
    from trainer_cases import SMALL

    config = TrainConfig(**{**SMALL, "pp": 1, "dtype": "bf16", "joint_projections": mode})
    (found,) = run_distributed(1, _joint_modules, config)
    assert found == [("SelfAttention", laid), ("SwiGLU", laid)]


@pytest.mark.parametrize("mode, schedule, compiled, device, joint_run", [
    ("auto", "1f1b", False, "cuda", True), ("auto", "1f1b", False, "cpu", False),
    ("auto", "zb-v", False, "cuda", True), ("auto", "1f1b", True, "cuda", False),
    ("on", "1f1b", False, "cpu", True), ("off", "1f1b", False, "cuda", False)])
def test_when_a_run_projects_jointly(mode, schedule, compiled, device, joint_run):
    from meshpipe.train.run import weight_layout
    from meshpipe.train.config import TrainConfig

    config = TrainConfig(pp=2, vpp=2 if schedule == "zb-v" else 1, schedule=schedule,
                         compile=compiled, joint_projections=mode)
    assert weight_layout.joint_projections(config, torch.device(device)) == joint_run


def test_joint_projections_on_with_compile_is_refused_before_the_run():
    from meshpipe.train.config import TrainConfig

    with pytest.raises(ValueError, match="is for eager blocks"):
        TrainConfig(pp=2, compile=True, joint_projections="on")


JOINT_LAYOUTS = {  # each forced on (auto is off on a CPU), against one process
    "tp2-sequence-parallel": dict(pp=1, schedule="none", tp=2, sequence_parallel=True),
    "cp2x2-hybrid": dict(pp=1, schedule="none", cp_ring=2, cp_ulysses=2),
    "ep2-dp2-moe": dict(pp=1, schedule="none", dp=2, ep=2, moe_experts=4, moe_top_k=2),
    "pp2-dp2-zero2-bf16": dict(pp=2, dp=2, zero=2, dtype="bf16"),
    "pp2-vpp2-zb-v": dict(pp=2, vpp=2, schedule="zb-v"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", JOINT_LAYOUTS.values(), ids=JOINT_LAYOUTS.keys())
def test_a_step_with_joint_projections_matches_one_process(layout):
    from meshpipe.testing import run_distributed
    from meshpipe.train.config import TrainConfig
    from trainer_cases import SMALL, check_first_step

    config = TrainConfig(**{**SMALL, **layout, "joint_projections": "on"})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["passed"], report
