"""The cost model at scale: a layout of a decoder on a cluster of GPU nodes, priced from the
model's shape and the cluster's description, no measurement needed (``meshpipe plan``).

Pure Python like the rest of ``schedules``. Per microbatch and GPU (``layer_costs``):

- compute: every projection is a matrix product priced at the GPU's bf16 peak times an
  efficiency that falls for small matrices (``Efficiency.matmul_s``: each dimension ``d``
  scales it by ``d / (d + matmul_half_size)``); attention (flash kernels, causal: half the
  score products) at its own efficiency, which grows with the sequence; norms, rotary, the
  activation, residual adds and the loss as bytes through the GPU's memory. A backward's
  input-gradient half (I) is its data-gradient products, attention's backward (2.5 times
  its forward's products, as flash kernels do) and the element-wise work twice; its
  weight-gradient half (W) the weight-gradient products and, where the runtime does not fuse
  it, adding the gradients into their float32 accumulators. A layer lasts at least the
  host's time to launch it (``Runtime.host_layer_s``). Recomputation adds the forward
  (``full``, to I and again to W where the schedule splits the backward, as the runtime
  does) or attention's forward (``selective``).
- tensor parallelism (with sequence parallelism, the layout meshpipe runs at tp > 1): per
  layer two all-gathers and two reduce-scatters of a microbatch's activations forward, as
  many backward, inside a node; ``Runtime.tensor_overlap`` of it hidden.
- context parallelism: ring attention sends K and V around the ring ``cp - 1`` times a layer
  (K, V and their gradients backward), each exchange hidden behind a tile's attention where
  it is shorter; Ulysses four all-to-alls of q, k, v and the output a layer, each way,
  exposed.
- experts: each MoE layer's dispatch and combine all-to-alls of the routed tokens, given to
  the simulator as ``CostModel.a2a``: other schedules wait for them; combined 1F1B hides each
  behind the other microbatch's layer as far as that layer's compute lasts (the planner's
  ``CostModel.overlap``). At tp > 1 meshpipe's tp ranks route the whole sequence and split
  each expert's width (``Runtime.experts_split_over_tp``): the same products, but routed
  rows not divided by tp, their outputs all-reduced over tp and kept whole for backward;
  Megatron-Core with an expert tensor-parallel size of 1 splits the tokens instead.
- the pipeline: stage messages (a microbatch's activations, sharded over tp) over the network
  unless the whole pipeline sits in a node; the bubble is the simulated schedule's own.
- data parallelism: the gradients' all-reduce (``--zero 1/2``: a reduce-scatter, then an
  all-gather of the updated bf16 weights) over the ``dp x cp`` replicas of each weight (expert
  weights over ``dp x cp / ep``), hierarchical where the group spans nodes (reduce-scatter
  in the node over NVLink, the rest between nodes, tree-like latency); the reduction runs
  behind the last microbatch's backward (the runtime's buckets), what does not fit in it is
  exposed, at least its last bucket. The optimizer streams the state it updates through
  memory.
- memory per GPU: the weights and optimizer state at the ZeRO level (bf16 weights with fp32
  masters, gradients and AdamW moments: ``ranking.state_bytes``), the schedule's peak of live
  activations (per token and layer: what the layer saves for backward, sharded over tp),
  the last stage's float32 logits, and the cluster's reserve.

Left out: FP8, stragglers, the network's topology beyond nodes, load imbalance between
experts, activation offloading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshpipe.schedules.cluster import Cluster
from meshpipe.schedules.model_shape import ModelShape
from meshpipe.schedules.ranking import Link, state_bytes

BF16 = 2.0
GRADIENT_REDUCE_BYTES = 4.0  # float32 gradients, as the runtime reduces them
ADAMW_BYTES_PER_PARAMETER = 30.0  # master, gradient and two moments read; three written; bf16 copy
BUCKET_BYTES = 32 * 2**20  # ``parallel.zero.BUCKET_BYTES``: the last one cannot hide
CP_KINDS = ("ring", "ulysses")


# meshpipe's attention (torch's SDPA flash kernel) on an H100, forward and backward together,
# causal: the fraction of the peak at each sequence length, as ``benchmarks/gpu_attention.py``
# measured the kernel alone (``results/gpu_bench_2026-11-26.md``: 0.27 at 8,192 tokens, 0.32
# at 16,384, 0.34 at 32,768); at 2,048 between the kernel alone (0.19) and what a 740M step's
# profile shows it taking in training (0.28, ``results/step_profile.md``).
SDPA_ON_H100 = ((2048, 0.25), (8192, 0.27), (16384, 0.32), (32768, 0.34))


@dataclass(frozen=True)
class Efficiency:
    """The fractions of the peak a GPU reaches: ``matmul`` for large bf16 matrix products,
    lowered for small ones by ``matmul_half_size`` (see the module docstring; 0.80 and 128
    price a 740M model's products at the 105 ms an H100 profile measured, 1.01x); flash
    attention's forward and backward together at each sequence length (``attention``:
    (tokens, fraction) points, linear in log tokens between them); ``memory`` the fraction of
    the memory bandwidth element-wise kernels reach (the 740M step's gradient accumulation
    measured 0.74)."""

    matmul: float = 0.80
    matmul_half_size: float = 128.0
    attention: tuple[tuple[float, float], ...] = SDPA_ON_H100
    memory: float = 0.75

    def stream_s(self, size: float, cluster: Cluster) -> float:
        """Moving ``size`` bytes through a GPU's memory in element-wise kernels."""
        return size / (cluster.hbm_bytes_per_s * self.memory)

    def matmul_s(self, flops: float, m: float, n: float, k: float, peak: float) -> float:
        """A product of ``flops`` with dimensions m x k times k x n."""
        if flops <= 0:
            return 0.0
        shape = 1.0
        for size in (m, n, k):
            shape *= size / (size + self.matmul_half_size)
        return flops / (peak * self.matmul * shape)

    def attention_at(self, seq_len: float) -> float:
        """The attention fraction at ``seq_len`` tokens (the end values beyond the points)."""
        sizes, fractions = zip(*self.attention)
        logs = [math.log(size) for size in sizes]
        at = min(max(math.log(seq_len), logs[0]), logs[-1])
        for (x0, y0), (x1, y1) in zip(zip(logs, fractions), zip(logs[1:], fractions[1:])):
            if at <= x1:
                return y0 + (y1 - y0) * (at - x0) / (x1 - x0)
        return fractions[-1]

    def scaled(self, factor: float) -> Efficiency:
        return Efficiency(self.matmul * factor, self.matmul_half_size,
                          tuple((size, fraction * factor) for size, fraction in self.attention),
                          self.memory * factor)


