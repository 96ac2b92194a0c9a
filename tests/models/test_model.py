"""The reference transformer, its split into pipeline chunks, shared parameters and the loss."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatched_ops import DispatchedOps
from meshpipe.context import LocalAttention, RingAttention, UlyssesAttention
from meshpipe.models import (SharedParameter, Transformer, TransformerConfig, causal_lm_loss,
                             shared_parameters, split)
from meshpipe.schedules.placement import balanced_layers
from meshpipe.testing import run_distributed

SMALL = TransformerConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                          max_seq_len=64)


pytestmark = pytest.mark.usefixtures("one_thread")

def _tokens(batch=2, seq=12, vocab=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator)


def _chain(chunks, tokens, positions=None, doc_ids=None):
    message = (tokens, positions, doc_ids)
    for chunk in chunks:
        message = chunk(*message)
    return message


def _grads(model):
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_forward_shapes_and_gqa_head_counts():
    model = Transformer(SMALL)
    logits = model(_tokens())
    assert logits.shape == (2, 12, 64) and logits.dtype == torch.float32
    attention = model.layers[0].attention
    assert attention.wq.weight.shape == (32, 32)
    assert attention.wk.weight.shape == (16, 32)  # 2 kv heads of dim 8
    assert model.layers[0].mlp.w_gate.weight.shape == (SMALL.ffn_width, 32)


def test_init_is_a_function_of_the_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = Transformer(SMALL), Transformer(SMALL)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    other = Transformer(TransformerConfig(**{**SMALL.__dict__, "init_seed": 1}))
    assert not torch.equal(a.embedding.weight, other.embedding.weight)


def test_a_parameters_initial_values_do_not_depend_on_the_others_nor_on_threads():
    """Each parameter draws from its own generator (seeded from the seed and its name): a
    larger vocabulary adds rows to the embedding and the head and changes nothing else, and
    the threads that draw the parameters change nothing."""
    small = Transformer(SMALL)
    wide = Transformer(TransformerConfig(**{**SMALL.__dict__, "vocab_size": 96}))
    wide_names = dict(wide.named_parameters())
    for name, param in small.named_parameters():
        assert torch.equal(param, wide_names[name][:len(param)]), name
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other_threads = Transformer(SMALL)
    finally:
        torch.set_num_threads(threads)
    for (name, a), b in zip(small.named_parameters(), other_threads.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("stages, tie", [({1}, False), ({0}, False), ({3}, True), ({0, 3}, False)],
                         ids=["middle", "first", "last-tied", "wrap-around"])
def test_a_rank_builds_only_its_stages_parts_with_the_whole_models_values(stages, tie):
    """The parameters of a rank's chunks are real and equal to the whole model's; every
    other is on the meta device (no memory, nothing drawn)."""
    from meshpipe.models import split
    from meshpipe.models.split import held_by_stages

    config = TransformerConfig(**{**SMALL.__dict__, "tie_embeddings": tie})
    whole = dict(Transformer(config).named_parameters())
    model = Transformer(config, held=held_by_stages([1, 1, 1, 1], stages, tie))
    chunks = split(model, 4, [1, 1, 1, 1])
    mine = {id(p) for stage in stages for p in chunks[stage].parameters()}
    for name, param in model.named_parameters():
        if id(param) in mine:
            assert torch.equal(param, whole[name]), name
        else:
            assert param.is_meta, name
    assert mine


def test_a_model_built_under_the_meta_device_stays_a_skeleton():
    with torch.device("meta"):
        model = Transformer(SMALL)
    assert all(param.is_meta for param in model.parameters())
    assert sum(param.numel() for param in model.parameters()) == sum(
        param.numel() for param in Transformer(SMALL).parameters())


def test_init_from_the_global_rng_when_no_seed():
    config = TransformerConfig(**{**SMALL.__dict__, "init_seed": None})
    torch.manual_seed(5)
    a = Transformer(config)
    torch.manual_seed(5)
    b = Transformer(config)
    c = Transformer(config)
    assert torch.equal(a.layers[1].mlp.w_up.weight, b.layers[1].mlp.w_up.weight)
    assert not torch.equal(a.layers[1].mlp.w_up.weight, c.layers[1].mlp.w_up.weight)


@pytest.mark.parametrize("bad, message", [
    ({"dim": 30}, "multiple of n_heads"),
    ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
    ({"n_layers": 0}, "n_layers must be positive"),
    ({"dim": 12, "n_heads": 4}, "even head dimension"),
])
def test_config_rejects_inconsistent_sizes(bad, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**SMALL.__dict__, **bad})


def test_tied_embeddings_share_one_tensor():
    model = Transformer(TransformerConfig(**{**SMALL.__dict__, "tie_embeddings": True}))
    assert model.head.weight is model.embedding.weight


def test_packed_documents_equal_separate_runs():
    """positions and doc_ids reach RoPE and the mask: a packed row is its documents run alone."""
    model = Transformer(SMALL)
    first, second = _tokens(1, 7, seed=1), _tokens(1, 5, seed=2)
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])
    doc_ids = torch.tensor([0] * 7 + [1] * 5)
    logits = model(packed, positions, doc_ids)
    torch.testing.assert_close(logits[:, :7], model(first))
    torch.testing.assert_close(logits[:, 7:], model(second))


def test_rope_follows_positions_not_offsets():
    """A suffix run with its true positions matches the same tokens inside the full sequence,
    for an "attention" that returns the rotated queries (isolating RoPE from the mask)."""
    def rotated_queries(q, k, v, *, positions=None, doc_ids=None, causal=True):
        return q
    model = Transformer(SMALL, attention=rotated_queries)
    tokens = _tokens(1, 10)
    full = model(tokens)
    suffix = model(tokens[:, 6:], positions=torch.arange(6, 10))
    torch.testing.assert_close(suffix, full[:, 6:])
    shifted = model(tokens[:, 6:])
    assert not torch.allclose(shifted, full[:, 6:])


def test_attention_is_pluggable_and_gets_positions():
    """Every layer's attention gets the positions given, and None for a plain sequence
    (the contract's ``0..seq-1``), with the same result."""
    calls = []
    local = LocalAttention()

    def spy(q, k, v, *, positions=None, doc_ids=None, causal=True):
        calls.append((q.shape, k.shape, positions, doc_ids, causal))
        return local(q, k, v, positions=positions, doc_ids=doc_ids, causal=causal)
    reference = Transformer(SMALL)
    model = Transformer(SMALL, attention=spy)
    tokens, given = _tokens(), torch.arange(12)
    torch.testing.assert_close(model(tokens), reference(tokens))
    torch.testing.assert_close(model(tokens, positions=given), reference(tokens))
    assert len(calls) == 2 * SMALL.n_layers
    q_shape, k_shape, positions, doc_ids, causal = calls[0]
    assert q_shape == (2, 12, 4, 8) and k_shape == (2, 12, 2, 8)
    assert positions is None and doc_ids is None and causal
    assert all(call[2] is given for call in calls[SMALL.n_layers:])


@pytest.mark.parametrize("num_stages, layers, tie", [
    (1, None, False), (2, None, True), (3, None, False), (4, None, True),
    (3, [0, 4, 0], True), (4, [1, 0, 3, 0], False),
])
def test_chained_chunks_equal_the_full_model(num_stages, layers, tie):
    config = TransformerConfig(**{**SMALL.__dict__, "tie_embeddings": tie})
    tokens, targets = _tokens(seed=3), _tokens(seed=4)
    positions = torch.cat([torch.arange(5), torch.arange(7)])
    doc_ids = torch.tensor([0] * 5 + [1] * 7)

    reference = Transformer(config)
    expected = reference(tokens, positions, doc_ids)
    causal_lm_loss(expected, targets).backward()

    model = Transformer(config)
    chunks = split(model, num_stages, layers)
    logits = _chain(chunks, tokens, positions, doc_ids)
    causal_lm_loss(logits, targets).backward()

    assert torch.equal(logits, expected)
    expected_grads = _grads(reference)
    for name, grad in _grads(model).items():
        assert torch.equal(grad, expected_grads[name]), name


def test_chunks_keep_the_full_model_parameter_names():
    model = Transformer(SMALL)
    chunks = split(model, 3)
    names = [name for chunk in chunks for name, _ in chunk.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    assert [chunk.layer_range for chunk in chunks] == [(0, 2), (2, 3), (3, 4)]
    assert "layers.2.mlp.w_up.weight" in dict(chunks[1].named_parameters())


def test_middle_chunks_pass_positions_and_doc_ids_along():
    model = Transformer(SMALL)
    chunks = split(model, 2)
    positions, doc_ids = torch.arange(12), torch.zeros(12, dtype=torch.int64)
    hidden, out_positions, out_doc_ids = chunks[0](_tokens(), positions, doc_ids)
    assert hidden.shape == (2, 12, 32)
    assert out_positions is positions and out_doc_ids is doc_ids
    assert chunks[0](_tokens())[1:] == (None, None)


@given(n_layers=st.integers(1, 40), num_stages=st.integers(1, 40))
@settings(max_examples=60, deadline=None)
def test_balanced_layers_are_even_and_front_loaded(n_layers, num_stages):
    counts = balanced_layers(n_layers, num_stages)
    assert len(counts) == num_stages and sum(counts) == n_layers
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)


@pytest.mark.parametrize("args, error, message", [
    ((5,), ValueError, "cannot balance 4 layers over 5 stages"),
    ((0,), ValueError, "positive int"),
    ((2, [1, 2]), ValueError, "summing to the model's 4 layers"),
    ((2, [1, 2, 1]), ValueError, "3 entries for 2 stages"),
    ((2, [5, -1]), ValueError, "non-negative"),
])
def test_split_rejects_bad_layouts(args, error, message):
    with pytest.raises(error, match=message):
        split(Transformer(SMALL), *args)


def test_split_rejects_other_modules():
    with pytest.raises(TypeError, match="meshpipe Transformer"):
        split(torch.nn.Linear(2, 2), 2)


def test_shared_parameters_name_the_tied_head_on_both_stages():
    tied = TransformerConfig(**{**SMALL.__dict__, "tie_embeddings": True})
    chunks = split(Transformer(tied), 3)
    assert shared_parameters(chunks) == [
        SharedParameter(((0, "embedding.weight"), (2, "head.weight")))]
    assert shared_parameters(chunks)[0].stages == (0, 2)
    assert shared_parameters(split(Transformer(tied), 1)) == []
    assert shared_parameters(split(Transformer(SMALL), 3)) == []


def test_tied_stages_summing_their_grads_equal_the_tied_model():
    """What the runtime does for a SharedParameter: two ranks' copies, gradients summed."""
    tied = TransformerConfig(**{**SMALL.__dict__, "tie_embeddings": True})
    tokens, targets = _tokens(seed=5), _tokens(seed=6)
    reference = Transformer(tied)
    causal_lm_loss(reference(tokens), targets).backward()

    first_rank, last_rank = Transformer(tied), Transformer(tied)
    chunks = [split(first_rank, 2)[0], split(last_rank, 2)[1]]
    causal_lm_loss(_chain(chunks, tokens), targets).backward()
    (shared,) = shared_parameters(split(Transformer(tied), 2))
    copies = [dict(chunks[stage].named_parameters())[name] for stage, name in shared.locations]
    assert copies[0] is not copies[1]
    summed = copies[0].grad + copies[1].grad
    torch.testing.assert_close(summed, reference.embedding.weight.grad)


def test_causal_lm_loss_mean_matches_cross_entropy():
    logits = torch.randn(2, 6, 10)
    targets = torch.randint(0, 10, (2, 6))
    expected = F.cross_entropy(logits.reshape(12, 10), targets.reshape(12))
    torch.testing.assert_close(causal_lm_loss(logits, targets), expected)


def test_causal_lm_loss_sums_and_counts_normalise_across_shards():
    """Summing (loss, count) over sequence shards and dividing once is the unsharded mean."""
    logits = torch.randn(2, 8, 10)
    targets = torch.randint(0, 10, (2, 8))
    targets[0, :3] = -100
    targets[1, 6] = -100
    whole = causal_lm_loss(logits, targets)
    shards = [causal_lm_loss(logits[:, i:i + 4], targets[:, i:i + 4], reduction="sum")
              for i in (0, 4)]
    total = sum(loss for loss, _ in shards)
    count = sum(count for _, count in shards)
    assert int(count) == 12
    torch.testing.assert_close(total / count, whole)


def _float32_saved(fn):
    """``fn()``'s result, and the largest float32 tensor autograd saved for its backward."""
    largest = [0]

    def pack(tensor):
        if tensor.dtype == torch.float32:
            largest[0] = max(largest[0], tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, largest[0]


def test_the_chunked_loss_is_exact_and_keeps_no_float32_copy_of_the_logits():
    """Over chunks of 8 of 40 positions, bf16 logits of a 64-token vocabulary: the same loss
    and gradients as one cross-entropy, and autograd keeps one chunk's float32 log-softmax
    at most (the plain loss keeps all 40 x 64)."""
    logits = torch.randn(2, 20, 64).to(torch.bfloat16)
    targets = torch.randint(0, 64, (2, 20))
    targets[1, 5:9] = -100
    plain_logits, chunked_logits = (logits.clone().requires_grad_() for _ in range(2))
    plain, plain_saved = _float32_saved(
        lambda: F.cross_entropy(plain_logits.float().reshape(40, 64), targets.reshape(40),
                                reduction="sum"))
    (chunked, count), chunked_saved = _float32_saved(
        lambda: causal_lm_loss(chunked_logits, targets, reduction="sum", chunk_tokens=8))
    torch.testing.assert_close(chunked, plain)
    assert int(count) == 36
    plain.backward()
    chunked.backward()
    torch.testing.assert_close(chunked_logits.grad, plain_logits.grad)
    assert plain_saved == 40 * 64 and chunked_saved <= 8 * 64
    with torch.no_grad():
        torch.testing.assert_close(causal_lm_loss(logits, targets, chunk_tokens=8),
                                   plain.detach() / 36)


def test_causal_lm_loss_rejects_bad_arguments():
    with pytest.raises(ValueError, match="need targets of shape"):
        causal_lm_loss(torch.randn(2, 6, 10), torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="reduction"):
        causal_lm_loss(torch.randn(2, 6, 10), torch.zeros(2, 6, dtype=torch.int64), reduction="x")


def test_positions_of_the_wrong_length_negative_or_beyond_max_seq_len_are_rejected():
    with pytest.raises(ValueError, match=r"positions must have shape \[12\]"):
        Transformer(SMALL)(_tokens(), positions=torch.arange(11))
    with pytest.raises(ValueError, match="raise TransformerConfig.max_seq_len"):
        Transformer(SMALL)(_tokens(), positions=torch.arange(60, 72))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        Transformer(SMALL)(_tokens(), positions=torch.arange(-1, 11))


def test_a_reused_positions_tensor_is_read_back_once(monkeypatch):
    """Checking positions reads a value back from the device: once per tensor, so a
    loader's reused positions cost no synchronisation per microbatch; a changed one is
    checked again."""
    reads = []
    lowest = torch.Tensor.min
    monkeypatch.setattr(torch.Tensor, "min", lambda self, *a: reads.append(1) or lowest(self, *a))
    model, positions = Transformer(SMALL), torch.arange(12)
    for _ in range(3):
        model(_tokens(), positions=positions)
    assert len(reads) == 1
    positions[0] = -1
    with pytest.raises(ValueError, match="positions must be >= 0"):
        model(_tokens(), positions=positions)


def test_a_model_without_positions_derives_nothing_from_a_layout(monkeypatch):
    """Without positions the sequence is plain (``0..seq-1``): attention does not work out
    whether it is (on a GPU that reads the device back, or a host copy), and RoPE takes its
    tables' first rows, a view, where positions are looked up with an index kernel."""
    from meshpipe.context import local

    calls = []
    plain = local.is_plain_sequence
    monkeypatch.setattr(local, "is_plain_sequence",
                        lambda *args: calls.append(1) or plain(*args))
    model = Transformer(SMALL)
    with DispatchedOps() as ops:
        without = model(_tokens())
    assert calls == [] and ops.called.count("aten.index") == 0
    with DispatchedOps() as ops:
        given = model(_tokens(), positions=torch.arange(12))
    # The cos and sin rows, once for every layer.
    assert calls == [1] and ops.called.count("aten.index") == 2
    torch.testing.assert_close(without, given, rtol=0, atol=0)


def _zigzag(seq, rank, world):
    """Chunks ``rank`` and ``2 * world - 1 - rank`` of ``2 * world`` equal chunks."""
    chunk = seq // (2 * world)
    mirror = 2 * world - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange(mirror * chunk, (mirror + 1) * chunk)])


