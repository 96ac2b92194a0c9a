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
from torch import nn

from meshpipe import graph_breaks
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


def compile_blocks(chunks: Iterable[nn.Module], split_backward: bool = False) -> int:
    """Compile every block of ``chunks`` (their ``layers``) in place, ``regions`` of each
    (a module shared by blocks once); how many modules.

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
    return len(compiled)
