"""``--compile``: the first step equals one process under every kind of schedule and
parallelism (split backward, combined 1F1B's sub-steps, tensor, context and expert
parallelism, a Hugging Face model, bf16), what is compiled and what stays eager, no
recompilation on a second step or another pack of documents, and a chunk's layers as one
graph of nested regions (``--chunk-graphs``): which chunks and microbatches, equal to their
layers one by one.

The tests compile with the ``aot_eager`` backend: TorchDynamo's capture, the graph breaks
and AOTAutograd's forward and backward graphs are inductor's, without generating and
building C++ (20 s a model here); ``benchmarks/compile.py`` runs inductor itself."""

import os

import pytest
import torch

from hf_models import save_tiny_model, write_documents
from meshpipe.models.compile import (BACKEND_VARIABLE, CHUNK_GRAPHS, HF_CHUNK_GRAPH_TYPES,
                                     NESTED_GRAPH_BREAKS, chunk_graph, compile_blocks, regions)
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from trainer_cases import SMALL, for_a_model

pytestmark = pytest.mark.distributed
needs_chunk_graphs = pytest.mark.skipif(
    not CHUNK_GRAPHS, reason=f"torch {torch.__version__} has no nested compile regions for "
    "a chunk's graph (--chunk-graphs)")


def _check_compiled(rank, world_size, config):
    os.environ[BACKEND_VARIABLE] = "aot_eager"
    from meshpipe.train.loop.trainer import Trainer

    return Trainer(config).check_first_step()


LAYOUTS = {  # two ranks each: the compile time is every rank's
    "zb-v": dict(pp=2, schedule="zb-v"),
    "dualpipe-v-recompute": dict(pp=2, schedule="dualpipe-v", recompute="full"),
    "interleaved-bf16": dict(pp=2, vpp=2, schedule="interleaved", dtype="bf16"),
    "1f1b-bf16-chunk-graphs": dict(pp=2, schedule="1f1b", dtype="bf16",
                                   chunk_graphs="on" if CHUNK_GRAPHS else "off"),
    "combined-1f1b-moe-ep2": dict(pp=1, dp=2, ep=2, moe_experts=4, schedule="combined-1f1b"),
    "ring2": dict(pp=1, schedule="none", cp_ring=2),
    "tp2-sequence-parallel-recompute": dict(pp=1, schedule="none", tp=2,
                                            sequence_parallel=True, recompute="full"),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_compiled_step_matches_one_process(tmp_path, layout):
    config = TrainConfig(**{**SMALL, **layout}, compile=True, out_dir=str(tmp_path))
    report = run_distributed(config.world_size, _check_compiled, config)[0]
    assert report["passed"], report


def test_a_compiled_hugging_face_model_on_packed_ulysses_matches_transformers(tmp_path):
    hf = for_a_model(SMALL)
    config = TrainConfig(**hf, pp=1, schedule="none", cp_ulysses=2, pack=True, compile=True,
                         model=str(save_tiny_model(tmp_path / "model", "qwen3")),
                         data=str(write_documents(tmp_path / "docs.txt")),
                         out_dir=str(tmp_path / "run"))
    report = run_distributed(2, _check_compiled, config)[0]
    assert report["passed"], report


@pytest.mark.slow
@needs_chunk_graphs
def test_a_compiled_hugging_face_pipeline_of_chunk_graphs_matches_transformers(tmp_path):
    """A Qwen3 over two stages in bf16, each stage's chunk one graph of its layers
    (``--chunk-graphs on``): the first step equals transformers' model in one process."""
    hf = for_a_model(SMALL)
    config = TrainConfig(**hf, pp=2, dtype="bf16", compile=True, chunk_graphs="on",
                         model=str(save_tiny_model(tmp_path / "model", "qwen3")),
                         data=str(write_documents(tmp_path / "docs.txt")),
                         out_dir=str(tmp_path / "run"))
    report = run_distributed(2, _check_compiled, config)[0]
    assert report["passed"], report


def _check_compiled_with_the_kernel_granted(rank, world_size, config):
    """``_check_compiled`` as on a GPU with the variable-length flash kernel, whose ops run
    as per-document stand-ins in the compiled graphs (``flash_stand_in``); the report and
    how many calls they took. The worker serves later tests: both grants are undone."""
    from flash_stand_in import StandInKernel
    from meshpipe.context import local
    from meshpipe.models import compile as compile_module
    from meshpipe.train.loop.trainer import Trainer

    kernel = StandInKernel()
    backend = kernel.backend()
    granted, chosen = local._varlen_runs_on, compile_module.backend
    local._varlen_runs_on, compile_module.backend = (lambda device: True), (lambda: backend)
    try:
        return Trainer(config).check_first_step(), len(kernel.calls)
    finally:
        local._varlen_runs_on, compile_module.backend = granted, chosen


@pytest.mark.slow
def test_a_compiled_pipeline_of_packs_in_the_blocks_graphs_matches_one_process(tmp_path):
    """``--pack --compile --dtype bf16`` over two pipeline stages, as on a GPU: each stage's
    chunk derives its microbatches' documents and its compiled blocks keep the pack's
    attention in their graphs (the kernel's stand-ins take every layer's call on both
    ranks); the first step equals one process."""
    config = TrainConfig(**SMALL, pp=2, dtype="bf16", pack=True, compile=True,
                         data=str(write_documents(tmp_path / "docs.txt")),
                         out_dir=str(tmp_path / "run"))
    (report, calls), (_, later_calls) = run_distributed(
        2, _check_compiled_with_the_kernel_granted, config)
    assert report["passed"], report
    assert calls > 0 and later_calls > 0


def test_blocks_compile_their_compute_and_leave_the_experts_eager():
    from meshpipe.models import Transformer, TransformerConfig, split

    model = Transformer(TransformerConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=32,
                                          moe_experts=4, moe_every=2))
    moe, dense = model.layers
    assert regions(dense) == [dense]
    assert regions(moe) == [moe.attention_norm, moe.attention, moe.mlp_norm]
    assert compile_blocks(split(model, 1)) == 4
    compiled = {module for module in model.modules()
                if getattr(module, "_compiled_call_impl", None) is not None}
    assert compiled == set(regions(dense) + regions(moe))
    # Recomputed under activation checkpointing: its pieces, around the checkpoint.
    dense.recompute = True
    assert regions(dense) == [dense.attention_norm, dense.attention, dense.mlp_norm, dense.mlp]
    # Under a split backward only what has no weight matrix; the blocks share one rotary.
    assert regions(dense, split_backward=True) == [dense.attention_norm, dense.attention.rope,
                                                   dense.mlp_norm, dense.mlp.activation]
    assert compile_blocks(split(model, 1), split_backward=True) == 6


