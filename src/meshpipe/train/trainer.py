"""The training loop: the reference transformer or a Hugging Face decoder, on the shipped
corpus or the user's text (``sources``), any layout, any schedule.

``run(config)`` starts the processes (locally, or joins torchrun's) and every rank runs
``Trainer(config).fit()``:

1. the topology (pp x dp x cp ring x cp Ulysses x tp, or a tp size per pipeline rank) and
   this rank's process groups;
2. the schedule from the builders, and the stages it places on this pipeline rank, cut from
   one model that every rank initialises identically and then shards over tensor
   parallelism (a ``--model`` is cut on the meta device and each rank reads only its
   stages' weights); the pipeline transport for the layout (stages of different
   tensor-parallel sizes talk through their roots, or fan out to every rank);
3. per step: the same batch on every rank of a context-parallel group, each rank keeping its
   slice of the sequence (zigzag for ring attention; its piece of every document of a
   ``--pack`` row), one Executor step in the run's precision, gradients summed over context
   parallelism and averaged over data parallelism, sequence-parallel ones summed over
   tensor parallelism, tied weights summed across the stages that hold them, (fp16:
   unscaled, and the step skipped on inf/NaN), global-norm clipping, AdamW;
4. rank 0 shows progress, appends each step's metrics to ``metrics.jsonl``, draws the
   measured timeline of one step, and with ``--check`` compares the first step with a
   single-process run of the same model.

Faults: the launcher supervises the ranks (``launch``); every rank marks what it does
(``runtime.activity``) so a hang is explained; a step whose loss or gradients are not
finite is caught by every rank at once and skipped (``--skip-nonfinite``) or stops the run
before anything reaches the weights; checkpoints are written whole or not at all and record
the config, which ``--resume`` checks before any process starts.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from meshpipe.comm import ops
from meshpipe.comm.p2p import P2PTransport
from meshpipe.comm.transport import Transport
from meshpipe.context.shards import hybrid_positions, packed_hybrid_positions
from meshpipe.comm.vtp import FanoutTransport, VTPTransport
from meshpipe.context import make_attention
from meshpipe.models import causal_lm_loss
from meshpipe.models.moe import is_expert_param
from meshpipe.models.transformer import check_tensor_parallel_sizes
from meshpipe.parallel import (is_sequence_parallel_param, shard_dim, unshard,
                               vocab_parallel_cross_entropy)
from meshpipe.runtime import (AutocastChunk, DynamicLossScaler, Executor, Stage, activity,
                              all_reduce_gradients, low_precision_tolerance)
from meshpipe.schedules import Schedule, build
from meshpipe.schedules.placement import stage_layers, wraparound_placement
from meshpipe.schedules.render import to_png, write_chrome_trace
from meshpipe.schedules.costs import fit_costs
from meshpipe.schedules.simulator import simulate
from meshpipe.schedules.timeline import Timeline
from meshpipe.topology import Topology, new_groups
from meshpipe.train import checkpoint, faults, sources
from meshpipe.train.config import TrainConfig
from meshpipe.train.devices import DevicePlan, local_rank, local_ranks, plan_devices
from meshpipe.train.launch import (PROCESS_GROUP_TIMEOUT_S, Supervision, launch,
                                   reports_for_the_job)
from meshpipe.train.metrics import FILE_NAME as METRICS_FILE
from meshpipe.train.metrics import MetricsLog, dumps
from meshpipe.train.metrics import read as read_metrics
from meshpipe.train.resume import ResumePlan, plan_resume

# With --check, the other ranks wait while rank 0 recomputes the whole step in one process.
CHECK_TIMEOUT_S = 900.0
# Setting up, saving or loading a checkpoint may take this many hang timeouts before it
# counts as a hang.
SAVE_PATIENCE = 10


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite more often in a row than allowed.
    ``blamed_rank`` is the first rank where it showed; ``where`` the step and stage."""

    def __init__(self, message: str, blamed_rank: int, where: str):
        super().__init__(message)
        self.blamed_rank = blamed_rank
        self.where = where


def run(config: TrainConfig) -> dict[str, Any] | None:
    """Train with ``config`` on ``config.world_size`` local processes (or under torchrun).

    The layout, the output directory and the checkpoint a ``--resume`` continues from are
    checked here, before any process starts (one-line ValueErrors). Returns rank 0's
    metrics (None on the other ranks of a torchrun job).
    """
    check_model_layout(config, build_schedule(config))
    devices = plan_devices(config.device, config.backend, local_ranks(config.world_size))
    out = check_out_dir(config.out_dir)
    plan = plan_resume(config) if config.resume else None
    sources.check_sources(config)
    is_main = reports_for_the_job()
    if is_main:
        notes = plan.notes if plan is not None else _earlier_checkpoints_note(out)
        for note in [*notes, devices.notice()]:
            if note:
                print(f"meshpipe: {note}", flush=True)
    launch(_fit_on_this_rank, config.world_size, config, plan, uuid.uuid4().hex[:12], devices,
           timeout_s=process_group_timeout(config),
           supervision=Supervision(hang_timeout=config.hang_timeout, log_dir=out / "logs",
                                   checkpoint_on_signal=config.checkpoint_on_signal),
           devices=devices)
    if not is_main:
        return None
    if config.export:
        export_newest(config)
    metrics_file = out / "metrics.json"
    return json.loads(metrics_file.read_text()) if metrics_file.exists() else None


