"""Stage: forward/backward per microbatch, split backward (I then W), seed 000's multi-tensor
semantics, skip connections, freeing sent outputs (seed 003) and errors. Single process."""

import copy
import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from meshpipe.models import Transformer, TransformerConfig, causal_lm_loss, split
from meshpipe.models.transformer import TransformerBlock
from meshpipe.runtime import Stage, StageError

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                           max_seq_len=64)


pytestmark = pytest.mark.usefixtures("one_thread")

def _data(microbatches, batch=2, seq=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (microbatches, batch, seq), generator=generator)
    targets = torch.randint(0, 64, (microbatches, batch, seq), generator=generator)
    return tokens, targets


def _copy_message(message):
    """What the next stage receives: a copy (the sender may free its own tensors)."""
    if isinstance(message, tuple):
        return tuple(_copy_message(value) for value in message)
    return message.detach().clone() if isinstance(message, torch.Tensor) else message


def _pipeline(model, num_stages, loss_fn=causal_lm_loss, **stage_kwargs):
    chunks = split(model, num_stages)
    return [Stage(chunk, i, num_stages, loss_fn=loss_fn if i == num_stages - 1 else None,
                  **stage_kwargs) for i, chunk in enumerate(chunks)]


def _forward_all(stages, microbatch, message, target, loss_scale=1.0, release=False):
    for stage in stages:
        result = stage.forward(microbatch, message, target=target if stage.is_last else None,
                               loss_scale=loss_scale)
        if stage.is_last:
            return result
        message = _copy_message(result)
        if release:
            stage.release_output(microbatch)


def _backward_all(stages, microbatch, split_backward=False):
    grads = None
    for stage in reversed(stages):
        if split_backward:
            grads = stage.backward_input(microbatch, grads)
        else:
            grads = stage.backward(microbatch, grads)
        grads = _copy_message(grads)
    return grads


def _param_grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def _assert_same_grads(actual, expected, exact=False):
    assert actual.keys() == expected.keys()
    for name in expected:
        if exact:
            assert torch.equal(actual[name], expected[name]), name
        else:
            torch.testing.assert_close(actual[name], expected[name], msg=name)


# --------------------------------------------------------------- parity with one model


def test_microbatched_stages_equal_one_full_backward():
    """Gradient accumulation over 4 microbatches with loss_scale 1/4 equals the full batch."""
    tokens, targets = _data(4)
    reference = Transformer(CONFIG)
    full_loss = causal_lm_loss(reference(tokens.flatten(0, 1)), targets.flatten(0, 1))
    full_loss.backward()

    model = Transformer(CONFIG)
    stages = _pipeline(model, 3)
    losses = []
    for mb in range(4):
        _, loss = _forward_all(stages, mb, (tokens[mb],), targets[mb], loss_scale=0.25)
        losses.append(loss)
    for mb in range(4):
        _backward_all(stages, mb)
    torch.testing.assert_close(torch.stack(losses).mean(), full_loss.detach())
    _assert_same_grads(_param_grads(model), _param_grads(reference))
    assert all(stage.live_microbatches == 0 for stage in stages)


IN_ORDER = [(2, 0), (1, 0), (2, 1), (0, 0), (1, 1), (2, 2), (0, 1), (1, 2), (0, 2)]
SCRAMBLED = [(1, 2), (2, 0), (0, 1), (2, 2), (1, 0), (0, 0), (2, 1), (1, 1), (0, 2)]


@pytest.mark.parametrize("weight_order", [IN_ORDER, SCRAMBLED], ids=["in-order", "scrambled"])
def test_split_backward_equals_backward_with_late_interleaved_weights(weight_order):
    """All I first, then the W's later: exact when each stage does its W's in microbatch order
    (the accumulation order of B); a scrambled order only reorders the float sums."""
    tokens, targets = _data(3, seed=1)
    models = [Transformer(CONFIG), Transformer(CONFIG)]
    full, halves = _pipeline(models[0], 3), _pipeline(models[1], 3)
    for mb in range(3):
        _forward_all(full, mb, (tokens[mb],), targets[mb], loss_scale=1 / 3)
        _forward_all(halves, mb, (tokens[mb],), targets[mb], loss_scale=1 / 3)

    expected = {}
    for mb in range(3):
        grads = None
        for stage in (2, 1, 0):
            grads = expected[stage, mb] = full[stage].backward(mb, _copy_message(grads))

    got = {}
    for stage, mb in [(2, 0), (2, 1), (1, 0), (2, 2), (1, 1), (0, 0), (1, 2), (0, 1), (0, 2)]:
        upstream = None if stage == 2 else _copy_message(got[stage + 1, mb])
        got[stage, mb] = halves[stage].backward_input(mb, upstream)
    assert all(p.grad is None for p in models[1].parameters()), "I must not touch weight grads"
    for stage, mb in weight_order:
        halves[stage].backward_weight(mb)

    for key, want in expected.items():
        if want is None:
            assert got[key] is None
        else:
            assert torch.equal(got[key][0], want[0]) and got[key][1:] == want[1:] == (None, None)
    _assert_same_grads(_param_grads(models[1]), _param_grads(models[0]),
                       exact=weight_order is IN_ORDER)
    assert all(stage.live_microbatches == 0 for stage in halves)


