"""A layer's experts as grouped products (``models.grouped_experts``) against one by one; the
one host read per layer and microbatch; which runs lay out, and their parity in training."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dispatched_ops import DispatchedOps
from meshpipe.models import grouped_experts
from meshpipe.models.mlp import SwiGLU
from meshpipe.models.moe import MoE

pytestmark = pytest.mark.skipif(not grouped_experts.available(),
                                reason="this torch has no grouped matrix product")

DIM, HIDDEN, EXPERTS = 32, 48, 8


def _moe(top_k: int, capacity_factor: float = 0.0, dtype=torch.float32) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k, capacity_factor)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.2)
    return moe.to(dtype)


def _step(moe: MoE, x: torch.Tensor, upstream: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    y, aux = moe(x)
    (y.float() * upstream).sum().add(0.5 * aux).backward()
    return y, aux, x.grad, {name: p.grad.clone() for name, p in moe.named_parameters()}


class _ExpertCalls:
    """Counts the experts' own forwards (the one-by-one path)."""

    def __init__(self, monkeypatch):
        self.count = 0
        forward = SwiGLU.forward

        def counted(module, x):
            self.count += 1
            return forward(module, x)

        monkeypatch.setattr(SwiGLU, "forward", counted)


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 0.0), (2, 0.0), (3, 0.0), (2, 0.75)])
def test_grouped_products_give_the_one_by_one_values(top_k, capacity_factor, monkeypatch):
    apart = _moe(top_k, capacity_factor)
    grouped = copy.deepcopy(apart)
    assert grouped_experts.lay_out([grouped]) == 1
    x, upstream = torch.randn(2, 12, DIM), torch.randn(2, 12, DIM)
    calls = _ExpertCalls(monkeypatch)
    want = _step(apart, x, upstream)
    assert calls.count == EXPERTS
    got = _step(grouped, x, upstream)
    assert calls.count == EXPERTS, "the laid-out layer ran its experts one by one"
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    assert got[3].keys() == want[3].keys()
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], msg=name)
    assert any(g.abs().sum() > 0 for name, g in got[3].items() if ".w_down." in name)


def _ops_of_a_microbatch(experts: int, grouped: bool) -> int:
    moe = MoE(DIM, HIDDEN, experts, top_k=4)
    if grouped:
        grouped_experts.lay_out([moe])
    x = torch.randn(1, 64, DIM, requires_grad=True)
    with DispatchedOps() as ops:
        y, aux = moe(x)
        (y.square().sum() + aux).backward()
    return len(ops.computing)


def test_a_grouped_layer_computes_in_as_many_operators_whatever_its_experts():
    """Forward and backward of a layer and microbatch: one by one, the operators grow with
    the experts, about 15 each (194, 1,034 and 1,994 at 8, 64 and 128 experts, top-8, dim 64,
    512 tokens, when measured); grouped, 87 at every count."""
    grouped = {experts: _ops_of_a_microbatch(experts, True) for experts in (8, 64)}
    apart = {experts: _ops_of_a_microbatch(experts, False) for experts in (8, 64)}
    assert grouped[8] == grouped[64]
    assert apart[64] > apart[8] + 56 * 9 and grouped[8] < apart[8]


def test_grouped_products_in_bf16_give_the_one_by_one_values():
    apart = _moe(2, dtype=torch.bfloat16)
    grouped = copy.deepcopy(apart)
    assert grouped_experts.lay_out([grouped]) == 1
    x, upstream = torch.randn(2, 12, DIM, dtype=torch.bfloat16), torch.randn(2, 12, DIM)
    want, got = _step(apart, x, upstream), _step(grouped, x, upstream)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0])
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], msg=name)