def export_newest(config: TrainConfig) -> Path:
    """``--export``: the run's last checkpoint as a directory transformers loads."""
    saved = checkpoint.find(Path(config.out_dir) / "checkpoint")
    exported = sources.export(saved.directory, config.export, config.model)
    print(f"meshpipe: exported step {saved.step} to {exported} (transformers "
          "AutoModelForCausalLM.from_pretrained loads it)", flush=True)
    return exported


def _earlier_checkpoints_note(out: Path) -> list[str]:
    """A fresh run leaves the checkpoints of earlier runs in its --out-dir alone: say so."""
    earlier = checkpoint.complete_checkpoints(out / "checkpoint")
    if not earlier:
        return []
    return [f"{out / 'checkpoint'} holds {len(earlier)} checkpoint(s) of earlier runs; this "
            "run leaves them (one of the same step is replaced) and --resume will take this "
            "run's newest; remove them or use another --out-dir to free the space"]


def process_group_timeout(config: TrainConfig) -> float:
    """Longer than the hang timeout, so the launcher explains a hang before a collective or
    a receive gives up on its own (and longer still while --check runs on rank 0)."""
    timeout = max(PROCESS_GROUP_TIMEOUT_S, 2 * config.hang_timeout + 30)
    return max(timeout, CHECK_TIMEOUT_S) if config.check else timeout


def check_out_dir(out_dir: str) -> Path:
    """The output directory, created; a one-line ValueError if it cannot hold the run's
    files (a file in its place, no permission, a full disk) instead of failing at the first
    write after hours of training."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {out} is a file, not a directory: give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".meshpipe-write-probe-{os.getpid()}"
        with open(probe, "wb") as stream:
            stream.write(b"\0" * 65536)
            stream.flush()
            os.fsync(stream.fileno())
        probe.unlink()
    except OSError as error:
        raise ValueError(f"--out-dir {out} is not writable ({error.strerror or error}): give a "
                         "directory this user can write, on a disk with free space") from None
    return out


def _fit_on_this_rank(config: TrainConfig, plan: ResumePlan | None, run_id: str,
                      devices: DevicePlan) -> None:
    # Building a large model and its process groups may take a while: not a hang.
    with activity.doing("setting up this rank's stages and groups",
                        limit=SAVE_PATIENCE * config.hang_timeout):
        trainer = Trainer(config, resume=plan, run_id=run_id, devices=devices)
    trainer.fit()


def build_schedule(config: TrainConfig, forward_only: bool = False) -> Schedule:
    """The run's schedule; fails if the model has too few layers for its stages."""
    schedule = build(config.schedule, config.pp, config.microbatches,
                     stages_per_rank=config.vpp, placement=config.placement_arg,
                     forward_only=forward_only)
    layers_per_stage(config, schedule)
    return schedule


def layers_per_stage(config: TrainConfig, schedule: Schedule) -> list[int]:
    """Each stage's layer count (``placement.stage_layers``); a one-line ValueError when
    the model has too few layers for the stages."""
    layers = sources.num_layers(config)
    counts = stage_layers(layers, schedule.placement)
    if counts is not None:
        return counts
    stages = schedule.num_stages
    wraps_around = schedule.placement == wraparound_placement(schedule.num_ranks)
    needed = stages - 1 if wraps_around else stages
    what = (f"the {layers} layers of --model {config.model}" if config.model
            else f"--layers {layers}")
    raise ValueError(f"{what} cannot fill the {stages} stages of {config.schedule} at pp "
                     f"{config.pp} x vpp {config.vpp}; use at least {needed} layers, or fewer "
                     "stages (--pp, --vpp)")


def check_model_layout(config: TrainConfig, schedule: Schedule) -> None:
    """Fail before any process starts when the model cannot be split as the layout asks."""
    layout = config.layout
    for tp in sorted({layout.tp_of(p) for p in range(config.pp)}):
        if tp > 1:
            check_tensor_parallel_sizes(sources.model_config(config), tp)
    if config.tie_embeddings and config.stage_tp:
        first, last = schedule.placement[0], schedule.placement[-1]
        if layout.tp_of(first) != layout.tp_of(last):
            raise ValueError(
                f"--tie-embeddings shares the embedding (pipeline rank {first}, --stage-tp "
                f"{layout.tp_of(first)}) with the head (pipeline rank {last}, --stage-tp "
                f"{layout.tp_of(last)}): give both the same tensor-parallel size")