def test_a_hugging_face_layer_compiles_whole_or_its_norms_and_activation(tmp_path):
    from meshpipe.models import hf

    layer = hf.build_skeleton(save_tiny_model(tmp_path, "qwen3")).model.layers[0]
    assert regions(layer) == [layer]
    pieces = regions(layer, split_backward=True)
    assert pieces == [layer.self_attn.q_norm, layer.self_attn.k_norm, layer.input_layernorm,
                      layer.post_attention_layernorm, layer.mlp.act_fn]


def test_a_second_step_and_another_pack_compile_nothing(monkeypatch):
    """A block of a plain sequence is one graph: its attention is one SDPA call, inside it
    (``context.routing``). A pack's attention core reads the document layout eagerly, at a
    graph break that cuts the block in two (each call of a graph costs host time); new
    layouts of the same shapes reuse those graphs, and so does the second block of a
    chunk."""
    import torch._dynamo

    from meshpipe.models import Transformer, TransformerConfig, split

    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    (chunk,) = split(Transformer(TransformerConfig(vocab_size=64, dim=32, n_layers=2,
                                                   n_heads=4, max_seq_len=32)), 1)
    compile_blocks([chunk])
    tokens = torch.randint(0, 64, (1, 24))

    def step(lengths=None):
        if lengths is None:
            chunk(tokens).sum().backward()
        else:
            positions = torch.cat([torch.arange(n) for n in lengths])
            doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
            chunk(tokens, positions, doc_ids).sum().backward()
        return dict(torch._dynamo.utils.counters["stats"])

    plain = step()
    assert plain["unique_graphs"] == 1
    assert step() == plain
    if not NESTED_GRAPH_BREAKS:
        pytest.skip(f"torch {torch.__version__} runs without nested graph breaks: a pack's "
                    "break cuts the functions around the core too, and a new pack recompiles")
    packed = step([10, 14])
    assert packed["unique_graphs"] == 1 + 2
    assert step([10, 14]) == packed
    assert step([3, 9, 12]) == packed
    assert step() == packed