def test_input_pass_skips_weight_work_and_weight_pass_does_only_that():
    """I + W costs what B costs (FLOPs), I about half: W does not redo the backward."""
    model = Transformer(CONFIG)
    stage = Stage(split(model, 3)[1], 1, 3)
    hidden = torch.randn(2, 16, 32)
    grads = (torch.randn(2, 16, 32), None, None)

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()
    stage.forward(0, (hidden, None, None))
    full = flops(lambda: stage.backward(0, grads))
    stage.forward(1, (hidden, None, None))
    input_half = flops(lambda: stage.backward_input(1, grads))
    weight_half = flops(lambda: stage.backward_weight(1))
    assert input_half + weight_half == full
    assert 0.3 * full < input_half < 0.7 * full


@pytest.mark.skipif(not hasattr(torch.utils.checkpoint, "GraphExecGroup"),
                    reason="this torch has no GraphExecGroup: W recomputes once per call")
def test_a_recomputed_stage_runs_each_block_once_in_the_input_pass_and_once_in_the_weight_pass():
    """Under --recompute full, W's several backward calls share one recomputation of each
    block (each pass reads the blocks' saved tensors), where a recomputation per call ran
    the blocks several times more. The gradients stay B's."""
    models = [Transformer(CONFIG, recompute="full") for _ in range(2)]
    split_stage, full_stage = (Stage(split(model, 3)[1], 1, 3) for model in models)
    blocks = [m for m in split_stage.module.modules() if isinstance(m, TransformerBlock)]
    runs = []
    for block in blocks:  # on its first module: an early-stopped recomputation ends inside
        block.attention_norm.register_forward_pre_hook(lambda module, args: runs.append(module))
    hidden = torch.randn(2, 16, 32)
    grads = (torch.randn(2, 16, 32), None, None)
    full_stage.forward(0, (hidden, None, None))
    full_stage.backward(0, grads)
    split_stage.forward(0, (hidden, None, None))
    split_stage.backward_input(0, grads)
    assert len(runs) == 2 * len(blocks)
    split_stage.backward_weight(0)
    assert len(runs) == 3 * len(blocks)
    _assert_same_grads(_param_grads(models[0]), _param_grads(models[1]))


