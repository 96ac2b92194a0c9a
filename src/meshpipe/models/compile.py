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

A chunk of dense reference blocks runs as one graph on a plain sequence (``ChunkGraph``,
``--chunk-graphs``): each block a nested compile region, traced and compiled once and called for
every layer (compile time grows a little with depth, not a block's worth a layer), while the chunk
pays one graph call's host time (guards, the autograd wrapper) a microbatch, not one a layer. A
microbatch whose attention would break a block's graph (a pack, a context-parallel rank: nothing may
break inside a nested region) runs the blocks' own compiled code.

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
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from meshpipe import graph_breaks
from meshpipe.context.local import LocalAttention
from meshpipe.models import hf_moe
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
    (a module shared by blocks once); how many modules. With ``chunk_graphs`` a chunk whose
    blocks ``ChunkGraph`` takes also gets one as its ``layers_graph``.

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
        if (chunk_graphs and not split_backward
                and ChunkGraph.takes_blocks(chunk.layers.values())):
            chunk.layers_graph = ChunkGraph(chunk.layers.values())
    return len(compiled)


class ChunkGraph:
    """A chunk's dense reference blocks as one compiled graph, each block a nested compile
    region (``torch.compiler.nested_compile_region``): inductor compiles one block's
    forward and backward and calls them for every layer, and the chunk's forward is one
    graph call (guards checked once, one autograd node) where its blocks' own regions are
    one a layer. On this CPU with inductor (``benchmarks/results/compile_regions.md``), a
    chunk's forward + backward took 0.74-0.78x the time of its blocks compiled one by one
    at dim 64 (4 and 16 layers, where host calls are the step) and 0.95-0.99x at dim 256;
    its first step compiled 1.13x as long at 4 layers and 1.37x at 16.

    The chunk's weights' gradients then arrive together at the end of its backward, where a
    block's arrive after the block's: a step holds up to a chunk's weight gradients more at
    that moment. Nothing may break a nested region's graph, so the chunk runs it only for a
    microbatch whose attention stays inside (``takes``): a plain sequence on one rank.

    The graph is compiled for static sizes (``dynamic=False``): a second graph of blocks of
    another width in the same process then compiles anew, where with automatic dynamic
    sizes torch 2.13's TorchDynamo failed to reuse the block's region (``KeyError`` on a
    size, ``stamp_out_subgraph``). A run's plain sequences have one size (evaluation under
    ``no_grad`` compiles once more)."""

    def __init__(self, blocks: Iterable[TransformerBlock]):
        self.blocks = tuple(blocks)
        self._attention = self.blocks[0].attention.core_attention
        self._run = torch.compile(_run_blocks, backend=backend(), mode=mode(), dynamic=False)

    @staticmethod
    def takes_blocks(blocks: Iterable[nn.Module]) -> bool:
        """Whether ``blocks`` (a chunk's) can run as nested regions of one graph: dense
        reference blocks compiled whole (``regions``), without tensor-parallel
        communication, attending with ``LocalAttention``."""
        blocks = list(blocks)
        return bool(blocks) and all(
            isinstance(block, TransformerBlock) and regions(block) == [block]
            and block.attention.tp.size == 1
            and isinstance(block.attention.core_attention, LocalAttention) for block in blocks)

    def takes(self, hidden: Tensor, positions: Tensor | None, doc_ids: Tensor | None) -> bool:
        """Whether a microbatch of ``hidden`` ``[batch, seq, dim]`` with this token layout
        keeps every block's attention in its graph: one SDPA call on a plain sequence
        (``LocalAttention.runs_in_graph``, which reads of its queries only the sequence
        length, device and dtype, which ``hidden`` has too)."""
        return self._attention.runs_in_graph(hidden, positions, doc_ids, None, None)

    def __call__(self, hidden: Tensor) -> Tensor:
        return self._run(self.blocks, hidden)


def _run_blocks(blocks: tuple[TransformerBlock, ...], hidden: Tensor) -> Tensor:
    for block in blocks:
        hidden = _block_region(block, hidden)
    return hidden


def _plain_block(block: TransformerBlock, hidden: Tensor) -> Tensor:
    return block._forward(hidden, None, None, None)


_block_region = (torch.compiler.nested_compile_region(_plain_block) if CHUNK_GRAPHS
                 else _plain_block)