@pytest.fixture
def nested_graph_breaks_off():
    """TorchDynamo's nested graph breaks off for a test (``compile_blocks`` turns them on,
    process-wide), and as they were after it. ``monkeypatch`` cannot restore a TorchDynamo
    config: putting back its default value deletes the option for every later compile."""
    from torch._dynamo import config as dynamo_config

    if not NESTED_GRAPH_BREAKS:
        pytest.skip(f"torch {torch.__version__}'s compiled blocks run without nested graph "
                    "breaks")
    with dynamo_config.patch(nested_graph_breaks=False):
        yield


def test_a_hugging_face_layer_is_one_graph_or_two_cut_at_its_attention(
        monkeypatch, tmp_path, nested_graph_breaks_off):
    """transformers' layers call their attention module, whose core is meshpipe's attention:
    on a plain sequence inside the layer's graph, one graph; on a pack a graph break, which
    resumed inside the nested call (TorchDynamo's nested graph breaks, where the torch has
    them) makes the layer two graphs, not four. Both equal the eager layers, gradients too."""
    import copy

    import torch._dynamo

    from meshpipe.context import LocalAttention
    from meshpipe.models import hf

    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    directory = save_tiny_model(tmp_path, "llama")
    skeleton = hf.build_skeleton(directory)
    (chunk,) = hf.split_model(skeleton, [skeleton.config.num_hidden_layers], LocalAttention())
    hf.materialize(skeleton, [chunk], directory)
    eager = copy.deepcopy(chunk)
    compile_blocks([chunk])
    tokens = torch.randint(0, 64, (1, 16))
    pack = (torch.cat([torch.arange(6), torch.arange(10)]), torch.tensor([0] * 6 + [1] * 10))
    for layout, graphs in (((), 1), (pack, 1 + 2)):
        outputs = [model(tokens, *layout) for model in (chunk, eager)]
        for out in outputs:
            out.float().square().mean().backward()
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        torch.testing.assert_close(*outputs)
        for (name, compiled), reference in zip(chunk.named_parameters(), eager.parameters()):
            torch.testing.assert_close(compiled.grad, reference.grad, msg=name)
            compiled.grad = reference.grad = None


def _recording_backend(graphs):
    """``aot_eager`` that first records each graph TorchDynamo hands it."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return aot_eager(graph_module, example_inputs)

    return backend


def _compiled_calls(chunk):
    """Count the calls of each block's own compiled code and of the chunk's graph. A call
    TorchDynamo traces is not one: a layer whose ``__call__`` is its own (transformers 5.17's
    ``GradientCheckpointingLayer``) is traced through its compiled call into the chunk's
    graph, and a count there would be replayed with the graph."""
    calls = {"blocks": 0, "chunk": 0}

    def counting(key, call):
        def counted(*args, **kwargs):
            if not torch.compiler.is_compiling():
                calls[key] += 1
            return call(*args, **kwargs)
        return counted

    for layer in chunk.layers.values():
        layer._compiled_call_impl = counting("blocks", layer._compiled_call_impl)
    graph = chunk.layers_graph
    graph._run = counting("chunk", graph._run)
    return calls


@needs_chunk_graphs
@pytest.mark.parametrize("recompute", ["none", pytest.param("selective", marks=pytest.mark.slow)])
def test_a_chunk_of_dense_blocks_is_one_graph_that_compiles_one_block(monkeypatch, recompute):
    """``--chunk-graphs``: on a plain sequence the chunk's three blocks run as one graph (one
    call a microbatch), which calls one block's nested region three times: one block is
    traced, as with a graph a block. A pack, whose attention breaks a block's graph on this
    CPU, runs the blocks' own compiled code (two graphs a block) and the next plain
    sequence the chunk's graph again, compiling nothing. Values and gradients equal the
    eager chunk's, also with each attention core recomputed in backward."""
    import copy

    import torch._dynamo

    from meshpipe.models import Transformer, TransformerConfig, split
    from meshpipe.models import compile as compile_module

    graphs = []
    recording = _recording_backend(graphs)
    monkeypatch.setattr(compile_module, "backend", lambda: recording)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    (chunk,) = split(Transformer(TransformerConfig(vocab_size=64, dim=32, n_layers=3,
                                                   n_heads=4, max_seq_len=32),
                                 recompute=recompute), 1)
    eager = copy.deepcopy(chunk)
    compile_blocks([chunk], chunk_graphs=True)
    calls = _compiled_calls(chunk)
    tokens = torch.randint(0, 64, (1, 24))
    pack = (torch.cat([torch.arange(10), torch.arange(14)]), torch.tensor([0] * 10 + [1] * 14))
    expected = [{"blocks": 0, "chunk": 1}, {"blocks": 3, "chunk": 1}, {"blocks": 3, "chunk": 2}]
    for layout, counted in zip(((), pack, ()), expected):
        outputs = [model(tokens, *layout) for model in (chunk, eager)]
        for out in outputs:
            out.square().mean().backward()
        torch.testing.assert_close(*outputs)
        for (name, compiled), reference in zip(chunk.named_parameters(), eager.parameters()):
            torch.testing.assert_close(compiled.grad, reference.grad, msg=name)
            compiled.grad = reference.grad = None
        assert calls == counted, layout
    # the chunk's; a block's two around a pack's attention
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 + 2
    regions_called = [node for node in graphs[0].graph.nodes
                      if node.target is torch.ops.higher_order.invoke_subgraph]
    assert len(regions_called) == 3
    assert len({node.args[0].target for node in regions_called}) == 1


