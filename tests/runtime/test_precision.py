"""Mixed precision pieces: autocast contexts, the dynamic loss scaler, parity tolerances."""

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshpipe.runtime import (DynamicLossScaler, Stage, autocast, low_precision_tolerance,
                              weights_cast_once)
from meshpipe.testing import run_distributed


# ------------------------------------------------------------------ autocast


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                         ("fp32", torch.float32)])
def test_autocast_runs_matmuls_in_the_named_precision_on_cpu(name, dtype):
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with autocast(name, "cpu"):
        assert layer(x).dtype == dtype
        assert (x @ x.T).dtype == dtype
    assert layer(x).dtype == torch.float32  # only inside the context


def test_autocast_rejects_an_unknown_precision():
    with pytest.raises(ValueError, match="unknown precision 'fp8': choose from fp32, bf16, fp16"):
        autocast("fp8", "cpu")


class _ParameterCasts(TorchDispatchMode):
    """Counts the casts (``aten._to_copy``) whose input is one of ``parameters``."""

    def __init__(self, parameters):
        super().__init__()
        self.pointers = {p.data_ptr() for p in parameters}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.pointers:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _microbatch_steps(model, microbatches, context):
    """Forward each microbatch in its own bf16 autocast and backward it, inside
    ``context``; the parameters' casts and gradients."""
    model.zero_grad()
    with _ParameterCasts(list(model.parameters())) as casts, context:
        for x in microbatches:
            with autocast("bf16", "cpu"):
                out = model(x)
            out.float().square().sum().backward()
    return casts.count, [p.grad.clone() for p in model.parameters()]


def test_a_step_casts_each_weight_once_with_the_same_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    microbatches = [torch.randn(3, 8) for _ in range(4)]
    per_microbatch, plain = _microbatch_steps(model, microbatches, contextlib.nullcontext())
    once, cached = _microbatch_steps(model, microbatches, weights_cast_once("bf16", "cpu"))
    assert (per_microbatch, once) == (4 * 4, 4)  # 2 weights, 2 biases
    for a, b in zip(cached, plain):
        assert torch.equal(a, b)
    assert not torch.is_autocast_enabled("cpu")
    with weights_cast_once("fp32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------------ loss scaler


def test_the_scale_grows_after_an_interval_of_good_steps_and_backs_off_on_overflow():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3, min_scale=2.0)
    for _ in range(2):
        scaler.update(False)
    assert (scaler.scale, scaler.good_steps) == (8.0, 2)
    scaler.update(False)
    assert (scaler.scale, scaler.good_steps) == (16.0, 0)
    scaler.update(False)
    scaler.update(True)  # an overflow resets the run of good steps
    assert (scaler.scale, scaler.good_steps, scaler.skipped_steps) == (8.0, 0, 1)
    for _ in range(3):
        scaler.update(True)
    assert (scaler.scale, scaler.skipped_steps) == (2.0, 4)  # never below min_scale
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 4.0


@pytest.mark.parametrize("options, message", [
    (dict(backoff_factor=1.0), "backoff_factor must lie in (0, 1)"),
    (dict(growth_factor=0.5), "growth_factor must be finite and >= 1"),
    (dict(growth_interval=0), "growth_interval must be a whole number >= 1"),
    (dict(init_scale=0.5), "init_scale must be finite and >= min_scale 1.0"),
    (dict(min_scale=0), "min_scale must be finite and > 0"),
])
def test_the_scaler_checks_its_settings(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DynamicLossScaler(**options)


def test_state_dict_round_trip_resumes_scale_and_counters():
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=5, backoff_factor=0.25)
    for found_inf in (False, True, False, False):
        scaler.update(found_inf)
    state = scaler.state_dict()
    assert all(isinstance(value, (int, float)) for value in state.values())
    resumed = DynamicLossScaler()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert (resumed.scale, resumed.good_steps, resumed.skipped_steps) == (256.0, 2, 1)
    for scaler_ in (scaler, resumed):
        for _ in range(3):
            scaler_.update(False)
    assert resumed.scale == scaler.scale == 512.0
    with pytest.raises(KeyError, match=r"missing \['scale'\], unknown \['scal'\]"):
        resumed.load_state_dict({("scal" if k == "scale" else k): v for k, v in state.items()})


def test_unscale_divides_gradients_in_place_and_finds_inf_and_nan():
    scaler = DynamicLossScaler(init_scale=4.0)
    weight, unused = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(1))
    bias = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))  # a half-precision gradient
    weight.grad = torch.tensor([4.0, -8.0, 2.0])
    bias.grad = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)
    assert scaler.unscale_([weight, bias, unused]) is False
    assert torch.equal(weight.grad, torch.tensor([1.0, -2.0, 0.5]))
    assert bias.grad.dtype == torch.bfloat16 and bias.grad.tolist() == [0.25, 0.0]
    for bad in (math.inf, math.nan):
        weight.grad = torch.tensor([1.0, bad, 1.0])
        assert scaler.unscale_([weight, bias]) is True