def lr_at(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay from ``lr`` to ``min_lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None  # None for a step skipped on inf/NaN gradients
    seconds: float
    skipped: bool = False
    moe: dict[str, float] | None = None
    nonfinite: bool = False  # the loss or a gradient was inf/NaN: the step was skipped


class Trainer:
    """One rank of a training run. ``resume`` is the checkpoint to continue from (checked
    by ``plan_resume`` before the processes started; with ``config.resume`` and none given,
    the newest complete one); ``run_id`` names this run's own checkpoints, the only ones it
    rotates. ``devices`` is the launcher's plan (``meshpipe.train.devices``); without one, the
    config's ``device`` on the backend the default process group was created with."""

    def __init__(self, config: TrainConfig, resume: ResumePlan | None = None,
                 run_id: str = "local", devices: DevicePlan | None = None):
        self.config = config
        self.resume = resume if resume is not None or not config.resume else plan_resume(config)
        self.run_id = run_id
        self.step = -1
        backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        self.devices = devices or plan_devices(config.device, backend,
                                               local_ranks(dist.get_world_size()))
        self.device = self.devices.device(local_rank(dist.get_rank()))
        self.topology = Topology.build(config.layout, device_type="cuda" if (
            self.devices.backend == "nccl") else "cpu")
        self.rank = self.topology.rank
        coords = self.topology.coords
        self.dp_rank = coords["dp"]
        self.tp_group = self.topology.tp_group if self.topology.tp_size > 1 else None
        self.schedule = build_schedule(config)
        num_stages = self.schedule.num_stages
        attention = make_attention(self.topology.cp_ulysses_group, self.topology.cp_ring_group)
        my_stages = self.schedule.stages_of(self.topology.pp_rank)
        parts = sources.build_chunks(
            config, layers_per_stage(config, self.schedule), attention, my_stages,
            tp_group=self.tp_group, ep_group=self.topology.ep_group,
            token_group=self.topology.cp_group if config.layout.cp > 1 else None)
        chunks = parts.chunks
        # Global layer index of each mixture-of-experts layer (its stats' place in a step).
        self._moe_index = parts.moe_index
        # Full-model names (a tied head is the embedding) key checkpoints and --check.
        self._names = parts.names
        self.scaler = DynamicLossScaler() if config.dtype == "fp16" else None
        grad_scale_fn = self.scaler.scale_loss if self.scaler is not None else None
        self.stages = {s: Stage(self._in_precision(chunks[s].to(self.device)), s, num_stages,
                                loss_fn=self._loss if s == num_stages - 1 else None,
                                grad_scale_fn=grad_scale_fn if s == num_stages - 1 else None)
                       for s in my_stages}
        self.parameters = self._unique_parameters()
        self._shared = self._shared_parameter_groups(chunks, parts.shared)
        # Tied weights held on several ranks: only the group's first rank counts in the norm.
        self._tied_copies = {id(p) for p, group in self._shared if dist.get_rank(group) != 0}
        self.optimizer = torch.optim.AdamW([p for _, p in self.parameters], lr=config.lr,
                                           weight_decay=config.weight_decay)
        transport = self._transport()
        executor_args = dict(pp_rank=self.topology.pp_rank,
                             pipeline_ranks=self.topology.pipeline_ranks, transport=transport,
                             recv_timeout=process_group_timeout(config))
        self.executor = Executor(self.schedule, self.stages, **executor_args)
        self.eval_executor = Executor(build_schedule(config, forward_only=True), self.stages,
                                      **executor_args)
        self.train_data, self.val_data = sources.samplers(config, self.dp_rank)
        self._cp_coords = (coords["cp_ring"], coords["cp_ulysses"])
        self.positions = hybrid_positions(config.seq_len, config.cp_ring, coords["cp_ring"],
                                          config.cp_ulysses, coords["cp_ulysses"])
        self._device_positions = self.positions.to(self.device)
        # What a microbatch's summed loss is divided by (set per batch: see microbatches).
        self._loss_denominator = float(config.microbatch_size * config.seq_len)
        self.fault = faults.from_environment(self.rank)
        if self.fault is not None:
            faults.install(self.fault, self.stages, lambda: self.step)
        self._nonfinite_in_a_row = 0

    def _fire_fault(self, place: str) -> None:
        if self.fault is not None and self.fault.at == place and self.fault.due(self.step):
            self.fault.fire()

    def _in_precision(self, chunk: torch.nn.Module) -> torch.nn.Module:
        """The chunk, its forward under autocast for bf16/fp16 (weights stay float32)."""
        if self.config.dtype == "fp32":
            return chunk
        return AutocastChunk(chunk, self.config.dtype, self.device.type)

    def _transport(self) -> Transport:
        """The pipeline transport of the layout: each tp rank's own pipeline (uniform tp), or
        stages of different sizes linked through their roots or fanned out to every rank.

        Payloads through NCCL need a CPU (gloo) group for headers and metadata, and a second
        NCCL group for the messages to lower ranks (one stream per direction). Ranks sharing
        a GPU over gloo send from host buffers and receive onto the GPU.
        """
        on_nccl = self.devices.backend == "nccl"
        meta_group = dist.new_group(backend="gloo") if on_nccl else None
        reverse_group = dist.new_group(backend="nccl") if on_nccl else None
        options = dict(reverse_group=reverse_group, meta_group=meta_group,
                       device=self.device if on_nccl else "cpu", deliver_to=self.device,
                       timeout=process_group_timeout(self.config), mode=self.config.p2p)
        layout = self.config.layout
        if self.config.link is None:
            return P2PTransport(**options)
        stage_ranks = layout.stage_ranks(self.rank)
        if self.config.link == "fanout":
            return FanoutTransport(stage_ranks, **options)
        intra_meta_group = (new_groups(layout.group_ranks(["tp"]), self.rank, backend="gloo")
                            if on_nccl else None)
        return VTPTransport(stage_ranks, self.topology.tp_group,
                            intra_meta_group=intra_meta_group, **options)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def counts_loss(self) -> bool:
        """Whether this rank's losses count in the step's loss: tensor-parallel ranks all
        compute the same loss, so only tp rank 0 reports it."""
        return self.topology.tp_rank == 0

    def _loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of the microbatch's mean loss (normalised over all its tokens,
        including those other context-parallel ranks hold), so CP shares add up. Under
        tensor parallelism the logits are this rank's vocabulary slice. With experts the
        output is ``(logits, aux)`` and the loss adds ``--moe-aux-coef`` x aux (this rank's
        share of the load-balancing loss)."""
        if isinstance(output, tuple):
            logits, aux = output
            return self._loss(logits, targets) + self.config.moe_aux_coef * aux
        logits = output
        if self.tp_group is not None:
            loss_sum = vocab_parallel_cross_entropy(logits, targets, self.tp_group).sum()
        else:
            loss_sum, _ = causal_lm_loss(logits, targets, reduction="sum")
        return loss_sum / self._loss_denominator

    def _unique_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters once each, under their full-model names."""
        seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for stage in self.stages.values():
            for param in stage.module.parameters():
                seen.setdefault(id(param), (self._names[id(param)], param))
        return list(seen.values())

    def _shared_parameter_groups(self, chunks, shared_parameters
                                 ) -> list[tuple[torch.nn.Parameter, Any]]:
        """For each tied parameter split over pipeline ranks: this rank's copy and the group of
        the ranks holding a copy (created collectively, for every pipeline)."""
        mine = []
        placement = self.schedule.placement
        layout = self.config.layout
        for shared in shared_parameters:
            positions = sorted({placement[stage] for stage in shared.stages})
            if len(positions) < 2:
                continue
            holders = []
            for pipeline in layout.group_ranks(["pp"]):
                at = {layout.coords(rank)["pp"]: rank for rank in pipeline}
                if all(p in at for p in positions):
                    holders.append([at[p] for p in positions])
            group = new_groups(holders, self.rank)
            if group is not None:
                stage, name = next((s, n) for s, n in shared.locations if s in self.stages)
                mine.append((chunks[stage].get_parameter(name), group))
        return mine

    def microbatches(self, sampler: Any, step: int):
        """This rank's stage-0 inputs and last-stage targets for batch ``step``.

        Sets the loss denominator: the replica's counted targets per microbatch, so the
        step's loss is the mean over every counted target of the batch (padding and each
        document's last token do not count), as one process computes it.
        """
        batch = sampler.batch(step)
        counted = max(sources.counted_targets(batch.targets), 1)
        self._loss_denominator = counted / self.config.microbatches
        if getattr(batch, "doc_lens", None) is not None:
            return self._packed_microbatches(batch)
        tokens = batch.tokens[:, self.positions].to(self.device)
        targets = batch.targets[:, self.positions].to(self.device)
        size = self.config.microbatch_size
        inputs = [(t, self._device_positions, None) for t in tokens.split(size)]
        return inputs, list(targets.split(size))

    def _packed_microbatches(self, batch):
        """Each microbatch one packed row (``sources.packed_rows``): this rank's piece of
        every document (each document split contiguously over the ring, then Ulysses), with each
        token's position inside its document and its document id, so that attention applies
        the block-diagonal causal mask without materialising it here."""
        config = self.config
        inputs, targets = [], []
        for row_tokens, row_targets, lengths in sources.packed_rows(batch,
                                                                    config.microbatch_size):
            held = packed_hybrid_positions(lengths, config.cp_ring, self._cp_coords[0],
                                           config.cp_ulysses, self._cp_coords[1])
            positions, doc_ids = sources.packed_layout(lengths, held)
            inputs.append((row_tokens[:, held].to(self.device), positions.to(self.device),
                           doc_ids.to(self.device)))
            targets.append(row_targets[:, held].to(self.device))
        return inputs, targets

    def _collective(self, what: str):
        """Mark waiting in a collective of the whole job (hang reports name who is missing)."""
        return activity.waiting(what, peers=list(range(dist.get_world_size())))

    def _global_loss(self, local_mean: float | None) -> float:
        """Mean loss over the whole step: CP shares add up, DP replicas average."""
        return self._global_loss_and_flag(local_mean, False)[0]

    def _global_loss_and_flag(self, local_mean: float | None, flag: bool) -> tuple[float, bool]:
        """The step's mean loss, and whether any rank raised ``flag`` (one all-reduce)."""
        counted = local_mean if self.counts_loss else None
        value = torch.tensor([counted or 0.0, float(flag)], dtype=torch.float64,
                             device=self.device)
        with self._collective("the loss all-reduce"):
            ops.all_reduce(value)
        return value[0].item() / self.config.dp, value[1].item() > 0

    def train_step(self, step: int) -> StepStats:
        start = time.perf_counter()
        inputs, targets = self.microbatches(self.train_data, step)
        self._take_moe_stats()
        self.last_result = self.executor.step(inputs, targets)
        with self._collective("the expert statistics all-reduce"):
            moe = self._moe_metrics()
        local_finite = self._local_finiteness()
        with self._collective("the gradient reduction"):
            self._reduce_gradients()
        overflow = self.scaler is not None and self.scaler.unscale_(
            [p for _, p in self.parameters])
        if self.scaler is not None:
            self.scaler.update(overflow)
        with self._collective("the gradient norm all-reduce"):
            grad_norm = None if overflow else self._grad_norm()
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm)
        loss, bad_norm = self._global_loss_and_flag(self.last_result.loss, bad_norm)
        nonfinite = bad_norm or not math.isfinite(loss)
        if nonfinite:
            self._skip_or_stop(step, local_finite, loss, grad_norm)
        else:
            self._nonfinite_in_a_row = 0
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.config, step)
        if not (overflow or nonfinite):
            self._clip(grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss, grad_norm, time.perf_counter() - start, overflow or nonfinite,
                         moe, nonfinite)

    def _local_finiteness(self) -> tuple[bool, bool]:
        """Whether this rank's own loss and gradients are finite, before the reductions mix
        every rank's in (so a report can say where a NaN came from). Under fp16 overflowing
        gradients are the loss scaler's business, so only the loss counts."""
        loss = self.last_result.loss
        loss_ok = loss is None or math.isfinite(loss)
        grads = [p.grad for _, p in self.parameters if p.grad is not None]
        if self.scaler is not None or not grads:
            return loss_ok, True
        norms = torch._foreach_norm(grads)
        return loss_ok, bool(torch.isfinite(torch.stack(norms).sum()))

    def _skip_or_stop(self, step: int, local_finite: tuple[bool, bool], loss: float,
                      grad_norm: float | None) -> None:
        """A non-finite step: every rank learns where it showed first; skip the step, or
        stop the run once more than ``--skip-nonfinite`` happened in a row."""
        flags = torch.tensor([not local_finite[0], not local_finite[1]], dtype=torch.int32,
                             device=self.device)
        gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
        with self._collective("the non-finite report"):
            ops.all_gather(gathered, flags)
        bad_loss = [r for r, f in enumerate(gathered) if f[0]]
        bad_grads = [r for r, f in enumerate(gathered) if f[1]]
        what, value = ("loss", loss) if bad_loss or not math.isfinite(loss) else (
            "gradient norm", grad_norm)
        blamed = (bad_loss or bad_grads or [0])[0]
        stages = list(self.schedule.stages_of(self.config.layout.coords(blamed)["pp"]))
        where = f"step {step}, stage {stages[0] if len(stages) == 1 else stages}"
        message = f"step {step}: the {what} is {value} (first seen on rank {blamed}, {where})"
        self._nonfinite_in_a_row += 1
        allowed = self.config.skip_nonfinite
        if self._nonfinite_in_a_row > allowed:
            raise NonFiniteError(
                f"{message}; stopped before it reached the weights or a checkpoint (the last "
                f"checkpoint is intact): find the cause, or let --skip-nonfinite N skip up to N "
                f"such steps in a row", blamed, where)
        if self.is_main:
            tqdm.write(f"meshpipe: {message}; step skipped ({self._nonfinite_in_a_row} in a "
                       f"row, --skip-nonfinite {allowed})")

    def _take_moe_stats(self) -> list[tuple[int, Any]]:
        """Each local expert layer's stats since the last call (global layer index, stats)."""
        return [(self._moe_index[id(module)], module.take_stats())
                for stage in self.stages.values() for module in stage.module.modules()
                if id(module) in self._moe_index]

    def _moe_metrics(self) -> dict[str, float] | None:
        """The step's load-balancing loss (mean per microbatch, summed over layers), the
        most and fewest picks any expert of any layer got, and the dropped picks, over the
        whole job; None without experts."""
        if not self._moe_index:
            return None
        experts = self.config.moe_experts
        counts = torch.zeros(len(self._moe_index) * experts + 2, dtype=torch.float64,
                             device=self.device)
        for index, stats in self._take_moe_stats():
            counts[index * experts:(index + 1) * experts] += stats.tokens_per_expert.to(
                counts.device, torch.float64)
            counts[-2] += stats.dropped.to(counts.device, torch.float64)
            counts[-1] += stats.aux_loss.to(counts.device)
        ops.all_reduce(counts)
        per_expert = counts[:-2]
        return {"moe_aux_loss": counts[-1].item() / (self.config.dp * self.config.microbatches),
                "max_tokens_per_expert": int(per_expert.max().item()),
                "min_tokens_per_expert": int(per_expert.min().item()),
                "dropped_tokens": int(counts[-2].item())}

    def _reduce_gradients(self) -> None:
        params = [p for _, p in self.parameters]
        if self.config.ep > 1:
            all_reduce_gradients([p for p in params if is_expert_param(p)],
                                 self.topology.expert_dp_group, scale=1.0 / self.config.dp)
            params = [p for p in params if not is_expert_param(p)]
        if self.config.dp * self.config.layout.cp > 1:
            all_reduce_gradients(params, self.topology.dp_cp_group, scale=1.0 / self.config.dp)
        if self.tp_group is not None and self.config.sequence_parallel:
            all_reduce_gradients([p for p in params if is_sequence_parallel_param(p)],
                                 self.tp_group)
        for param, group in self._shared:
            all_reduce_gradients([param], group)

    def _counts_in_norm(self, param: torch.nn.Parameter) -> bool:
        """Whether this rank adds ``param``'s gradient to the global norm: a shard always, a
        replicated parameter on tp rank 0 only, a tied weight on its first holder only."""
        if id(param) in self._tied_copies:
            return False
        return shard_dim(param) is not None or self.topology.tp_rank == 0

    def _grad_norm(self) -> float:
        """Global gradient norm over the whole model (each weight counted once; experts
        are spread over the expert-parallel ranks)."""
        def sum_of_squares(experts: bool) -> torch.Tensor:
            squares = [p.grad.detach().double().pow(2).sum() for _, p in self.parameters
                       if p.grad is not None and self._counts_in_norm(p)
                       and is_expert_param(p) == experts]
            return (torch.stack(squares).sum() if squares
                    else torch.zeros((), dtype=torch.float64, device=self.device)).reshape(1)

        total = sum_of_squares(experts=False)
        if self.config.ep > 1:
            experts = sum_of_squares(experts=True)
            ops.all_reduce(experts, group=self.topology.ep_group)
            total += experts
        else:
            total += sum_of_squares(experts=True)
        ops.all_reduce(total, group=self.topology.model_group)
        return math.sqrt(total.item())

    def _clip(self, norm: float) -> None:
        if self.config.grad_clip > 0 and norm > self.config.grad_clip:
            for _, p in self.parameters:
                if p.grad is not None:
                    p.grad.mul_(self.config.grad_clip / (norm + 1e-6))

    def evaluate(self, step: int) -> float:
        with activity.doing(f"evaluation after step {step}"):
            inputs, targets = self.microbatches(self.val_data, step)
            result = self.eval_executor.step(inputs, targets)
            return self._global_loss(result.loss)

    def _stop_requested(self) -> bool:
        """Whether any rank was asked to stop (a signal, --checkpoint-on-signal): every rank
        agrees, at the start of a step. This all-reduce is also the step's barrier."""
        flag = torch.tensor([float(activity.stop_requested())], device=self.device)
        with self._collective("the start of the step"):
            ops.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    def _save(self, step: int) -> None:
        """The checkpoint of ``step`` (written whole or not at all; see checkpoint.save)."""
        patience = SAVE_PATIENCE * self.config.hang_timeout
        with activity.doing(f"saving the checkpoint of step {step}", limit=patience,
                            action="checkpoint save"):
            checkpoint.save(Path(self.config.out_dir) / "checkpoint", self.parameters,
                            self.optimizer, step, self.tp_group, self.scaler,
                            config=self.config.to_dict(), run_id=self.run_id,
                            keep=self.config.keep_checkpoints,
                            after_write=lambda: self._fire_fault("save"))
        self._saved_step = step

    def fit(self) -> dict[str, Any]:
        """Train; return the metrics: on rank 0 the whole history (the steps before a
        resume included, from metrics.jsonl), on the other ranks this run's steps."""
        config = self.config
        out = Path(config.out_dir)
        start_step = 0
        if self.resume is not None:
            with activity.doing("loading the checkpoint",
                                limit=SAVE_PATIENCE * config.hang_timeout):
                checkpoint.load(self.resume.checkpoint.directory, self.parameters,
                                self.optimizer, self.tp_group, self.scaler)
            start_step = self.resume.start_step
        self._saved_step = start_step - 1
        log = MetricsLog(out, start_step) if self.is_main else None
        metrics: dict[str, Any] = {"config": config.to_dict(), "world_size": config.world_size,
                                   "schedule": str(self.schedule.name),
                                   "resumed_from": start_step or None, "history": [],
                                   "eval": []}
        if config.check and start_step == 0:
            with activity.doing("the --check step in one process", limit=CHECK_TIMEOUT_S):
                metrics["check"] = self._parity_check()
        # A thread lock: tqdm's default is a process-shared semaphore, which a rank stopped
        # by the launcher leaves behind (and the resource tracker then warns about).
        tqdm.set_lock(threading.RLock())
        bar = tqdm(total=config.steps, initial=start_step, unit="step", dynamic_ncols=True,
                   disable=not (self.is_main and config.progress))
        for step in range(start_step, config.steps):
            self.step = step
            with activity.doing(f"step {step}", step=step):
                self._fire_fault("step")
                if self._stop_requested():
                    metrics["stopped_at_step"] = step
                    if config.checkpoint_on_signal and self._saved_step < step - 1:
                        self._save(step - 1)
                    break
                self._run_step(step, out, bar, log, metrics)
        bar.close()
        if log is not None:
            log.close()
            self._write_metrics(out, metrics)
        return metrics

    def _run_step(self, step: int, out: Path, bar: tqdm, log: Any,
                  metrics: dict[str, Any]) -> None:
        """One training step and what follows it: metrics, timeline, evaluation, checkpoint."""
        config = self.config
        stats = self.train_step(step)
        tokens_per_s = config.tokens_per_step / stats.seconds
        record = {"step": step, "loss": stats.loss, "lr": lr_at(config, step),
                  "grad_norm": stats.grad_norm, "step_seconds": stats.seconds,
                  "tokens_per_s": tokens_per_s}
        if self.scaler is not None:
            record.update(skipped=stats.skipped, loss_scale=self.scaler.scale)
        if stats.nonfinite:
            record.update(skipped=True, nonfinite=True)
        postfix = f"loss {stats.loss:.3f} | {tokens_per_s:,.0f} tok/s"
        if stats.moe is not None:
            record.update(stats.moe)
            postfix += (f" | aux {stats.moe['moe_aux_loss']:.3f} | experts "
                        f"{stats.moe['min_tokens_per_expert']}-"
                        f"{stats.moe['max_tokens_per_expert']} tok"
                        + (f", {stats.moe['dropped_tokens']} dropped"
                           if self.config.moe_capacity_factor else ""))
        if log is not None:
            log.append(record)
        metrics["history"].append(record)
        bar.set_postfix_str(postfix)
        bar.update()
        if step + 1 == config.timeline_step:
            with self._collective("the timeline gather"):
                timeline = self._gather_timeline()
            if timeline is not None:
                metrics["timeline"] = self._draw_timeline(timeline, out)
                metrics["bubble"] = measured_bubble(timeline, self.schedule, step)
        if config.eval_every and (step + 1) % config.eval_every == 0:
            val_loss = self.evaluate(step)
            metrics["eval"].append({"step": step, "val_loss": val_loss})
            if log is not None:
                log.append(metrics["eval"][-1])
        if step == config.steps - 1 or (config.checkpoint_every
                                         and (step + 1) % config.checkpoint_every == 0):
            self._save(step)

    def _write_metrics(self, out: Path, metrics: dict[str, Any]) -> None:
        """metrics.json: the whole history (earlier runs of a resumed one included), the
        evaluations and a summary; the summary line on the terminal."""
        records = read_metrics(out / METRICS_FILE)
        history = [r for r in records if "loss" in r]
        metrics["history"] = history
        metrics["eval"] = [r for r in records if "val_loss" in r]
        if history:
            steady = [h["tokens_per_s"] for h in history[1:]] or [history[0]["tokens_per_s"]]
            metrics["summary"] = {"first_loss": history[0]["loss"],
                                  "last_loss": history[-1]["loss"],
                                  "median_tokens_per_s": sorted(steady)[len(steady) // 2],
                                  "skipped_steps": sum(bool(h.get("skipped")) for h in history),
                                  "nonfinite_steps": sum(bool(h.get("nonfinite"))
                                                         for h in history)}
        (out / "metrics.json").write_text(dumps(metrics, indent=2))
        summary = metrics.get("summary")
        if summary:
            first, last = summary["first_loss"], summary["last_loss"]
            bubble = metrics.get("bubble")
            bubbles = (f", bubble {100 * bubble['measured']:.1f}% measured vs "
                       f"{100 * bubble['simulated']:.1f}% simulated" if bubble else "")
            print(f"loss {_number(first)} -> {_number(last)} over {len(history)} steps, "
                  f"{summary['median_tokens_per_s']:,.0f} tokens/s{bubbles}; metrics in "
                  f"{out / 'metrics.json'}")

    def _gather_timeline(self) -> Timeline | None:
        """The last step's measured action times of rank 0's pipeline, on rank 0."""
        records = [(self.topology.pp_rank, t.action, t.start, t.end)
                   for t in self.last_result.timeline]
        gathered: list[Any] = [None] * dist.get_world_size() if self.is_main else None
        dist.gather_object(records, gathered, dst=0)
        if not self.is_main:
            return None
        pipeline = self.topology.pipeline_ranks
        return Timeline.from_records([r for rank in pipeline for r in gathered[rank]],
                                     num_ranks=len(pipeline), seconds_per_unit=1.0)

    def _draw_timeline(self, timeline: Timeline, out: Path) -> str:
        """Draw a measured step as a picture and a Chrome trace."""
        out.mkdir(parents=True, exist_ok=True)
        title = (f"measured step: {self.config.schedule}, pp {self.config.pp}, "
                 f"{self.config.microbatches} microbatches")
        to_png(timeline, out / "timeline.png", title=title)
        write_chrome_trace(timeline, out / "timeline.trace.json")
        return str(out / "timeline.png")

    def _parity_check(self) -> dict[str, Any] | None:
        """Run step 0 here and in one process on rank 0; compare loss and every gradient.

        Tensor-parallel shards are put back together on rank 0 before the comparison. The
        optimizer is not stepped: this step is repeated by the training loop.
        """
        inputs, targets = self.microbatches(self.train_data, 0)
        result = self.executor.step(inputs, targets)
        self._reduce_gradients()
        if self.scaler is not None:
            self.scaler.unscale_([p for _, p in self.parameters])
        loss = self._global_loss(result.loss)
        grads = {name: GradientPiece(p.grad.detach().cpu(), shard_dim(p), self.topology.tp_rank)
                 for name, p in self.parameters if p.grad is not None}
        gathered: list[Any] = [None] * dist.get_world_size() if self.is_main else None
        dist.gather_object(grads, gathered, dst=0)
        self.optimizer.zero_grad(set_to_none=True)
        if not self.is_main:
            return None
        return compare_with_single_process(self.config, loss, whole_gradients(
            self.config.layout, gathered))


def measured_bubble(timeline: Timeline, schedule: Schedule, step: int) -> dict[str, Any]:
    """The bubble of a measured step beside the simulated bubble of the same schedule at
    the costs fitted from that step (compute only, messages free): their difference is what
    communication and the runtime add."""
    costs = fit_costs(timeline, schedule.num_stages)
    return {"step": step, "measured": timeline.bubble_ratio,
            "simulated": simulate(schedule, costs).bubble_ratio,
            "fitted_costs_s": {"forward": costs.forward, "backward": costs.backward,
                               "backward_input": costs.backward_input,
                               "backward_weight": costs.backward_weight}}


def _number(value: float | None) -> str:
    return "nan" if value is None else f"{value:.3f}"


@dataclass
class GradientPiece:
    """One rank's gradient of a parameter: whole, or its tensor-parallel shard."""

    grad: torch.Tensor
    shard_dim: int | None
    tp_rank: int


def whole_gradients(layout, gathered: list[dict[str, GradientPiece]]
                    ) -> list[dict[str, torch.Tensor]]:
    """Every model replica's gradients (one dict per data x context coordinate and per
    pipeline copy), tensor-parallel shards concatenated in tp order."""
    replicas: dict[tuple, dict[str, dict[int, GradientPiece]]] = {}
    for rank, pieces in enumerate(gathered):
        coords = layout.coords(rank)
        replica = (coords["dp"], coords["cp_ring"], coords["cp_ulysses"])
        for name, piece in pieces.items():
            key = replica if piece.shard_dim is not None else (*replica, rank)
            replicas.setdefault(key, {}).setdefault(name, {})[piece.tp_rank] = piece
    whole: list[dict[str, torch.Tensor]] = []
    for by_name in replicas.values():
        grads = {}
        for name, shards in by_name.items():
            pieces = [shards[t] for t in sorted(shards)]
            dim = pieces[0].shard_dim
            grads[name] = pieces[0].grad if dim is None else unshard([p.grad for p in pieces],
                                                                      dim)
        whole.append(grads)
    return whole


def compare_with_single_process(config: TrainConfig, loss: float,
                                gathered: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Compare a run's step-0 loss and gradients with one process in the same precision.

    fp32 uses torch's default tolerances; bf16/fp16 scale the absolute tolerance with each
    gradient's largest magnitude (``low_precision_tolerance``), reported as ``atol_factor``.
    """
    reference_loss, reference = sources.reference_step(config)
    tolerance = low_precision_tolerance(config.dtype, 1.0)
    worst_grad, worst_name = 0.0, ""
    reported = {name for grads in gathered for name in grads}
    mismatched = sorted(set(reference) ^ reported)  # a gradient missing on every rank fails
    for grads in gathered:
        for name, grad in grads.items():
            if name not in reference:
                continue
            if grad.shape != reference[name].shape:
                mismatched.append(name)
                continue
            difference = (grad - reference[name]).abs().max().item()
            if difference > worst_grad:
                worst_grad, worst_name = difference, name
            try:
                torch.testing.assert_close(
                    grad, reference[name], **low_precision_tolerance(config.dtype, reference[name])
                    if config.dtype != "fp32" else {})
            except AssertionError:
                mismatched.append(name)
    loss_difference = abs(loss - reference_loss)
    loss_tolerance = low_precision_tolerance("fp32")
    passed = not mismatched and math.isclose(loss, reference_loss, rel_tol=tolerance["rtol"],
                                             abs_tol=loss_tolerance["atol"])
    rtol = tolerance["rtol"]
    atol = (f"atol {tolerance['atol']:.1e}" if config.dtype == "fp32"
            else f"atol {tolerance['atol']:.0e} x max|grad|")
    report = {"loss": loss, "reference_loss": reference_loss,
              "loss_difference": loss_difference, "max_grad_difference": worst_grad,
              "worst_parameter": worst_name, "mismatched": sorted(set(mismatched)),
              "dtype": config.dtype,
              "tolerance": {"rtol": rtol, ("atol" if config.dtype == "fp32" else "atol_factor"):
                            tolerance["atol"]},
              "passed": passed}
    verdict = "PASS" if passed else f"FAIL ({len(set(mismatched))} gradients differ)"
    print(f"--check step 0 vs one process ({config.dtype}, rtol {rtol:.1e}, {atol}): loss "
          f"{loss:.6f} vs {reference_loss:.6f} (|diff| {loss_difference:.2e}), largest "
          f"gradient |diff| {worst_grad:.2e} ({worst_name}): {verdict}")
    return report
