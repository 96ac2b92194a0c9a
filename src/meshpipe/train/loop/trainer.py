"""The training loop: the reference transformer or a Hugging Face decoder, on the shipped
corpus or the user's text (``sources``), any layout, any schedule.

``run(config)`` decides the run once (``plan.plan_run``: checks, schedule, layer split,
devices, resume), starts the processes (locally, or joins torchrun's) and every rank runs
``Trainer(config, plan=plan).fit()``, composed of small parts:

1. the topology (pp x dp x cp ring x cp Ulysses x tp, or a tp size per pipeline rank) and
   this rank's process groups;
2. the stages the plan's schedule places on this pipeline rank, cut from a model sharded on
   the meta device, only this rank's parts then drawn or read (``sources``); the pipeline
   transport for the layout; an executor for training and one for evaluation;
3. per step (``StepState`` holds what it creates): this rank's microbatches
   (``batches``), one executor step in the run's precision, the gradients reduced over the
   ranks sharing each weight, measured and clipped (``gradients``; fp16: unscaled, and the
   step skipped on inf/NaN), AdamW;
4. rank 0 shows progress and appends each step's metrics to ``metrics.jsonl``, draws the
   measured timeline of one step (``reporting``), gathers each rank's memory (``memory``),
   and with ``--check`` compares the first step with a single-process run of the same
   model (``parity``); checkpoints (``checkpoint.Checkpointer``) are whole or not at all.

Faults: the launcher supervises the ranks (``launch``); every rank marks what it does
(``runtime.activity``) so a hang is explained; a step whose loss or gradients are not
finite is caught by every rank at once and skipped (``--skip-nonfinite``) or stops the run
before anything reaches the weights.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from meshpipe.comm import ops
from meshpipe.context import make_attention
from meshpipe.models import causal_lm_loss
from meshpipe.parallel import vocab_parallel_cross_entropy
from meshpipe.runtime import (AutocastChunk, DynamicLossScaler, Executor, MasterWeights, Stage,
                              StageHooks, StepResult, activity, weights_cast_once, weights_dtype)
from meshpipe.topology import Topology
from meshpipe.train.checkpoints import store as checkpoint
from meshpipe.train.checkpoints.resume import ResumePlan
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop import parity
from meshpipe.train.loop.batches import RankBatches
from meshpipe.train.loop.gradients import Gradients, tied_groups
from meshpipe.train.loop.learning_rate import LearningRate
from meshpipe.train.loop.nonfinite import NonFiniteSteps
from meshpipe.train.loop.source_losses import SourceLosses, SourcedTargets
from meshpipe.train.loop.transports import pipeline_transport
from meshpipe.train.outputs import memory, reporting
from meshpipe.train.outputs.metrics import MetricsLog
from meshpipe.train.run import data_sources, sources, weight_layout
from meshpipe.train.run.devices import DevicePlan, local_rank
from meshpipe.train.run.plan import CHECK_TIMEOUT_S, RunPlan, plan_for_rank, plan_run
from meshpipe.train.supervisor import faults
from meshpipe.train.supervisor.launch import (LaunchError, Supervision, launch,
                                              reports_for_the_job)
from meshpipe.train.supervisor.restarts import Restarts, resumed_under_torchrun

# Setting up, saving or loading a checkpoint may take this many hang timeouts before it
# counts as a hang.
SAVE_PATIENCE = 10


def run(config: TrainConfig) -> dict[str, Any] | None:
    """Train with ``config`` on ``config.world_size`` local processes (or under torchrun).

    The run is decided before any process starts (``plan_run``; one-line ValueErrors).
    With ``--max-restarts`` a failed attempt is followed by another from the newest
    checkpoint (``Restarts``). Returns rank 0's metrics (None on the other ranks of a
    torchrun job).
    """
    restarts = Restarts(config)
    attempt = resumed_under_torchrun(config)
    faults.forget_fired(config.out_dir)
    while True:
        try:
            _launch(attempt)
            break
        except LaunchError as error:
            attempt = restarts.after(error)
    if not reports_for_the_job():
        return None
    if config.export:
        export_newest(config)
    metrics_file = Path(config.out_dir) / "metrics.json"
    return json.loads(metrics_file.read_text()) if metrics_file.exists() else None


def _launch(config: TrainConfig) -> None:
    """One attempt: plan, then start the processes (or join torchrun's)."""
    plan = plan_run(config)
    if reports_for_the_job():
        for note in plan.notes:
            print(f"meshpipe: {note}", flush=True)
    launch(_fit_on_this_rank, config.world_size, plan, timeout_s=plan.process_group_timeout,
           supervision=Supervision(hang_timeout=config.hang_timeout,
                                   log_dir=Path(config.out_dir) / "logs",
                                   checkpoint_on_signal=config.checkpoint_on_signal),
           devices=plan.devices)


def export_newest(config: TrainConfig) -> Path:
    """``--export``: the run's last checkpoint as a directory transformers loads."""
    saved = checkpoint.find(Path(config.out_dir) / "checkpoint")
    exported = sources.export(saved.directory, config.export, config.model)
    print(f"meshpipe: exported step {saved.step} to {exported} (transformers "
          "AutoModelForCausalLM.from_pretrained loads it)", flush=True)
    return exported


def _fit_on_this_rank(plan: RunPlan) -> None:
    # Building a large model and its process groups may take a while: not a hang.
    with activity.doing("setting up this rank's stages and groups",
                        limit=SAVE_PATIENCE * plan.config.hang_timeout):
        trainer = Trainer(plan.config, plan=plan)
    trainer.fit()


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None  # None for a step skipped on inf/NaN gradients
    seconds: float
    skipped: bool = False
    moe: dict[str, float] | None = None
    nonfinite: bool = False  # the loss or a gradient was inf/NaN: the step was skipped
    sources: dict[str, Any] | None = None  # a mixture's share and loss per source


@dataclass
class StepState:
    """What one step (or evaluation) creates: its index, what each microbatch's summed loss
    is divided by, and the executor's result once it ran."""

    step: int
    loss_denominator: float
    result: StepResult | None = None
    by_source: list[float] = field(default_factory=list)

    def source_metrics(self, losses: SourceLosses | None, prefix: str) -> dict[str, Any]:
        """A mixture's share and loss of each source (``SourceLosses.metrics``)."""
        return {} if losses is None else losses.metrics(self.by_source, prefix)


class Trainer:
    """One rank of a training run, built from ``plan`` (the launcher's ``RunPlan``).

    Without a plan the rank plans for itself (``plan_for_rank``): ``resume`` is the
    checkpoint to continue from (with ``config.resume`` and none given, the newest complete
    one), ``run_id`` names this run's own checkpoints, ``devices`` where it computes
    (default: ``config.device`` on the backend of the process group it is in)."""

    def __init__(self, config: TrainConfig, resume: ResumePlan | None = None,
                 run_id: str = "local", devices: DevicePlan | None = None, *,
                 plan: RunPlan | None = None):
        plan = plan or plan_for_rank(config, resume, run_id, devices)
        self.plan = plan
        self.config = config
        self.step = -1
        self.device = plan.devices.device(local_rank(dist.get_rank()))
        self.topology = Topology.build(config.layout, device_type="cuda" if (
            plan.devices.backend == "nccl") else "cpu")
        self.rank = self.topology.rank
        coords = self.topology.coords
        self.tp_group = self.topology.tp_group if self.topology.tp_size > 1 else None
        self.schedule = plan.schedule
        my_stages = self.schedule.stages_of(self.topology.pp_rank)
        parts = sources.build_chunks(
            config, list(plan.layers),
            make_attention(self.topology.cp_ulysses_group, self.topology.cp_ring_group),
            my_stages, tp_group=self.tp_group, ep_group=self.topology.ep_group,
            token_group=self.topology.cp_group if config.layout.cp > 1 else None)
        self.scaler = DynamicLossScaler() if config.dtype == "fp16" else None
        self.stages = self._stages(parts.chunks, my_stages)
        self.experts = reporting.ExpertStats(config, self.stages, parts.moe_index, self.device,
                                             sources.num_experts(config),
                                             counted=self.topology.tp_rank == 0)
        self.aux_coef = sources.aux_coefficient(config)
        # This rank's parameters once each, under their full-model names (a tied head is the
        # embedding): the names key checkpoints and --check. In bf16 the stages' own are
        # bfloat16 and these are their float32 masters.
        self.masters = MasterWeights({
            id(param): (parts.names[id(param)], param) for stage in self.stages.values()
            for param in stage.module.parameters()}.values(), weights_dtype(config.dtype))
        self.parameters = self.masters.named
        weight_layout.lay_out(config, self.device,  # once weights have their dtype
                              [stage.module for stage in self.stages.values()], self.masters)
        tied = tied_groups(parts.shared, parts.chunks, self.stages, self.schedule.placement,
                           config, self.rank)
        self.gradients = Gradients(
            config, self.topology, self.parameters,
            [(self.masters.master_of(param), group) for param, group in tied], self.device,
            stage_params={index: self.masters.masters_of(stage.module.parameters())
                          for index, stage in self.stages.items()},
            twin_of=self.masters.twin_of,
            lr_scale_of=lambda name: sources.lr_scale_of(config, name))
        self.masters.release(p for bucket in self.gradients.buckets if bucket.owns_values
                             for p in bucket.params)
        self.learning_rate = (plan.resume.learning_rate if plan.resume is not None
                              else LearningRate.of(config))
        # The fused kernel on CUDA and CPU alike (on CPU 3x the loop's speed, 2.6M weights).
        self.optimizer = torch.optim.AdamW(self.gradients.param_groups(), lr=config.lr,
                                           weight_decay=config.weight_decay, fused=True)
        self.optimizer_memory = memory.OptimizerMemory(self.optimizer, self.device)
        executor_args = dict(pp_rank=self.topology.pp_rank,
                             pipeline_ranks=self.topology.pipeline_ranks,
                             transport=pipeline_transport(config, plan, self.topology,
                                                          self.device),
                             recv_timeout=plan.process_group_timeout)
        # A stage's gradients start reducing once its last backward of the step is done; its
        # weights (gathered under --zero 1/2) are awaited before its first forward.
        self._overlap = True
        self.executor = Executor(self.schedule, self.stages, **executor_args,
                                 stage_hooks=StageHooks(
                                     before_first_forward=self._weights_of,
                                     after_last_backward=self._gradients_final))
        self.eval_executor = Executor(plan.eval_schedule, self.stages, **executor_args)
        self.train_data, self.val_data = data_sources.samplers(config, coords["dp"])
        self.source_losses = (SourceLosses(data_sources.names(config), self.device)
                              if len(config.data) > 1 else None)
        self.batches = RankBatches(config, coords["cp_ring"], coords["cp_ulysses"],
                                   self.device)
        self.checkpointer = checkpoint.Checkpointer(
            Path(config.out_dir) / "checkpoint", self.parameters, self.optimizer,
            self.tp_group, self.scaler, config=config.to_dict(), run_id=plan.run_id,
            keep=config.keep_checkpoints, patience=SAVE_PATIENCE * config.hang_timeout,
            after_write=lambda step: self._fire_fault("save", step),
            learning_rate=self.learning_rate.anchor, buckets=self.gradients.buckets,
            background=config.checkpoint_async)
        self._now = StepState(-1, float(config.microbatch_size * config.seq_len))
        self.fault = faults.from_environment(self.rank, config.out_dir)
        if self.fault is not None:
            faults.install(self.fault, self.stages, lambda: self.step + 1)
        self.nonfinite = NonFiniteSteps(config, self.schedule.stages_of, self.device, self.is_main)

    def _stages(self, chunks: dict[int, torch.nn.Module], my_stages) -> dict[int, Stage]:
        """This rank's stages, in the run's precision; the last one computes the loss."""
        num_stages = self.schedule.num_stages
        last = num_stages - 1
        grad_scale_fn = self.scaler.scale_loss if self.scaler is not None else None
        return {s: Stage(self._in_precision(chunks[s].to(self.device)), s, num_stages,
                         loss_fn=self._loss if s == last else None,
                         grad_scale_fn=grad_scale_fn if s == last else None)
                for s in my_stages}

    def _weights_of(self, stage: int) -> None:
        """Before ``stage``'s first forward of a step: its weights gathered (``--zero``) and,
        in bf16, copied from their masters where those changed."""
        self.gradients.weights_of(stage)
        self.masters.refresh(self.stages[stage].module.parameters())

    def _all_weights(self) -> None:
        """Every weight current (before an evaluation, a save, the end)."""
        self.gradients.all_weights()
        self.masters.refresh(p for stage in self.stages.values()
                             for p in stage.module.parameters())

    def _fire_fault(self, place: str, step: int | None = None) -> None:
        """Fire the injected fault if it is due at ``place`` in ``step`` (default: the step
        under way; a save's is its checkpoint's, written in the background maybe later)."""
        step = self.step + 1 if step is None else step
        if self.fault is not None and self.fault.at == place and self.fault.due(step):
            self.fault.fire()

    def _in_precision(self, chunk: torch.nn.Module) -> torch.nn.Module:
        """The chunk, its forward under autocast for bf16/fp16 (its weights become bfloat16
        in bf16 once the stages exist: ``MasterWeights``)."""
        if self.config.dtype == "fp32":
            return chunk
        return AutocastChunk(chunk, self.config.dtype, self.device.type)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def counts_loss(self) -> bool:
        """Whether this rank's losses count in the step's loss: tensor-parallel ranks all
        compute the same loss, so only tp rank 0 reports it."""
        return self.topology.tp_rank == 0

    @property
    def last_result(self) -> StepResult | None:
        """The executor's result of the last step (or evaluation)."""
        return self._now.result

    def _loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of the microbatch's mean loss (normalised over all its tokens,
        including those other context-parallel ranks hold), so CP shares add up. Under
        tensor parallelism the logits are this rank's vocabulary slice. With experts the
        output is ``(logits, aux)`` and the loss adds the aux coefficient (``--moe-aux-coef``
        or the model's) x aux (this rank's share of the load-balancing loss)."""
        if isinstance(output, tuple):
            logits, aux = output
            return self._loss(logits, targets) + self.aux_coef * aux
        logits = output
        if isinstance(targets, SourcedTargets):
            loss_sum = self.source_losses.loss_sum(logits, targets, self.tp_group)
        elif self.tp_group is not None:
            loss_sum = vocab_parallel_cross_entropy(logits, targets, self.tp_group).sum()
        else:
            loss_sum, _ = causal_lm_loss(logits, targets, reduction="sum")
        return loss_sum / self._now.loss_denominator

    def microbatches(self, sampler: Any, step: int) -> tuple[list[Any], list[torch.Tensor]]:
        """This rank's stage-0 inputs and last-stage targets for batch ``step``; starts the
        step's state (its loss denominator)."""
        batch = self.batches(sampler, step)
        self._now = StepState(step, batch.loss_denominator)
        if self.source_losses is not None:
            self.source_losses.reset()
        return batch.inputs, batch.targets

    def _run(self, executor: Executor, sampler: Any, step: int) -> StepResult:
        inputs, targets = self.microbatches(sampler, step)
        with weights_cast_once(self.config.dtype, self.device.type):
            self._now.result = executor.step(inputs, targets)
        return self._now.result

    def _collective(self, what: str):
        """Mark waiting in a collective of the whole job (hang reports name who is missing)."""
        return activity.waiting(what, peers=list(range(dist.get_world_size())))

    def _global_loss(self, local_mean: float | None, flag: bool = False) -> tuple[float, bool]:
        """The step's mean loss over the whole job (CP shares add up, DP replicas average),
        and whether any rank raised ``flag`` (one all-reduce)."""
        counted = local_mean if self.counts_loss else None
        value = torch.tensor([counted or 0.0, float(flag)], dtype=torch.float64,
                             device=self.device)
        if self.source_losses is not None:  # a mixture's sums and counts per source
            value = torch.cat([value, self.source_losses.values() * float(self.counts_loss)])
        with self._collective("the loss all-reduce"):
            ops.all_reduce(value)
        total, flagged, *self._now.by_source = value.tolist()  # one read of the device
        return total / self.config.dp, flagged > 0

    def _gradients_final(self, stage: int) -> None:
        if self._overlap:
            self.gradients.stage_done(stage)

    def gradients_of_step(self, step: int) -> float:
        """Forward and backward of batch ``step`` with the gradients reduced whole (and
        unscaled under fp16), the optimizer not stepped; the step's loss (``--check``'s
        step)."""
        self._overlap = False
        try:
            result = self._run(self.executor, self.train_data, step)
        finally:
            self._overlap = True
        self.gradients.reduce(whole=True)
        if self.scaler is not None:
            self.scaler.unscale_(self.gradients.held)
        return self._global_loss(result.loss)[0]

    def check_first_step(self) -> dict[str, Any] | None:
        """``--check``: the first step here and in one process; rank 0's report (``parity``). The
        optimizer is not stepped: the training loop repeats this step."""
        loss = self.gradients_of_step(0)
        report = parity.check_step(self.config, loss, self.parameters, self.topology.tp_rank)
        self.gradients.zero()
        return report

    def train_step(self, step: int) -> StepStats:
        start = time.perf_counter()
        self.experts.take()
        result = self._run(self.executor, self.train_data, step)
        with self._collective("the expert statistics all-reduce"):
            moe = self.experts.metrics()
        locally_finite = (result.loss is None or math.isfinite(result.loss),
                          self.scaler is not None or self.gradients.all_finite())
        with self._collective("the gradient reduction"):
            self.gradients.reduce()
        overflow = self.scaler is not None and self.scaler.unscale_(self.gradients.held)
        if self.scaler is not None:
            self.scaler.update(overflow)
        with self._collective("the gradient norm all-reduce"):
            grad_norm = None if overflow else self.gradients.norm()
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm)
        loss, bad_norm = self._global_loss(result.loss, bad_norm)
        nonfinite = bad_norm or not math.isfinite(loss)
        if nonfinite:
            self.nonfinite.skip_or_stop(step, locally_finite, loss, grad_norm, self._collective)
        else:
            self.nonfinite.finite()
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate.at(step) * group["lr_scale"]
        if not (overflow or nonfinite):
            self.gradients.clip(grad_norm)
            self.optimizer.step()
            self.masters.updated()
            self.gradients.start_gathers()
        self.gradients.zero()
        return StepStats(loss, grad_norm, time.perf_counter() - start, overflow or nonfinite,
                         moe, nonfinite, self._now.source_metrics(self.source_losses, "data_"))

    def evaluate(self, step: int) -> float:
        """The validation loss after the step of index ``step`` (step ``step + 1``)."""
        self._all_weights()
        with activity.doing(f"evaluation after step {step + 1}"):
            result = self._run(self.eval_executor, self.val_data, step)
            return self._global_loss(result.loss)[0]

    def _stop_requested(self) -> bool:
        """Whether any rank was asked to stop (a signal, --checkpoint-on-signal): every rank
        agrees, at the start of a step. This all-reduce is also the step's barrier."""
        flag = torch.tensor([float(activity.stop_requested())], device=self.device)
        with self._collective("the start of the step"):
            ops.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    def fit(self) -> dict[str, Any]:
        """Train; return the metrics: on rank 0 the whole history (the steps before a
        resume included, from metrics.jsonl), on the other ranks this run's steps."""
        config = self.config
        out = Path(config.out_dir)
        start_step = 0  # the index of the first step to train: the steps done before it
        resume = self.plan.resume
        if resume is not None:
            self.checkpointer.load(resume.checkpoint.directory, resume.start_step)
            self.masters.updated()
            start_step = resume.start_step
        log = (MetricsLog(out, start_step, tensorboard=config.tensorboard) if self.is_main
               else None)
        metrics: dict[str, Any] = {"config": config.to_dict(), "world_size": config.world_size,
                                   "schedule": str(self.schedule.name),
                                   "resumed_from": start_step or None, "history": [],
                                   "eval": []}
        if config.check and start_step == 0:
            with activity.doing("the --check step in one process", limit=CHECK_TIMEOUT_S):
                metrics["check"] = self.check_first_step()
        # A thread lock: tqdm's default is a process-shared semaphore, which a rank stopped
        # by the launcher leaves behind (and the resource tracker then warns about).
        tqdm.set_lock(threading.RLock())
        bar = tqdm(total=config.steps, initial=start_step, unit="step", dynamic_ncols=True,
                   disable=not (self.is_main and config.progress))
        # People read a step's number, step + 1 (metrics, checkpoints, messages, faults).
        for step in range(start_step, config.steps):
            self.step = step
            with activity.doing(f"step {step + 1}", step=step + 1):
                self._fire_fault("step")
                if self._stop_requested():
                    metrics["stopped_at_step"] = step + 1
                    if config.checkpoint_on_signal and self.checkpointer.saved_step < step:
                        self._all_weights()
                        self.checkpointer.save(step)
                    break
                self._run_step(step, out, bar, log, metrics)
        bar.close()
        self.checkpointer.finish()
        self._all_weights()
        with self._collective("the gather of each rank's memory"):
            metrics["memory"] = self.optimizer_memory.gathered(self.is_main)
        if log is not None:
            log.close()
            reporting.write_metrics(out, metrics)
        return metrics

    def _run_step(self, step: int, out: Path, bar: tqdm, log: Any,
                  metrics: dict[str, Any]) -> None:
        """One training step and what follows it: metrics, timeline, evaluation, checkpoint."""
        config = self.config
        stats = self.train_step(step)
        record, postfix = reporting.step_record(
            config, step + 1, stats, self.learning_rate.at(step),
            self.scaler.scale if self.scaler is not None else None)
        if log is not None:
            log.append(record)
        metrics["history"].append(record)
        bar.set_postfix_str(postfix)
        bar.update()
        if step + 1 == config.timeline_step:
            records = [(self.topology.pp_rank, t.action, t.start, t.end)
                       for t in self.last_result.timeline]
            with self._collective("the timeline gather"):
                timeline = reporting.gather_timeline(records, self.topology.pipeline_ranks,
                                                     self.is_main)
            if timeline is not None:
                metrics["timeline"] = reporting.draw_timeline(config, timeline, out)
                metrics["bubble"] = reporting.measured_bubble(timeline, self.schedule, step + 1)
                log.append({"step": step + 1, "bubble_measured": metrics["bubble"]["measured"],
                            "bubble_simulated": metrics["bubble"]["simulated"]})
        if config.eval_every and (step + 1) % config.eval_every == 0:
            metrics["eval"].append({"step": step + 1, "val_loss": self.evaluate(step),
                                    **self._now.source_metrics(self.source_losses, "val_")})
            if log is not None:
                log.append(metrics["eval"][-1])
        if step == config.steps - 1 or (config.checkpoint_every
                                         and (step + 1) % config.checkpoint_every == 0):
            self._all_weights()
            self.checkpointer.save(step + 1)