def test_scale_loss_computes_a_half_precision_loss_in_float32():
    scaler = DynamicLossScaler()
    scaled = scaler.scale_loss(torch.tensor(3.0, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and scaled.item() == 3.0 * 2 ** 16


def _unscale_on_every_rank(rank, world_size, inf_rank):
    scaler = DynamicLossScaler(init_scale=2.0)
    parameter = nn.Parameter(torch.zeros(2))
    parameter.grad = torch.full((2,), 2.0 * (rank + 1))
    if rank == inf_rank:
        parameter.grad[1] = math.inf
    found_inf = scaler.unscale_([parameter])
    scaler.update(found_inf)
    # A rank without gradients takes part in the vote too.
    no_grads = scaler.unscale_([nn.Parameter(torch.zeros(1))] if rank == 0 else [parameter])
    return found_inf, parameter.grad[0].item(), scaler.scale, no_grads


@pytest.mark.distributed
def test_unscale_agrees_across_ranks_with_one_all_reduce():
    overflow = run_distributed(2, _unscale_on_every_rank, 1)
    assert [r[0] for r in overflow] == [True, True]  # rank 0's gradients were finite
    assert [r[1] for r in overflow] == [1.0, 2.0]
    assert [r[2] for r in overflow] == [1.0, 1.0]  # both backed off: same scale everywhere
    assert [r[3] for r in overflow] == [True, True]  # rank 1 still holds the inf
    clean = run_distributed(2, _unscale_on_every_rank, None)
    assert [r[0] for r in clean] == [False, False]
    assert [r[2] for r in clean] == [2.0, 2.0]


def test_scale_loss_is_a_stage_grad_scale_fn():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x, target = torch.randn(5, 4), torch.randn(5, 3)
    nn.functional.mse_loss(layer(x), target).backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()

    scaler = DynamicLossScaler(init_scale=256.0)
    stage = Stage(layer, 0, 1, loss_fn=nn.functional.mse_loss, grad_scale_fn=scaler.scale_loss)
    _, loss = stage.forward(0, x, target=target)
    stage.backward(0)
    assert loss.item() == pytest.approx(nn.functional.mse_loss(layer(x), target).item())
    for parameter, unscaled in zip(layer.parameters(), expected):
        torch.testing.assert_close(parameter.grad, 256.0 * unscaled)
    assert scaler.unscale_(layer.parameters()) is False
    for parameter, unscaled in zip(layer.parameters(), expected):
        torch.testing.assert_close(parameter.grad, unscaled)


# ------------------------------------------------------------------ tolerances


def test_fp32_tolerance_is_torchs_default():
    assert low_precision_tolerance("fp32") == {"rtol": 1.3e-6, "atol": 1e-5}
    assert low_precision_tolerance("fp32", torch.ones(3) * 100) == {"rtol": 1.3e-6, "atol": 1e-5}


def test_low_precision_atol_follows_the_reference_magnitude():
    assert low_precision_tolerance("bf16", torch.tensor([0.5, -2.0])) == {
        "rtol": 1.6e-2, "atol": pytest.approx(6e-2)}
    assert low_precision_tolerance("fp16", 0.01) == {"rtol": 1e-3, "atol": pytest.approx(5e-5)}
    assert low_precision_tolerance("bf16") == low_precision_tolerance("bf16", 1e-2)
    with pytest.raises(ValueError, match="unknown precision"):
        low_precision_tolerance("int8")


_DIM, _HIDDEN, _BLOCKS, _VOCAB = 64, 256, 3, 128


def _toy_gradients(dtype_name, *, split, microbatches):
    """A small pre-norm residual MLP stack: loss and fp32 parameter gradients under autocast.
    ``split`` computes each down-projection as two summed halves (tensor parallel's partial
    sums); the batch runs in ``microbatches`` accumulated pieces (a pipeline's order)."""
    generator = torch.Generator().manual_seed(0)
    weights = [nn.Parameter(torch.randn(shape, generator=generator) * 0.04)
               for _ in range(_BLOCKS) for shape in ((_HIDDEN, _DIM), (_DIM, _HIDDEN))]
    head = nn.Parameter(torch.randn(_VOCAB, _DIM, generator=generator) * 0.04)
    x = torch.randn(8, 32, _DIM, generator=generator)
    targets = torch.randint(0, _VOCAB, (8, 32), generator=generator)
    scaler = DynamicLossScaler()  # fp16 parity needs loss scaling in both runs

    def norm(h):
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(h.dtype)

    for xs, ts in zip(x.chunk(microbatches), targets.chunk(microbatches)):
        with autocast(dtype_name, "cpu"):
            h = xs
            for up, down in zip(weights[::2], weights[1::2]):
                a = nn.functional.silu(norm(h) @ up.T)
                if split:
                    half = _HIDDEN // 2
                    h = h + (a[..., :half] @ down[:, :half].T + a[..., half:] @ down[:, half:].T)
                else:
                    h = h + a @ down.T
            logits = norm(h) @ head.T
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ts.flatten())
        loss = loss / microbatches
        (scaler.scale_loss(loss) if dtype_name == "fp16" else loss).backward()
    parameters = weights + [head]
    if dtype_name == "fp16":
        assert not scaler.unscale_(parameters)
    return [p.grad for p in parameters]


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_the_tolerance_passes_a_reordered_run_and_catches_a_gradient_10_percent_short(dtype_name):
    reference = _toy_gradients(dtype_name, split=False, microbatches=1)
    reordered = _toy_gradients(dtype_name, split=True, microbatches=4)
    for actual, expected in zip(reordered, reference):
        assert not torch.equal(actual, expected)  # the reduction order did change the result
        tolerance = low_precision_tolerance(dtype_name, expected)
        # with margin: half the tolerance passes too
        torch.testing.assert_close(actual, expected, rtol=tolerance["rtol"] / 2,
                                   atol=tolerance["atol"] / 2)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(actual * 0.9, expected, **tolerance)