@dataclass(frozen=True)
class Runtime:
    """What the runtime does besides the arithmetic, which the costs depend on:
    ``host_layer_s`` the host's time to launch a layer's forward and its backward for one
    microbatch (the GPU runs behind it: a layer takes at least that long);
    ``tensor_overlap`` the fraction of tensor-parallel collectives hidden behind products
    (meshpipe runs them in the compute's order: none); ``data_overlap`` whether the gradient
    reduction runs behind the last backward (meshpipe's buckets: yes);
    ``weight_gather_overlap`` the fraction of ZeRO's weight all-gather hidden (meshpipe: none;
    it follows the step); ``fused_gradient_accumulation`` whether weight gradients land in
    their float32 accumulators inside the products (meshpipe: eager, with
    ``--grad-accumulation-fusion``; compiled, as ``meshpipe plan`` writes runs, no: one add a
    parameter and microbatch); ``node_dedup_dispatch`` whether a token crosses to another
    node once for all its experts there (DeepEP's dispatch; meshpipe: once per expert);
    ``experts_split_over_tp`` whether a MoE layer's tp ranks route the whole sequence and
    each keeps a slice of every expert's width (meshpipe) or route their own tokens to
    whole experts (Megatron-Core's expert tensor-parallel size 1);
    ``recompute_keeps_routed_rows`` whether full recomputation keeps the rows a MoE layer's
    exchanges carry (meshpipe: it runs no exchange again) or the layer's input only."""

    host_layer_s: tuple[float, float] = (0.0, 0.0)
    tensor_overlap: float = 0.0
    data_overlap: bool = True
    weight_gather_overlap: float = 0.0
    fused_gradient_accumulation: bool = False
    node_dedup_dispatch: bool = False
    experts_split_over_tp: bool = False
    recompute_keeps_routed_rows: bool = False


