"""What the trainer tests share: a small reference model's flags, the first step's --check on
every rank of a pool, and training a run (optionally resumed from a given checkpoint)."""

from pathlib import Path

from meshpipe.train.checkpoints import store as checkpoint
from meshpipe.train.checkpoints.resume import resume_from
from meshpipe.train.loop.trainer import Trainer

SMALL = dict(dim=32, layers=4, heads=4, kv_heads=2, seq_len=16, microbatch_size=2, steps=4,
             eval_every=0, timeline_step=0, progress=False)


def for_a_model(flags: dict) -> dict:
    """``flags`` without the reference transformer's sizes, which a ``--model`` refuses."""
    return {key: value for key, value in flags.items()
            if key not in ("dim", "layers", "heads", "kv_heads")}


def check_first_step(rank, world_size, config):
    """Rank 0's ``--check`` report of ``config``'s first step (None on the other ranks)."""
    return Trainer(config).check_first_step()


def resume_plan(config, rewind_to):
    """A plan resuming from the checkpoint directory ``rewind_to`` (not the newest); None
    without one."""
    if rewind_to is None:
        return None
    info = checkpoint.read_info(Path(config.out_dir) / "checkpoint" / rewind_to)
    return resume_from(info, config)


def train(rank, world_size, config, rewind_to=None):
    """Train; with ``rewind_to``, resume from that checkpoint directory. The step losses."""
    metrics = Trainer(config, resume=resume_plan(config, rewind_to)).fit()
    return [h["loss"] for h in metrics["history"]]


def train_then_logits(rank, world_size, config, tokens):
    """Train, export on rank 0, and return the trained stages' logits of ``tokens`` through
    a forward-only step on every rank (experts' exchanges need them all): from the rank
    holding the last stage, whole over its tensor-parallel ranks' vocabulary shards, None
    from the others."""
    import torch
    import torch.distributed as dist

    from meshpipe.parallel import unshard
    from meshpipe.train.loop.trainer import export_newest

    trainer = Trainer(config)
    trainer.fit()
    if rank == 0:
        export_newest(config)
    dist.barrier()
    inputs = [(tokens, None, None)] * config.microbatches
    outputs = trainer.eval_executor.step(inputs, None).outputs
    if not outputs:
        return None
    logits = outputs[0][0] if isinstance(outputs[0], tuple) else outputs[0]  # (logits, aux)
    if trainer.tp_group is None:
        return logits
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(trainer.tp_group))]
    dist.all_gather(shards, logits.contiguous(), group=trainer.tp_group)
    return unshard(shards, dim=-1)