class CrossingWeights(nn.Module):
    """Weight b feeds the input-side path below weight a and also sits beside it, at a's level:
    one W call for both would walk the input-side product with ``mix`` again."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.randn(4, 4)) for _ in range(3))
        self.register_buffer("mix", torch.randn(4, 4))

    def forward(self, x):
        below = (x @ self.b) @ self.mix
        beside = (x @ self.c) @ self.b
        return below @ self.a + beside


def test_weight_pass_does_not_repeat_input_side_work_between_crossing_weights():
    module = CrossingWeights()
    reference = copy.deepcopy(module)
    stage, full = Stage(module, 1, 2), Stage(reference, 1, 2)
    x, grad = torch.randn(4, 4), torch.randn(4, 4)
    stage.forward(0, x)
    full.forward(0, x)
    with FlopCounterMode(display=False) as counter:
        stage.backward_input(0, grad)
        stage.backward_weight(0)
    split_flops = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        full.backward(0, grad)
    assert split_flops == counter.get_total_flops()
    _assert_same_grads(_param_grads(module), _param_grads(reference))


# ------------------------------------------------------------------- multi-tensor


class MultiTensorStage(nn.Module):
    """Takes and returns float32, bfloat16, int64, None and a Python int (seed 000)."""

    def __init__(self):
        super().__init__()
        self.w32 = nn.Parameter(torch.randn(4, 4))
        self.w16 = nn.Parameter(torch.randn(4, 4))

    def forward(self, x32, x16, index, nothing, scale, unused):
        assert nothing is None and isinstance(scale, int)
        y32 = (x32 @ self.w32) * scale + x16.float()[index]
        y16 = (x16.float() @ self.w16).to(torch.bfloat16)
        return y32, y16, index + 1, None, scale + 1


def _multi_inputs():
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(3, 4, generator=generator),
            torch.randn(3, 4, generator=generator).to(torch.bfloat16),
            torch.tensor([2, 0, 1]), None, 3, torch.randn(5, generator=generator))


@pytest.mark.parametrize("split_backward", [False, True])
def test_multi_tensor_message_grads_follow_seed_000(split_backward):
    module = MultiTensorStage()
    reference = copy.deepcopy(module)
    stage = Stage(module, 1, 3)
    x32, x16, index, nothing, scale, unused = _multi_inputs()
    y32, y16, next_index, none_out, next_scale = stage.forward(0, (x32, x16, index, nothing, scale,
                                                                   unused))
    assert y16.dtype == torch.bfloat16 and torch.equal(next_index, index + 1)
    assert none_out is None and next_scale == 4
    g32, g16 = torch.randn(3, 4), torch.randn(3, 4).to(torch.bfloat16)
    output_grads = (g32, g16, "ignored: int output", None, None)
    if split_backward:
        grads = stage.backward_input(0, output_grads)
        stage.backward_weight(0)
    else:
        grads = stage.backward(0, output_grads)

    leaves = [t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor)
              else t for t in (x32, x16, index, nothing, scale, unused)]
    r32, r16, *_ = reference(*leaves)
    torch.autograd.backward([r32, r16], [g32, g16])
    assert grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(grads[0], leaves[0].grad)
    torch.testing.assert_close(grads[1], leaves[1].grad)
    assert grads[2] is None and grads[3] is None and grads[4] is None
    assert torch.equal(grads[5], torch.zeros(5)), "a float input without gradient gets zeros"
    _assert_same_grads(_param_grads(module), _param_grads(reference))


def test_outputs_whose_gradient_is_none_take_no_part():
    module = MultiTensorStage()
    stage = Stage(module, 1, 2)
    stage.forward(0, _multi_inputs())
    grads = stage.backward(0, (None, torch.ones(3, 4, dtype=torch.bfloat16), None, None, None))
    assert torch.equal(grads[0], torch.zeros(3, 4))
    assert module.w32.grad is None and module.w16.grad is not None


# ---------------------------------------------------------------- skip connection


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        encoded = torch.tanh(self.proj(x))
        return encoded, encoded


class Decoder(nn.Module):
    """Uses the encoder output and passes it on unchanged to the next stage."""

    def __init__(self, last):
        super().__init__()
        self.mix = nn.Linear(12, 6)
        self.last = last

    def forward(self, hidden, encoded):
        hidden = torch.relu(self.mix(torch.cat([hidden, encoded], dim=-1))) + hidden
        return hidden.sum() if self.last else (hidden, encoded)


def _encoder_decoder():
    torch.manual_seed(11)
    return nn.ModuleList([Encoder(), Decoder(False), Decoder(False), Decoder(True)])


def _run_encoder_decoder(layers, x):
    message = layers[0](x)
    for layer in layers[1:]:
        message = layer(*message)
    return message


@pytest.mark.parametrize("split_backward", [False, True])
def test_skip_connection_gets_the_gradient_of_every_path(split_backward):
    x = torch.randn(5, 6)
    reference = _encoder_decoder()
    _run_encoder_decoder(reference, x).backward()

    layers = _encoder_decoder()
    stages = [Stage(layer, i, 4, loss_fn=(lambda out, _: out) if i == 3 else None)
              for i, layer in enumerate(layers)]
    _forward_all(stages, 0, x, target=0, release=True)
    grads = _backward_all(stages, 0, split_backward)
    assert grads is None  # the first stage has nobody to send input grads to
    if split_backward:
        for stage in stages:
            stage.backward_weight(0)
    _assert_same_grads(_param_grads(layers), _param_grads(reference))


# ------------------------------------------------------------------ loss handling


def test_grad_scale_fn_scales_the_backward_root_but_not_the_returned_loss():
    tokens, targets = _data(1, seed=2)
    reference = Transformer(CONFIG)
    expected_loss = causal_lm_loss(reference(tokens[0]), targets[0])
    (expected_loss * 0.5 * 8).backward()

    model = Transformer(CONFIG)
    stages = _pipeline(model, 2, grad_scale_fn=lambda loss: loss * 8)
    _, loss = _forward_all(stages, 0, (tokens[0],), targets[0], loss_scale=0.5)
    _backward_all(stages, 0)
    torch.testing.assert_close(loss, expected_loss.detach())
    assert not loss.requires_grad
    _assert_same_grads(_param_grads(model), _param_grads(reference))


def test_forward_only_keeps_nothing_and_still_reports_the_loss():
    tokens, targets = _data(1, seed=3)
    stages = _pipeline(Transformer(CONFIG), 2)
    message = stages[0].forward(0, (tokens[0],), keep_for_backward=False)
    assert stages[0].live_microbatches == 0 and not message[0].requires_grad
    logits, loss = stages[1].forward(0, message, target=targets[0], keep_for_backward=False)
    assert not logits.requires_grad and stages[1].live_microbatches == 0
    reference = Transformer(CONFIG)
    torch.testing.assert_close(loss, causal_lm_loss(reference(tokens[0]), targets[0]).detach())
    with pytest.raises(StageError, match="no forward of this microbatch is held"):
        stages[0].backward(0)


# ---------------------------------------------------------------- freeing outputs


def _release_and_backward(module, message, grads):
    """Forward, release, backward: (which outputs were freed, param grads, input grads)."""
    stage = Stage(module, 1, 3)
    output = stage.forward(0, message)
    stage.release_output(0)
    outputs = output if isinstance(output, tuple) else (output,)
    freed = [o.untyped_storage().nbytes() == 0 for o in outputs]
    input_grads = stage.backward(0, grads)
    return freed, _param_grads(module), input_grads


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) + x


class TanhOut(Residual):
    def forward(self, x):
        return torch.tanh(self.linear(x))


class OutputSavedByAnotherOp(Residual):
    def forward(self, x):
        hidden = self.linear(x) + x
        return hidden, hidden * self.linear.weight[0]


class _SaveForBackward(torch.autograd.Function):
    """x * w with x and w saved by ``save_for_backward`` (as a custom op would)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class OutputSavedByCustomFunction(Residual):
    def forward(self, x):
        hidden = self.linear(x) + x
        return hidden, _SaveForBackward.apply(hidden, self.linear.weight[0])