@needs_chunk_graphs
def test_chunk_graphs_of_two_widths_and_shapes_run_in_one_process(monkeypatch):
    """Chunk graphs of models of two widths in one process (a test worker, a notebook), each
    also on another batch shape under ``no_grad``, equal their eager chunks: the graph compiles
    for static sizes (with automatic dynamic sizes the second width failed in TorchDynamo's
    reuse of the block's region)."""
    import copy

    import torch._dynamo

    from meshpipe.models import Transformer, TransformerConfig, split

    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    torch._dynamo.reset()
    for dim in (32, 64):
        (chunk,) = split(Transformer(TransformerConfig(vocab_size=64, dim=dim, n_layers=2,
                                                       n_heads=4, max_seq_len=32)), 1)
        eager = copy.deepcopy(chunk)
        compile_blocks([chunk], chunk_graphs=True)
        tokens = torch.randint(0, 64, (1, 24))
        torch.testing.assert_close(chunk(tokens), eager(tokens))
        with torch.no_grad():
            tokens = torch.randint(0, 64, (2, 16))
            torch.testing.assert_close(chunk(tokens), eager(tokens))


@torch.compiler.disable
def _outside_any_graph(hidden):
    return hidden


@needs_chunk_graphs
def test_a_chunk_graph_that_cannot_be_captured_warns_and_runs_the_layers(monkeypatch):
    """A layer whose nested region breaks (here a ``torch.compiler.disable``d call inside
    it) fails while TorchDynamo traces, before anything runs: the chunk warns once, runs
    this microbatch and the later ones through its layers' own graphs, and its values and
    gradients still equal the eager chunk's."""
    import copy

    import torch._dynamo

    from meshpipe.models import Transformer, TransformerConfig, split
    from meshpipe.models.compile import ChunkGraph

    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    torch._dynamo.reset()
    (chunk,) = split(Transformer(TransformerConfig(vocab_size=64, dim=32, n_layers=2,
                                                   n_heads=4, max_seq_len=32)), 1)
    eager = copy.deepcopy(chunk)
    compile_blocks([chunk], chunk_graphs=True)

    @torch.compiler.nested_compile_region
    def breaking(block, hidden):
        return _outside_any_graph(block._forward(hidden, None, None, None))

    def run(blocks, attention, hidden):
        for block in blocks:
            hidden = breaking(block, hidden)
        return hidden

    chunk.layers_graph = graph = ChunkGraph(chunk.layers.values(),
                                            chunk.layers_graph._attention, run)
    tokens = torch.randint(0, 64, (1, 24))
    with pytest.warns(UserWarning, match="--chunk-graphs: a layer of a chunk breaks"):
        outputs = [model(tokens) for model in (chunk, eager)]
    assert graph.broken and not graph.takes(chunk.embedding(tokens), None, None)
    outputs.append(chunk(tokens))
    for out in outputs:
        out.square().mean().backward()
    torch.testing.assert_close(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[2], outputs[1])
    for (name, compiled), reference in zip(chunk.named_parameters(), eager.parameters()):
        torch.testing.assert_close(compiled.grad, 2 * reference.grad, msg=name)


