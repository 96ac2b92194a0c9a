"""The CUDA paths of meshpipe: run by ``make gpu-check`` (``pytest -m gpu``), skipped without CUDA.

Single-process tests: the reference model on CUDA against the CPU, a mixture-of-experts
Stage whose exchanges run on the communication thread's CUDA stream, ring attention's tile
kernel against the math kernel (every tile kind, fp32/bf16/fp16), SDPA's flash kernel at a
long sequence. Two-rank tests start one process per rank: on NCCL when there are two GPUs,
else sharing one GPU over gloo (NCCL refuses two ranks of one communicator on one GPU; then
the messages travel through host memory and the compute stays on the GPU).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from meshpipe.comm.p2p import P2PTransport
from meshpipe.context import LocalAttention, RingAttention
from meshpipe.models import Transformer, TransformerConfig, causal_lm_loss, split
from meshpipe.runtime import Stage, low_precision_tolerance
from meshpipe.runtime.substeps import CommWorker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"needs CUDA: torch {torch.__version__} sees no CUDA device "
                              f"(built for CUDA {torch.version.cuda}); run `make gpu-check` "
                              f"on a GPU machine"),
]

SMALL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)


@pytest.fixture(autouse=True)
def no_tf32():
    """Full fp32 matmuls on CUDA, so the CPU comparison can use fp32 tolerances."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def _batch(batch=2, seq=32, vocab=256, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch, seq), generator=generator),
            torch.randint(0, vocab, (batch, seq), generator=generator))


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------- one GPU

def test_transformer_forward_and_backward_on_cuda_equal_the_cpu():
    cpu_model = Transformer(TransformerConfig(**SMALL))
    cuda_model = copy.deepcopy(cpu_model).cuda()
    tokens, targets = _batch()
    results = {}
    for name, model, device in (("cpu", cpu_model, "cpu"), ("cuda", cuda_model, "cuda")):
        logits = model(tokens.to(device))
        causal_lm_loss(logits, targets.to(device)).backward()
        results[name] = logits
    torch.testing.assert_close(results["cuda"].cpu(), results["cpu"], rtol=1e-4, atol=1e-5)
    cpu_grads, cuda_grads = _grads(cpu_model), _grads(cuda_model)
    assert cpu_grads.keys() == cuda_grads.keys()
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(cuda_grads[name].cpu(), grad, rtol=1e-4, atol=1e-6, msg=name)


def _moe_loss(output, targets):
    logits, aux = output
    return causal_lm_loss(logits, targets) + 0.01 * aux


def test_moe_stage_runs_its_exchanges_on_the_cuda_comm_stream_and_matches_the_model(
        monkeypatch):
    posts = {"all": 0, "on a CUDA stream": 0}
    post, post_on_stream = CommWorker.post, CommWorker._post_on_stream

    def counting(original, key):
        def call(*args, **kwargs):
            posts[key] += 1
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(CommWorker, "post", counting(post, "all"))
    monkeypatch.setattr(CommWorker, "_post_on_stream", counting(post_on_stream,
                                                                "on a CUDA stream"))
    model = Transformer(TransformerConfig(**SMALL, moe_experts=4, moe_top_k=2)).cuda()
    reference = copy.deepcopy(model)
    stage = Stage(split(model, 1)[0], 0, 1, loss_fn=_moe_loss)
    assert stage.has_substeps
    microbatches = [_batch(seed=seed) for seed in range(2)]
    losses = []
    for index, (tokens, targets) in enumerate(microbatches):
        _, loss = stage.forward(index, (tokens.cuda(), None, None), target=targets.cuda())
        losses.append(loss)
    for index in range(len(microbatches)):
        stage.backward(index)
    # Every sub-step exchange went to the communication thread with CUDA tensors, which runs
    # it on a CUDA stream of its own.
    assert posts["all"] > 0 and posts["on a CUDA stream"] == posts["all"], posts
    for index, (tokens, targets) in enumerate(microbatches):
        expected = _moe_loss(reference(tokens.cuda()), targets.cuda())
        expected.backward()
        torch.testing.assert_close(losses[index], expected.detach())
    grads, expected_grads = _grads(model), _grads(reference)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


