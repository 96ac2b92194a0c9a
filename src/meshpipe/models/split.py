"""Cut a ``Transformer`` into pipeline stages, and name the parameters stages share.

A chunk speaks pipeline messages: the first takes ``(tokens, positions, doc_ids)``, every
chunk but the last returns ``(hidden, positions, doc_ids)`` for the next one, and the last
returns logits. A model with mixture-of-experts layers adds the running load-balancing loss
(a scalar) to every message: ``(hidden, positions, doc_ids, aux)``, and ``(logits, aux)``
from the last chunk. ``positions`` and ``doc_ids`` may be None; int64 tensors and None
travel beside the float activations in one message.

Chunks reuse the model's own submodules, so on one process chaining them is the model, and
their parameter names are the full model's names (``layers.5.mlp.w_up.weight`` on whichever
chunk holds layer 5), which keeps checkpoints layout-independent.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from meshpipe.context.routing import GraphPack, pack_for_graph
from meshpipe.models.transformer import (Held, Transformer, default_positions, logits_of,
                                         run_layers)
from meshpipe.runtime.substeps import run_steps
from meshpipe.schedules.placement import balanced_layers

PipelineMessage = tuple[Tensor, Tensor | None, Tensor | None]


class TransformerChunk(nn.Module):
    """Layers ``[start, stop)`` of a model; the embedding if first, the norm and head if last."""

    def __init__(self, model: Transformer, start: int, stop: int, *, first: bool, last: bool):
        super().__init__()
        self.is_first = first
        self.is_last = last
        self.layer_range = (start, stop)
        self.tp = model.tp
        self.is_moe = model.config.is_moe
        if first:
            self.embedding = model.embedding
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, stop)})
        if last:
            self.norm = model.norm
            self.head = model.head
        self.layers_graph = None  # models.compile.ChunkGraph, set under --compile

    def forward(self, x: Tensor, positions: Tensor | None = None,
                doc_ids: Tensor | None = None, aux: Tensor | None = None) -> Any:
        return run_steps(self.forward_steps(x, positions, doc_ids, aux))

    def forward_steps(self, x: Tensor, positions: Tensor | None = None,
                      doc_ids: Tensor | None = None, aux: Tensor | None = None):
        """``forward`` cut at the experts' exchanges (``meshpipe.runtime.substeps``)."""
        hidden = self.embedding(x) if self.is_first else x
        layer_positions = None if positions is None else default_positions(
            x if self.is_first else hidden, positions, check_values=self.is_first,
            sequence_shards=1 if self.is_first else self.tp.sequence_shards)
        if self.is_moe and aux is None:
            aux = torch.zeros((), device=hidden.device)
        graph = self.layers_graph
        layers_out = None if graph is None else graph.run(hidden, layer_positions, doc_ids)
        if layers_out is not None:
            hidden = layers_out
        else:
            hidden, aux = yield from run_layers(self.layers.values(), hidden, aux,
                                                layer_positions, doc_ids,
                                                self._pack(layer_positions, doc_ids, hidden))
        if self.is_last:
            logits = logits_of(self, hidden)
            return (logits, aux) if self.is_moe else logits
        return (hidden, positions, doc_ids, aux) if self.is_moe else (hidden, positions, doc_ids)

    def _pack(self, positions: Tensor | None, doc_ids: Tensor | None,
              hidden: Tensor) -> GraphPack | None:
        """The microbatch's pack as its compiled blocks keep it in their graphs, derived once
        here, outside them (``routing.pack_for_graph``)."""
        if not self.layers:
            return None
        block = next(iter(self.layers.values()))
        return pack_for_graph(block.attention.core_attention, positions, doc_ids, hidden)

    def extra_repr(self) -> str:
        start, stop = self.layer_range
        return f"layers=[{start}, {stop}), first={self.is_first}, last={self.is_last}"


def held_by_stages(layers_per_stage: list[int], stages: Iterable[int],
                   tie_embeddings: bool) -> Held:
    """The parts of the model a rank holding ``stages`` needs: their layers, the embedding
    with the first stage (or the last, whose head it is when tied), the norm and head with
    the last."""
    stages = set(stages)
    starts = list(itertools.accumulate(layers_per_stage, initial=0))
    last = len(layers_per_stage) - 1
    return Held(layers=frozenset(i for s in stages for i in range(starts[s], starts[s + 1])),
                embedding=0 in stages or (tie_embeddings and last in stages),
                head=last in stages)


def split(model: Transformer, num_stages: int,
          layers_per_stage: list[int] | None = None) -> list[TransformerChunk]:
    """Cut ``model`` into ``num_stages`` chunks of consecutive layers.

    ``layers_per_stage`` gives each stage's layer count (zeros allowed: a stage may hold only
    the embedding, only the head, or nothing); by default the layers are balanced, which
    needs at least one layer per stage.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"split expects a meshpipe Transformer, got {type(model).__name__}")
    n_layers = len(model.layers)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if layers_per_stage is None:
        if num_stages > n_layers:
            raise ValueError(
                f"cannot balance {n_layers} layers over {num_stages} stages; use fewer stages "
                f"or pass layers_per_stage explicitly (zeros allowed)")
        layers_per_stage = balanced_layers(n_layers, num_stages)
    counts = list(layers_per_stage)
    if len(counts) != num_stages:
        raise ValueError(f"layers_per_stage has {len(counts)} entries for {num_stages} stages")
    if any(not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != n_layers:
        raise ValueError(f"layers_per_stage {counts} must be non-negative ints summing to the "
                         f"model's {n_layers} layers")
    chunks = []
    start = 0
    for stage, count in enumerate(counts):
        chunks.append(TransformerChunk(model, start, start + count, first=stage == 0,
                                       last=stage == num_stages - 1))
        start += count
    return chunks


@dataclass(frozen=True)
class SharedParameter:
    """A parameter held by several stages, e.g. the tied embedding and head weight.

    ``locations`` lists ``(stage index, parameter name in that stage's chunk)``. What the
    runtime must do: after the backward of a step and before the optimizer step, sum the
    gradient of the parameter over the ranks holding those stages (stages on one rank share a
    single tensor, whose gradient is already the local sum: count that rank once). The copies
    start equal (same init on every rank) and then get equal gradients, so they stay equal.
    """

    locations: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(stage for stage, _ in self.locations)


def shared_parameters(chunks: list[nn.Module]) -> list[SharedParameter]:
    """Parameters that appear (as the same tensor) in more than one chunk."""
    by_identity: dict[int, list[tuple[int, str]]] = {}
    for stage, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            by_identity.setdefault(id(param), []).append((stage, name))
    return [SharedParameter(tuple(locations)) for locations in by_identity.values()
            if len(locations) > 1]