def test_which_chunks_run_as_one_graph():
    """A chunk runs as one graph where every block is a dense reference block compiled
    whole on ``LocalAttention`` (recomputing its attention core is inside the graph); not
    with a mixture-of-experts block, ``--recompute full`` (its parts are compiled), a
    context-parallel attention, a split backward, or ``chunk_graphs`` off. Only a plain
    sequence short enough for one SDPA call on this CPU takes the graph."""
    from meshpipe.context import RingAttention
    from meshpipe.models import Transformer, TransformerConfig, split

    def chunk_of(attention=None, **flags):
        config = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=512)
        model_flags = {key: flags.pop(key) for key in ("moe_experts", "moe_every")
                       if key in flags}
        (chunk,) = split(Transformer(TransformerConfig(**config, **model_flags),
                                     attention=attention, **flags), 1)
        return chunk

    assert chunk_graph(chunk_of()) is not None
    assert chunk_graph(chunk_of(recompute="selective")) is not None
    assert chunk_graph(chunk_of(recompute="full")) is None
    assert chunk_graph(chunk_of(moe_experts=4, moe_every=2)) is None
    assert chunk_graph(chunk_of(RingAttention())) is None
    for kwargs, graph in ((dict(chunk_graphs=True), True),
                          (dict(chunk_graphs=True, split_backward=True), False),
                          (dict(), False)):
        chunk = chunk_of()
        compile_blocks([chunk], **kwargs)
        assert (chunk.layers_graph is not None) == graph, kwargs
    graph = chunk_graph(chunk_of())
    hidden = torch.zeros(1, 256, 32)
    positions = torch.arange(256)
    assert graph.takes(hidden, None, None)
    assert not graph.takes(hidden, positions, torch.zeros(256, dtype=torch.long))
    assert not graph.takes(torch.zeros(1, 257, 32), None, None)  # the CPU's causal squares


def _hf_chunk(directory, **options):
    from meshpipe.context import LocalAttention
    from meshpipe.models import hf

    skeleton = hf.build_skeleton(directory)
    (chunk,) = hf.split_model(skeleton, [skeleton.config.num_hidden_layers], LocalAttention(),
                              **options)
    hf.materialize(skeleton, [chunk], directory)
    return chunk


@needs_chunk_graphs
@pytest.mark.parametrize("arch", [arch if arch == "gemma3_text" else  # the rest slow
                                  pytest.param(arch, marks=pytest.mark.slow)
                                  for arch in HF_CHUNK_GRAPH_TYPES])
def test_a_hugging_face_chunk_is_one_graph_of_its_layers(monkeypatch, tmp_path, arch):
    """A chunk of each listed decoder runs a plain sequence as one graph, one layer's nested
    region called for every layer (with each layer's rotary tables: Gemma 3's local and
    global ones), equal to its layers one by one, gradients too; a sliding window shorter
    than the sequence (Gemma 3's, 6 tokens) keeps the layers' own graphs."""
    import copy

    import torch._dynamo

    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    chunk = _hf_chunk(save_tiny_model(tmp_path, arch))
    eager = copy.deepcopy(chunk)
    compile_blocks([chunk], chunk_graphs=True)
    calls = _compiled_calls(chunk)
    windowed = arch == "gemma3_text"
    tokens = torch.randint(0, 64, (1, 16))
    for _ in range(2):
        outputs = [model(tokens) for model in (chunk, eager)]
        for out in outputs:
            out.float().square().mean().backward()
        torch.testing.assert_close(*outputs)
        for (name, compiled), reference in zip(chunk.named_parameters(), eager.parameters()):
            torch.testing.assert_close(compiled.grad, reference.grad, msg=name)
            compiled.grad = reference.grad = None
    layers = len(chunk.layers)
    assert calls == ({"blocks": 2 * layers, "chunk": 0} if windowed
                     else {"blocks": 0, "chunk": 2})
    short = tokens[:, :6]
    torch.testing.assert_close(chunk(short), eager(short))
    assert calls["chunk"] == (1 if windowed else 3)