@pytest.mark.parametrize("mask_kind", ["causal", "none", "explicit"])
def test_ring_tiles_on_the_memory_efficient_kernel_equal_the_math_kernel(mask_kind):
    """``CUDA_EFFICIENT`` (the kernel ring attention's tiles run on CUDA) against ``MATH`` on
    the same CUDA tensors: grouped key/value heads, 37 rows (not a multiple of the op's 32-row
    log-sum-exp padding), an explicit mask with 21 columns (not 16-aligned)."""
    from meshpipe.context.blockwise import CAUSAL, CUDA_EFFICIENT, MATH

    generator = torch.Generator(device="cuda").manual_seed(3)
    s_k = 37 if mask_kind == "causal" else 21
    q, grad_out = (torch.randn(2, 4, 37, 16, device="cuda", generator=generator)
                   for _ in range(2))
    k, v = (torch.randn(2, 2, s_k, 16, device="cuda", generator=generator) for _ in range(2))
    explicit = torch.rand(37, s_k, device="cuda", generator=generator) < 0.7
    explicit[:, 0] = True  # every row attends at least one key, as tiles guarantee
    mask = {"causal": CAUSAL, "none": None, "explicit": explicit}[mask_kind]

    out, lse = CUDA_EFFICIENT.forward(q, k, v, mask, 0.25)
    want_out, want_lse = MATH.forward(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-5)
    got = CUDA_EFFICIENT.backward(grad_out, q, k, v, out, lse, mask, 0.25)
    want = MATH.backward(grad_out, q, k, v, want_out, want_lse, mask, 0.25)
    for name, got_grad, want_grad in zip("qkv", got, want):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5, msg=f"d{name}")


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of this process alone (ring attention's group of one rank)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5),
             torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
             torch.float16: dict(rtol=1e-3, atol=1e-3)}