class OutputViewSavedByAnotherOp(Residual):
    def forward(self, x):
        hidden = self.linear(x) + x
        return hidden, hidden[:2].t() * self.linear.weight[:, :1]


class OutputSavedByCheckpoint(Residual):
    def forward(self, x):
        hidden = self.linear(x) + x
        return hidden, checkpoint(torch.sin, hidden, use_reentrant=True)


class PassThrough(Residual):
    def forward(self, x):
        return self.linear(x), x


class ViewOut(Residual):
    def forward(self, x):
        return (self.linear(x) + 1).view(-1)


@pytest.mark.parametrize("module_type, freed", [
    (Residual, [True]),
    (TanhOut, [False]),                      # tanh saved its own result
    (OutputSavedByAnotherOp, [False, True]),  # the product saved the first output
    (OutputSavedByCustomFunction, [False, True]),  # so did save_for_backward
    (OutputViewSavedByAnotherOp, [False, True]),   # a saved view shares its storage
    (OutputSavedByCheckpoint, [False, True]),      # a reentrant checkpoint saves its input
    (PassThrough, [True, False]),             # the second output is the stage's input
    (ViewOut, [False]),                       # a view: freeing it frees nothing
])
def test_release_output_frees_only_what_backward_does_not_need(module_type, freed):
    torch.manual_seed(0)
    module = module_type()
    reference = copy.deepcopy(module)
    x = torch.randn(4, 8)
    generator = torch.Generator().manual_seed(1)
    out = module(x.clone())
    outputs = out if isinstance(out, tuple) else (out,)
    grads = tuple(torch.randn(o.shape, generator=generator) for o in outputs)
    grads = grads if len(outputs) > 1 else grads[0]

    actually_freed, param_grads, input_grads = _release_and_backward(module, x, grads)
    assert actually_freed == freed

    leaf = x.clone().requires_grad_(True)
    expected = reference(leaf)
    torch.autograd.backward(expected, grads)
    torch.testing.assert_close(input_grads, leaf.grad)
    _assert_same_grads(param_grads, _param_grads(reference))


class EmbedWithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)

    def forward(self, tokens, positions):
        return self.embed(tokens) + positions.unsqueeze(-1), positions


def test_release_output_keeps_what_the_first_stage_passes_through_from_its_inputs():
    stage = Stage(EmbedWithPositions(), 0, 2)
    tokens, positions = torch.randint(0, 10, (2, 5)), torch.arange(5)
    for microbatch in range(2):  # the caller passes the same positions every time
        hidden, passed = stage.forward(microbatch, (tokens, positions))
        stage.release_output(microbatch)
        assert hidden.untyped_storage().nbytes() == 0
        assert passed is positions and torch.equal(positions, torch.arange(5))