def test_which_hugging_face_chunks_run_as_one_graph(monkeypatch, tmp_path):
    """Not a mixture of experts (Mixtral), soft-capped attention (Gemma 2), recomputed
    layers, a decoder not in the list, nor a layer holding a hook (tensor parallelism enters
    its region through pre-hooks)."""
    from meshpipe.models import compile as compile_module

    assert chunk_graph(_hf_chunk(save_tiny_model(tmp_path / "llama", "llama"))) is not None
    assert chunk_graph(_hf_chunk(tmp_path / "llama", recompute=True)) is None
    with monkeypatch.context() as patch:
        patch.setattr(compile_module, "HF_CHUNK_GRAPH_TYPES", ("qwen3",))
        assert chunk_graph(_hf_chunk(tmp_path / "llama")) is None
    for arch in ("mixtral", "gemma2"):
        assert chunk_graph(_hf_chunk(save_tiny_model(tmp_path / arch, arch))) is None, arch
    hooked = _hf_chunk(tmp_path / "llama")
    next(iter(hooked.layers.values())).mlp.register_forward_pre_hook(lambda *args: None)
    assert chunk_graph(hooked) is None


def test_chunk_graphs_are_decided_once_and_refused_before_the_run(monkeypatch):
    from meshpipe.models import compile as compile_module

    monkeypatch.setattr(compile_module, "CHUNK_GRAPHS", True)
    assert [compile_module.chunk_graphs(mode) for mode in ("auto", "on", "off")] == [
        True, True, False]
    TrainConfig(compile=True, chunk_graphs="on")
    with pytest.raises(ValueError, match="--chunk-graphs on .* add --compile"):
        TrainConfig(chunk_graphs="on")
    with pytest.raises(ValueError, match="unknown --chunk-graphs"):
        TrainConfig(compile=True, chunk_graphs="yes")
    monkeypatch.setattr(compile_module, "CHUNK_GRAPHS", False)
    assert [compile_module.chunk_graphs(mode) for mode in ("auto", "on", "off")] == [
        False, True, False]
    with pytest.raises(ValueError, match="torch >= 2.11"):
        TrainConfig(compile=True, chunk_graphs="on")
    TrainConfig(compile=True, chunk_graphs="auto")