@pytest.mark.parametrize("dtype", TOLERANCE, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_ring_attention_on_its_cuda_tiles_equals_the_math_kernel(one_rank_group, monkeypatch,
                                                                 dtype, packed):
    """A ring of one rank runs the whole sequence as tiles: causal squares halved into causal
    leaves and unmasked rectangles, and with packed documents explicit masks. Output and
    q/k/v gradients on the CUDA kernels (memory-efficient in fp32, flash in bf16/fp16) equal
    those on the math kernel."""
    from meshpipe.context import ring
    from meshpipe.context.blockwise import MATH, kernel_for

    generator = torch.Generator(device="cuda").manual_seed(5)
    seq = 333  # not a multiple of the kernel's 32-row log-sum-exp padding
    q, grad = (torch.randn(2, seq, 4, 32, device="cuda", generator=generator).to(dtype)
               for _ in range(2))
    k, v = (torch.randn(2, seq, 2, 32, device="cuda", generator=generator).to(dtype)
            for _ in range(2))
    layout = {}
    if packed:
        lengths = torch.tensor([100, 7, 150, 76], device="cuda")
        doc_ids = torch.repeat_interleave(torch.arange(4, device="cuda"), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        layout = dict(positions=torch.arange(seq, device="cuda") - starts[doc_ids],
                      doc_ids=doc_ids)

    def run():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = RingAttention()(*inputs, **layout)
        out.backward(grad)
        return [out, *(t.grad for t in inputs)]

    expected = "cuda_efficient" if dtype is torch.float32 else "cuda_flash"
    assert kernel_for(q.device, dtype=dtype).name == expected
    efficient = run()
    monkeypatch.setattr(ring, "kernel_for", lambda device, softcap=None, dtype=None: MATH)
    math_kernel = run()
    for name, got, want in zip(["out", "dq", "dk", "dv"], efficient, math_kernel):
        assert got.dtype == dtype and got.isfinite().all()
        torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=name)


@pytest.mark.parametrize("dtype", TOLERANCE, ids=["fp32", "bf16", "fp16"])
def test_a_pack_on_cuda_is_one_call_equal_to_its_documents(monkeypatch, dtype):
    """On CUDA a pack runs as one call per layer: of the variable-length flash kernel in
    bf16/fp16 (context.varlen), of SDPA with its mask in fp32 (context.local._per_document);
    it equals the document-by-document path, output and q/k/v gradients."""
    from meshpipe.context import local

    generator = torch.Generator(device="cuda").manual_seed(3)
    lengths = torch.tensor([300, 17, 700, 1031], device="cuda")
    seq = int(lengths.sum())
    doc_ids = torch.repeat_interleave(torch.arange(4, device="cuda"), lengths)
    positions = torch.arange(seq, device="cuda") - (torch.cumsum(lengths, 0) - lengths)[doc_ids]
    q, grad = (torch.randn(2, seq, 8, 64, device="cuda", generator=generator).to(dtype)
               for _ in range(2))
    k, v = (torch.randn(2, seq, 2, 64, device="cuda", generator=generator).to(dtype)
            for _ in range(2))
    varlen_calls = []
    packed = local.packed_flash_attention
    monkeypatch.setattr(local, "packed_flash_attention",
                        lambda *args: varlen_calls.append(1) or packed(*args))

    def run():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = LocalAttention()(*inputs, positions=positions, doc_ids=doc_ids)
        out.backward(grad)
        return [out, *(t.grad for t in inputs)]

    assert not local._per_document(q.transpose(1, 2))
    one_call = run()
    assert len(varlen_calls) == (0 if dtype is torch.float32 else 1)
    monkeypatch.setattr(local, "_varlen_takes", lambda q: False)
    monkeypatch.setattr(local, "_per_document", lambda q: True)
    name_of = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    for name, got, want in zip(["out", "dq", "dk", "dv"], one_call, run()):
        # Gradients summed over 2048 queries in half precision: --check's tolerance.
        torch.testing.assert_close(got.float(), want.float(), msg=name,
                                   **low_precision_tolerance(name_of[dtype], want.float()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_sliding_window_on_cuda_is_one_variable_length_call(monkeypatch, dtype):
    """A window shorter than the sequence runs on the variable-length flash kernel with its
    window (context.varlen); it equals the masked SDPA path, output and q/k/v gradients."""
    from meshpipe.context import local

    generator = torch.Generator(device="cuda").manual_seed(4)
    q, grad = (torch.randn(2, 1500, 8, 64, device="cuda", generator=generator).to(dtype)
               for _ in range(2))
    k, v = (torch.randn(2, 1500, 2, 64, device="cuda", generator=generator).to(dtype)
            for _ in range(2))

    def run():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = LocalAttention()(*inputs, window=256)
        out.backward(grad)
        return [out, *(t.grad for t in inputs)]

    assert local._varlen_takes(q) and local.takes_windows()
    windowed = run()
    monkeypatch.setattr(local, "_varlen_takes", lambda q: False)
    name = "bf16" if dtype is torch.bfloat16 else "fp16"
    for what, got, want in zip(["out", "dq", "dk", "dv"], windowed, run()):
        torch.testing.assert_close(got.float(), want.float(), msg=what,
                                   **low_precision_tolerance(name, want.float()))


@pytest.mark.distributed  # inductor compiles in worker processes
def test_a_compiled_block_keeps_a_pack_in_its_graph_as_one_variable_length_call():
    """``--compile --pack`` on CUDA in bf16: the chunk derives each pack's documents before
    its blocks (``routing.pack_for_graph``), and inductor's graph of a block holds the pack's
    attention as one variable-length flash call, forward and backward: one graph a block
    with no graph break, a second pack recompiling once (its document count and longest
    document become dynamic) and a third not at all; outputs and gradients equal the eager
    blocks' (bf16 tolerance)."""
    import torch._dynamo

    from meshpipe.models.compile import compile_blocks

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    (chunk,) = split(Transformer(TransformerConfig(**SMALL)), 1)
    chunk = chunk.to("cuda", torch.bfloat16)
    eager = copy.deepcopy(chunk)
    compile_blocks([chunk])
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 96), device="cuda")
    graphs = []
    for lengths in ([40, 56], [7, 30, 59], [20, 76]):
        positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
        doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]).cuda()
        outputs = [model(tokens, positions, doc_ids) for model in (chunk, eager)]
        for out in outputs:
            out.float().square().mean().backward()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        torch.testing.assert_close(outputs[0].float(), outputs[1].float(),
                                   **low_precision_tolerance("bf16", outputs[1].float()))
        for (name, compiled), reference in zip(chunk.named_parameters(), eager.parameters()):
            torch.testing.assert_close(compiled.grad.float(), reference.grad.float(), msg=name,
                                       **low_precision_tolerance("bf16", reference.grad.float()))
            compiled.grad = reference.grad = None
    assert graphs == [1, 2, 2]
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.distributed  # inductor compiles in worker processes
def test_a_compiled_chunk_is_one_graph_of_nested_blocks_on_cuda():
    """``--compile`` with ``--chunk-graphs`` on CUDA in bf16: a plain sequence runs the
    chunk's blocks as one inductor graph, each block a nested region compiled once, SDPA
    inside; outputs and gradients equal the eager blocks' (bf16 tolerance), a second
    microbatch compiles nothing and makes no host-device synchronization."""
    import torch._dynamo

    from meshpipe.models.compile import CHUNK_GRAPHS, compile_blocks

    if not CHUNK_GRAPHS:
        pytest.skip(f"torch {torch.__version__} has no nested compile regions for a chunk")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    (chunk,) = split(Transformer(TransformerConfig(**SMALL)), 1)
    chunk = chunk.to("cuda", torch.bfloat16)
    eager = copy.deepcopy(chunk)
    compile_blocks([chunk], chunk_graphs=True)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 96), device="cuda")
    assert chunk.layers_graph.takes(chunk.embedding(tokens), None, None)
    outputs = [model(tokens) for model in (chunk, eager)]
    for out in outputs:
        out.float().square().mean().backward()
    torch.testing.assert_close(outputs[0].float(), outputs[1].float(),
                               **low_precision_tolerance("bf16", outputs[1].float()))
    for (name, compiled), reference in zip(chunk.named_parameters(), eager.parameters()):
        torch.testing.assert_close(compiled.grad.float(), reference.grad.float(), msg=name,
                                   **low_precision_tolerance("bf16", reference.grad.float()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        chunk(tokens).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.distributed  # inductor compiles in worker processes
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_packs_microbatch_never_waits_for_the_gpu(compiled):
    """A pack's forward and backward through a chunk in bf16, its tokens and layout moved as
    the loader moves them (``to_device``: pinned, without waiting, the host copy kept),
    makes no host-device synchronization (``set_sync_debug_mode("error")`` raises at one):
    its documents and cumulative lengths are read from the host copies once per
    microbatch, and nothing a layer does reads the device. The first microbatch (cuBLAS's
    and inductor's set-up) runs before the check."""
    import torch._dynamo

    from meshpipe.context.derived import to_device
    from meshpipe.models.compile import compile_blocks

    (chunk,) = split(Transformer(TransformerConfig(**SMALL)), 1)
    chunk = chunk.to("cuda", torch.bfloat16)
    if compiled:
        torch._dynamo.reset()
        compile_blocks([chunk])
    lengths = [40, 7, 49]
    positions = torch.cat([torch.arange(n) for n in lengths])
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])

    def microbatch():
        tokens = torch.randint(0, SMALL["vocab_size"], (2, sum(lengths)))
        out = chunk(*(to_device(t, torch.device("cuda")) for t in (tokens, positions, doc_ids)))
        out.float().square().mean().backward()

    microbatch()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            microbatch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(p.grad.isfinite().all() for p in chunk.parameters())


