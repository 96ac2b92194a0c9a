"""A mixture-of-experts MLP with expert parallelism, cut at its two all-to-alls.

Each token's router (a linear layer, softmax over the experts in float32) picks its top-k
experts; their gates are the picked probabilities, renormalised to sum to one (or not, as
some Qwen MoE models). ``ExpertLayer`` is that machinery; ``MoE``, the reference model's
layer, has SwiGLU experts, and ``meshpipe.models.hf_moe`` gives a Hugging Face sparse block
its own experts and shared expert. With an expert-parallel group of P ranks, rank j holds experts
``[j E/P, (j+1) E/P)``; tokens travel to their experts' ranks and back with the exact-size
all-to-all of ``meshpipe.comm.collectives`` (only the rows routed there, no padding):

1. route: gates, choose experts, drop beyond capacity, sort the picks by expert;
2. *dispatch* (exchange): the per-expert counts, then the token rows;
3. experts: each local expert on its rows;
4. *combine* (exchange): the results back to the ranks the tokens came from;
5. unsort, weight by the gates, sum the k picks of each token.

``forward_steps`` yields the two exchanges (``meshpipe.runtime.substeps``), so combined
1F1B runs one microbatch's experts while another microbatch's tokens travel.

With tensor parallelism (``MoE.split_width``; ``hf_tp`` for a Hugging Face layer) every tp
rank keeps a slice of each expert's hidden width. The tp ranks route the same tokens (under
sequence parallelism the layer first gathers their shards, and keeps its own shard of the
output), exchange them with the ranks of the same tp index, and sum their experts' partial
outputs over tp in step 3: one all-reduce forward, one of the rows' gradients backward.
With ``recompute`` the experts' products of step 3 run again in backward; the exchanges
do not.

The load-balancing loss (Switch Transformer) is ``E * sum_i f_i * P_i``: ``f_i`` the share
of the microbatch's top-k picks that chose expert i (before dropping), ``P_i`` the mean
router probability of expert i. The microbatch is all its tokens, also those that other
context-parallel ranks (``token_group``) hold: the pick counts are summed over that group
(in the dispatch exchange), and each rank's loss is its share of ``P_i``, so the shares add
up to the loss of the whole microbatch, as the token losses do.

``capacity_factor`` > 0 limits each expert to ``ceil(factor * tokens * k / E)`` picks of
this rank's tokens per microbatch; later picks (in token order) are dropped: the token keeps
its other picks and the residual. Dropped picks are counted in ``MoEStats``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from meshpipe.comm import ops
from meshpipe.comm.collectives import exchange_counts, exchange_rows
from meshpipe.models import grouped_experts
from meshpipe.models.mlp import SwiGLU, linear
from meshpipe.models.recompute import maybe_checkpoint
from meshpipe.parallel import (TensorParallelRegion, copy_to_tp, gather_to_replicate,
                               reduce_from_tp, scatter_to_sequence)
from meshpipe.runtime.substeps import Exchange, run_steps


@dataclass
class MoEStats:
    """What one MoE layer saw since its stats were last taken: picks per expert (before
    dropping, this rank's tokens), dropped picks, and the sum of its load-balancing loss
    shares over the microbatches."""

    tokens_per_expert: Tensor
    dropped: Tensor
    aux_loss: Tensor
    microbatches: int = 0

    @classmethod
    def empty(cls, experts: int, device: torch.device | str = "cpu") -> MoEStats:
        return cls(torch.zeros(experts, dtype=torch.int64, device=device),
                   torch.zeros((), dtype=torch.int64, device=device),
                   torch.zeros((), dtype=torch.float64, device=device))

    def add(self, picks: Tensor, dropped: Tensor, aux_loss: Tensor) -> None:
        """Count one microbatch (on the device of its tensors: no host sync)."""
        self.tokens_per_expert = self.tokens_per_expert.to(picks.device) + picks
        self.dropped = self.dropped.to(picks.device) + dropped
        self.aux_loss = self.aux_loss.to(aux_loss.device) + aux_loss.double()
        self.microbatches += 1


@dataclass
class _Dispatch:
    """The row counts of one microbatch's dispatch, read to the host once its counts were
    exchanged (the all-to-all's split sizes: the one host read of the layer's microbatch);
    the combine and both reverses reuse them."""

    send_counts: Tensor
    group: dist.ProcessGroup | None
    token_group: dist.ProcessGroup | None
    picks: Tensor
    sent: int = 0  # rows given to send: every pick, the dropped ones last
    send_rows: list[int] = field(default_factory=list)  # per ep rank
    receive_rows: list[int] = field(default_factory=list)  # per ep rank
    expert_rows: list[int] = field(default_factory=list)  # received per local expert

    @property
    def kept(self) -> int:
        """The rows this rank sends: its picks that were not dropped."""
        return sum(self.send_rows)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Counts, then rows, then the microbatch's pick counts over the token group."""
        receive_counts = (self.send_counts if self.group is None
                          else exchange_counts(self.send_counts, self.group))
        self._read_counts(receive_counts)
        self.sent = tokens.shape[0]
        received = self._to_experts(tokens[:self.kept])
        picks = self.picks.clone()
        if self.token_group is not None and dist.get_world_size(self.token_group) > 1:
            ops.all_reduce(picks, group=self.token_group)
        return received, receive_counts, picks

    def _read_counts(self, receive_counts: Tensor) -> None:
        send, receive = torch.stack([self.send_counts,
                                     receive_counts.to(self.send_counts.device)]).tolist()
        self.send_rows = [sum(row) for row in send]
        self.receive_rows = [sum(row) for row in receive]
        self.expert_rows = [sum(column) for column in zip(*receive)]

    def backward(self, grads: tuple[Tensor, Tensor | None, Tensor | None]) -> Tensor:
        """The sent rows' gradient; the dropped picks' rows, never sent, get zeros."""
        grad = self._from_experts(grads[0])
        dropped = self.sent - grad.shape[0]
        return F.pad(grad, (0, 0, 0, dropped)) if dropped else grad

    def combine(self, rows: Tensor) -> Tensor:
        return self._from_experts(rows)

    def combine_backward(self, grad: Tensor) -> Tensor:
        return self._to_experts(grad)

    def _to_experts(self, rows: Tensor) -> Tensor:
        """Rows from this rank to the ranks of their experts."""
        return self._rows(rows, self.send_rows, self.receive_rows)

    def _from_experts(self, rows: Tensor) -> Tensor:
        """Rows computed here back to the ranks their tokens came from."""
        return self._rows(rows, self.receive_rows, self.send_rows)

    def _rows(self, x: Tensor, send_rows: list[int], receive_rows: list[int]) -> Tensor:
        """``x``'s rows exchanged; without expert parallelism they stay here as they are
        (no copy: nothing writes into them)."""
        if self.group is None:
            return x
        return exchange_rows(x, send_rows, receive_rows, self.group)


def mark_expert_parallel(param: nn.Parameter) -> nn.Parameter:
    """Tag an expert's parameter: its gradient is synchronised over the ranks that hold the
    same expert (expert-data-parallel group), not over all data-parallel ranks."""
    param._meshpipe_expert = True
    return param


def is_expert_param(param: Tensor) -> bool:
    return getattr(param, "_meshpipe_expert", False)


class ExpertLayer(nn.Module):
    """Routing, expert parallelism, sub-steps and stats of a mixture-of-experts MLP; a
    subclass registers its parameters (the reference ``MoE``, or a Hugging Face model's
    sparse block, ``meshpipe.models.hf_moe``) and says how to compute them:

    - ``self.experts``: a ``ModuleDict`` of every expert by its index as a string (``shard``
      keeps this rank's), each mapping rows ``[n, dim]`` to ``[n, dim]``;
    - ``router_logits(tokens)``: ``[tokens, experts]``;
    - ``shared_output(tokens)``: what experts every token goes through add (None: none).

    ``normalize``: the top-k gates are renormalised to sum to one (else they stay the
    router's probabilities, as Qwen MoE models without ``norm_topk_prob``).
    """

    experts: nn.ModuleDict

    def __init__(self, experts: int, top_k: int = 1, capacity_factor: float = 0.0,
                 normalize: bool = True):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top-k {top_k} must be between 1 and the number of experts "
                             f"{experts}")
        self.num_experts = experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.normalize = normalize
        self.ep_group: dist.ProcessGroup | None = None
        self.token_group: dist.ProcessGroup | None = None
        self.ep_size, self.ep_rank = 1, 0
        self.stats = MoEStats.empty(experts)
        self.grouped_weights: grouped_experts.LaidOut | None = None  # grouped_experts.lay_out
        self.tp = TensorParallelRegion()  # the experts' width split (``MoE.split_width``)
        self.recompute = False  # --recompute full: the experts' products again in backward

    @property
    def grouped(self) -> bool:
        """Whether the local experts run as grouped products (``grouped_experts.lay_out``)."""
        return self.grouped_weights is not None

    def router_logits(self, tokens: Tensor) -> Tensor:
        raise NotImplementedError

    def shared_output(self, tokens: Tensor) -> Tensor | None:
        return None

    @property
    def local_experts(self) -> range:
        per_rank = self.num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def shard(self, ep_group: dist.ProcessGroup | None,
              token_group: dist.ProcessGroup | None) -> None:
        """Keep this rank's experts of ``ep_group``; ``token_group`` holds the other parts of
        each microbatch (context parallelism) for the load-balancing loss."""
        self.ep_group, self.token_group = ep_group, token_group
        if ep_group is not None:
            self.ep_size, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if self.num_experts % self.ep_size:
            raise ValueError(f"expert parallelism {self.ep_size} must divide the number of "
                             f"experts {self.num_experts}")
        keep = {str(e) for e in self.local_experts}
        for name in list(self.experts):
            if name not in keep:
                del self.experts[name]
        for param in self.experts.parameters():
            mark_expert_parallel(param)

    def take_stats(self) -> MoEStats:
        """The stats since the last call, and start counting anew."""
        stats = self.stats
        self.stats = MoEStats.empty(self.num_experts, stats.tokens_per_expert.device)
        return stats

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y, aux, _ = run_steps(self.forward_steps(x))
        return y, aux

    def forward_steps(self, x: Tensor, keep=None):
        """The MoE as sub-steps: yields the dispatch and the combine exchanges; returns
        ``(y, aux_loss, keep)``, ``keep`` being the caller's values carried across them."""
        x = self._whole_sequence(x)
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        route = self._route(tokens)
        shared = self.shared_output(tokens)
        dispatch = _Dispatch(route.send_counts, self.ep_group, self.token_group, route.picks)
        (received, receive_counts, picks), (gates, probability_sums, shared, keep) = yield (
            Exchange(send=tokens[route.token_of_row],
                     keep=(route.gate_of_row, route.probability_sums, shared, keep),
                     communicate=dispatch.forward, communicate_backward=dispatch.backward,
                     name="dispatch"))
        aux = self._load_balancing_loss(picks, probability_sums, tokens.shape[0])
        outputs = self._run_experts(received, receive_counts, dispatch.expert_rows)
        combined, (gates, aux, shared, keep) = yield Exchange(
            send=outputs, keep=(gates, aux, shared, keep), communicate=dispatch.combine,
            communicate_backward=dispatch.combine_backward, name="combine")
        kept = dispatch.kept
        weighted = combined * gates[:kept].unsqueeze(-1).to(combined.dtype)
        y = torch.zeros(tokens.shape[0], dim, dtype=weighted.dtype, device=x.device)
        y = y.index_add(0, route.token_of_row[:kept], weighted)
        if shared is not None:
            y = y + shared
        self._count(route, aux)
        return self._own_sequence(y.view(batch, seq, dim).to(x.dtype)), aux, keep

    def _whole_sequence(self, x: Tensor) -> Tensor:
        """Under sequence parallelism, every tp rank's sequence shard gathered: the ranks
        route the whole sequence alike (the experts' width is what they split)."""
        return gather_to_replicate(x, self.tp.group) if self.tp.sequence_parallel else x

    def _own_sequence(self, y: Tensor) -> Tensor:
        return scatter_to_sequence(y, self.tp.group) if self.tp.sequence_parallel else y

    def _route(self, tokens: Tensor) -> _Route:
        logits = self.router_logits(tokens).float()
        probabilities = logits.softmax(dim=-1)
        top_probabilities, experts = probabilities.topk(self.top_k, dim=-1)
        gates = (top_probabilities / top_probabilities.sum(dim=-1, keepdim=True)
                 if self.normalize else top_probabilities)
        expert_of_pick = experts.reshape(-1)
        picks = _counts(expert_of_pick, self.num_experts)
        destination = self._within_capacity(expert_of_pick, tokens.shape[0])
        pick_index = torch.argsort(destination, stable=True)
        counts = _counts(destination, self.num_experts + 1)[:-1]
        total_picks = torch.cat([picks, torch.full((1,), tokens.shape[0], device=picks.device)])
        return _Route(token_of_row=pick_index // self.top_k,
                      gate_of_row=gates.reshape(-1)[pick_index],
                      send_counts=counts.view(self.ep_size, -1),
                      picks=total_picks, probability_sums=probabilities.sum(dim=0),
                      dropped=expert_of_pick.numel() - counts.sum(),
                      local_picks=picks)

    def _within_capacity(self, expert_of_pick: Tensor, num_tokens: int) -> Tensor:
        """Each pick's expert, or ``num_experts`` for a pick beyond its expert's capacity
        (the first ``capacity`` in token order are taken): sorted by it, the dropped picks
        come last, and no host read is needed to leave them out."""
        if self.capacity_factor <= 0:
            return expert_of_pick
        capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        chose = expert_of_pick.unsqueeze(1) == torch.arange(self.num_experts,
                                                             device=expert_of_pick.device)
        position_in_expert = chose.long().cumsum(dim=0).gather(
            1, expert_of_pick.unsqueeze(1)).squeeze(1)
        return torch.where(position_in_expert <= capacity, expert_of_pick, self.num_experts)

    def _load_balancing_loss(self, picks: Tensor, probability_sums: Tensor,
                             local_tokens: int) -> Tensor:
        """This rank's share of ``E * sum_i f_i * P_i`` over the whole microbatch."""
        picks = picks.to(probability_sums.device)
        tokens = picks[-1].to(torch.float32)
        share_of_picks = picks[:-1].to(torch.float32) / (tokens * self.top_k)
        return self.num_experts * (share_of_picks * probability_sums).sum() / tokens

    def _run_experts(self, received: Tensor, receive_counts: Tensor,
                     expert_rows: list[int]) -> Tensor:
        """Each local expert on its rows (``expert_rows`` of each), as grouped products where
        the layer is laid out for them (``models.grouped_experts``), else one by one. Rows
        arrive grouped by source rank, then expert: from several ranks, they are sorted by
        expert first (on the device: the counts are not read again)."""
        receive_counts = receive_counts.to(received.device)
        order = None
        if self.ep_size > 1:
            expert_of_row = torch.arange(len(self.local_experts), device=received.device).repeat(
                self.ep_size).repeat_interleave(receive_counts.reshape(-1),
                                                output_size=received.shape[0])
            order = torch.argsort(expert_of_row, stable=True)
            received = received[order]
        received = copy_to_tp(received, self.tp.group)
        outputs = maybe_checkpoint(self.recompute, self._experts_on, received,
                                   receive_counts.sum(dim=0), expert_rows)
        outputs = reduce_from_tp(outputs, self.tp.group)
        return outputs if order is None else outputs[torch.argsort(order)]

    def _experts_on(self, rows: Tensor, rows_per_expert: Tensor,
                    expert_rows: list[int]) -> Tensor:
        """The local experts' outputs of their rows (grouped by expert): what backward
        recomputes under ``recompute``, the exchanges around it kept."""
        if grouped_experts.ready(self, rows):
            return grouped_experts.run(self, rows, rows_per_expert)
        return torch.cat([self.experts[str(e)](part) for e, part in zip(
            self.local_experts, rows.split(expert_rows))])

    def _count(self, route: _Route, aux: Tensor) -> None:
        self.stats.add(route.local_picks, route.dropped, aux.detach())


