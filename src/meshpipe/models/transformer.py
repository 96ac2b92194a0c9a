"""A decoder-only reference transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The attention is pluggable (any callable honouring ``meshpipe.context.interface.Attention``),
so the same model runs with local attention or with a context-parallel one. Token
``positions`` drive both RoPE and the attention mask, which is how a context-parallel rank
holding a zigzag or packed slice of a sequence still gets the right rotary angles. Without
them (None, down to every block) the sequence is plain, ``0..seq-1``: RoPE takes its tables'
first rows, and attention needs to derive nothing (compiled, it stays in the block's graph).

Tensor parallelism (``tp_group``) splits attention heads and key/value heads, the SwiGLU
width, the vocabulary of the embedding and the output head over the group (Megatron's
column/row split: one all-reduce after attention and one after the MLP, or with
``sequence_parallel`` an all-gather before and a reduce-scatter after, the activations
between them split along the sequence). The head's logits stay split over the vocabulary:
``meshpipe.parallel.vocab_parallel_cross_entropy`` takes them as they are.

``recompute`` trades compute for memory: ``"full"`` keeps only each block's input and
recomputes the block in backward, ``"selective"`` recomputes only the attention core (its
saved state grows with the square of the sequence). Both use non-reentrant checkpointing,
which the split backward of zero-bubble schedules supports.

Initialisation is a pure function of ``TransformerConfig.init_seed`` and each parameter's
name: a rank builds the model on the meta device, cuts its tensor-parallel shards and keeps
its experts there, and then draws only the parts its pipeline chunks hold (``Held``, see
``meshpipe.models.split``), with the values the whole model has.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from meshpipe.context.derived import derived, on_host, to_device
from meshpipe.context.interface import Attention
from meshpipe.context.local import LocalAttention
from meshpipe.context.routing import GraphPack, attend
from meshpipe.models import joint
from meshpipe.models.initial_values import Draw, draw_normal
from meshpipe.models.mlp import SwiGLU, linear
from meshpipe.models.moe import MoE
from meshpipe.models.recompute import maybe_checkpoint
from meshpipe.models.rotary import RotaryEmbedding
from meshpipe.models.skeleton import real_parameter, replace_parameters
from meshpipe.parallel import (TensorParallelRegion, VocabParallelEmbedding,
                               mark_sequence_parallel, own_shard, shard_dim, shard_linear,
                               shard_parts, tp_rank_and_size)
from meshpipe.runtime.substeps import run_steps
from meshpipe.schedules.costs import RECOMPUTE_MODES



@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of the reference transformer.

    ``n_kv_heads`` None means plain multi-head attention (as many key/value heads as query
    heads); ``ffn_hidden`` None picks the usual SwiGLU width, about 8/3 of ``dim`` rounded up to
    a multiple of ``ffn_multiple_of``. ``init_seed`` None draws the initial weights from the
    global RNG (seed it with ``torch.manual_seed`` before construction), in order, over the
    parameters this rank holds: only a whole model (tensor-parallel shards aside) then has
    the values of a model built in one process.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    ffn_multiple_of: int = 32
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    init_seed: int | None = 0
    moe_experts: int = 0
    moe_top_k: int = 1
    moe_every: int = 1
    moe_capacity_factor: float = 0.0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "ffn_multiple_of")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"TransformerConfig.{name} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"TransformerConfig.dim ({self.dim}) must be a multiple of n_heads "
                             f"({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension; dim/n_heads = {self.head_dim}")
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a positive multiple of n_kv_heads "
                             f"({self.kv_heads}) for grouped-query attention")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ValueError(f"TransformerConfig.ffn_hidden must be positive, got "
                             f"{self.ffn_hidden}")
        if (self.moe_experts < 0 or self.moe_every < 1 or self.moe_capacity_factor < 0
                or not 1 <= self.moe_top_k <= max(self.moe_experts, 1)):
            raise ValueError(f"need moe_experts >= 0, 1 <= moe_top_k <= moe_experts, "
                             f"moe_every >= 1 and moe_capacity_factor >= 0; got "
                             f"{self.moe_experts}, {self.moe_top_k}, {self.moe_every}, "
                             f"{self.moe_capacity_factor}")

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` has a mixture-of-experts MLP: every ``moe_every``-th,
        starting with the first."""
        return self.is_moe and layer % self.moe_every == 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_width(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        width = int(8 * self.dim / 3)
        return self.ffn_multiple_of * math.ceil(width / self.ffn_multiple_of)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in float32 (the gain included)
    and returned in the input's dtype."""
    torch_computes_in_float32 = torch.__version__ >= (2, 8)  # 2.6 rounds before the gain

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # torch's rms_norm with the gain: float32 inside, one fused kernel on CUDA where the
        # formula written out launches five and casts around them (a step's kernel launches
        # are what bound it there). `.to`: autocast may count it among its float32 ops.
        shape = (x.shape[-1],)
        if self.weight.dtype != x.dtype or not self.torch_computes_in_float32:
            return F.rms_norm(x.float(), shape, self.weight.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, shape, self.weight, self.eps).to(x.dtype)


_NO_TENSOR_PARALLELISM = TensorParallelRegion()


class SelfAttention(nn.Module):
    """Grouped-query self-attention whose core is a pluggable ``Attention`` callable."""

    JOINT_LINEARS = ("wq", "wk", "wv")  # one product once laid out (``models.joint``)

    def __init__(self, config: TransformerConfig, rope: RotaryEmbedding, attention: Attention):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.wq = linear(config.dim, config.n_heads * config.head_dim)
        self.wk = linear(config.dim, config.kv_heads * config.head_dim)
        self.wv = linear(config.dim, config.kv_heads * config.head_dim)
        self.wo = linear(config.n_heads * config.head_dim, config.dim)
        self.rope = rope
        self.core_attention = attention
        self.tp = _NO_TENSOR_PARALLELISM
        self.recompute_core = False

    def shard(self, tp: TensorParallelRegion) -> None:
        """Keep this rank's heads: q/k/v split by output (column), wo by input (row)."""
        self.tp = tp
        self.n_heads //= tp.size
        self.n_kv_heads //= tp.size
        for name in ("wq", "wk", "wv"):
            setattr(self, name, shard_linear(getattr(self, name), 0, tp.group))
        self.wo = shard_linear(self.wo, 1, tp.group)

    def forward(self, x: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
                pack: GraphPack | None = None) -> Tensor:
        q, k, v = self.project(x, positions)
        return self.output(self.core(q, k, v, positions, doc_ids, pack))

    def project(self, x: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ``[batch, seq, heads, head_dim]``, rotated. Projected
        jointly (``models.joint``), the queries and keys are side by side in one tensor and
        rotate as one: four kernels fewer a layer and microbatch forward, three backward."""
        x = self.tp.enter(x)
        batch, seq, _ = x.shape
        heads = (self.n_heads, self.n_kv_heads)
        out = joint.project_together(self, x)
        if out is None:
            q, k, v = (getattr(self, name)(x) for name in self.JOINT_LINEARS)
            q, k = (self.rope(t.view(batch, seq, h, self.head_dim), positions)
                    for t, h in zip((q, k), heads))
        else:
            qk, v = out.split([sum(heads) * self.head_dim, self.n_kv_heads * self.head_dim],
                              dim=-1)
            qk = self.rope(qk.view(batch, seq, sum(heads), self.head_dim), positions)
            q, k = qk.split(heads, dim=2)
        return q, k, v.view(batch, seq, self.n_kv_heads, self.head_dim)

    def core(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None,
             doc_ids: Tensor | None, pack: GraphPack | None = None) -> Tensor:
        """The attention core (recomputed in backward with ``--recompute selective``);
        ``pack``: the microbatch's ``routing.pack_for_graph``."""
        return maybe_checkpoint(self.recompute_core, self._core, q, k, v, positions, doc_ids,
                                pack)

    def output(self, out: Tensor) -> Tensor:
        batch, seq = out.shape[:2]
        return self.tp.leave(self.wo(out.reshape(batch, seq, self.n_heads * self.head_dim)))

    def _core(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None,
              doc_ids: Tensor | None, pack: GraphPack | None) -> Tensor:
        return attend(self.core_attention, q, k, v, positions=positions, doc_ids=doc_ids,
                      pack=pack, causal=True)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then a SwiGLU MLP, or a mixture of experts.

    A dense block's ``forward`` returns the hidden states; a mixture-of-experts block's
    returns ``(hidden, aux_loss)``. ``forward_steps(x, aux, positions, doc_ids)`` gives
    ``(hidden, aux + this block's aux_loss)`` for both, cut at the experts' exchanges. A
    ``pack`` (``routing.pack_for_graph``) keeps a compiled block's pack in its graph.
    """

    def __init__(self, config: TransformerConfig, rope: RotaryEmbedding, attention: Attention,
                 *, moe: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = SelfAttention(config, rope, attention)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.is_moe = moe
        self.mlp = (MoE(config.dim, config.ffn_width, config.moe_experts, config.moe_top_k,
                        config.moe_capacity_factor) if moe
                    else SwiGLU(config.dim, config.ffn_width))
        self.recompute = False

    def forward(self, x: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
                pack: GraphPack | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if self.is_moe:
            return run_steps(self.forward_steps(x, torch.zeros((), device=x.device),
                                                positions, doc_ids, pack))
        if self.recompute:
            return maybe_checkpoint(True, self._forward_by_parts, x, positions, doc_ids, pack)
        return self._forward(x, positions, doc_ids, pack)

    def forward_steps(self, x: Tensor, aux: Tensor | None, positions: Tensor | None,
                      doc_ids: Tensor | None, pack: GraphPack | None = None):
        if not self.is_moe:
            return self(x, positions, doc_ids, pack), aux
        x = maybe_checkpoint(self.recompute, self._attend, x, positions, doc_ids, pack)
        y, layer_aux, (x, aux) = yield from self.mlp.forward_steps(self.mlp_norm(x),
                                                                   keep=(x, aux))
        return x + y, aux + layer_aux

    def _attend(self, x: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
                pack: GraphPack | None) -> Tensor:
        return x + self.attention(self.attention_norm(x), positions, doc_ids, pack)

    def _forward_by_parts(self, x: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
                          pack: GraphPack | None) -> Tensor:
        """``_forward`` through the attention module whole: what a recomputed block runs,
        whose parts are compiled one by one (``models.compile.regions``)."""
        x = self._attend(x, positions, doc_ids, pack)
        return x + self.mlp(self.mlp_norm(x))

    def _forward(self, x: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
                 pack: GraphPack | None) -> Tensor:
        """A dense block, written out in one function. Compiled, a plain sequence
        (``positions`` None) or a pack given as a ``pack`` is one graph; otherwise the
        attention core, called from here, is a graph break that cuts it into two
        (``context.routing``), where a break inside a nested call would cut every enclosing
        function around that call (five graphs)."""
        attention = self.attention
        q, k, v = attention.project(self.attention_norm(x), positions)
        x = x + attention.output(attention.core(q, k, v, positions, doc_ids, pack))
        return x + self.mlp(self.mlp_norm(x))


def default_positions(tokens_or_hidden: Tensor, positions: Tensor | None, *,
                      check_values: bool = True, sequence_shards: int = 1) -> Tensor:
    """``positions`` as given, or ``0..seq-1`` for an unpacked sequence; checked against ``seq``.

    ``check_values`` also checks that no position is negative, which reads a value back from
    the device (a sync on GPUs, unless the loader kept a host copy: ``context.derived``):
    the first stage checks, once per positions tensor (a loader that reuses its tensor is
    checked once), and later stages receive checked ones.
    ``sequence_shards`` > 1 says the activations hold one of that many sequence-parallel
    shards of the sequence the positions describe.
    """
    seq = tokens_or_hidden.shape[1] * sequence_shards
    if positions is None:
        return _plain_positions(seq, tokens_or_hidden.device)
    if positions.dim() != 1 or positions.shape[0] != seq:
        raise ValueError(f"positions must have shape [{seq}] (one per token of the local "
                         f"sequence); got {tuple(positions.shape)}")
    if check_values and seq and derived("lowest position", (positions,),
                                        lambda: int(on_host(positions)[0].min())) < 0:
        raise ValueError(f"positions must be >= 0 (a token's position inside its document); "
                         f"got {int(positions.min())}")
    return positions


@functools.lru_cache(maxsize=16)
def _plain_positions(seq: int, device: torch.device) -> Tensor:
    """``0..seq-1`` on ``device``, one tensor per length and device with its host copy,
    made once: what a caller that needs the plain sequence's positions as a tensor gets (a
    Hugging Face chunk's position ids; the reference blocks take None instead)."""
    return to_device(torch.arange(seq, device="cpu"), device)


def check_tensor_parallel_sizes(config: TransformerConfig, tp: int) -> None:
    """Fail unless ``tp`` divides every size tensor parallelism splits; the message names
    the size and the flag that changes it."""
    splits = {"query heads (--heads)": config.n_heads,
              "key/value heads (--kv-heads)": config.kv_heads,
              "SwiGLU width": config.ffn_width, "vocabulary": config.vocab_size}
    for what, size in splits.items():
        if size % tp:
            raise ValueError(f"tensor parallelism {tp} must divide the {what}, {size}; use a "
                             f"tp that divides {size} or change the size")


@dataclass(frozen=True)
class Held:
    """The parts of a model one rank holds (``held_by_stages``): its layers, and whether it
    holds the embedding and the final norm and head. ``Transformer`` leaves the others on
    the meta device: no memory and no initial values (each held parameter's are those of
    the whole model: its generator does not depend on the others)."""

    layers: frozenset[int]
    embedding: bool
    head: bool


class Transformer(nn.Module):
    """Decoder-only transformer: ``model(tokens, positions=None, doc_ids=None) -> logits``.

    ``tokens`` is int64 ``[batch, seq]``; ``positions`` (int64 ``[seq]``) is each token's
    position inside its document, ``doc_ids`` (int64 ``[seq]``) its document for packed
    sequences. ``attention`` defaults to ``LocalAttention``; pass a context-parallel attention
    to shard the sequence. The attention object is shared by every layer.

    With mixture-of-experts layers (``config.moe_experts`` > 0) it returns ``(logits,
    aux_loss)``, the sum of the layers' load-balancing losses; ``ep_group`` shards the
    experts over expert-parallel ranks (a ``tp_group`` each expert's width) and
    ``token_group`` names the ranks holding the other parts of each sequence (context
    parallelism), which the load-balancing loss counts.

    With a ``tp_group`` of several ranks the logits are this rank's vocabulary slice, and
    with ``sequence_parallel`` the layers between the embedding and the head hold this
    rank's contiguous share of the sequence (the tokens and positions stay whole).
    ``recompute`` is one of ``RECOMPUTE_MODES``. ``held`` (default: everything) names the
    parts this rank holds; the others stay on the meta device. Only the held parts'
    tensor-parallel shards and this rank's experts are ever real, on the CPU (all stays on
    the meta device where that is the default device).
    """

    def __init__(self, config: TransformerConfig, attention: Attention | None = None, *,
                 tp_group: dist.ProcessGroup | None = None, sequence_parallel: bool = False,
                 recompute: str = "none", ep_group: dist.ProcessGroup | None = None,
                 token_group: dist.ProcessGroup | None = None, held: Held | None = None):
        super().__init__()
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.config = config
        self.attention = LocalAttention() if attention is None else attention
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_seq_len)
        with torch.device("meta"):  # the skeleton: ``_materialize`` makes the held parts real
            # `_weight`: no reset_parameters, whose normal_ on meta imports torch._dynamo (1.3 s)
            self.embedding = nn.Embedding(config.vocab_size, config.dim,
                                          _weight=torch.empty(config.vocab_size, config.dim))
            self.layers = nn.ModuleList(
                TransformerBlock(config, self.rope, self.attention, moe=config.is_moe_layer(i))
                for i in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.head = linear(config.dim, config.vocab_size)
        if config.tie_embeddings:
            self.head.weight = self.embedding.weight
        self.tp = TensorParallelRegion(tp_group, sequence_parallel)
        if self.tp.size > 1:
            self._shard_for_tensor_parallelism()
        for layer in self.layers:
            if layer.is_moe:
                layer.mlp.shard(ep_group, token_group)
        if torch.get_default_device().type != "meta":  # else a skeleton is what was asked
            self._materialize(held or Held(frozenset(range(config.n_layers)), embedding=True,
                                           head=True))
        for layer in self.layers:
            layer.recompute = recompute == "full"
            layer.attention.recompute_core = recompute == "selective"
            if layer.is_moe:
                layer.mlp.recompute = recompute == "full"

    def _shard_for_tensor_parallelism(self) -> None:
        """Replace every split weight of the skeleton by this rank's shard (still on the meta
        device: ``_materialize`` draws it)."""
        check_tensor_parallel_sizes(self.config, self.tp.size)
        self.embedding = VocabParallelEmbedding.from_embedding(
            self.embedding, self.tp.group, sequence_parallel=self.tp.sequence_parallel)
        if self.config.tie_embeddings:
            self.head = linear(self.config.dim, self.config.vocab_size // self.tp.size)
            self.head.weight = self.embedding.weight
        else:
            self.head = shard_linear(self.head, 0, self.tp.group)
        for layer in self.layers:
            layer.attention.shard(self.tp)
            if layer.is_moe:
                layer.mlp.split_width(self.tp)
            else:
                layer.mlp.shard(self.tp)
        if self.tp.sequence_parallel:
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    mark_sequence_parallel(param)

    def _materialize(self, held: Held) -> None:
        """Give the held parts real parameters on the CPU with their initial values:
        Normal(0, init_std), the residual output projections' scaled by 1/sqrt(2 L), the
        norms' ones. A tensor-parallel shard is cut from a draw of its whole parameter
        (``initial_values``); the parts not held stay on the meta device."""
        parts = [self.layers[i] for i in sorted(held.layers)]  # in the model's order:
        if held.embedding:  # with ``init_seed`` None the draws follow it
            parts.insert(0, self.embedding)
        if held.head:
            parts += [self.norm, self.head]
        names = {id(param): name for name, param in self.named_parameters()}
        real = {}
        for param in (param for part in parts for param in part.parameters()):
            if param.is_meta and id(param) not in real:  # a tied weight: once
                real[id(param)] = real_parameter(param, torch.empty_like(param, device="cpu"))
        replace_parameters(self.modules(), real)
        residual_std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        rank, size = tp_rank_and_size(self.tp.group)
        draws = []
        for meta_id, param in real.items():
            name = names[meta_id]
            if name.endswith("norm.weight"):
                with torch.no_grad():
                    param.fill_(1.0)
                continue
            std = residual_std if name.endswith(("wo.weight", "w_down.weight")) \
                else self.config.init_std
            dim = shard_dim(param)
            if dim is None:
                draws.append(Draw(name, param, std))
                continue
            whole = list(param.shape)
            whole[dim] *= size
            draws.append(Draw(name, param, std, cut=functools.partial(
                own_shard, dim=dim, rank=rank, size=size, parts=shard_parts(param)),
                whole_shape=tuple(whole)))
        draw_normal(draws, self.config.init_seed)

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                doc_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        return run_steps(self.forward_steps(tokens, positions, doc_ids))

    def forward_steps(self, tokens: Tensor, positions: Tensor | None = None,
                      doc_ids: Tensor | None = None):
        """``forward`` cut at the experts' exchanges (``meshpipe.runtime.substeps``)."""
        if positions is not None:
            positions = default_positions(tokens, positions)
        hidden = self.embedding(tokens)
        aux = torch.zeros((), device=tokens.device) if self.config.is_moe else None
        hidden, aux = yield from run_layers(self.layers, hidden, aux, positions, doc_ids)
        logits = logits_of(self, hidden)
        return (logits, aux) if self.config.is_moe else logits


def run_layers(layers, hidden: Tensor, aux: Tensor | None, positions: Tensor | None,
               doc_ids: Tensor | None, pack: GraphPack | None = None):
    """Sub-steps of ``layers`` in order: ``(hidden, aux)`` after the last."""
    for layer in layers:
        hidden, aux = yield from layer.forward_steps(hidden, aux, positions, doc_ids, pack)
    return hidden, aux


def logits_of(owner: nn.Module, hidden: Tensor) -> Tensor:
    """The output head on the last hidden states: ``owner.head(owner.norm(hidden))`` inside
    the tensor-parallel region of ``owner.tp`` (a model or its last chunk)."""
    return owner.head(owner.tp.enter(owner.norm(hidden)))