def _grouped_and_apart(few_experts: bool):
    """A bf16 expert layer on CUDA and its copy laid out for grouped products; with
    ``few_experts`` every token picks experts 0-3, so the other 12 get no rows."""
    from meshpipe.models import grouped_experts
    from meshpipe.models.moe import MoE

    torch.manual_seed(0)
    apart = MoE(256, 512, 16, top_k=4)
    with torch.no_grad():
        for param in apart.parameters():
            param.normal_(0.0, 0.05)
        if few_experts:
            apart.router.weight[:4].abs_().add_(0.1)
            apart.router.weight[4:].zero_()
    apart = apart.to("cuda", torch.bfloat16)
    grouped = copy.deepcopy(apart)
    assert grouped_experts.lay_out([grouped]) == 1
    return apart, grouped


@pytest.mark.parametrize("few_experts", [False, True], ids=["spread", "12-experts-idle"])
def test_grouped_experts_on_cuda_give_the_one_by_one_values_in_bf16(few_experts):
    from meshpipe.models import grouped_experts

    apart, grouped = _grouped_and_apart(few_experts)
    x = torch.randn(4, 256, 256, device="cuda")
    if few_experts:
        x = x.abs()
    x = x.to(torch.bfloat16)
    upstream = torch.randn(4, 256, 256, device="cuda")
    results = []
    for layer in (apart, grouped):
        rows = x.detach().clone().requires_grad_()
        y, aux = layer(rows)
        (y.float() * upstream).sum().add(aux).backward()
        results.append((y, rows.grad, {n: p.grad for n, p in layer.named_parameters()}))
    assert grouped_experts.ready(grouped, x.reshape(-1, 256))
    (y, grad_x, grads), (got_y, got_grad_x, got_grads) = results
    torch.testing.assert_close(got_y, y, **low_precision_tolerance("bf16", y))
    torch.testing.assert_close(got_grad_x, grad_x, **low_precision_tolerance("bf16", grad_x))
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad,
                                   **low_precision_tolerance("bf16", grad), msg=name)
    if few_experts:
        assert all(got_grads[f"experts.{e}.w_down.weight"].abs().sum() == 0
                   for e in range(4, 16))