MESHPIPE = Runtime(host_layer_s=(0.75e-3, 0.9e-3), experts_split_over_tp=True,
                   recompute_keeps_routed_rows=True)
"""meshpipe with ``--compile`` (what ``meshpipe plan`` writes): a compiled block's call
measured 0.75 ms of host time forward and 0.9 ms backward on an H100 (docs/gpu.md)."""


@dataclass(frozen=True)
class ScaleLayout:
    """A layout of ``gpus = tp x cp x pp x dp`` GPUs: ``ep`` expert-parallel ranks inside
    ``dp x cp``; ``microbatches`` of ``microbatch_size`` sequences per replica a step."""

    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    microbatch_size: int
    microbatches: int
    schedule: str
    cp_kind: str = "ring"
    ep: int = 1
    zero: int = 0
    recompute: str = "none"

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        cp = f", cp {self.cp} {self.cp_kind}" if self.cp > 1 else ""
        ep = f", ep {self.ep}" if self.ep > 1 else ""
        zero = f", zero {self.zero}" if self.zero else ""
        recompute = f", recompute {self.recompute}" if self.recompute != "none" else ""
        return (f"tp {self.tp}, pp {self.pp}, vpp {self.vpp}, dp {self.dp}{cp}{ep}, "
                f"{self.microbatches} microbatches of {self.microbatch_size}, "
                f"{self.schedule}{zero}{recompute}")


@dataclass(frozen=True)
class LayerCosts:
    """One layer's seconds for one microbatch on one GPU: forward, the backward's input and
    weight halves, the exposed communication inside them (already included), the expert
    all-to-all of a forward (not included: ``CostModel.a2a``); bytes it saves for backward."""

    forward: float
    backward_input: float
    backward_weight: float
    exposed_comm: float
    a2a: float
    activation_bytes: float


def collective_s(link: Link, size: float, ranks: int, passes: float = 1.0) -> float:
    """A ring collective moving ``passes x (ranks - 1) / ranks x size`` bytes per rank
    (all-gather or reduce-scatter: 1 pass; all-reduce: 2), ``ranks - 1`` latencies a pass."""
    if ranks <= 1:
        return 0.0
    return passes * ((ranks - 1) * link.latency + (ranks - 1) / ranks * size / link.bytes_per_s)


def all_to_all_s(link: Link, size: float, ranks: int) -> float:
    """An all-to-all of ``size`` bytes per rank: all but ``1 / ranks`` of it leaves."""
    if ranks <= 1:
        return 0.0
    return link.latency + (ranks - 1) / ranks * size / link.bytes_per_s


def group_link(cluster: Cluster, stride: int, ranks: int) -> Link:
    """The link a group of ``ranks`` GPUs ``stride`` apart talks over: NVLink if they share a
    node, the network otherwise."""
    return cluster.nvlink if stride * ranks <= cluster.gpus_per_node else cluster.network