class CheckpointedTanh(Residual):
    """A non-reentrant checkpoint: reading its saved tensors recomputes the region."""

    def __init__(self):
        super().__init__()
        self.regions_run = 0

    def region(self, x):
        self.regions_run += 1
        return torch.tanh(self.linear(x))

    def forward(self, x):
        return checkpoint(self.region, x, use_reentrant=False)


def test_release_output_reads_no_saved_tensor_so_checkpoints_do_not_recompute():
    torch.manual_seed(0)
    module = CheckpointedTanh()
    reference = copy.deepcopy(module)
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    freed, param_grads, input_grads = _release_and_backward(module, x, grad)
    assert module.regions_run == 2  # forward, and the recomputation in backward only
    assert freed == [True]  # the checkpoint keeps no tensor on the output's storage
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward(reference(leaf), grad)
    torch.testing.assert_close(input_grads, leaf.grad)
    _assert_same_grads(param_grads, _param_grads(reference))


def test_release_output_of_transformer_chunks_keeps_training_exact():
    tokens, targets = _data(2, seed=4)
    models = [Transformer(CONFIG), Transformer(CONFIG)]
    kept, freed = _pipeline(models[0], 3), _pipeline(models[1], 3)
    for mb in range(2):
        _forward_all(kept, mb, (tokens[mb],), targets[mb])
        _forward_all(freed, mb, (tokens[mb],), targets[mb], release=True)
    for mb in range(2):
        _backward_all(kept, mb)
        _backward_all(freed, mb, split_backward=True)
        for stage in freed:
            stage.backward_weight(mb)
    _assert_same_grads(_param_grads(models[1]), _param_grads(models[0]), exact=True)


def test_release_output_really_frees_the_hidden_state():
    stage = Stage(split(Transformer(CONFIG), 2)[0], 0, 2)
    hidden, _, _ = stage.forward(0, (_data(1)[0][0],))
    assert hidden.untyped_storage().nbytes() == hidden.numel() * 4
    stage.release_output(0)
    assert hidden.untyped_storage().nbytes() == 0
    stage.release_output(0)  # idempotent
    stage.backward(0, (torch.ones(2, 10, 32), None, None))
    stage.release_output(0)  # nothing held any more: a no-op