def test_laying_out_keeps_the_parameters_and_a_weight_given_new_data_goes_one_by_one(
        monkeypatch):
    moe = _moe(2)
    before = {name: (param, param.detach().clone()) for name, param in moe.named_parameters()}
    grouped_experts.lay_out([moe])
    for name, param in moe.named_parameters():
        assert param is before[name][0] and torch.equal(param, before[name][1]), name
    gate_up = [moe.experts[str(e)].w_gate.weight for e in range(EXPERTS)]
    assert len({w.untyped_storage().data_ptr() for w in gate_up}) == 1
    rows = torch.randn(5, DIM)
    assert grouped_experts.ready(moe, rows)
    with torch.no_grad():
        moe.experts["3"].w_up.weight.data = moe.experts["3"].w_up.weight.clone()
    assert not grouped_experts.ready(moe, rows)
    calls = _ExpertCalls(monkeypatch)
    moe(torch.randn(1, 4, DIM))
    assert calls.count == EXPERTS


def test_a_layer_given_no_rows_runs_its_experts_one_by_one():
    moe = _moe(2)
    grouped_experts.lay_out([moe])
    assert not grouped_experts.ready(moe, torch.randn(0, DIM))
    x = torch.randn(1, 0, DIM, requires_grad=True)
    y, _ = moe(x)
    y.sum().backward()
    assert y.shape == (1, 0, DIM)
    assert all(p.grad is None or not p.grad.any() for n, p in moe.named_parameters()
               if n.startswith("experts."))


def test_a_layer_the_kernels_cannot_take_is_left_as_it_is():
    odd = MoE(DIM, 42, EXPERTS, 2)  # 42 float32 columns: 168 bytes, not a multiple of 16
    assert grouped_experts.lay_out([odd]) == 0
    assert not getattr(odd, "grouped", False)


def _grouped_products(call) -> int:
    with DispatchedOps() as ops:
        call()
    return ops.called.count("aten._grouped_mm")


def test_a_split_backward_takes_the_grouped_products_apart():
    """The input half runs the inputs' grouped products only, the weight half the weights'
    only (two each per layer), and together they give the full backward's gradients."""
    from meshpipe.models import Transformer, TransformerConfig, split
    from meshpipe.runtime import Stage

    config = TransformerConfig(vocab_size=64, dim=DIM, n_layers=2, n_heads=4, max_seq_len=16,
                               moe_experts=4, moe_top_k=2)
    torch.manual_seed(0)
    whole, halves = Transformer(config), Transformer(config)
    halves.load_state_dict(whole.state_dict())
    stages = [Stage(split(model, 2)[1], 1, 2) for model in (whole, halves)]
    assert grouped_experts.lay_out([stage.module for stage in stages]) == 2  # a layer each
    hidden, upstream = torch.randn(2, 8, DIM), (torch.randn(2, 8, 64), torch.tensor(0.5))
    for stage in stages:
        stage.forward(0, (hidden.clone(), None, None, torch.zeros(())))
    full = _grouped_products(lambda: stages[0].backward(0, upstream))
    input_half = _grouped_products(lambda: stages[1].backward_input(0, upstream))
    assert all(p.grad is None for p in halves.parameters() if p.requires_grad)
    weight_half = _grouped_products(lambda: stages[1].backward_weight(0))
    assert (full, input_half, weight_half) == (4, 2, 2)
    for (name, want), got in zip(whole.named_parameters(), halves.parameters()):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, msg=name)


@pytest.mark.parametrize("device, dtype, runs", [
    ("cuda", torch.bfloat16, True), ("cuda", torch.float32, False),
    ("cuda", torch.float16, False), ("cpu", torch.float32, True), ("cpu", torch.bfloat16, True),
    ("meta", torch.bfloat16, False)])
def test_where_a_grouped_product_runs(device, dtype, runs):
    assert grouped_experts.supported(torch.device(device), dtype) == runs


# Operators that make the host wait for the GPU on CUDA: a scalar read, an output sized by
# the values (``nonzero``; ``bincount`` by the largest; ``repeat_interleave`` without its
# output size), and a tensor made from host values (``lift_fresh``: copied to the GPU).
_WAITING_ON_CUDA = {"aten._local_scalar_dense", "aten.nonzero", "aten.bincount",
                    "aten.masked_select", "aten.unique", "aten.lift_fresh"}