@pytest.mark.parametrize("grouped", [False, True], ids=["one-by-one", "grouped"])
def test_an_expert_layer_on_cuda_waits_for_the_gpu_once_per_microbatch(grouped):
    """The dispatch's split sizes are the one read of the device per layer and microbatch
    (``set_sync_debug_mode`` warns at each synchronizing call); the first microbatch, with
    cuBLAS's set-up, runs before the count."""
    import warnings

    apart, laid_out = _grouped_and_apart(False)
    layer = laid_out if grouped else apart

    def microbatch():
        x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y, aux = layer(x)
        (y.float().square().mean() + aux).backward()

    microbatch()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            microbatch()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronizing = [w for w in caught if "synchronizing" in str(w.message)]
    assert len(synchronizing) == 1, [str(w.message) for w in synchronizing]


def test_a_fused_linear_on_cuda_adds_one_float32_output_product_into_its_master():
    """``--grad-accumulation-fusion``'s kernel: the master's gradient is the float32 sum of
    the bf16 operands' products (the unfused path rounds each microbatch's to bf16 first)."""
    from meshpipe.models import master_grads
    from meshpipe.runtime import MasterWeights

    assert master_grads.fused_kernel(torch.device("cuda"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    for fused in (True, False):
        linear = torch.nn.Linear(512, 256, bias=False, device="cuda")
        torch.nn.init.normal_(linear.weight, generator=generator)
        masters = MasterWeights(linear.named_parameters(), torch.bfloat16)
        if fused:
            assert master_grads.fuse([linear], masters.own_masters) == 1
        expected = torch.zeros(256, 512, device="cuda")
        for microbatch in range(3):
            seeded = torch.Generator(device="cuda").manual_seed(microbatch)
            x = torch.randn(4, 128, 512, device="cuda", generator=seeded).bfloat16()
            upstream = torch.randn(4, 128, 256, device="cuda", generator=seeded).bfloat16()
            linear(x).backward(upstream)
            expected += upstream.float().reshape(-1, 256).t() @ x.float().reshape(-1, 512)
        assert linear.weight.grad is None
        results[fused] = (masters.master_of(linear.weight).grad, expected)
    got, expected = results[True]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    unfused, _ = results[False]
    assert (unfused - expected).abs().max() > (got - expected).abs().max()


def test_a_fused_model_on_cuda_matches_the_unfused_one():
    """The reference model with q/k/v and gate/up joint: every master's gradient as the
    unfused model's within bf16's tolerance, and no weight of a linear gets a ``.grad``."""
    from meshpipe.models import joint, master_grads
    from meshpipe.runtime import MasterWeights

    torch.manual_seed(0)
    fused = Transformer(TransformerConfig(**SMALL)).cuda()
    unfused = copy.deepcopy(fused)
    masters = MasterWeights(fused.named_parameters(), torch.bfloat16)
    plain_masters = MasterWeights(unfused.named_parameters(), torch.bfloat16)
    joint.lay_out([fused, unfused])
    assert master_grads.fuse([fused], masters.own_masters) == 9 * SMALL["n_layers"] + 2
    for seed in range(3):
        tokens, _ = _batch(seed=seed)
        upstream = torch.randn(2, 32, SMALL["vocab_size"], device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(seed))
        for model in (fused, unfused):
            model(tokens.cuda()).float().backward(upstream)
    assert all(p.grad is None for p in fused.parameters()
               if p.dim() == 2 and p is not fused.embedding.weight)
    for (name, got), (_, want) in zip(masters.named, plain_masters.named):
        torch.testing.assert_close(got.grad, want.grad,
                                   **low_precision_tolerance("bf16", want.grad), msg=name)


def test_a_hugging_face_norm_on_cuda_is_one_fused_kernel(tmp_path):
    """``models.hf_norms``: Llama's RMSNorm forward as ``_fused_rms_norm`` alone (one kernel
    where transformers' formula runs eight), within bf16's rounding of that formula."""
    pytest.importorskip("transformers")
    from dispatched_ops import DispatchedOps
    from hf_models import save_tiny_model
    from meshpipe.models import hf

    model = hf.build_skeleton(save_tiny_model(tmp_path / "llama", "llama"))
    norm = next(m for m in model.modules() if type(m).__name__ == "FusedLlamaRMSNorm")
    norm.to_empty(device="cuda")
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    norm.to(torch.bfloat16)
    x = torch.randn(4, 128, norm.weight.shape[0], device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    with DispatchedOps() as ops:
        y = norm(x)
    assert ops.computing == ["aten._fused_rms_norm"], ops.computing
    y.float().square().sum().backward()
    want = type(norm).__mro__[1].forward(norm, x.detach())
    torch.testing.assert_close(y, want, **low_precision_tolerance("bf16", want))


def test_local_attention_takes_the_flash_kernel_at_seq_8192_in_bf16():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq, heads, head_dim = 8192, 8, 64
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, seq, heads, head_dim, device="cuda", generator=generator,
                           dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash cannot take the inputs
        out = LocalAttention()(q, k, v)
        out.float().square().mean().backward()
    assert out.shape == q.shape and all(t.grad.isfinite().all() for t in (q, k, v))
    # 128 queries spread along the sequence against every key, in fp32 math.
    rows = torch.arange(0, seq, 64, device="cuda")
    qf, kf, vf = (t.detach().float().transpose(1, 2) for t in (q, k, v))
    scores = qf[:, :, rows] @ kf.transpose(-1, -2) / head_dim ** 0.5
    scores = scores.masked_fill(torch.arange(seq, device="cuda") > rows[:, None], float("-inf"))
    expected = (scores.softmax(-1) @ vf).transpose(1, 2)
    torch.testing.assert_close(out[:, rows].float(), expected, rtol=1.6e-2, atol=2e-3)


@pytest.mark.distributed
def test_tune_under_torchrun_measures_on_the_gpu(tmp_path):
    """Under torchrun the tuner's in-process profile, its measuring steps and its probes
    (message, all-reduce, optimizer) run on the rank's GPU, timed after a synchronize."""
    from meshpipe.train.tune import profile as tune_profile
    from meshpipe.train.config import TrainConfig

    config = TrainConfig(dim=64, layers=2, heads=4, kv_heads=2, seq_len=64, microbatch_size=2)
    profile = tune_profile.model_profile(config, torch.device("cuda"))
    assert profile.layer.forward > 0 and profile.layer.activation_bytes > 0
    ((tokens, per_token),) = tune_profile.layer_curve(config, [128], torch.device("cuda"))
    assert tokens == 128 and per_token > 0
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m",
         "meshpipe", "tune", "--world-size", "1", "--dim", "64", "--layers", "2", "--heads",
         "4", "--seq-len", "64", "--top", "3"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("| rank | pp |") == 1, done.stdout


# ------------------------------------------- two ranks: NCCL on two GPUs, else one GPU shared

def _backend() -> str:
    return "nccl" if torch.cuda.device_count() >= 2 else "gloo"


def _gpu_rank(rank: int, world_size: int, init_file: str, fn, args: tuple) -> None:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    backend = _backend()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            device_id=device if backend == "nccl" else None)
    try:
        fn(rank, world_size, device, backend, *args)
    finally:
        dist.destroy_process_group()


def _run_on_gpus(world_size: int, fn, *args) -> None:
    """``fn(rank, world_size, device, backend, *args)`` on ``world_size`` processes: one GPU
    each on NCCL where there are enough, else sharing them over gloo (an AssertionError on
    a rank fails the test with that rank's traceback)."""
    with tempfile.TemporaryDirectory(prefix="meshpipe-gpu-") as tmp:
        torch_mp.start_processes(_gpu_rank, args=(world_size, os.path.join(tmp, "init"), fn,
                                                  args),
                                 nprocs=world_size, join=True, start_method="spawn")


def _message(index: int, device: torch.device):
    """Message ``index``: its sequence length changes, so layouts change (slow path)."""
    generator = torch.Generator().manual_seed(index)
    seq = 3 + 4 * index
    return (torch.randn(2, seq, 8, generator=generator).to(device),
            {"lowp": torch.randn(seq, 3, generator=generator).to(torch.bfloat16).to(device),
             "ids": torch.arange(seq, device=device), "skip": None},
            [index, f"microbatch {index}"])


def _assert_same(actual, expected) -> None:
    if isinstance(expected, torch.Tensor):
        assert actual.device == expected.device and actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            _assert_same(actual[key], expected[key])
    else:
        assert actual == expected


def _p2p_both_ways(rank: int, world_size: int, device: torch.device, backend: str) -> None:
    """Rank 0 sends four messages of changing layouts to rank 1, rank 1 sends each back; on
    NCCL forward and back on two groups, headers and metadata on a gloo group; over gloo
    from host buffers, delivered onto the GPU."""
    if backend == "nccl":
        transport = P2PTransport(reverse_group=dist.new_group(backend="nccl"),
                                 meta_group=dist.new_group(backend="gloo"), device=device,
                                 timeout=60.0)
    else:
        transport = P2PTransport(device="cpu", deliver_to=device, timeout=60.0)
    peer = 1 - rank
    for index in range(4):
        expected = _message(index, device)
        if rank == 0:
            transport.post_send(expected, peer, label=f"F{index}")
            _assert_same(transport.post_recv(peer, label=f"B{index}").wait(), expected)
        else:
            received = transport.post_recv(peer, label=f"F{index}").wait()
            _assert_same(received, expected)
            transport.post_send(received, peer, label=f"B{index}")
    transport.wait_sends()


def _ring_equals_sdpa(rank: int, world_size: int, device: torch.device, backend: str) -> None:
    """Ring attention over the ranks (contiguous halves, causal) against SDPA on the whole
    sequence, output and q/k/v gradients of this rank's half."""
    generator = torch.Generator().manual_seed(0)
    seq, heads, heads_kv, head_dim = 512, 4, 2, 32
    q = torch.randn(1, seq, heads, head_dim, generator=generator).to(device)
    k, v = (torch.randn(1, seq, heads_kv, head_dim, generator=generator).to(device)
            for _ in range(2))
    grad = torch.randn(1, seq, heads, head_dim, generator=generator).to(device)
    mine = slice(rank * seq // world_size, (rank + 1) * seq // world_size)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
    LocalAttention()(*full).backward(grad)
    out = RingAttention()(*local)
    out.backward(grad[:, mine])
    with torch.no_grad():
        expected = LocalAttention()(q, k, v)
    torch.testing.assert_close(out, expected[:, mine], rtol=1e-4, atol=1e-5)
    for name, mine_t, full_t in zip("qkv", local, full):
        torch.testing.assert_close(mine_t.grad, full_t.grad[:, mine], rtol=1e-4, atol=1e-5,
                                   msg=name)


def _ulysses_head_groups(rank: int, world_size: int, device: torch.device,
                         backend: str) -> None:
    """Ulysses on CUDA runs two head groups by itself (their all-to-alls started at once) and
    equals one group and local attention on the whole sequence: bf16, a pack of three
    documents (the variable-length kernel inside), output and q/k/v gradients."""
    from meshpipe.context import UlyssesAttention
    from meshpipe.context import head_groups

    generator = torch.Generator().manual_seed(0)
    seq, heads, heads_kv, head_dim = 384, 8, 4, 64
    q = torch.randn(1, seq, heads, head_dim, generator=generator)
    k, v = (torch.randn(1, seq, heads_kv, head_dim, generator=generator) for _ in range(2))
    grad = torch.randn(1, seq, heads, head_dim, generator=generator)
    q, k, v, grad = (t.to(device, torch.bfloat16) for t in (q, k, v, grad))
    lengths = torch.tensor([100, 200, 84])
    doc_ids = torch.repeat_interleave(torch.arange(3), lengths).to(device)
    starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    positions = (torch.arange(seq) - starts).to(device)
    mine = slice(rank * seq // world_size, (rank + 1) * seq // world_size)
    groups_run = []
    original = head_groups.HeadGroupUlysses.apply
    head_groups.HeadGroupUlysses.apply = lambda *args: groups_run.append(args[6]) or \
        original(*args)
    results = []
    try:
        for attention in (UlyssesAttention(), UlyssesAttention(head_groups=1)):
            local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
            out = attention(*local, positions=positions[mine], doc_ids=doc_ids[mine])
            out.backward(grad[:, mine])
            results.append([out.detach(), *(t.grad for t in local)])
    finally:
        head_groups.HeadGroupUlysses.apply = original
    assert groups_run == [2], groups_run
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = LocalAttention()(*full, positions=positions, doc_ids=doc_ids)
    expected.backward(grad)
    wanted = [expected.detach()[:, mine], *(t.grad[:, mine] for t in full)]
    for name, grouped, one_group, want in zip(("out", "q", "k", "v"), *results, wanted):
        tolerance = low_precision_tolerance("bf16", want.float())
        torch.testing.assert_close(grouped.float(), one_group.float(), **tolerance, msg=name)
        torch.testing.assert_close(grouped.float(), want.float(), **tolerance, msg=name)


@pytest.mark.distributed
def test_ulysses_on_the_gpu_overlaps_two_head_groups_and_equals_local_attention():
    _run_on_gpus(2, _ulysses_head_groups)


@pytest.mark.distributed
def test_p2p_pytrees_travel_between_two_ranks_on_the_gpu():
    _run_on_gpus(2, _p2p_both_ways)


@pytest.mark.distributed
def test_ring_attention_over_two_ranks_on_the_gpu_equals_sdpa_on_the_whole_sequence():
    _run_on_gpus(2, _ring_equals_sdpa)