class ReturnsModuleTensors(Residual):
    """Sends a buffer, a plain tensor attribute, a parameter and an integer tensor it computed
    beside its activation: none of them is this forward's differentiable result."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.offsets = torch.arange(8.0)

    def forward(self, x):
        return self.linear(x) + x, self.scale, self.offsets, self.linear.bias, x.argmax(-1)


def test_release_output_frees_only_this_forwards_differentiable_results():
    torch.manual_seed(0)
    module = ReturnsModuleTensors()
    reference = copy.deepcopy(module)
    stage = Stage(module, 1, 3)
    x = torch.randn(4, 8)
    hidden, scale, offsets, bias, argmax = stage.forward(0, x)
    stage.release_output(0)
    assert hidden.untyped_storage().nbytes() == 0
    torch.testing.assert_close(module.scale, torch.full((8,), 2.0))
    torch.testing.assert_close(module.offsets, torch.arange(8.0))
    torch.testing.assert_close(module.linear.bias, reference.linear.bias)
    torch.testing.assert_close(argmax, x.argmax(-1))
    assert scale is module.scale and offsets is module.offsets and bias is module.linear.bias
    grad = torch.randn(4, 8)
    input_grads = stage.backward(0, (grad, None, None, None, None))
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward(reference(leaf)[0], grad)
    torch.testing.assert_close(input_grads, leaf.grad)
    _assert_same_grads(_param_grads(module), _param_grads(reference))


# ---------------------------------------------------------- state and bookkeeping


def test_live_microbatches_count_held_forwards():
    stage = Stage(Residual(), 1, 3)
    for mb in range(3):
        stage.forward(mb, torch.randn(2, 8))
    assert stage.live_microbatches == 3
    stage.backward(1, torch.ones(2, 8))
    assert stage.live_microbatches == 2
    stage.backward_input(0, torch.ones(2, 8))
    assert stage.live_microbatches == 2
    stage.backward_weight(0)
    assert stage.live_microbatches == 1
    stage.forward(3, torch.randn(2, 8), keep_for_backward=False)
    assert stage.live_microbatches == 1


class RemembersActivation(Residual):
    """Keeps a weak reference to an activation that autograd saves for backward."""

    def forward(self, x):
        hidden = torch.relu(self.linear(x))
        self.activation = weakref.ref(hidden)
        return hidden @ self.linear.weight


@pytest.mark.parametrize("split_backward", [False, True])
def test_backward_lets_go_of_saved_activations(split_backward):
    module = RemembersActivation()
    stage = Stage(module, 1, 3)
    output = stage.forward(0, torch.randn(2, 8))
    del output
    gc.collect()
    assert module.activation() is not None, "backward needs it: the stage must hold it"
    if split_backward:
        stage.backward_input(0, torch.ones(2, 8))
        gc.collect()
        assert module.activation() is not None, "W still needs it"
        stage.backward_weight(0)
    else:
        stage.backward(0, torch.ones(2, 8))
    gc.collect()
    assert module.activation() is None


def test_parameter_grads_accumulate_and_are_never_zeroed():
    module = Residual()
    stage = Stage(module, 1, 3)
    x, grad = torch.randn(2, 8), torch.ones(2, 8)
    stage.forward(0, x)
    stage.backward(0, grad)
    once = module.linear.weight.grad.clone()
    stage.forward(0, x)
    stage.backward_input(0, grad)
    stage.backward_weight(0)
    torch.testing.assert_close(module.linear.weight.grad, 2 * once)


def test_reset_forgets_held_forwards_and_split_backward_state():
    torch.manual_seed(0)
    module = Residual()
    reference = copy.deepcopy(module)
    stage = Stage(module, 1, 3)
    x, grad = torch.randn(2, 8), torch.randn(2, 8)
    stage.forward(0, x)
    stage.forward(1, x)
    stage.backward_input(1, grad)  # half-way through a split backward
    stage.reset()
    assert stage.live_microbatches == 0
    assert "no forward of this microbatch" in str(_error(lambda: stage.backward_weight(1)))
    module.zero_grad(set_to_none=True)
    for microbatch in (0, 1):  # the same ids run again, each with one backward
        stage.forward(microbatch, x)
        stage.backward(microbatch, grad)
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward(reference(leaf), grad)
    expected = {name: 2 * g for name, g in _param_grads(reference).items()}
    _assert_same_grads(_param_grads(module), expected)


def test_forward_only_without_a_target_returns_the_output_without_a_loss():
    tokens, targets = _data(1, seed=5)
    stages = _pipeline(Transformer(CONFIG), 2)
    message = stages[0].forward(0, (tokens[0],), keep_for_backward=False)
    assert not stages[1].computes_loss(None, keep_for_backward=False)
    assert stages[1].computes_loss(targets[0], keep_for_backward=False)
    logits = stages[1].forward(0, message, keep_for_backward=False)
    reference = Transformer(CONFIG)
    torch.testing.assert_close(logits, reference(tokens[0]).detach())
    _, loss = stages[1].forward(0, message, target=targets[0], keep_for_backward=False)
    torch.testing.assert_close(loss, causal_lm_loss(reference(tokens[0]), targets[0]).detach())
    assert "no target" in str(_error(lambda: stages[1].forward(0, message)))
    assert not stages[0].computes_loss(targets[0])


# ------------------------------------------------------------------------- errors


def _error(fn):
    with pytest.raises(StageError) as info:
        fn()
    return info.value


def test_message_with_the_wrong_arity_names_stage_microbatch_and_action():
    stage = Stage(split(Transformer(CONFIG), 3)[1], 1, 3)
    error = _error(lambda: stage.forward(4, (torch.randn(2, 10, 32), None, None, None, None)))
    assert (error.stage, error.microbatch, error.action) == (1, 4, "forward")
    assert "stage 1, microbatch 4, forward" in str(error)
    assert "does not fit the module's forward" in str(error)
    assert stage.live_microbatches == 0


def test_message_with_the_wrong_dtype_is_a_stage_error():
    first = Stage(split(Transformer(CONFIG), 2)[0], 0, 2)
    error = _error(lambda: first.forward(0, (torch.randn(2, 10),)))
    assert "Tensor(2, 10):float32" in str(error) and error.action == "forward"
    middle = Stage(split(Transformer(CONFIG), 3)[1], 1, 3)
    error = _error(lambda: middle.forward(0, (torch.randn(2, 10, 32, dtype=torch.float64),
                                               None, None)))
    assert "float64" in str(error)


def test_loss_that_is_not_a_scalar_is_rejected():
    stage = Stage(Residual(), 2, 3, loss_fn=lambda out, target: (out - target) ** 2)
    error = _error(lambda: stage.forward(0, torch.randn(2, 8), target=torch.zeros(2, 8)))
    assert "not a floating-point scalar" in str(error) and "stage 2" in str(error)
    error = _error(lambda: stage.forward(1, torch.randn(2, 8)))
    assert "no target" in str(error)
    error = _error(lambda: stage.forward(2, torch.randn(2, 8), target=torch.zeros(3, 8)))
    assert "loss_fn raised RuntimeError" in str(error) and "Tensor(2, 8):float32" in str(error)


def test_backward_errors_say_what_to_do():
    stage = Stage(Residual(), 1, 3)
    assert "no forward of this microbatch" in str(_error(lambda: stage.backward(0,
                                                                               torch.ones(2, 8))))
    stage.forward(0, torch.randn(2, 8))
    assert "still waiting for its backward" in str(_error(lambda: stage.forward(0,
                                                                              torch.ones(2, 8))))
    assert "backward_input first" in str(_error(lambda: stage.backward_weight(0)))
    wrong = _error(lambda: stage.backward(0, torch.ones(2, 9)))
    assert "shape (2, 8)" in str(wrong) and wrong.action == "backward"
    assert "no output gradients" in str(_error(lambda: stage.backward(0)))
    stage.backward_input(0, torch.ones(2, 8))
    assert "finish it with backward_weight" in str(_error(lambda: stage.backward(0,
                                                                                 torch.ones(2, 8))))
    stage.backward_weight(0)
    twice = _error(lambda: stage.backward_weight(0))
    assert "already ran (backward_weight)" in str(twice) and twice.microbatch == 0


def test_last_stage_rejects_output_grads_and_other_stages_reject_a_loss():
    stage = Stage(Residual(), 2, 3, loss_fn=lambda out, target: out.sum())
    stage.forward(0, torch.randn(2, 8), target=0)
    assert "pass output_grads=None" in str(_error(lambda: stage.backward(0, torch.ones(2, 8))))
    with pytest.raises(ValueError, match="only the last stage"):
        Stage(Residual(), 0, 3, loss_fn=lambda out, target: out.sum())


class ModifiesSavedInPlace(Residual):
    """Changes a tensor autograd saved for backward, so every backward through it fails."""

    def forward(self, x):
        saved = torch.sigmoid(self.linear(x))
        out = saved * 2
        saved.mul_(1)
        return out


def _sigmoid_then_in_place(out, target):
    saved = torch.sigmoid(out)
    loss = saved.sum()
    saved.mul_(1)
    return loss


def _sum_loss(out, target):
    return out.sum()


STEP_INPUTS = "inputs given to Executor.step(inputs=...)"


@pytest.mark.parametrize("message", [(torch.randn(2, 8), torch.randn(2, 8)),   # arity
                                     torch.randn(2, 8, dtype=torch.float64),   # dtype
                                     torch.randn(2, 5)])                        # shape
def test_a_bad_input_on_the_first_stage_points_at_the_step_inputs(message):
    """Stage 0's input is the user's data, not a previous stage's output."""
    error = _error(lambda: Stage(Residual(), 0, 3).forward(0, message))
    assert STEP_INPUTS in str(error) and "first chunk" in str(error)
    assert "previous stage" not in str(error)