class _HostReads(TorchDispatchMode):
    """Every read of a tensor's values to the host (a ``tolist``, or an operator that waits
    for the GPU on CUDA: ``_WAITING_ON_CUDA``)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads = []
        tolist = torch.Tensor.tolist

        def counted(tensor):
            self.reads.append("tolist")
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in _WAITING_ON_CUDA or (name == "aten.repeat_interleave"
                                         and (kwargs or {}).get("output_size") is None):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grouped", [False, True], ids=["one-by-one", "grouped"])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
def test_a_layer_reads_the_host_once_per_microbatch(grouped, capacity_factor, monkeypatch):
    """The dispatch's split sizes, read once; the routing, capacity, expert split, combine and
    backward read nothing more, and call nothing that waits for the GPU on CUDA."""
    moe = _moe(2, capacity_factor)
    if grouped:
        grouped_experts.lay_out([moe])
    x = torch.randn(2, 12, DIM, requires_grad=True)
    with _HostReads(monkeypatch) as host:
        y, aux = moe(x)
        (y.square().sum() + aux).backward()
    assert host.reads == ["tolist"]


def _expert_parallel_host_reads(rank, world_size, grouped):
    import torch.distributed as dist
    from _pytest.monkeypatch import MonkeyPatch

    moe = _moe(2)
    moe.shard(dist.group.WORLD, None)
    if grouped:
        grouped_experts.lay_out([moe])
    torch.manual_seed(rank)
    x = torch.randn(2, 6, DIM, requires_grad=True)
    with MonkeyPatch.context() as patch, _HostReads(patch) as host:
        y, aux = moe(x)
        (y.square().sum() + aux).backward()
    return host.reads


@pytest.mark.distributed
@pytest.mark.parametrize("grouped", [False, True], ids=["one-by-one", "grouped"])
def test_an_expert_parallel_layer_reads_the_host_once_per_microbatch(grouped):
    from meshpipe.testing import run_distributed

    assert run_distributed(2, _expert_parallel_host_reads, grouped) == [["tolist"]] * 2


@pytest.mark.parametrize("mode, schedule, device, dtype, laid", [
    ("auto", "1f1b", "cuda", "bf16", True), ("auto", "1f1b", "cuda", "fp32", False),
    ("auto", "1f1b", "cpu", "bf16", False), ("auto", "zb-h1", "cuda", "bf16", True),
    ("on", "1f1b", "cpu", "fp32", True), ("on", "combined-1f1b", "cpu", "bf16", True),
    ("auto", "1f1b", "cuda", "fp16", False),
    ("off", "1f1b", "cuda", "bf16", False)])
def test_when_a_run_groups_its_experts(mode, schedule, device, dtype, laid):
    from meshpipe.train.config import TrainConfig
    from meshpipe.train.run import weight_layout

    config = TrainConfig(pp=2, schedule=schedule, dtype=dtype, moe_experts=4,
                         grouped_experts=mode)
    assert weight_layout.grouped_experts(config, torch.device(device)) == laid


def test_grouped_experts_on_where_they_cannot_run_is_refused_before_the_run(monkeypatch):
    from meshpipe.train.config import TrainConfig

    with pytest.raises(ValueError, match="under --dtype fp16 they are float32"):
        TrainConfig(pp=2, dtype="fp16", moe_experts=4, grouped_experts="on")
    with pytest.raises(ValueError, match="--grouped-experts applies only to mixture-of-experts"):
        TrainConfig(pp=2, grouped_experts="on")
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(ValueError, match="needs a torch with a grouped matrix product"):
        TrainConfig(pp=2, moe_experts=4, grouped_experts="on")


def _laid_out_layers(rank, world_size, config):
    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    return sorted({type(m).__name__: getattr(m, "grouped", False)
                   for stage in trainer.stages.values() for m in stage.module.modules()
                   if hasattr(m, "local_experts")}.items())


@pytest.mark.distributed
def test_the_trainer_lays_out_the_experts_after_their_dtype():
    from meshpipe.testing import run_distributed
    from meshpipe.train.config import TrainConfig
    from trainer_cases import SMALL

    config = TrainConfig(**{**SMALL, "pp": 1, "dtype": "bf16", "moe_experts": 4,
                            "grouped_experts": "on"})
    assert run_distributed(1, _laid_out_layers, config) == [[("MoE", True)]]