def test_the_compile_mode_comes_from_the_environment(monkeypatch):
    """``MESHPIPE_COMPILE_MODE`` reaches every region's ``compile``; unset, inductor's
    default mode."""
    from torch import nn

    from meshpipe.models import Transformer, TransformerConfig, split
    from meshpipe.models.compile import MODE_VARIABLE

    calls = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: calls.append(kwargs))
    monkeypatch.delenv(BACKEND_VARIABLE, raising=False)
    (chunk,) = split(Transformer(TransformerConfig(vocab_size=64, dim=32, n_layers=1,
                                                   n_heads=4, max_seq_len=32)), 1)
    monkeypatch.setenv(MODE_VARIABLE, "max-autotune-no-cudagraphs")
    compile_blocks([chunk])
    monkeypatch.delenv(MODE_VARIABLE)
    compile_blocks([chunk])
    modes = [call["mode"] for call in calls]
    half = len(modes) // 2
    assert modes == ["max-autotune-no-cudagraphs"] * half + [None] * half
    assert modes and all(call["backend"] == "inductor" for call in calls)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_a_compile_mode_of_cuda_graphs_is_refused_before_the_run(monkeypatch, mode):
    """CUDA graphs overwrite the outputs a pipeline step still holds for backward (measured
    on an H100): ``--compile`` with such a mode is one line naming the variable, while the
    mode without ``--compile`` (unused) and a mode without graphs pass."""
    from meshpipe.models.compile import MODE_VARIABLE
    from meshpipe.train.config import TrainConfig

    monkeypatch.setenv(MODE_VARIABLE, mode)
    with pytest.raises(ValueError, match=f"{MODE_VARIABLE}={mode} replays"):
        TrainConfig(compile=True)
    TrainConfig(compile=False)
    monkeypatch.setenv(MODE_VARIABLE, "max-autotune-no-cudagraphs")
    TrainConfig(compile=True)


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """The variable-length flash kernel granted to the CPU, its ops run by per-document
    stand-ins inside the compiled graphs (``flash_stand_in``), and TorchDynamo's caches and
    counters cleared: the kernel, whose ``calls`` record each call."""
    import torch._dynamo

    from flash_stand_in import StandInKernel
    from meshpipe.context import local
    from meshpipe.models import compile as compile_module

    kernel = StandInKernel()
    backend = kernel.backend()
    monkeypatch.setattr(compile_module, "backend", lambda: backend)
    monkeypatch.setattr(local, "_varlen_runs_on", lambda device: True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return kernel


def _compiled_and_eager_agree_in_bf16(compiled, eager, inputs):
    """Forward and backward of both chunks on ``inputs``: outputs and every gradient within
    bf16's tolerance (the gradients are cleared after)."""
    from meshpipe.runtime.precision import low_precision_tolerance

    outputs = [model(*inputs) for model in (compiled, eager)]
    for out in outputs:
        out.float().square().mean().backward()
    torch.testing.assert_close(outputs[0], outputs[1],
                               **low_precision_tolerance("bf16", outputs[1]))
    for (name, param), reference in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(param.grad, reference.grad, msg=name,
                                   **low_precision_tolerance("bf16", reference.grad))
        param.grad = reference.grad = None


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_pack_the_variable_length_kernel_takes_stays_in_the_blocks_graph(stand_in_kernel,
                                                                           recompute):
    """On CUDA in bf16/fp16 a chunk derives its pack's documents before its blocks run
    (``routing.pack_for_graph``), and each compiled block holds the pack's attention as one
    call of the variable-length kernel's aten op, differentiated by the op's own formula:
    one graph a block with no graph break, forward and backward one kernel call per layer
    (recomputed layers one more forward in backward; ``--recompute full`` compiles a block's
    parts, its attention module one of them). The first pack of another document count and
    longest document recompiles once (both become dynamic); no later pack does. Here the
    device's kernel is granted and the ops run as per-document stand-ins: outputs and
    gradients equal the eager chunk's per-document attention."""
    import copy

    import torch._dynamo

    from meshpipe.models import Transformer, TransformerConfig, split

    layers = 2
    config = TransformerConfig(vocab_size=64, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                               max_seq_len=32)
    (chunk,) = split(Transformer(config, recompute=recompute), 1)
    chunk = chunk.to(torch.bfloat16)
    eager = copy.deepcopy(chunk)
    compile_blocks([chunk])
    tokens = torch.randint(0, 64, (1, 24))
    graphs = []
    for lengths in ([10, 14], [3, 9, 12], [5, 5, 5, 9], [24]):
        positions = torch.cat([torch.arange(n) for n in lengths])
        doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
        stand_in_kernel.calls.clear()
        _compiled_and_eager_agree_in_bf16(chunk, eager, (tokens, positions, doc_ids))
        cumulative = torch.tensor([0, *lengths]).cumsum(0).tolist()
        forward, backward = ("fwd", cumulative, max(lengths), True), (
            "bwd", cumulative, max(lengths), True)
        assert [call[:1] + call[3:6] for call in stand_in_kernel.calls] == [forward] * layers + (
            [backward] if recompute == "none" else [forward, backward]) * layers, lengths
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0] + 1] * 3  # the attention's graph recompiled once
    assert graphs[0] == (3 if recompute == "full" else 1)  # the norms', attention's, MLP's
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_hugging_face_layer_keeps_a_pack_the_kernel_takes_in_its_graph(stand_in_kernel,
                                                                          tmp_path):
    """A Hugging Face chunk derives its pack's documents once, before its layers, and passes
    them through each layer to meshpipe's attention function (``meshpipe_pack``): compiled
    and in bf16 on a device with the variable-length kernel (granted here, its ops as
    stand-ins), a layer of a pack is one graph, one kernel call forward and one backward a
    layer, equal to the eager layers."""
    import copy

    import torch._dynamo

    from meshpipe.context import LocalAttention
    from meshpipe.models import hf

    directory = save_tiny_model(tmp_path, "llama")
    skeleton = hf.build_skeleton(directory)
    (chunk,) = hf.split_model(skeleton, [skeleton.config.num_hidden_layers], LocalAttention())
    hf.materialize(skeleton, [chunk], directory)
    chunk = chunk.to(torch.bfloat16)
    eager = copy.deepcopy(chunk)
    compile_blocks([chunk])
    tokens = torch.randint(0, 64, (1, 16))
    layout = (torch.cat([torch.arange(6), torch.arange(10)]), torch.tensor([0] * 6 + [1] * 10))
    _compiled_and_eager_agree_in_bf16(chunk, eager, (tokens, *layout))
    layers = skeleton.config.num_hidden_layers
    assert [call[0] for call in stand_in_kernel.calls] == ["fwd"] * layers + ["bwd"] * layers
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