@pytest.mark.parametrize("message", [(torch.randn(2, 8), torch.randn(2, 8)),
                                     torch.randn(2, 8, dtype=torch.float64),
                                     torch.randn(2, 5)])
def test_a_bad_input_on_a_later_stage_points_at_the_previous_stage(message):
    for stage in (Stage(Residual(), 1, 3), Stage(Residual(), 2, 3, loss_fn=_sum_loss)):
        error = _error(lambda: stage.forward(0, message, target=0))
        assert "previous stage" in str(error) and "Executor.step" not in str(error)


def test_a_failing_backward_points_at_the_next_stage_or_at_the_loss():
    middle = Stage(ModifiesSavedInPlace(), 1, 3)
    middle.forward(0, torch.randn(2, 8))
    error = _error(lambda: middle.backward(0, torch.ones(2, 8)))
    assert "autograd failed" in str(error)
    assert "check the output gradients received from the next stage" in str(error)
    middle.forward(1, torch.randn(2, 8))
    missing = _error(lambda: middle.backward(1))
    assert "pass the gradients received from the next stage" in str(missing)

    last = Stage(Residual(), 2, 3, loss_fn=_sigmoid_then_in_place)
    last.forward(0, torch.randn(2, 8), target=0)
    error = _error(lambda: last.backward(0))
    assert "autograd failed" in str(error) and "next stage" not in str(error)
    assert "backward starts from its loss: check loss_fn" in str(error)

    # A last stage without a loss_fn (forward kept for backward through the Stage API).
    no_loss = Stage(Residual(), 2, 3)
    no_loss.forward(0, torch.randn(2, 8))
    error = _error(lambda: no_loss.backward(0))
    assert "no loss_fn" in str(error) and "next stage" not in str(error)