def _context_parallel_rank(rank, world_size, seq):
    """Each rank runs the model on its slice with its positions; loss normalised globally."""
    import torch.distributed as dist
    tokens, targets = _tokens(2, seq, seed=8), _tokens(2, seq, seed=9)
    layouts = {
        "ring, zigzag": (RingAttention(), _zigzag(seq, rank, world_size)),
        "ulysses, contiguous": (UlyssesAttention(),
                                torch.arange(seq).chunk(world_size)[rank]),
    }
    results = {}
    for name, (attention, positions) in layouts.items():
        model = Transformer(SMALL, attention=attention)
        logits = model(tokens[:, positions], positions)
        loss_sum, count = causal_lm_loss(logits, targets[:, positions], reduction="sum")
        dist.all_reduce(count)
        (loss_sum / count).backward()
        grads = {}
        for param_name, param in model.named_parameters():
            dist.all_reduce(param.grad)
            grads[param_name] = param.grad
        total = loss_sum.detach() / count
        dist.all_reduce(total)
        results[name] = (positions, logits.detach(), total, grads)
    return results


@pytest.mark.distributed
def test_context_parallel_ranks_with_their_positions_equal_the_full_model():
    """RoPE and the mask follow positions: zigzag (ring) and contiguous (Ulysses) slices give
    the full model's logits, loss and (summed) gradients."""
    seq = 16
    reference = Transformer(SMALL)
    tokens, targets = _tokens(2, seq, seed=8), _tokens(2, seq, seed=9)
    logits = reference(tokens)
    loss = causal_lm_loss(logits, targets)
    loss.backward()
    for per_rank in zip(*(r.values() for r in run_distributed(2, _context_parallel_rank, seq))):
        for positions, rank_logits, total, grads in per_rank:
            torch.testing.assert_close(rank_logits, logits.detach()[:, positions])
            torch.testing.assert_close(total, loss.detach())
            _assert_grads_close(grads, reference)


