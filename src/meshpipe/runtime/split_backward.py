"""Split one backward pass into input gradients now (I) and weight gradients later (W).

Zero-bubble schedules send a stage's input gradients upstream as early as possible and fill
bubbles with the weight gradients. ``SplitBackward`` does that on the stage's existing
autograd graph, without recomputing the forward and without running the backward twice.

How: the backward graph of the stage is read once (from the outputs down to the leaves).
Nodes from which a stage input is reachable form the *input side*. Every weight (any leaf
that is not a stage input) gets its gradient from the roots either through a *frontier
node* (an input-side node with an edge leaving the input side toward the weight, e.g. the
matmul that consumes both the activation and the weight) or through an output that leads
to no input at all (on the first stage, every output). I runs ``autograd.grad`` toward the
inputs only, so every frontier node skips its weight-side product, and a pre-hook captures
the gradient arriving at each frontier node. W restarts the backward from the frontier
nodes with the captured gradients, limited to the weights: each frontier node now computes
only its weight-side product. A pre-hook pins each frontier node's incoming gradient to the
captured value, so a path from one frontier node to another never counts a gradient twice.

Weights that share frontier nodes form a group. One backward call may serve several groups
only if none of them can reach another's frontier through the input side (otherwise the
engine would walk the input-side path between them again, the very work I already did);
groups are packed into such calls level by level (a level is how many frontier nodes lie
below, e.g. all of a transformer layer's q/k/v projections share one call).

Cost: I is the input-gradient half of the backward plus a Python walk of the graph; W is
the weight-gradient half plus one ``autograd.backward`` call per packed batch (about six
per transformer layer). Memory: the graph is retained from I to W (as any split backward
must) and the captured gradients at the frontier nodes (about one activation gradient per
weight-consuming op) are held until W.

Recomputation: a region under ``torch.utils.checkpoint(..., use_reentrant=False)`` is
recomputed by I, and once more by W: its frontier nodes read their saved tensors in both
passes, and the checkpoint hands out each recomputed tensor once per pass. W's calls share
that one recomputation (``torch.utils.checkpoint.GraphExecGroup``); without it each call
recomputed the region again, and W cost several forwards more (a torch without that group
still does).

W accumulates through ``autograd.backward(inputs=weights)``, the way a full backward does
(into ``.grad``, running the parameters' hooks), so I then W gives the gradients of B.

Limits:

- A hook registered on an input-side activation (``Tensor.register_hook`` on a tensor the
  stage input flows into) runs in I and again in W, because W restarts at the node that
  produced that activation. The gradients stay right (W starts from the value I captured
  after the hook), but side effects (counting, logging, recording statistics) happen
  twice; keep such hooks pure, or use a schedule with full backwards (B).
- ``torch.utils.checkpoint(..., use_reentrant=True)`` cannot run here: its backward refuses
  ``autograd.grad`` and ``backward(inputs=...)``, which I and W are made of. I finds it in
  the graph and raises before computing anything; ``Stage`` reports that as a StageError
  asking for ``use_reentrant=False``, which works.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils import checkpoint

GradTuple = tuple[Tensor | None, ...]


def _parents_of_graph(roots: Sequence[GradientEdge]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, mapped to the nodes that send it a gradient."""
    parents: dict[Node, list[Node]] = {}
    stack = []
    for edge in roots:
        if edge.node not in parents:
            parents[edge.node] = []
            stack.append(edge.node)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(targets: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``targets`` and every node with a path to one of them."""
    found = set(targets)
    stack = list(targets)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def _postorder(nodes: set[Node]) -> list[Node]:
    """``nodes`` ordered so that each comes after its children within ``nodes``."""
    order: list[Node] = []
    visited: set[Node] = set()
    for start in nodes:
        stack = [(start, False)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                order.append(node)
                continue
            if node in visited:
                continue
            visited.add(node)
            stack.append((node, True))
            stack.extend((child, False) for child, _ in node.next_functions
                         if child in nodes and child not in visited)
    return order


class _UnionFind:
    def __init__(self) -> None:
        self._parent: dict[Node, Node] = {}

    def find(self, item: Node) -> Node:
        self._parent.setdefault(item, item)
        while self._parent[item] is not item:
            self._parent[item] = self._parent[self._parent[item]]
            item = self._parent[item]
        return item

    def union(self, first: Node, second: Node) -> None:
        self._parent[self.find(first)] = self.find(second)


class _WeightGroup:
    """Weights whose gradients come from a common set of frontier nodes and roots."""

    def __init__(self) -> None:
        self.weights: list[Tensor] = []
        self.frontier: set[Node] = set()
        self.root_nodes: set[Node] = set()


def _weight_sources(weight_node: Node, parents: dict[Node, list[Node]], input_side: set[Node],
                    root_nodes: set[Node]) -> set[Node]:
    """Frontier nodes and input-free root nodes from which a weight gets its gradient."""
    sources: set[Node] = set()
    seen = {weight_node}
    stack = [weight_node]
    while stack:
        node = stack.pop()
        if node in root_nodes:
            sources.add(node)
        for parent in parents[node]:
            if parent in input_side:
                sources.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return sources


def _weight_groups(parents: dict[Node, list[Node]], input_side: set[Node],
                   input_nodes: set[Node], root_nodes: set[Node]) -> list[_WeightGroup]:
    """Every leaf below the roots that is not a stage input, grouped by shared sources."""
    sources_of = {node: _weight_sources(node, parents, input_side, root_nodes)
                  for node in parents if hasattr(node, "variable") and node not in input_nodes}
    union = _UnionFind()
    for weight_node, sources in sources_of.items():
        for source in sources:
            union.union(weight_node, source)
    groups: dict[Node, _WeightGroup] = {}
    for weight_node, sources in sources_of.items():
        group = groups.setdefault(union.find(weight_node), _WeightGroup())
        group.weights.append(weight_node.variable)
        for source in sources:
            (group.frontier if source in input_side else group.root_nodes).add(source)
    return list(groups.values())


def _pack_into_calls(groups: list[_WeightGroup],
                     input_side: set[Node]) -> list[list[_WeightGroup]]:
    """Batches of groups such that no group of a batch reaches another's frontier node."""
    owner = {node: index for index, group in enumerate(groups) for node in group.frontier}
    # For each input-side node: groups owning a frontier node strictly below it, and the
    # largest number of frontier nodes on a path below it (its level).
    below: dict[Node, tuple[int, int]] = {}
    for node in _postorder(input_side):
        mask, level = 0, 0
        for child, _ in node.next_functions:
            if child in below:
                child_mask, child_level = below[child]
                child_owner = owner.get(child)
                if child_owner is not None:
                    child_mask |= 1 << child_owner
                    child_level += 1
                mask |= child_mask
                level = max(level, child_level)
        below[node] = (mask, level)
    reach = [0] * len(groups)
    level_of = [-1] * len(groups)
    for node, index in owner.items():
        mask, level = below[node]
        reach[index] |= mask & ~(1 << index)
        level_of[index] = max(level_of[index], level)
    calls: list[list[_WeightGroup]] = []
    for level in sorted(set(level_of)):
        packed: list[tuple[int, int, list[_WeightGroup]]] = []  # (members, their reach, groups)
        for index in (i for i in range(len(groups)) if level_of[i] == level):
            bit = 1 << index
            for slot, (members, members_reach, batch) in enumerate(packed):
                if not members_reach & bit and not reach[index] & members:
                    packed[slot] = (members | bit, members_reach | reach[index],
                                    batch + [groups[index]])
                    break
            else:
                packed.append((bit, reach[index], [groups[index]]))
        calls.extend(batch for _, _, batch in packed)
    return calls


class ReentrantCheckpointError(RuntimeError):
    """The graph of a split backward holds ``torch.utils.checkpoint(..., use_reentrant=True)``."""


_REENTRANT_CHECKPOINT_NODE = "CheckpointFunctionBackward"


def _refuse_reentrant_checkpoints(nodes: Iterable[Node]) -> None:
    """Raise before any gradient is computed if the graph holds a reentrant checkpoint: its
    backward refuses ``autograd.grad`` and ``backward(inputs=...)`` (torch 2.8 fails in W
    instead, with another message, and torch 2.6 crashes there)."""
    if any(node.name() == _REENTRANT_CHECKPOINT_NODE for node in nodes):
        raise ReentrantCheckpointError("a split backward cannot run through "
                                       "torch.utils.checkpoint(..., use_reentrant=True)")


def _one_recomputation() -> AbstractContextManager:
    """A context in which the backward calls made recompute each checkpointed region once
    between them (the module docstring); a no-op on a torch without the group."""
    group = getattr(checkpoint, "GraphExecGroup", None)
    return nullcontext() if group is None else group()


class SplitBackward:
    """The backward of one microbatch, run as ``input_grads()`` then ``accumulate_weight_grads()``.

    ``roots`` are the gradient edges of the outputs that take part, ``root_grads`` their
    gradients, ``inputs`` the stage inputs that require grad (leaves). Call each method once,
    in order.
    """

    def __init__(self, roots: Sequence[GradientEdge], root_grads: Sequence[Tensor],
                 inputs: Sequence[Tensor]):
        self._roots = list(roots)
        self._root_grads = list(root_grads)
        self._inputs = list(inputs)
        self._calls: list[list[_WeightGroup]] = []
        self._captured: dict[Node, GradTuple] = {}

    def input_grads(self) -> list[Tensor | None]:
        """Gradients of the inputs (None where no gradient reached one); stores what W needs."""
        parents = _parents_of_graph(self._roots)
        _refuse_reentrant_checkpoints(parents)
        input_nodes = {get_gradient_edge(t).node for t in self._inputs}
        input_side = _ancestors(input_nodes & parents.keys(), parents)
        root_nodes = {edge.node for edge in self._roots}
        groups = _weight_groups(parents, input_side, input_nodes, root_nodes)
        self._calls = _pack_into_calls(groups, input_side)
        frontier = set().union(*(group.frontier for group in groups))
        handles = [node.register_prehook(self._capture_hook(node)) for node in frontier]
        try:
            grads = self._grads_toward_inputs()
        finally:
            for handle in handles:
                handle.remove()
        self._inputs = []
        return grads

    def held_bytes(self) -> int:
        """Bytes of the gradients I captured for W (each storage once): what this split
        backward holds beyond the forward's saved tensors until W."""
        storages = {grad.untyped_storage().data_ptr(): grad.untyped_storage().nbytes()
                    for grads in self._captured.values() for grad in grads if grad is not None}
        return sum(storages.values())

    def accumulate_weight_grads(self) -> None:
        """Add the weight gradients into ``.grad`` from what I captured."""
        roots_at: dict[Node, list[tuple[GradientEdge, Tensor]]] = {}
        for edge, grad in zip(self._roots, self._root_grads):
            roots_at.setdefault(edge.node, []).append((edge, grad))
        try:
            with _one_recomputation():
                for groups in self._calls:
                    self._run_call(groups, roots_at)
        finally:
            self._calls, self._captured, self._roots, self._root_grads = [], {}, [], []

    def _capture_hook(self, node: Node):
        def capture(grad_outputs: GradTuple) -> None:
            self._captured[node] = tuple(grad_outputs)
        return capture

    def _grads_toward_inputs(self) -> list[Tensor | None]:
        if not self._inputs or not self._roots:
            return [None] * len(self._inputs)
        return list(torch.autograd.grad(self._roots, self._inputs, self._root_grads,
                                        retain_graph=True, allow_unused=True))

    def _run_call(self, groups: Iterable[_WeightGroup],
                  roots_at: dict[Node, list[tuple[GradientEdge, Tensor]]]) -> None:
        edges: list[GradientEdge] = []
        grads: list[Tensor] = []
        weights: list[Tensor] = []
        handles = []
        try:
            for group in groups:
                weights.extend(group.weights)
                for node in group.frontier:
                    captured = self._captured.get(node)
                    if captured is None:
                        continue
                    for output_nr, grad in enumerate(captured):
                        if grad is not None:
                            edges.append(GradientEdge(node, output_nr))
                            grads.append(grad)
                    handles.append(node.register_prehook(lambda _, pinned=captured: pinned))
                for node in group.root_nodes:
                    for edge, grad in roots_at.get(node, ()):
                        edges.append(edge)
                        grads.append(grad)
            if edges:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=weights)
        finally:
            for handle in handles:
                handle.remove()