def hierarchical_reduce_s(cluster: Cluster, size: float, ranks: int, stride: int,
                          passes: float = 2.0) -> float:
    """A reduction (``passes`` 2: all-reduce, 1: reduce-scatter or all-gather) of ``size``
    bytes over ``ranks`` GPUs ``stride`` apart: in one node a ring on NVLink; across nodes a
    ring on NVLink among each node's members, then the ``1 / members`` share between nodes at
    the network's bandwidth with a tree's latency (``2 log2(nodes)`` hops a pass)."""
    if ranks <= 1 or size <= 0:
        return 0.0
    members = max(1, min(ranks, cluster.gpus_per_node // stride))
    if members == ranks:
        return collective_s(cluster.nvlink, size, ranks, passes)
    nodes = ranks // members
    inside = collective_s(cluster.nvlink, size, members, passes)
    share = size / members
    between = passes * (2 * math.log2(nodes) * cluster.network.latency
                        + (nodes - 1) / nodes * share / cluster.network.bytes_per_s)
    return inside + between


def _tokens(layout: ScaleLayout, seq_len: int) -> float:
    """Tokens of one microbatch a GPU's matrix products take (sequence parallelism gathers
    the tp group's shares): the microbatch's over the cp ranks."""
    return layout.microbatch_size * seq_len / layout.cp


def _matmuls(model: ModelShape, layout: ScaleLayout, tokens: float, moe: bool,
             runtime: Runtime) -> list[tuple[float, float, float, float]]:
    """A layer's forward products on one GPU: (flops, m, n, k) each."""
    tp, h = layout.tp, model.hidden
    q, kv = model.query_width, model.kv_width
    products = [(2 * tokens * h * (q + 2 * kv) / tp, tokens, (q + 2 * kv) / tp, h),
                (2 * tokens * q * h / tp, tokens, h, q / tp)]
    mm = model.mlp_matrices
    if not moe:
        products += [(2 * tokens * h * (mm - 1) * model.ffn_hidden / tp, tokens,
                      (mm - 1) * model.ffn_hidden / tp, h),
                     (2 * tokens * model.ffn_hidden * h / tp, tokens, h, model.ffn_hidden / tp)]
        return products
    # The tp ranks split either each expert's width (routing every token) or the tokens.
    split = runtime.experts_split_over_tp
    routing = tokens if split else tokens / tp
    width = model.moe_ffn_hidden / tp if split else model.moe_ffn_hidden
    routed = routing * model.top_k
    per_expert = routed * layout.ep / model.experts
    products += [(2 * routed * h * mm * width, per_expert, width, h),
                 (2 * routing * h * model.experts, routing, model.experts, h)]
    if model.shared_ffn_hidden:
        products.append((2 * tokens * h * mm * model.shared_ffn_hidden / tp, tokens,
                         mm * model.shared_ffn_hidden / tp, h))
    return products


def _elementwise_bytes(model: ModelShape, layout: ScaleLayout, tokens: float, moe: bool,
                      runtime: Runtime) -> float:
    """What a layer's forward moves through memory outside its products: two norms, rotary,
    residual adds, the activation (and the routed tokens' copies), sharded over tp (the
    routed copies whole where the experts' width is split instead)."""
    h = model.hidden
    width = 10 * h + 2 * (model.query_width + model.kv_width)
    whole = 0.0
    if moe:
        width += model.top_k * 3 * model.moe_ffn_hidden + 3 * model.shared_ffn_hidden
        copies = model.top_k * 4 * h
        if runtime.experts_split_over_tp:
            whole = copies
        else:
            width += copies
    else:
        width += 3 * model.ffn_hidden
    return tokens * (width / layout.tp + whole) * BF16


def _routed_rows_kept_whole(model: ModelShape, layout: ScaleLayout, runtime: Runtime
                            ) -> float:
    """What a MoE layer keeps per token beyond ``saved_bytes_per_token``'s tp share: its
    routed rows (to the experts and back) where the tp ranks hold them whole, and under full
    recomputation those the runtime keeps rather than exchanging again."""
    rows = model.top_k * 2 * model.hidden * BF16
    held = rows if runtime.experts_split_over_tp else rows / layout.tp
    if layout.recompute == "full":
        return held if runtime.recompute_keeps_routed_rows else 0.0
    return held - rows / layout.tp


def saved_bytes_per_token(model: ModelShape, moe: bool, recompute: str) -> float:
    """What a layer keeps for its backward per token (before tp's sharding): its inputs of
    the norms and products, q, k, v and attention's output, the MLP's (or the routed
    experts') intermediate; ``selective`` drops attention's own, ``full`` keeps the input."""
    h, q, kv = model.hidden, model.query_width, model.kv_width
    if recompute == "full":
        return h * BF16
    attention_core = 0.0 if recompute == "selective" else q + 2 * kv
    attention = 3 * h + q + attention_core
    if moe:
        mlp = (2 * h + model.top_k * (2 * h + model.mlp_matrices * model.moe_ffn_hidden)
               + model.mlp_matrices * model.shared_ffn_hidden)
    else:
        mlp = 2 * h + model.mlp_matrices * model.ffn_hidden
    return (attention + mlp) * BF16


def layer_costs(model: ModelShape, cluster: Cluster, layout: ScaleLayout, seq_len: int,
                efficiency: Efficiency, runtime: Runtime, moe: bool, split: bool) -> LayerCosts:
    """One layer (dense, or with experts if ``moe``) for one microbatch on one GPU (see the
    module docstring); ``split``: the schedule runs the backward as I and W."""
    peak, tokens = cluster.peak_flops, _tokens(layout, seq_len)
    forward_products = sum(efficiency.matmul_s(f, m, n, k, peak)
                           for f, m, n, k in _matmuls(model, layout, tokens, moe, runtime))
    attention_flops = tokens * model.attention_flops_per_token(seq_len) / layout.tp
    attention = attention_flops / (peak * efficiency.attention_at(seq_len))
    attention_back = 2.5 * attention
    elementwise = efficiency.stream_s(_elementwise_bytes(model, layout, tokens, moe, runtime),
                                      cluster)
    tensor = (1 - runtime.tensor_overlap) * (
        expert_tensor_parallel_s(model, cluster, layout, tokens)
        if moe and runtime.experts_split_over_tp
        else tensor_parallel_s(model, cluster, layout, tokens))
    context_forward, context_backward = context_parallel_s(model, cluster, layout, tokens,
                                                           attention, attention_back)
    forward = forward_products + attention + elementwise + tensor + context_forward
    backward_input = (forward_products + attention_back + 2 * elementwise + tensor
                      + context_backward)
    backward_weight = forward_products
    host_forward, host_backward = runtime.host_layer_s
    forward = max(forward, host_forward)
    if 0 < backward_input + backward_weight < host_backward:
        stretch = host_backward / (backward_input + backward_weight)
        backward_input, backward_weight = backward_input * stretch, backward_weight * stretch
    if layout.recompute == "full":
        backward_input += forward
        if split:
            backward_weight += forward
    elif layout.recompute == "selective":
        backward_input += attention
    a2a = expert_all_to_all_s(model, cluster, layout, tokens, runtime) if moe else 0.0
    saved = saved_bytes_per_token(model, moe, layout.recompute) * tokens / layout.tp
    if moe:
        saved += _routed_rows_kept_whole(model, layout, runtime) * tokens
    return LayerCosts(forward, backward_input, backward_weight,
                      2 * tensor + context_forward + context_backward, a2a, saved)


def tensor_parallel_s(model: ModelShape, cluster: Cluster, layout: ScaleLayout,
                      tokens: float, collectives: int = 4) -> float:
    """A layer's tensor-parallel collectives one way (forward, or backward): all-gathers
    and reduce-scatters of the microbatch's activations over tp, inside a node (a dense
    layer: two of each)."""
    size = tokens * model.hidden * BF16
    return collectives * collective_s(cluster.nvlink, size, layout.tp)


def expert_tensor_parallel_s(model: ModelShape, cluster: Cluster, layout: ScaleLayout,
                             tokens: float) -> float:
    """One way of a MoE layer whose tp ranks split each expert's width (meshpipe): the
    attention's all-gather and reduce-scatter, the sequence gathered to route (the layer's
    own shard kept after it, no collective; backward the other way round), and the routed
    rows' outputs all-reduced over tp (backward: their input gradients)."""
    rows = tokens * model.top_k * model.hidden * BF16
    return (tensor_parallel_s(model, cluster, layout, tokens, collectives=3)
            + collective_s(cluster.nvlink, rows, layout.tp, passes=2))


def context_parallel_s(model: ModelShape, cluster: Cluster, layout: ScaleLayout, tokens: float,
                       attention: float, attention_back: float) -> tuple[float, float]:
    """A layer's exposed context-parallel communication, forward and backward: ring
    attention's K/V exchanges beyond each tile's compute, or Ulysses' all-to-alls."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    link = group_link(cluster, layout.tp, cp)
    kv_width = max(model.kv_width / layout.tp, model.head_dim)
    if layout.cp_kind == "ring":
        kv = 2 * tokens * kv_width * BF16
        step = link.latency + kv / link.bytes_per_s
        back_step = link.latency + 2 * kv / link.bytes_per_s
        forward = (cp - 1) * max(0.0, step - attention / cp) + link.latency
        backward = (cp - 1) * max(0.0, back_step - attention_back / cp) + link.latency
        return forward, backward
    width = (2 * model.query_width / layout.tp + 2 * kv_width)
    one_way = all_to_all_s(link, tokens * width * BF16, cp)
    return one_way, one_way


def expert_all_to_all_s(model: ModelShape, cluster: Cluster, layout: ScaleLayout,
                        tokens: float, runtime: Runtime = MESHPIPE) -> float:
    """A MoE layer's dispatch and combine of one forward: each GPU's share of the routed
    tokens (``top_k`` copies of its ``tokens / tp``, or of all ``tokens`` where the tp ranks
    split the experts' width: ``Runtime.experts_split_over_tp``) to and from the ep group. With
    ``runtime.node_dedup_dispatch`` a token crosses to each other node once, however many of
    its experts are there (with experts drawn evenly, ``nodes (1 - (1 - 1/nodes)^top_k)``
    copies), the node's NVLink spreading it to them."""
    copies = model.top_k
    link = group_link(cluster, layout.tp, layout.ep)
    nodes = layout.tp * layout.ep // cluster.gpus_per_node
    if runtime.node_dedup_dispatch and nodes > 1:
        copies = nodes * (1 - (1 - 1 / nodes) ** model.top_k)
    routing = tokens if runtime.experts_split_over_tp else tokens / layout.tp
    size = routing * copies * model.hidden * BF16
    return 2 * all_to_all_s(link, size, layout.ep)


def pipeline_message_s(model: ModelShape, cluster: Cluster, layout: ScaleLayout,
                       seq_len: int) -> float:
    """One activation (or gradient) message between neighbour stages: the microbatch's
    hidden states, sharded over tp; inside a node only if the whole pipeline fits in one."""
    if layout.pp == 1:
        return 0.0
    size = _tokens(layout, seq_len) * model.hidden * BF16 / layout.tp
    link = cluster.nvlink if layout.gpus <= cluster.gpus_per_node else cluster.network
    return link.seconds(size)


def gradient_sync_s(cluster: Cluster, layout: ScaleLayout, dense_parameters: float,
                    expert_parameters: float, backward_window: float, runtime: Runtime,
                    efficiency: Efficiency = Efficiency()) -> tuple[float, float]:
    """(exposed seconds of the gradient reduction and ZeRO's weight all-gather, the
    optimizer's seconds) for a GPU holding these parameters (see the module docstring)."""
    replicas = layout.dp * layout.cp
    expert_replicas = max(1, replicas // layout.ep)
    passes = 1.0 if layout.zero else 2.0
    reduce = (hierarchical_reduce_s(cluster, GRADIENT_REDUCE_BYTES * dense_parameters, replicas,
                                    layout.tp, passes)
              + hierarchical_reduce_s(cluster, GRADIENT_REDUCE_BYTES * expert_parameters,
                                      expert_replicas, layout.tp * layout.ep, passes))
    total_bytes = GRADIENT_REDUCE_BYTES * (dense_parameters + expert_parameters)
    last_bucket = reduce * min(1.0, BUCKET_BYTES / total_bytes) if total_bytes else 0.0
    exposed = max(reduce - backward_window, last_bucket) if runtime.data_overlap else reduce
    updated = (dense_parameters / replicas + expert_parameters / expert_replicas
               if layout.zero else dense_parameters + expert_parameters)
    if layout.zero:
        gather = (hierarchical_reduce_s(cluster, BF16 * dense_parameters, replicas, layout.tp, 1.0)
                  + hierarchical_reduce_s(cluster, BF16 * expert_parameters, expert_replicas,
                                          layout.tp * layout.ep, 1.0))
        exposed += (1 - runtime.weight_gather_overlap) * gather
    optimizer = efficiency.stream_s(updated * ADAMW_BYTES_PER_PARAMETER, cluster)
    return exposed, optimizer


def gradient_accumulation_s(cluster: Cluster, parameters: float, runtime: Runtime,
                            efficiency: Efficiency = Efficiency()) -> float:
    """Adding one microbatch's bf16 weight gradients into their float32 accumulators
    (read both, write one), where the products do not do it themselves."""
    if runtime.fused_gradient_accumulation:
        return 0.0
    return efficiency.stream_s(parameters * (BF16 + 2 * GRADIENT_REDUCE_BYTES), cluster)


def state_bytes_of(layout: ScaleLayout, dense_parameters: float,
                   expert_parameters: float) -> float:
    """Weights, gradients and AdamW state a GPU holds (bf16 weights, fp32 masters)."""
    replicas = layout.dp * layout.cp
    return (state_bytes(layout.zero, replicas, masters=True) * dense_parameters
            + state_bytes(layout.zero, max(1, replicas // layout.ep), masters=True)
            * expert_parameters)