def _assert_grads_close(grads, model):
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


@pytest.mark.parametrize("older_torch", [False, True], ids=["this-torch", "torch-2.6"])
@pytest.mark.parametrize(("dtype", "gain_dtype"), [(torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32)])
def test_rms_norm_is_torchs_one_call_and_equals_the_formula(monkeypatch, dtype, gain_dtype,
                                                            older_torch):
    """The norm is one call of torch's ``rms_norm`` with the gain (one fused kernel on CUDA,
    where the formula written out launches five and casts around them): bit for bit the
    formula in float32, and in bf16 the formula computed in float32 and rounded once; the
    bf16 call takes the bf16 activations as they are (``--dtype bf16``'s weights are bf16)
    where torch computes them in float32 (2.8 on), else their float32 copy."""
    from meshpipe.models.transformer import RMSNorm

    if older_torch:
        monkeypatch.setattr(RMSNorm, "torch_computes_in_float32", False)
    calls = []
    original = F.rms_norm
    monkeypatch.setattr(F, "rms_norm",
                        lambda *a, **k: calls.append(a[0].dtype) or original(*a, **k))
    norm = RMSNorm(64, 1e-5)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    norm.to(gain_dtype)
    x = torch.randn(2, 16, 64).to(dtype)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    formula = (normed * norm.weight.float()).to(dtype)
    assert torch.equal(norm(x), formula)
    as_they_are = gain_dtype == dtype and RMSNorm.torch_computes_in_float32
    assert calls == [dtype if as_they_are else torch.float32]