def _counts(values: Tensor, size: int) -> Tensor:
    """How often each of ``0 .. size-1`` occurs in ``values``: ``bincount``, which on CUDA
    reads the largest value to the host (a wait for the GPU) where this adds on the device."""
    return torch.zeros(size, dtype=torch.int64, device=values.device).index_add_(
        0, values, torch.ones_like(values))


class MoE(ExpertLayer):
    """The reference mixture-of-experts MLP: a linear router and SwiGLU experts;
    ``forward(x) -> (y, aux_loss)`` on ``[batch, seq, dim]``."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 1,
                 capacity_factor: float = 0.0):
        super().__init__(experts, top_k, capacity_factor)
        self.router = linear(dim, experts)
        self.experts = nn.ModuleDict({str(e): SwiGLU(dim, hidden) for e in range(experts)})

    def router_logits(self, tokens: Tensor) -> Tensor:
        return self.router(tokens)

    def split_width(self, tp: TensorParallelRegion) -> None:
        """Keep this rank's slice of every expert's hidden width (the router stays whole).
        Every rank of ``tp`` routes the same tokens (with sequence parallelism: the gathered
        sequence) and receives the same rows; the layer's experts give this rank's part of
        their outputs, summed over ``tp`` in one all-reduce (and their input gradients in
        one backward)."""
        self.tp = tp
        for expert in self.experts.values():
            expert.shard_weights(tp)


@dataclass
class _Route:
    """Where one microbatch's tokens go: the rows to send (picks sorted by expert) with their
    token and gate, the rows per (ep rank, local expert), and the counts for the stats."""

    token_of_row: Tensor
    gate_of_row: Tensor
    send_counts: Tensor
    picks: Tensor
    probability_sums: Tensor
    dropped: Tensor
    local_picks: Tensor
