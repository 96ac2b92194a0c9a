"""What ``--resume`` continues from, decided in the launcher before any worker starts.

``plan_resume`` only reads files: it finds the complete checkpoint saved last under
``<out_dir>/checkpoint`` and compares the config recorded in its ``meta.json`` with the one
given, field group by field group:

- model fields (``MODEL_FIELDS``) must match: the weights would not fit another model;
- fields that change the trajectory (``SCHEDULE_FIELDS``: learning rates, batch, data
  order, precision) must match unless ``--allow-config-change`` accepts them (then a note
  says so);
- the run's length and running (``RUN_FIELDS``: ``--steps``, evaluation, checkpoints,
  output, progress, fault handling) may change, with a note: a changed ``--steps`` extends
  or shortens the run and re-spans the learning-rate decay from where it stands
  (``learning_rate``);
- layout fields (``LAYOUT_FIELDS``) may change freely: checkpoints are layout-free;
- the rest (``IGNORED_FIELDS``) does not matter.

Every refusal is a ValueError of one line that says what to do. A field missing from an
older checkpoint's config counts as its default; a field this version does not know is noted
and ignored.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from pathlib import Path
from typing import Any

from meshpipe.train.checkpoints.store import CheckpointInfo, incomplete_checkpoints, newest
from meshpipe.train.config import LIST_FIELDS, TrainConfig, as_list_value
from meshpipe.train.loop.learning_rate import LearningRate

# Every TrainConfig field is in exactly one group (a test checks it, so a new field cannot be
# forgotten here).
MODEL_FIELDS = ("model", "dim", "layers", "heads", "kv_heads", "tie_embeddings", "moe_experts",
                "moe_top_k", "moe_every")
SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "seed",
                   "microbatches", "microbatch_size", "dp", "seq_len", "dtype", "moe_aux_coef",
                   "moe_capacity_factor", "data", "val_data", "text_field", "loss_on",
                   "chat_template", "truncate", "tokenizer", "pack", "freeze", "lr_scale")
LAYOUT_FIELDS = ("pp", "vpp", "cp_ulysses", "cp_ring", "tp", "stage_tp", "stage_layers",
                 "stage_link", "sequence_parallel", "schedule", "placement", "p2p", "recompute",
                 "ep", "device", "backend", "zero", "compile", "chunk_graphs",
                 "joint_projections", "grouped_experts", "grad_accumulation_fusion")
RUN_FIELDS = ("steps", "eval_every", "checkpoint_every", "checkpoint_async", "keep_checkpoints",
              "timeline_step", "progress", "tensorboard", "hang_timeout", "skip_nonfinite", "checkpoint_on_signal",
              "max_restarts", "export", "data_cache")
IGNORED_FIELDS = ("out_dir", "resume", "check", "allow_config_change")


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint to load, the first step to train, the learning-rate schedule from
    there, and one-line notes for the user."""

    checkpoint: CheckpointInfo
    start_step: int
    learning_rate: LearningRate
    notes: list[str] = field(default_factory=list)


def checkpoint_root(config: TrainConfig) -> Path:
    """Where a run's checkpoints live."""
    return Path(config.out_dir) / "checkpoint"


def plan_resume(config: TrainConfig) -> ResumePlan:
    """The checkpoint ``config`` resumes from and the step it starts at, or a one-line
    ValueError that says why it cannot and what to do."""
    root = checkpoint_root(config)
    info = newest(root)
    if info is None:
        raise ValueError(_nothing_to_resume(root))
    return resume_from(info, config)


def resume_from(info: CheckpointInfo, config: TrainConfig) -> ResumePlan:
    """The plan of continuing the checkpoint ``info`` with ``config`` (``plan_resume``'s
    checks and notes), or a one-line ValueError."""
    saved = _saved_values(info.config)
    where = f"checkpoint {info.directory}"

    model = _differences(saved, config, MODEL_FIELDS)
    if model:
        raise ValueError(f"{where} holds another model: {model} (saved -> given); give the "
                         "saved model's flags to resume it, or another --out-dir to start a new "
                         "run")
    schedule = _differences(saved, config, SCHEDULE_FIELDS)
    if schedule and not config.allow_config_change:
        raise ValueError(f"{where} was trained with other settings: {schedule} (saved -> "
                         "given); give the saved values, or --allow-config-change to accept "
                         "them")
    start_step = info.step  # the index of the next step: the steps done
    if start_step >= config.steps:
        raise ValueError(f"nothing to train: checkpoint {info.directory.name} holds {start_step} "
                         f"steps and --steps is {config.steps}; give a larger --steps to "
                         "continue the run")
    saved_rate = LearningRate.of(SimpleNamespace(**saved), info.learning_rate)
    learning_rate = saved_rate.respanned(start_step, config)

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.saved_at))
    notes = [f"resuming from {info.directory} (saved {when}): step {start_step + 1} of "
             f"{config.steps} is next"]
    if schedule:
        notes.append(f"training settings changed: {schedule} (accepted with "
                     "--allow-config-change)")
    run = _differences(saved, config, RUN_FIELDS)
    if run:
        rate = (f"; {saved_rate.describe_change(start_step, learning_rate)}"
                if saved["steps"] != config.steps else "")
        notes.append(f"run settings changed: {run}{rate}")
    layout = _differences(saved, config, LAYOUT_FIELDS)
    if layout:
        notes.append(f"layout changed: {layout} (checkpoints are layout-free)")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(info.config) - known)
    if unknown:
        notes.append(f"ignoring settings this version does not know in the checkpoint: "
                     f"{', '.join(unknown)}")
    return ResumePlan(checkpoint=info, start_step=start_step, learning_rate=learning_rate,
                      notes=notes)


def _nothing_to_resume(root: Path) -> str:
    incomplete = incomplete_checkpoints(root)
    if incomplete:
        names = ", ".join(path.name for path in incomplete[:3])
        more = f" and {len(incomplete) - 3} more" if len(incomplete) > 3 else ""
        return (f"no complete checkpoint in {root} to resume from, only {len(incomplete)} "
                f"incomplete one(s) from interrupted saves ({names}{more}); run without "
                "--resume to start over, or point --out-dir at the run to continue")
    return (f"no complete checkpoint in {root} to resume from, and no incomplete one "
            "either: run once without --resume, or point --out-dir at the run to continue")


def _saved_values(saved: dict[str, Any]) -> dict[str, Any]:
    """The saved config with every field it lacks (an older version's) at its default."""
    values = {f.name: saved.get(f.name, f.default) for f in dataclasses.fields(TrainConfig)}
    return {name: as_list_value(value) if name in LIST_FIELDS else value
            for name, value in values.items()}


def _show(value: Any) -> str:
    return repr(value) if value == "" else str(value)


def _differences(saved: dict[str, Any], config: TrainConfig, names: tuple[str, ...]) -> str:
    """``name saved -> given`` for each field of ``names`` that differs, comma-separated."""
    return ", ".join(f"{name} {_show(saved[name])} -> {_show(getattr(config, name))}"
                     for name in names if saved[name] != getattr(config, name))
