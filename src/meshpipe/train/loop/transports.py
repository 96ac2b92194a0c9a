"""The pipeline transport a training run's layout needs (``pipeline_transport``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshpipe.comm import strict
from meshpipe.comm.p2p import P2PTransport
from meshpipe.comm.transport import Transport
from meshpipe.comm.vtp import FanoutTransport, VTPTransport
from meshpipe.topology import Topology, new_groups
from meshpipe.train.config import TrainConfig
from meshpipe.train.run.plan import RunPlan


def pipeline_transport(config: TrainConfig, plan: RunPlan, topology: Topology,
                       device: torch.device) -> Transport:
    """The pipeline transport of the layout: each tp rank's own pipeline (uniform tp), or
    stages of different sizes linked through their roots or fanned out to every rank.

    Payloads through NCCL need a CPU (gloo) group for headers and metadata, and a second
    NCCL group for the messages to lower ranks (one stream per direction). Ranks sharing
    a GPU over gloo send from host buffers and receive onto the GPU.
    """
    on_nccl = plan.devices.backend == "nccl"
    # The strict communication mode runs gloo in NCCL's order: the groups are NCCL's too.
    nccl_shaped = on_nccl or strict.active()
    meta_group = strict.host_group(dist.new_group(backend="gloo")) if nccl_shaped else None
    reverse_group = (dist.new_group(backend=plan.devices.backend) if nccl_shaped else None)
    options = dict(reverse_group=reverse_group, meta_group=meta_group,
                   device=device if on_nccl else "cpu", deliver_to=device,
                   timeout=plan.process_group_timeout, mode=config.p2p)
    layout = config.layout
    if config.link is None:
        return P2PTransport(**options)
    stage_ranks = layout.stage_ranks(topology.rank)
    if config.link == "fanout":
        return FanoutTransport(stage_ranks, **options)
    intra_meta_group = (strict.host_group(new_groups(layout.group_ranks(["tp"]),
                                                     topology.rank, backend="gloo"))
                        if nccl_shaped else None)
    return VTPTransport(stage_ranks, topology.tp_group, intra_meta_group=intra_meta_group,
                        **options)
