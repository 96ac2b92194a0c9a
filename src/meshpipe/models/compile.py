"""``--compile``: regional ``torch.compile`` of the decoder blocks of a stage's chunk.

Each block (the reference ``TransformerBlock``, a Hugging Face decoder layer) is compiled in
place, and every block of a model runs the same compiled code: parameters are inputs of the
graph, not constants, so compile time does not grow with depth, and a second step or
microbatch of the same shapes compiles nothing. A compiled region is one autograd node,
which every schedule's executor runs as any other. A split backward (ZB-H1, ZB-V,
DualPipeV) would run such a node's backward again, whole, in its weight half: under those
schedules only the pieces without a weight matrix are compiled (norms, rotary, the gated
activation), and the matrix products stay the eager nodes that split.

What is not compiled runs eager at known graph breaks, each marked ``@graph_break``
(``meshpipe.graph_breaks``, made ``torch.compiler.disable`` here before compiling):

- the attention core: meshpipe's attentions (local, Ulysses, ring, hybrid) read the token
  layout of each microbatch (documents, windows) and communicate, so compiling them would
  recompile for every pack of documents. Not so a plain sequence's on one rank (one SDPA
  call) nor a pack's on one CUDA rank in bf16/fp16 (one variable-length flash call on the
  documents the chunk derived before its blocks): they stay in the block's graph
  (``meshpipe.context.routing``);
- tensor-parallel communication (``meshpipe.parallel.tp_comm``);
- a mixture-of-experts block's experts: its forward is cut at its all-to-alls for combined
  1F1B (``forward_steps``), so only its attention and norms are compiled.

A chunk of dense reference blocks (or of a common decoder's layers) runs as one graph on a plain
sequence (``ChunkGraph``, ``--chunk-graphs``): each block a nested compile region, traced and
compiled once and called for every layer (compile time grows a little with depth, not a block's
worth a layer), while the chunk pays one graph call's host time (guards, the autograd wrapper) a
microbatch, not one a layer. A microbatch whose attention would break a block's graph (a pack, a
context-parallel rank: nothing may break inside a nested region) runs the blocks' own compiled code.

``MESHPIPE_COMPILE_BACKEND`` names another backend than inductor (``aot_eager`` traces and
differentiates like inductor without generating code: quick, for checking);
``MESHPIPE_COMPILE_MODE`` an inductor mode (``max-autotune-no-cudagraphs``). The modes that
run the regions as CUDA graphs (``reduce-overhead``, ``max-autotune``) are refused
(``check_mode``): a graph's replay writes its outputs over the last replay's, while a
pipeline step still holds several microbatches' (and every layer's, where layers share one
compiled region) for their backwards. On an H100 (torch 2.11) ``reduce-overhead`` failed so
at the second microbatch's backward of a one-stage 1F1B step.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from meshpipe import graph_breaks
from meshpipe.context.local import LocalAttention
from meshpipe.models import hf_moe
from meshpipe.models.hf import HFChunk
from meshpipe.models.hf_attention import call_layer, meshpipe_arguments
from meshpipe.models.transformer import TransformerBlock

BACKEND_VARIABLE = "MESHPIPE_COMPILE_BACKEND"
MODE_VARIABLE = "MESHPIPE_COMPILE_MODE"
# transformers' decoders name their norms <Model>RMSNorm.
HF_NORM_SUFFIX = "RMSNorm"


def backend() -> str:
    return os.environ.get(BACKEND_VARIABLE, "inductor")


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def mode() -> str | None:
    return os.environ.get(MODE_VARIABLE) or None


def check_mode() -> None:
    """Refuse a compile mode that runs the regions as CUDA graphs (see the module's note)."""
    if mode() in CUDA_GRAPH_MODES:
        raise ValueError(f"{MODE_VARIABLE}={mode()} replays the compiled blocks as CUDA "
                         "graphs, which overwrite outputs that a pipeline step still holds "
                         "for backward; unset it or use max-autotune-no-cudagraphs")


def regions(block: nn.Module, split_backward: bool = False) -> list[nn.Module]:
    """The parts of ``block`` that are compiled. A dense reference block and a Hugging Face
    layer whole: one graph on a plain sequence and a CUDA pack, else two, cut at the
    attention core (a Hugging Face layer four where the torch has no nested graph breaks:
    ``compile_blocks``).
    Each call of a compiled region costs host time (0.3-0.45 ms forward or backward on an
    H100 host, more than the kernels it fuses at a 740M model's sizes), so the fewer regions
    the better. A reference block that recomputes (``--recompute full``: its forward under
    activation checkpointing, which a graph break inside takes out of the graph whole) and
    a mixture-of-experts block: its norms, attention and MLP each; the experts never. Under
    a split backward only the pieces without a weight matrix (norms, rotary, the gated
    activation): a compiled region is one autograd node, whose backward the weight half
    would run again whole."""
    if split_backward:
        return _weightless_pieces(block)
    if isinstance(block, TransformerBlock):
        if not (block.is_moe or block.recompute):
            return [block]
        return [block.attention_norm, block.attention, block.mlp_norm] + (
            [] if block.is_moe else [block.mlp])
    if hf_moe.expert_layer(block) is not None:
        return [block.input_layernorm, block.self_attn, block.post_attention_layernorm]
    return [block]


def _weightless_pieces(block: nn.Module) -> list[nn.Module]:
    if isinstance(block, TransformerBlock):
        pieces = [block.attention_norm, block.attention.rope, block.mlp_norm]
        return pieces + ([] if block.is_moe else [block.mlp.activation])
    norms = [module for module in block.modules()
             if type(module).__name__.endswith(HF_NORM_SUFFIX)]
    activation = getattr(getattr(block, "mlp", None), "act_fn", None)
    return norms + ([activation] if isinstance(activation, nn.Module) else [])


NESTED_GRAPH_BREAKS = torch.__version__ >= (2, 10)
"""Whether ``compile_blocks`` turns TorchDynamo's nested graph breaks on: torch 2.9 has them,
but its compiled blocks then fail on symbolic sizes (a norm's gain against a dynamic hidden
size), so there a break inside a nested call cuts every enclosing function."""


CHUNK_GRAPHS = hasattr(torch.compiler, "nested_compile_region") and torch.__version__ >= (2, 11)
"""Whether this torch runs a chunk's blocks as nested compile regions of one graph
(``ChunkGraph``): torch 2.11 and 2.13 were tested."""


def chunk_graphs(setting: str) -> bool:
    """``--chunk-graphs``: auto is on where this torch has them (``CHUNK_GRAPHS``)."""
    return setting == "on" or (setting == "auto" and CHUNK_GRAPHS)


def compile_blocks(chunks: Iterable[nn.Module], split_backward: bool = False,
                   chunk_graphs: bool = False) -> int:
    """Compile every block of ``chunks`` (their ``layers``) in place, ``regions`` of each
    (a module shared by blocks once); how many modules. With ``chunk_graphs`` each chunk
    also gets its ``chunk_graph`` as its ``layers_graph`` (None where it has none).

    A split backward keeps the autograd graph from its input half to its weight half, which
    AOTAutograd's donated buffers (backward freeing saved tensors early) forbid: they are
    turned off, process-wide. From torch 2.10 (``NESTED_GRAPH_BREAKS``), TorchDynamo's
    nested graph breaks are turned on, process-wide: a break inside a nested call (a Hugging
    Face layer calls its attention module, whose core breaks) then resumes there instead of
    cutting every enclosing function around the call, so such a layer is two graphs, not
    four."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config

    functorch_config.donated_buffer = False
    if NESTED_GRAPH_BREAKS:
        dynamo_config.nested_graph_breaks = True
    graph_breaks.install()
    compiled: dict[int, nn.Module] = {}
    for chunk in chunks:
        for block in chunk.layers.values():
            for region in regions(block, split_backward):
                if id(region) not in compiled:
                    region.compile(backend=backend(), mode=mode())
                    compiled[id(region)] = region
        if chunk_graphs and not split_backward:
            chunk.layers_graph = chunk_graph(chunk)
    return len(compiled)


class ChunkGraph:
    """A chunk's layers as one compiled graph, each layer a nested compile region
    (``torch.compiler.nested_compile_region``): inductor compiles one layer's forward and
    backward and calls them for every layer, and the chunk's forward is one graph call
    (guards checked once, one autograd node) where its layers' own regions are one a layer.
    On this CPU with inductor (``benchmarks/results/compile_regions.md``), a reference
    chunk's forward + backward took 0.74-0.78x the time of its blocks compiled one by one
    at dim 64 (4 and 16 layers, where host calls are the step) and 0.95-0.99x at dim 256;
    its first step compiled 1.13x as long at 4 layers and 1.37x at 16.

    The chunk's weights' gradients then arrive together at the end of its backward, where a
    layer's arrive after the layer's: a step holds up to a chunk's weight gradients more at
    that moment. Nothing may break a nested region's graph, so the chunk runs it only for a
    microbatch whose attention stays inside in every layer (``takes``): a plain sequence on
    one rank, no layer's sliding window shorter than it.

    The graph is compiled for static sizes (``dynamic=False``): a second graph of layers of
    another width in the same process then compiles anew, where with automatic dynamic
    sizes torch 2.13's TorchDynamo failed to reuse the layer's region (``KeyError`` on a
    size, ``stamp_out_subgraph``). A run's plain sequences have one size (evaluation under
    ``no_grad`` compiles once more)."""

    def __init__(self, layers: Iterable[nn.Module], attention: LocalAttention,
                 run: Callable[..., Tensor], windows: Iterable[int | None] = (None,)):
        self.layers = tuple(layers)
        self._attention = attention
        self._windows = tuple(set(windows))
        self._run = torch.compile(run, backend=backend(), mode=mode(), dynamic=False)
        self.broken: str | None = None

    def takes(self, hidden: Tensor, positions: Tensor | None, doc_ids: Tensor | None) -> bool:
        """Whether a microbatch of ``hidden`` ``[batch, seq, dim]`` with this token layout
        keeps every layer's attention in its graph: one SDPA call on a plain sequence
        (``LocalAttention.runs_in_graph``, which reads of its queries only the sequence
        length, device and dtype, which ``hidden`` has too)."""
        return self.broken is None and all(
            self._attention.runs_in_graph(hidden, positions, doc_ids, window, None)
            for window in self._windows)

    def run(self, hidden: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
            *inputs: Any) -> Tensor | None:
        """The layers on ``hidden`` where this microbatch ``takes`` the graph, else None (the
        chunk then runs its layers one by one); ``inputs``: what a Hugging Face chunk's
        layers also take (each layer's rotary tables, the position ids). Where TorchDynamo
        cannot capture a layer whole (something breaks its graph: a decoder of another
        transformers release might), a warning says so, this microbatch and every later
        one run the layers one by one, and nothing has run yet (it fails while tracing)."""
        if not self.takes(hidden, positions, doc_ids):
            return None
        from torch._dynamo.exc import UncapturedHigherOrderOpError

        try:
            return self._run(self.layers, self._attention, hidden, *inputs)
        except UncapturedHigherOrderOpError as error:
            self.broken = str(error).strip().splitlines()[0]
            warnings.warn(f"--chunk-graphs: a layer of a chunk breaks its nested region "
                          f"({self.broken}); the chunk runs its layers' own compiled graphs "
                          f"instead (--chunk-graphs off does so from the start)")
            return None


HF_CHUNK_GRAPH_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
"""transformers' decoders whose chunks run as one graph (``chunk_graph``): each tested
against its layers one by one. Another's layers keep a graph each."""


def chunk_graph(chunk: nn.Module) -> ChunkGraph | None:
    """``chunk``'s layers as a ``ChunkGraph`` where they can run as nested regions of one
    graph, else None: dense reference blocks compiled whole (``regions``) without
    tensor-parallel communication, or the dense layers of a decoder of
    ``HF_CHUNK_GRAPH_TYPES`` without recomputation, tensor parallelism (no layer holds a
    hook) or soft-capped attention; attending with ``LocalAttention``."""
    layers = list(chunk.layers.values())
    if not layers:
        return None
    if all(isinstance(block, TransformerBlock) and regions(block) == [block]
           and block.attention.tp.size == 1 for block in layers):
        attention = layers[0].attention.core_attention
        return ChunkGraph(layers, attention, _run_blocks) if isinstance(
            attention, LocalAttention) else None
    if not (isinstance(chunk, HFChunk) and isinstance(chunk.attention, LocalAttention)
            and not chunk.recompute and chunk.sequence_shards == 1
            and all(_plain_hf_layer(layer) for layer in layers)):
        return None
    return ChunkGraph(layers, chunk.attention, _run_hf_layers,
                      [_sliding_window(layer.self_attn) for layer in layers])


def _plain_hf_layer(layer: nn.Module) -> bool:
    attention = getattr(layer, "self_attn", None)
    config = getattr(attention, "config", None)
    return (getattr(config, "model_type", None) in HF_CHUNK_GRAPH_TYPES
            and hf_moe.expert_layer(layer) is None
            and getattr(attention, "attn_logit_softcapping", None) is None
            and not any(module._forward_pre_hooks or module._forward_hooks
                        for module in layer.modules()))


def _sliding_window(attention: nn.Module) -> int | None:
    """The window transformers' attention module passes its attention function: its own
    (Qwen2, Qwen3, Gemma 3: None on a full layer), else its config's (Mistral, Phi-3)."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(attention.config, "sliding_window", None)


def _run_blocks(blocks: tuple[TransformerBlock, ...], attention: LocalAttention,
                hidden: Tensor) -> Tensor:
    """The reference blocks in order; ``attention`` is not read (each block holds its own),
    it is there because ``ChunkGraph`` calls every chunk's run alike."""
    for block in blocks:
        hidden = _block_region(block, hidden)
    return hidden


def _plain_block(block: TransformerBlock, hidden: Tensor) -> Tensor:
    return block._forward(hidden, None, None, None)


def _run_hf_layers(layers: tuple[nn.Module, ...], attention: LocalAttention, hidden: Tensor,
                   tables: tuple[tuple[Tensor, Tensor], ...], position_ids: Tensor) -> Tensor:
    for layer, (cos, sin) in zip(layers, tables):
        hidden = _hf_layer_region(layer, attention, hidden, cos, sin, position_ids)
    return hidden


def _plain_hf_layer_call(layer: nn.Module, attention: LocalAttention, hidden: Tensor,
                         cos: Tensor, sin: Tensor, position_ids: Tensor) -> Tensor:
    return call_layer(layer, hidden, (cos, sin), position_ids,
                      meshpipe_arguments(attention, None, None, None))


_block_region, _hf_layer_region = (
    (torch.compiler.nested_compile_region(_plain_block),
     torch.compiler.nested_compile_region(_plain_hf_layer_call)) if CHUNK_GRAPHS
    else (_plain_block, _plain_hf_layer_call))
