"""Shared pieces of the pipeline parity tests: a tiny transformer, data, and the rank body.

``pipeline_step`` runs on every rank of a worker pool: it builds the same model everywhere,
keeps this rank's stages, runs one step of the named schedule through the Executor and
returns this rank's loss, parameter gradients and observed activation peak. ``reference_step``
computes the same step in one process. Parity tests compare the two.
"""

from __future__ import annotations

import torch

from meshpipe.comm.p2p import P2PTransport
from meshpipe.models import Transformer, TransformerConfig, causal_lm_loss, split
from meshpipe.runtime.executor import Executor
from meshpipe.runtime.grad_sync import all_reduce_gradients
from meshpipe.runtime.stage import Stage
from meshpipe.schedules import build
from meshpipe.schedules import simulate
from meshpipe.topology import ParallelLayout, Topology

SEQ = 8
MICROBATCH_SIZE = 2


def tiny_config(num_layers: int, tie: bool = False) -> TransformerConfig:
    return TransformerConfig(vocab_size=32, dim=16, n_layers=num_layers, n_heads=4,
                             n_kv_heads=2, max_seq_len=SEQ, tie_embeddings=tie, init_seed=3)


def batch(num_sequences: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (num_sequences, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference_step(num_layers: int, num_sequences: int, tie: bool = False):
    """Loss and gradients of one process over the whole batch (mean over tokens)."""
    model = Transformer(tiny_config(num_layers, tie))
    tokens, targets = batch(num_sequences)
    loss = causal_lm_loss(model(tokens), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def stage_gradients(stages: dict[int, Stage]) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient of this rank's stages, keyed ``"stage.name"``."""
    return {f"{s}.{n}": p.grad.clone() for s, stage in stages.items()
            for n, p in stage.module.named_parameters()}


def pipeline_step(rank, world_size, name, pp, microbatches, *, stages_per_rank=1,
                  placement=None, dp=1, forward_only=False, tie=False, p2p_mode="async"):
    schedule = build(name, pp, microbatches, stages_per_rank=stages_per_rank,
                     placement=placement, forward_only=forward_only)
    topo = Topology.build(ParallelLayout(pp=pp, dp=dp))
    num_layers = 2 * schedule.num_stages
    chunks = split(Transformer(tiny_config(num_layers, tie)), schedule.num_stages)
    last = schedule.num_stages - 1
    stages = {s: Stage(chunks[s], s, schedule.num_stages,
                       loss_fn=causal_lm_loss if s == last else None)
              for s in schedule.stages_of(topo.pp_rank)}
    executor = Executor(schedule, stages, pp_rank=topo.pp_rank,
                        pipeline_ranks=topo.pipeline_ranks,
                        transport=P2PTransport(mode=p2p_mode))
    tokens, targets = batch(dp * microbatches * MICROBATCH_SIZE)
    mine = slice(topo.coords["dp"] * microbatches * MICROBATCH_SIZE,
                 (topo.coords["dp"] + 1) * microbatches * MICROBATCH_SIZE)
    inputs = [(t, None, None) for t in tokens[mine].split(MICROBATCH_SIZE)]
    result = executor.step(inputs, list(targets[mine].split(MICROBATCH_SIZE)))
    params = {n: p for s in stages.values() for n, p in s.module.named_parameters()}
    if not forward_only:
        all_reduce_gradients(params.values(), topo.dp_group, scale=1.0 / dp)
    simulated_peak = simulate(schedule).peak_activations[topo.pp_rank]
    return {
        "loss": result.loss,
        "outputs": [o.detach() for o in result.outputs],
        "grads": {} if forward_only else {n: p.grad.clone() for n, p in params.items()},
        "peak": result.peak_live_activations,
        "simulated_peak": simulated_peak,
        "timeline": [(t.action, t.start, t.end) for t in result.timeline],
    }
