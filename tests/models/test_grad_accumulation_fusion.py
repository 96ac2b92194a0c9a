"""Gradient-accumulation fusion (``--grad-accumulation-fusion``, ``models.master_grads``):
under bf16 weights with float32 masters, a linear layer's product (an embedding's lookup, a
layer's grouped experts) adds its weight's gradient straight into the master's gradient,
summed in float32, and the weight gets no ``.grad``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshpipe.models import Transformer, TransformerConfig, joint, master_grads
from meshpipe.models.mlp import SwiGLU
from meshpipe.parallel import VocabParallelEmbedding
from meshpipe.runtime import MasterWeights

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           max_seq_len=16)


def _masters_of(module: nn.Module) -> MasterWeights:
    return MasterWeights(module.named_parameters(), torch.bfloat16)


def _float32_gradient(inputs, upstreams) -> torch.Tensor:
    """A linear weight's gradient over microbatches, from bf16 operands summed in float32."""
    return sum(g.float().reshape(-1, g.shape[-1]).t() @ x.float().reshape(-1, x.shape[-1])
               for x, g in zip(inputs, upstreams))


@pytest.mark.parametrize("fused", [True, False])
def test_a_fused_linear_adds_its_gradient_into_the_master_in_float32(fused):
    """Without fusion the bf16 gradient of each microbatch is rounded before the master
    sums it: the float32 sum of the operands then differs by more than fusion's rounding."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 24, bias=True)
    masters = _masters_of(linear)
    if fused:
        assert master_grads.fuse([linear], masters.own_masters) == 1
        assert isinstance(linear, nn.Linear) and type(linear) is master_grads.FusedLinear
    inputs = [torch.randn(3, 5, 48, dtype=torch.bfloat16) for _ in range(2)]
    upstreams = [torch.randn(3, 5, 24, dtype=torch.bfloat16) for _ in range(2)]
    for x, g in zip(inputs, upstreams):
        x.requires_grad_(True)
        out = linear(x)
        out.backward(g)
        torch.testing.assert_close(x.grad, g @ linear.weight)
    master = masters.master_of(linear.weight)
    expected = _float32_gradient(inputs, upstreams)
    assert linear.weight.grad is None and linear.bias.grad is None  # moved into the masters
    torch.testing.assert_close(masters.master_of(linear.bias).grad,
                               sum(g.float().sum((0, 1)) for g in upstreams),
                               rtol=2e-2, atol=1e-1)
    if fused:
        torch.testing.assert_close(master.grad, expected, rtol=1e-5, atol=1e-5)
    else:
        assert not torch.allclose(master.grad, expected, rtol=1e-5, atol=1e-5)


def test_a_joint_product_adds_into_its_masters_as_rows_of_one_matrix():
    """q/k/v laid out as one product: their masters' gradients become rows of one float32
    matrix, which the one weight-gradient product adds into."""
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    masters = _masters_of(model)
    joint.lay_out([model])
    # per layer: the joint q/k/v and gate/up, and seven linears; the head, the embedding
    assert master_grads.fuse([model], masters.own_masters) == CONFIG.n_layers * 9 + 2
    reference = Transformer(CONFIG)
    reference_masters = _masters_of(reference)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    for module in (model, reference):
        for _ in range(2):
            module(tokens).float().square().mean().backward()
    attention = model.layers[0].attention
    q, k, v = (masters.master_of(getattr(attention, name).weight).grad
               for name in ("wq", "wk", "wv"))
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    assert v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
    assert all(p.grad is None for p in model.parameters() if p.dim() == 2)
    for (name, master), (_, want) in zip(masters.named, reference_masters.named):
        # the unfused reference rounds each microbatch's gradient to bf16 first
        torch.testing.assert_close(master.grad, want.grad, rtol=2e-2,
                                   atol=2e-2 * want.grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_a_fused_embedding_adds_its_rows_into_the_master_in_float32(padding_idx):
    """No whole ``[vocabulary, dim]`` gradient: the lookup's rows go into the master's
    gradient, summed in float32 (repeated tokens too), none into the padding row."""
    from dispatched_ops import DispatchedOps

    torch.manual_seed(0)
    results = {}
    tokens = [torch.tensor([[1, 3, 1, 7], [3, 3, 0, 1]]), torch.tensor([[7, 1, 2, 3]])]
    upstreams = [torch.randn(*t.shape, 16).bfloat16() for t in tokens]
    for fused in (False, True):
        embedding = nn.Embedding(10, 16, padding_idx=padding_idx)
        masters = _masters_of(embedding)
        if fused:
            assert master_grads.fuse([embedding], masters.own_masters) == 1
            assert type(embedding) is master_grads.FusedEmbedding
        with DispatchedOps() as ops:
            for t, g in zip(tokens, upstreams):
                embedding(t).backward(g)
        assert embedding.weight.grad is None
        results[fused] = (masters.master_of(embedding.weight).grad,
                          "aten.embedding_dense_backward" in ops.called)
    expected = torch.zeros(10, 16)
    for t, g in zip(tokens, upstreams):
        expected.index_add_(0, t.reshape(-1), g.float().reshape(-1, 16))
    if padding_idx is not None:
        expected[padding_idx] = 0
    got, whole = results[True]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not whole and results[False][1]
    assert not torch.allclose(results[False][0], expected, rtol=1e-6, atol=1e-6)


def test_autograd_grad_of_a_fused_embedding_returns_its_gradient():
    embedding = nn.Embedding(6, 4)
    masters = _masters_of(embedding)
    master_grads.fuse([embedding], masters.own_masters)
    tokens, upstream = torch.tensor([[1, 1, 5]]), torch.randn(1, 3, 4).bfloat16()
    (grad,) = torch.autograd.grad(embedding(tokens), [embedding.weight], upstream)
    expected = torch.zeros(6, 4, dtype=torch.bfloat16).index_add_(0, tokens[0], upstream[0])
    torch.testing.assert_close(grad, expected)
    assert masters.master_of(embedding.weight).grad is None


def test_a_master_holding_another_gradient_gets_the_product_added_apart():
    """A tied embedding's hook may give the head's master its gradient first: the product
    is then computed apart and added into it."""
    weights = [nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(2, 8))]
    earlier = torch.randn(2, 8)
    weights[1].grad = earlier.clone()
    into = master_grads.GradInto(weights)
    a, b = torch.randn(6, 5, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    into(a, b)
    product = a.float() @ b.float()
    torch.testing.assert_close(weights[0].grad, product[:4])
    torch.testing.assert_close(weights[1].grad, earlier + product[4:])
    into(a, b)  # no longer rows of one matrix: apart again
    torch.testing.assert_close(weights[0].grad, 2 * product[:4])


def test_autograd_grad_of_a_fused_weight_returns_its_gradient_and_leaves_the_master():
    linear = nn.Linear(8, 4, bias=False)
    masters = _masters_of(linear)
    master_grads.fuse([linear], masters.own_masters)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    upstream = torch.randn(3, 4, dtype=torch.bfloat16)
    (grad,) = torch.autograd.grad(linear(x), [linear.weight], upstream)
    torch.testing.assert_close(grad, upstream.t() @ x)
    assert masters.master_of(linear.weight).grad is None


def test_frozen_or_float32_weights_are_not_fused():
    mlp = SwiGLU(8, 16)
    mlp.w_up.weight.requires_grad_(False)
    masters = _masters_of(mlp)
    joint.lay_out([mlp])
    # the gate/up pair has a frozen weight, and so has w_up: w_gate and w_down only
    assert master_grads.fuse([mlp], masters.own_masters) == 2
    assert not hasattr(mlp, "grads_into")
    float32 = nn.Linear(8, 8)
    assert master_grads.fuse([float32], _float32_masters(float32).own_masters) == 0


def _float32_masters(module: nn.Module) -> MasterWeights:
    return MasterWeights(module.named_parameters(), torch.float32)


def test_a_split_backward_adds_into_the_masters_in_its_weight_half_only():
    from meshpipe.models import split
    from meshpipe.runtime import Stage

    torch.manual_seed(0)
    whole, halves = Transformer(CONFIG), Transformer(CONFIG)
    halves.load_state_dict(whole.state_dict())
    stages, all_masters = [], []
    for model in (whole, halves):
        stage = Stage(split(model, 2)[1], 1, 2)
        masters = _masters_of(stage.module)
        joint.lay_out([stage.module])
        master_grads.fuse([stage.module], masters.own_masters)
        stages.append(stage)
        all_masters.append(masters)
    hidden = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    upstream = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    for stage in stages:
        stage.forward(0, (hidden.clone(), None, None))
    stages[0].backward(0, upstream)
    stages[1].backward_input(0, upstream)
    assert all(master.grad is None for master in all_masters[1].params
               if master.dim() == 2)
    stages[1].backward_weight(0)
    for (name, want), (_, got) in zip(all_masters[0].named, all_masters[1].named):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, msg=name)


@pytest.mark.parametrize("mode, dtype, compiled, device, fused", [
    ("auto", "bf16", False, "cpu", False), ("auto", "bf16", True, "cuda", True),
    ("auto", "fp32", False, "cuda", False), ("auto", "fp16", False, "cuda", False),
    ("on", "bf16", False, "cpu", True), ("on", "bf16", True, "cpu", True),
    ("off", "bf16", False, "cuda", False)])
def test_when_a_run_fuses_the_gradient_accumulation(mode, dtype, compiled, device, fused):
    from meshpipe.train.config import TrainConfig
    from meshpipe.train.run import weight_layout

    config = TrainConfig(pp=2, dtype=dtype, compile=compiled, grad_accumulation_fusion=mode)
    has_kernel = hasattr(torch.ops.aten.addmm, "dtype_out")
    expected = fused and (mode == "on" or has_kernel)
    assert weight_layout.grad_accumulation_fusion(config, torch.device(device)) == expected


def test_auto_fuses_on_cuda_where_torch_has_the_float32_output_product():
    from meshpipe.train.config import TrainConfig
    from meshpipe.train.run import weight_layout

    config = TrainConfig(pp=2, dtype="bf16")
    has_kernel = hasattr(torch.ops.aten.addmm, "dtype_out")
    assert master_grads.fused_kernel(torch.device("cuda")) == has_kernel
    assert weight_layout.grad_accumulation_fusion(config, torch.device("cuda")) == has_kernel
    assert not master_grads.fused_kernel(torch.device("cpu"))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fusion_on_without_masters_is_refused_before_the_run(dtype):
    from meshpipe.train.config import TrainConfig

    with pytest.raises(ValueError, match="only --dtype bf16 has"):
        TrainConfig(pp=2, grad_accumulation_fusion="on", dtype=dtype)


def _fused_step(rank, world_size, config):
    """The ``--check`` report of the first step, with how many linear layers were fused and
    how many products added into the masters on this rank, and how many gradients of linear
    and embedding weights autograd produced (a tied weight's counted once per use)."""
    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    modules = [m for stage in trainer.stages.values() for m in stage.module.modules()]
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    own_grads = []
    embeddings = (nn.Embedding, VocabParallelEmbedding)
    for module in modules:
        if isinstance(module, (nn.Linear, *embeddings)) and module.weight.requires_grad:
            module.weight.register_hook(lambda grad: own_grads.append(grad is not None))
    added = []
    original = master_grads.add_product
    master_grads.add_product = lambda *args: (added.append(1), original(*args))[1]
    try:
        report = trainer.check_first_step()
    finally:
        master_grads.add_product = original
    fused = sum(isinstance(m, master_grads.FusedLinear) for m in linears)
    return report, fused, len(added), sum(own_grads)


FUSED_LAYOUTS = {
    "pp2-dp2-zero2-recompute-full": dict(pp=2, dp=2, zero=2, recompute="full"),
    "pp2-vpp2-zb-v": dict(pp=2, vpp=2, schedule="zb-v"),
    "pp1-tied-joint": dict(pp=1, schedule="none", tie_embeddings=True, joint_projections="on"),
    "tp2-sequence-parallel": dict(pp=1, schedule="none", tp=2, sequence_parallel=True),
    "ep2-dp2-experts-one-by-one": dict(pp=1, schedule="none", dp=2, ep=2, moe_experts=4,
                                       moe_top_k=2, grouped_experts="off"),
    "pp2-dp2-ep2-grouped-zb-v": dict(pp=2, vpp=2, schedule="zb-v", dp=2, ep=2, moe_experts=4,
                                     moe_top_k=2, grouped_experts="on"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", FUSED_LAYOUTS.values(), ids=FUSED_LAYOUTS.keys())
def test_a_fused_step_matches_one_process(layout):
    """Every linear of every rank adds its gradient into its master once a microbatch (a
    joint product once for its weights), none reaches its weight, and the step's gradients
    match one process's."""
    from meshpipe.testing import run_distributed
    from meshpipe.train.config import TrainConfig
    from trainer_cases import SMALL

    config = TrainConfig(**{**SMALL, **layout, "dtype": "bf16",
                            "grad_accumulation_fusion": "on"})
    results = run_distributed(config.world_size, _fused_step, config)
    assert results[0][0]["passed"], results[0][0]
    for _, fused, added, own_grads in results:
        assert fused > 0 and own_grads == 0
        if layout.get("joint_projections") == "on":
            # a joint product replaces its three (q/k/v) or two (gate/up) linears'
            assert added == (fused - 3 * config.layers) * config.microbatches
        elif not config.moe_experts:  # an expert given no rows runs no product
            assert added == fused * config.microbatches


@pytest.mark.distributed
def test_a_hugging_face_model_with_biases_fuses_at_pp2(tmp_path):
    """Qwen2's q/k/v have biases, which reach their masters as before."""
    pytest.importorskip("transformers")
    from hf_models import save_tiny_model
    from meshpipe.testing import run_distributed
    from meshpipe.train.config import TrainConfig
    from trainer_cases import SMALL, for_a_model

    directory = save_tiny_model(tmp_path / "model", "qwen2")
    config = TrainConfig(**for_a_model(SMALL), pp=2, dtype="bf16", model=str(directory),
                         out_dir=str(tmp_path / "run"), grad_accumulation_fusion="on")
    results = run_distributed(config.world_size, _fused_step, config)
    assert results[0][0]["passed"], results[0][0]
    for _, fused, added, own_grads in results:
        assert fused > 0 and own_grads == 0 and added == fused * config.microbatches


def _bf16_experts(experts: int, fused: bool, seed: int = 0):
    """A MoE layer in bf16 with float32 masters, laid out for grouped products, fused or
    not; with its masters."""
    from meshpipe.models import grouped_experts
    from meshpipe.models.moe import MoE

    torch.manual_seed(seed)
    moe = MoE(32, 48, experts, top_k=4)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.2)
    masters = _masters_of(moe)
    assert grouped_experts.lay_out([moe]) == 1
    if fused:
        master_grads.fuse([moe], masters.own_masters)
    return moe, masters


def _experts_microbatch(moe, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 64, 32, generator=generator).bfloat16().requires_grad_()
    y, aux = moe(x)
    (y.float().square().sum() + aux).backward()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no grouped matrix product")
def test_grouped_experts_add_each_projections_gradient_into_the_masters_at_once():
    """Per layer and microbatch the experts' weight gradients reach the float32 masters in
    one addition per projection, not one hook and addition per weight (3E): the same
    values, as the grouped product's bf16 gradient is added either way."""
    from dispatched_ops import DispatchedOps

    results, additions = {}, {}
    for fused in (False, True):
        moe, masters = _bf16_experts(8, fused)
        _experts_microbatch(moe, 0)
        with DispatchedOps() as ops:
            _experts_microbatch(moe, 1)
        additions[fused] = ops.called.count("aten.add_")
        results[fused] = {name: master.grad for name, master in masters.named}
    for name, want in results[False].items():
        if ".experts." in name:
            torch.testing.assert_close(results[True][name], want, rtol=0, atol=0, msg=name)
    # unfused: a hook's addition per expert weight (3 x 8) and the router's; fused: one per
    # projection (the router's product adds itself, by addmm)
    assert additions[False] - additions[True] == 3 * 8 + 1 - 2


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no grouped matrix product")
def test_fused_grouped_experts_take_as_many_operators_whatever_their_count():
    from dispatched_ops import DispatchedOps

    counts = {}
    for experts in (8, 32):
        moe, _ = _bf16_experts(experts, True)
        _experts_microbatch(moe, 0)
        with DispatchedOps() as ops:
            _experts_microbatch(moe, 1)
        counts[experts] = len(ops.computing)
    assert counts[8] == counts[32]


def _fused_compiled_step(rank, world_size, config):
    import os

    from meshpipe.models.compile import BACKEND_VARIABLE

    os.environ[BACKEND_VARIABLE] = "aot_eager"
    return _fused_step(rank, world_size, config)


@pytest.mark.distributed
def test_under_compile_the_eager_head_fuses_and_the_compiled_blocks_keep_their_hooks(tmp_path):
    """The compiled blocks' linears take the plain product inside their graphs (their
    weights get a ``.grad``, which the hook moves into the masters); the head, eager, adds
    into its master once a microbatch; the step matches one process."""
    from meshpipe.testing import run_distributed
    from meshpipe.train.config import TrainConfig
    from trainer_cases import SMALL

    config = TrainConfig(**{**SMALL, "pp": 2, "dtype": "bf16", "compile": True,
                            "grad_accumulation_fusion": "on", "out_dir": str(tmp_path)})
    results = run_distributed(config.world_size, _fused_compiled_step, config)
    assert results[0][0]["passed"], results[0][0]
    (_, _, first_added, first_own), (_, _, last_added, last_own) = results
    block_linears = 7 * config.layers // 2  # a stage's
    assert first_added == 0 and first_own == block_linears * config.microbatches
    assert last_added == config.microbatches  # the head's
    assert last_own == block_linears * config.microbatches