def test_rotary_tables_are_looked_up_once_per_positions_tensor():
    """Every query and key of every layer rotates by the same rows of the tables: two lookups
    (cos and sin) per positions tensor, not four a layer; a reused tensor none again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountLookups(TorchDispatchMode):
        lookups = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountLookups.lookups += func.overloadpacket is torch.ops.aten.index
            return func(*args, **(kwargs or {}))

    model, positions = Transformer(SMALL), torch.arange(12)
    with CountLookups():
        first = model(_tokens(), positions=positions)
        again = model(_tokens(), positions=positions)
        other = model(_tokens(), positions=torch.arange(12))
    assert SMALL.n_layers > 1 and CountLookups.lookups == 4
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(other, first, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_embedding_turns_each_pair_in_two_products(dtype):
    """RoPE turns each pair (first, second) into (first cos - second sin, second cos + first
    sin) in the input's dtype, bit for bit, values and gradients, with two elementwise
    products where the pairs written out take four, and no cast or negation of the input
    forward or backward (kernel launches bound a GPU step); in low precision it stays within that
    precision's rounding of the float32 rotation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshpipe.models.rotary import RotaryEmbedding

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.products = self.casts = self.negations = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.products += func is torch.ops.aten.mul.Tensor
            self.negations += func.overloadpacket is torch.ops.aten.neg
            self.casts += func.overloadpacket is torch.ops.aten._to_copy and \
                args[0].dim() == 4  # the queries, not the table rows
            return func(*args, **(kwargs or {}))

    rope = RotaryEmbedding(16, 10000.0, 64)
    x = torch.randn(2, 24, 3, 16).to(dtype).requires_grad_()
    positions = torch.randint(0, 64, (24,))
    grad = torch.randn(2, 24, 3, 16).to(dtype)
    with CountOps() as counted:
        out = rope(x, positions)
        (rotated_grad,) = torch.autograd.grad(out, x, grad)
    # forward and backward
    assert (counted.products, counted.casts, counted.negations) == (2 + 2, 0, 0)
    cos, sin = (t[positions, 8:][None, :, None, :].to(dtype)
                for t in (rope.cos, rope.sin_signed))
    first, second = x.chunk(2, dim=-1)
    pairs = torch.cat((first * cos - second * sin, second * cos + first * sin), -1)
    assert torch.equal(out, pairs)
    assert torch.equal(rotated_grad, torch.autograd.grad(pairs, x, grad)[0])
    exact = rope(x.detach().float(), positions)
    torch.testing.assert_close(out.float(), exact, **_ROUNDING[dtype])