class ReentrantCheckpoint(nn.Module):
    """An embedding (first stage) or the stage input, then a reentrant-checkpointed block."""

    def __init__(self, first: bool):
        super().__init__()
        self.embed = nn.Embedding(10, 8) if first else None
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        hidden = self.embed(x) if self.embed is not None else x
        return checkpoint(lambda h: torch.tanh(self.linear(h)), hidden, use_reentrant=True)


@pytest.mark.parametrize("index", [1, 0])
def test_split_backward_through_a_reentrant_checkpoint_asks_for_use_reentrant_false(index):
    """Found in the graph by I, before anything runs, on the first stage too (whose I
    computes nothing): torch 2.8 failed only in W, with another message, and 2.6 crashed."""
    stage = Stage(ReentrantCheckpoint(first=index == 0), index, 3)
    x = torch.randint(0, 10, (2, 4)) if index == 0 else torch.randn(2, 4, 8)
    stage.forward(0, x)
    with pytest.raises(StageError) as info:
        stage.backward_input(0, torch.ones(2, 4, 8))
    assert info.value.action == "backward_input"
    assert "use torch.utils.checkpoint(..., use_reentrant=False) with zero-bubble schedules" \
        in str(info.value)
    stage.forward(1, x)  # a full backward works through it
    stage.backward(1, torch.ones(2, 4, 8))
    assert stage.module.linear.weight.grad is not None


# ------------------------------------------- split backward on arbitrary graphs


class RandomGraph(nn.Module):
    """A small random computation over stage inputs and weights (reuse, skips, branches)."""

    def __init__(self, program, outputs, n_weights):
        super().__init__()
        self.program = program
        self.outputs = outputs
        self.weight = nn.ParameterList(nn.Parameter(torch.randn(4, 4) * 0.5)
                                       for _ in range(n_weights))

    def forward(self, *inputs):
        values = list(inputs)
        for op, a, b in self.program:
            x = values[a]
            if op == "matmul":
                values.append(x @ self.weight[b])
            elif op == "scale":
                values.append(x * self.weight[b][0])
            elif op == "tanh":
                values.append(torch.tanh(x))
            elif op == "add":
                values.append(x + values[b])
            else:  # "weights": a value that depends on weights only
                values.append(self.weight[b] @ self.weight[a % len(self.weight)])
        return tuple(values[i] for i in self.outputs)


@st.composite
def _graphs(draw):
    n_inputs = draw(st.integers(1, 3))
    n_weights = draw(st.integers(1, 3))
    program = []
    for step in range(draw(st.integers(1, 7))):
        available = n_inputs + step
        op = draw(st.sampled_from(["matmul", "scale", "tanh", "add", "weights"]))
        program.append((op, draw(st.integers(0, available - 1)),
                        draw(st.integers(0, (available if op == "add" else n_weights) - 1))))
    n_values = n_inputs + len(program)
    outputs = draw(st.lists(st.integers(0, n_values - 1), min_size=1, max_size=3, unique=True))
    first = draw(st.booleans())
    return n_inputs, n_weights, program, outputs, first


def _check_split_equals_full(n_inputs, n_weights, program, outputs, first, seed):
    torch.manual_seed(seed)
    full_module = RandomGraph(program, outputs, n_weights)
    split_module = copy.deepcopy(full_module)
    inputs = tuple(torch.randn(4, 4) for _ in range(n_inputs))
    index = 0 if first else 1
    full, halves = Stage(full_module, index, 3), Stage(split_module, index, 3)
    out = full.forward(0, inputs)
    halves.forward(0, inputs)
    grads = tuple(torch.randn(o.shape) for o in out)
    expected = full.backward(0, grads)
    got = halves.backward_input(0, grads)
    halves.backward_weight(0)
    if first:
        assert got is None and expected is None
    else:
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    for (name, p), q in zip(full_module.named_parameters(), split_module.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)


@given(graph=_graphs(), seed=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_split_backward_equals_backward_on_random_graphs(graph, seed):
    _check_split_equals_full(*graph, seed)