# Elementwise relative error of a few roundings at each dtype's precision.
_ROUNDING = {torch.float32: dict(rtol=0, atol=0), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=3e-3, atol=3e-3)}


def test_grouped_loss_sums_split_the_loss_sum_by_group():
    """A mixture's per-source loss sums: they add up to causal_lm_loss's sum, chunk by chunk
    with the same gradients, and each is the sum over its group's counted targets."""
    from meshpipe.models.loss import grouped_loss_sums

    torch.manual_seed(0)
    logits = torch.randn(2, 9, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 9))
    targets[0, :3] = -100
    groups = torch.randint(0, 3, (2, 9))
    sums = grouped_loss_sums(logits, targets, groups, 3, chunk_tokens=4)
    (grad_grouped,) = torch.autograd.grad(sums.sum(), logits)
    whole, _ = causal_lm_loss(logits, targets, reduction="sum")
    (grad_whole,) = torch.autograd.grad(whole, logits)
    torch.testing.assert_close(sums.sum(), whole)
    torch.testing.assert_close(grad_grouped, grad_whole)
    for group in range(3):
        kept = torch.where(groups == group, targets, torch.full_like(targets, -100))
        torch.testing.assert_close(sums[group],
                                   causal_lm_loss(logits, kept, reduction="sum")[0])


def _build_with_its_peak(rank, world_size, config: dict, group: str):
    """Build a model whose tensor-parallel (``group`` "tp") or expert-parallel ("ep") group
    is every rank; returns the peak bytes of the build beyond the start, the bytes of the
    model's real parameters, the largest whole parameter's bytes, and which real parameters
    differ from the whole model's part."""
    import torch.distributed as dist

    from malloc_probe import peak_bytes_during
    from meshpipe.parallel import own_shard, shard_dim, shard_parts

    torch.set_num_threads(1)  # the draws run on this thread, where the probe reads
    config = TransformerConfig(**config)
    groups = {"tp_group" if group == "tp" else "ep_group": dist.group.WORLD}
    model, peak = peak_bytes_during(lambda: Transformer(config, **groups))
    real = [(name, p) for name, p in model.named_parameters() if not p.is_meta]
    whole = dict(Transformer(config).named_parameters())
    differ = [name for name, p in real
              if not torch.equal(p, whole[name] if shard_dim(p) is None else own_shard(
                  whole[name], shard_dim(p), rank, world_size, shard_parts(p)))]
    return {"peak": peak, "real": sum(p.numel() * 4 for _, p in real),
            "largest": max(p.numel() * 4 for p in whole.values()), "differ": differ,
            "count": len(real)}


@pytest.mark.distributed
@pytest.mark.parametrize("group, config", [
    ("tp", dict(vocab_size=256, dim=256, n_layers=4, n_heads=4)),
    ("ep", dict(vocab_size=256, dim=256, n_layers=2, n_heads=4, moe_experts=4, moe_top_k=2)),
], ids=["tensor-parallel-shards", "expert-parallel-experts"])
def test_a_rank_draws_only_its_shards_and_experts_with_the_whole_models_values(group, config):
    """Sharding happens on the meta skeleton: a rank's build never holds more than its own
    shards or experts and one whole parameter being drawn (the old build held every whole
    layer, or every expert, before cutting), and their values are the whole model's."""
    for result in run_distributed(2, _build_with_its_peak, config, group):
        assert result["count"] > 0 and result["differ"] == []
        assert result["peak"] <= result["real"] + result["largest"] + 2**20, result
