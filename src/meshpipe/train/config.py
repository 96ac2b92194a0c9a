"""Training configuration: one dataclass, also the source of the ``meshpipe train`` flags.
One module because every flag is one field with its help and checks, read in one place.

Every field becomes a ``--flag`` (underscores become dashes) with its default and the help
text from ``FIELD_HELP`` (``meshpipe.train.run.arguments``), so the CLI never drifts from the
library. ``--config run.toml`` gives them as a TOML file (``meshpipe.train.run.toml_config``);
the flags given override it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from meshpipe.comm.p2p import MODES as P2P_MODES
from meshpipe.models import grouped_experts
from meshpipe.models.hf_vision import parse_lr_scales, parse_parts
from meshpipe.runtime.precision import DTYPES
from meshpipe.schedules import SCHEDULES
from meshpipe.schedules.builders import schedule_spec
from meshpipe.schedules.costs import RECOMPUTE_MODES
from meshpipe.schedules.placement import PLACEMENTS
from meshpipe.schedules.ranking import ZERO_LEVELS
from meshpipe.topology import ParallelLayout
from meshpipe.train.run.devices import BACKENDS, DEVICES

STAGE_LINKS = ("root", "fanout")
# --joint-projections and --grouped-experts (weights laid out for fewer, larger products) and
# --grad-accumulation-fusion: auto lets the run decide (meshpipe.train.run.weight_layout).
WEIGHT_LAYOUT_MODES = ("auto", "on", "off")
# Flags that describe the reference transformer: a --model directory's config.json says them.
_REFERENCE_MODEL_FLAGS = ("dim", "layers", "heads", "kv_heads", "tie_embeddings", "moe_experts",
                          "moe_top_k", "moe_every", "moe_aux_coef")
# Flags that only mean something with --moe-experts > 0 (or a --model with experts, which
# the launcher checks once it has read the model's config).
_EXPERT_FLAGS = ("moe_top_k", "moe_every", "moe_aux_coef", "moe_capacity_factor", "ep",
                 "grouped_experts")
# The cosine decay ends at the peak learning rate over this unless --min-lr says.
MIN_LR_DIVISOR = 10
# The step whose timeline is drawn unless --timeline-step says (the first is warm-up).
TIMELINE_STEP = 2
# --loss-on: which tokens of chat and prompt/completion rows the loss counts (plain text
# always counts every token).
LOSS_ON = ("assistant", "all")
# Fields given as a list: a flag repeated (--data a --data b), an array in a TOML file.
LIST_FIELDS = ("data",)


@dataclass(frozen=True)
class TrainConfig:
    # parallel layout
    pp: int = 2
    vpp: int = 1
    dp: int = 1
    cp_ulysses: int = 1
    cp_ring: int = 1
    tp: int = 1
    stage_tp: str = ""
    stage_layers: str = ""
    freeze: str = ""
    lr_scale: str = ""
    stage_link: str = ""
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    placement: str = "auto"
    p2p: str = "async"
    # batch
    microbatches: int = 4
    microbatch_size: int = 2
    seq_len: int = 64
    # your model and data (empty: the reference transformer on the shipped corpus)
    model: str = ""
    data: tuple[str, ...] = ()
    val_data: str = ""
    text_field: str = "text"
    loss_on: str = "assistant"
    chat_template: str = ""
    truncate: bool = True
    tokenizer: str = ""
    pack: bool = False
    data_cache: str = ""
    export: str = ""
    # model
    dim: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int | None = None  # DERIVED_DEFAULTS
    tie_embeddings: bool = False
    # mixture of experts
    moe_experts: int = 0
    moe_top_k: int = 1
    moe_every: int = 1
    moe_aux_coef: float = 0.01
    moe_capacity_factor: float = 0.0
    ep: int = 1
    # precision and memory
    dtype: str = "fp32"
    recompute: str = "none"
    zero: int = 0
    compile: bool = False
    chunk_graphs: str = "auto"
    joint_projections: str = "auto"
    grouped_experts: str = "auto"
    grad_accumulation_fusion: str = "auto"
    # optimisation
    steps: int = 30
    lr: float = 3e-3
    min_lr: float | None = None  # DERIVED_DEFAULTS
    warmup_steps: int = 5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # evaluation, output, checkpoints
    eval_every: int = 10
    out_dir: str = "out/train"
    checkpoint_every: int = 0
    resume: bool = False
    keep_checkpoints: int = 2
    allow_config_change: bool = False
    check: bool = False
    timeline_step: int | None = None  # DERIVED_DEFAULTS
    progress: bool = True
    tensorboard: bool = False
    # devices
    device: str = "auto"
    backend: str = "auto"
    # faults
    hang_timeout: float = 30.0
    skip_nonfinite: int = 0
    checkpoint_on_signal: bool = False
    checkpoint_async: bool = False
    max_restarts: int = 0

    def __post_init__(self) -> None:
        for name in LIST_FIELDS:
            object.__setattr__(self, name, as_list_value(getattr(self, name)))
        for name, rule in DERIVED_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, rule.value(self))
        parse_parts(self.freeze)
        parse_lr_scales(self.lr_scale)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of "
                             f"{', '.join(SCHEDULES)}")
        if self.placement not in ("auto", *PLACEMENTS):
            raise ValueError(f"unknown placement {self.placement!r}; choose auto or one of "
                             f"{', '.join(PLACEMENTS)}")
        for name, choices in (("dtype", DTYPES), ("p2p", P2P_MODES),
                              ("recompute", RECOMPUTE_MODES), ("device", DEVICES),
                              ("backend", BACKENDS), ("loss_on", LOSS_ON),
                              ("chunk_graphs", WEIGHT_LAYOUT_MODES),
                              ("joint_projections", WEIGHT_LAYOUT_MODES),
                              ("grouped_experts", WEIGHT_LAYOUT_MODES),
                              ("grad_accumulation_fusion", WEIGHT_LAYOUT_MODES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown --{flag_name(name)} {getattr(self, name)!r}; choose one "
                                 f"of {', '.join(choices)}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{flag_name(field.name)} must be a finite number, got {value}")
        if self.joint_projections == "on" and self.compile:
            raise ValueError("--joint-projections on is for eager blocks; a --compile'd "
                             "block takes its products as they are: drop one of them")
        self._check_grouped_experts()
        self._check_grad_accumulation_fusion()
        if schedule_spec(self.schedule).v_shaped:
            if self.vpp not in (1, 2):
                raise ValueError(f"--schedule {self.schedule} places 2 stages per pipeline rank "
                                 f"(a V); drop --vpp {self.vpp} or give --vpp 2")
            object.__setattr__(self, "vpp", 2)  # what runs, so metrics and checks say so
        positive = ("vpp", "microbatches", "microbatch_size", "seq_len", "dim", "layers",
                    "heads", "kv_heads", "steps", "tp", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr:  # before --min-lr, which follows it by default
            raise ValueError(f"need 0 < --lr and --min-lr <= --lr, got --lr {self.lr} "
                             f"--min-lr {self.min_lr}")
        non_negative = ("warmup_steps", "weight_decay", "grad_clip", "eval_every",
                        "checkpoint_every", "timeline_step", "min_lr", "skip_nonfinite",
                        "max_restarts")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"--{flag_name(name)} must be >= 0 (0 disables where it "
                                 f"applies), got {getattr(self, name)}")
        if self.zero not in ZERO_LEVELS:
            raise ValueError(f"--zero {self.zero}: choose 0 (every replica holds the whole "
                             "optimizer state), 1 (its states sharded over the replicas) or 2 "
                             "(its gradients too)")
        if not self.hang_timeout > 0:
            raise ValueError(f"--hang-timeout must be > 0 seconds, got {self.hang_timeout}")
        if self.min_lr > self.lr:
            raise ValueError(f"need 0 < --lr and --min-lr <= --lr, got --lr {self.lr} "
                             f"--min-lr {self.min_lr}")
        if self.timeline_step > self.steps:
            raise ValueError(f"--timeline-step {self.timeline_step} is after the last step "
                             f"{self.steps}; use a step in 1..{self.steps}, or 0 for none")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads "
                             f"{self.kv_heads} (grouped-query attention)")
        if self.dim % self.heads:
            raise ValueError(f"--dim {self.dim} must be a multiple of --heads {self.heads}")
        if self.cp_ring > 1 and self.seq_len % (2 * self.cp_ring):
            raise ValueError(f"ring attention splits the sequence into 2 x cp_ring = "
                             f"{2 * self.cp_ring} zigzag chunks: --seq-len {self.seq_len} is not "
                             f"divisible; use a multiple of {2 * self.cp_ring}")
        self._check_tensor_parallelism()
        self._check_experts()
        self._check_model_and_data()
        self.layout  # noqa: B018 - raises on invalid sizes

    def _check_model_and_data(self) -> None:
        if self.model:
            given = [f"--{flag_name(field.name)}" for field in dataclasses.fields(self)
                     if field.name in _REFERENCE_MODEL_FLAGS
                     and getattr(self, field.name) != self.default_of(field.name)]
            if given:
                verb = "describes" if len(given) == 1 else "describe"
                raise ValueError(f"{', '.join(given)} {verb} the reference transformer; with "
                                 f"--model {self.model} the sizes come from its config.json: "
                                 "drop them")
            if self.recompute == "selective":
                raise ValueError("--recompute selective recomputes the reference model's "
                                 "attention core; with --model use --recompute full or none")
        if self.pack and not self.data:
            raise ValueError("--pack packs the documents of --data into sequences: give --data "
                             "PATH (a .txt, a .jsonl or a folder of them)")
        data_flags = [f"--{flag_name(name)}" for name in ("val_data", "chat_template")
                      if getattr(self, name)]
        if data_flags and not self.data:
            raise ValueError(f"{' and '.join(data_flags)} go with your own --data; the shipped "
                             "corpus has its own validation split and no chat: give --data "
                             "PATH or drop them")
        if self.pack and self.sequence_parallel:
            raise ValueError("--pack gives each rank uneven pieces of every document, which "
                             "--sequence-parallel cannot split evenly over the tp ranks: drop "
                             "one of them")
        if self.tokenizer and not self.data:
            raise ValueError("--tokenizer tokenizes --data; the shipped corpus is byte-level: "
                             "give --data PATH or drop --tokenizer")
        if self.compile:
            from meshpipe.models.compile import check_mode

            check_mode()
        self._check_chunk_graphs()

    def _check_chunk_graphs(self) -> None:
        if self.chunk_graphs != "on":
            return
        if not self.compile:
            raise ValueError("--chunk-graphs on runs a chunk's compiled blocks as one graph, "
                             "which only --compile compiles: add --compile or drop the flag")
        from meshpipe.models.compile import CHUNK_GRAPHS

        if not CHUNK_GRAPHS:
            raise ValueError(f"--chunk-graphs on needs nested compile regions of a torch >= "
                             f"2.11; this is {torch.__version__}: use auto or off")

    def _check_grouped_experts(self) -> None:
        if self.grouped_experts != "on":
            return
        if self.dtype == "fp16":
            raise ValueError("--grouped-experts on needs the experts' weights in the dtype "
                             "they compute in; under --dtype fp16 they are float32 (autocast "
                             "casts each product): use bf16 or fp32, or --grouped-experts auto")
        if not grouped_experts.available():
            raise ValueError(f"--grouped-experts on needs a torch with a grouped matrix "
                             f"product (torch._grouped_mm, torch >= 2.8); this is "
                             f"{torch.__version__}: use auto or off")

    def _check_grad_accumulation_fusion(self) -> None:
        if self.grad_accumulation_fusion != "on":
            return
        if self.dtype != "bf16":
            raise ValueError(f"--grad-accumulation-fusion on adds bf16 weights' gradients into "
                             f"their float32 masters, which only --dtype bf16 has (this run: "
                             f"{self.dtype}): add --dtype bf16 or drop the flag")

    def _check_experts(self) -> None:
        if self.model:
            if self.moe_capacity_factor < 0:
                raise ValueError("need --moe-capacity-factor >= 0")
            return
        if self.moe_experts == 0:
            given = [f"--{flag_name(field.name)}" for field in dataclasses.fields(self)
                     if field.name in _EXPERT_FLAGS and getattr(self, field.name) != field.default]
            if given:
                verb = "applies" if len(given) == 1 else "apply"
                raise ValueError(f"{', '.join(given)} {verb} only to mixture-of-experts layers; "
                                 "give --moe-experts N (N > 0) or drop them")
            return
        if min(self.moe_experts, self.moe_top_k, self.moe_every) < 1 or min(
                self.moe_aux_coef, self.moe_capacity_factor) < 0:
            raise ValueError("need --moe-experts, --moe-top-k, --moe-every >= 1 and "
                             "--moe-aux-coef, --moe-capacity-factor >= 0")
        if self.moe_top_k > self.moe_experts:
            raise ValueError(f"--moe-top-k {self.moe_top_k} picks more experts than "
                             f"--moe-experts {self.moe_experts} has; use a top-k of at most "
                             f"{self.moe_experts}")
        if self.moe_experts % self.ep:
            raise ValueError(f"--moe-experts {self.moe_experts} is not divisible by --ep "
                             f"{self.ep}: each expert-parallel rank holds as many experts; "
                             f"use a multiple of {self.ep}")

    def _check_tensor_parallelism(self) -> None:
        if self.stage_link and self.stage_link not in STAGE_LINKS:
            raise ValueError(f"unknown --stage-link {self.stage_link!r}; choose one of "
                             f"{', '.join(STAGE_LINKS)}")
        if self.stage_link and not self.stage_tp:
            raise ValueError("--stage-link says how stages of different tensor-parallel sizes "
                             "talk; give the sizes with --stage-tp (e.g. --stage-tp 2,1)")
        if self.stage_tp and self.tp > 1:
            raise ValueError(f"give either --tp {self.tp} (every stage) or --stage-tp "
                             f"{self.stage_tp} (one size per pipeline rank), not both")
        sizes = self.stage_tp_sizes
        if sizes is not None and len(sizes) != self.pp:
            raise ValueError(f"--stage-tp {self.stage_tp} gives {len(sizes)} sizes for --pp "
                             f"{self.pp}; give one tensor-parallel size per pipeline rank")
        if self.sequence_parallel:
            if self.stage_tp:
                raise ValueError("--sequence-parallel needs the same tensor-parallel size on "
                                 "every stage (the sequence shards must line up between "
                                 "stages): use --tp instead of --stage-tp")
            if self.tp == 1:
                raise ValueError("--sequence-parallel splits the sequence over the tensor-"
                                 "parallel ranks: it needs --tp 2 or more")
            shards = self.cp_ring * self.cp_ulysses * self.tp
            if self.seq_len % shards:
                raise ValueError(f"--sequence-parallel splits each rank's share of --seq-len "
                                 f"{self.seq_len} over --tp {self.tp} after context "
                                 f"parallelism {self.cp_ring * self.cp_ulysses}: use a "
                                 f"multiple of {shards}")

    def default_of(self, name: str) -> Any:
        """Field ``name``'s default in this config (a derived default follows its rule)."""
        rule = DERIVED_DEFAULTS.get(name)
        return rule.value(self) if rule is not None else FIELDS[name].default

    @property
    def stage_tp_sizes(self) -> tuple[int, ...] | None:
        """``--stage-tp`` as integers (None when not given)."""
        if not self.stage_tp:
            return None
        try:
            return tuple(int(size) for size in self.stage_tp.split(","))
        except ValueError:
            raise ValueError(f"--stage-tp must be comma-separated integers such as 2,1; got "
                             f"{self.stage_tp!r}") from None

    @property
    def link(self) -> str | None:
        """How stages of different tensor-parallel sizes talk (None without --stage-tp)."""
        return (self.stage_link or "root") if self.stage_tp else None

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(pp=self.pp, dp=self.dp, cp_ring=self.cp_ring,
                              cp_ulysses=self.cp_ulysses, tp=self.tp,
                              stage_tp=self.stage_tp_sizes, ep=self.ep)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def placement_arg(self) -> str | None:
        """The placement to hand the schedule builder (None lets it pick its own)."""
        return None if self.placement == "auto" else self.placement

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.microbatches * self.microbatch_size * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DerivedDefault:
    """A default that follows other flags: the field is declared None (not given) and
    ``TrainConfig`` puts ``value(config)`` there; ``says`` is the rule for ``--help``."""

    says: str
    value: Callable[[TrainConfig], Any]


def _grouped_kv_heads(config: TrainConfig) -> int:
    """2 key/value heads (grouped-query attention) where --heads and every stage's tensor-
    parallel size allow it, else one per query head."""
    widest_tp = max(config.stage_tp_sizes or (config.tp,))
    return 2 if config.heads % 2 == 0 and 2 % widest_tp == 0 else config.heads


def _decimal(value: float) -> float:
    """``value`` rounded to 12 significant digits: 3e-3 / 10 is 0.0003, not
    0.00030000000000000003, in metrics, checkpoints and messages."""
    return float(f"{value:.12g}")


DERIVED_DEFAULTS = {
    "kv_heads": DerivedDefault("2 where --heads and --tp allow it, else --heads",
                               _grouped_kv_heads),
    "min_lr": DerivedDefault(f"--lr / {MIN_LR_DIVISOR}", lambda config: _decimal(
        config.lr / MIN_LR_DIVISOR)),
    "timeline_step": DerivedDefault(f"{TIMELINE_STEP}, or 1 with --steps 1",
                                    lambda config: min(TIMELINE_STEP, config.steps)),
}
FIELDS = {field.name: field for field in dataclasses.fields(TrainConfig)}


def field_kind(name: str) -> str:
    """Field ``name``'s value type: 'int', 'float', 'str', 'bool' or 'list' (of strings; a
    derived default's declared ``| None`` dropped)."""
    return "list" if name in LIST_FIELDS else str(FIELDS[name].type).split(" | ")[0]


def as_list_value(value: Any) -> tuple[str, ...]:
    """A list field's value as a tuple of strings: a list (read back from JSON or TOML)
    becomes a tuple, and one string (an older checkpoint's ``data``, a caller's
    ``data="a.txt"``) a tuple of it, or of nothing when empty."""
    if isinstance(value, str):
        return (value,) if value else ()
    return tuple(value)


def default_help(name: str) -> str:
    """What ``--help`` says field ``name`` defaults to."""
    rule = DERIVED_DEFAULTS.get(name)
    return rule.says if rule is not None else str(FIELDS[name].default)


def flag_name(name: str) -> str:
    """The command-line flag of field ``name``, without its dashes (``seq_len`` -> ``seq-len``)."""
    return name.replace("_", "-")


# The Hugging Face families ``--model`` trains (``meshpipe.models.hf.SUPPORTED_MODEL_TYPES``).
HF_FAMILIES = ("Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, Mixtral, Qwen2-MoE or "
               "Qwen3-MoE")

FIELD_HELP = {
    "pp": "pipeline-parallel ranks",
    "vpp": "virtual stages (model chunks) per pipeline rank",
    "dp": "data-parallel replicas",
    "cp_ulysses": "context-parallel Ulysses degree (heads <-> sequence all-to-all)",
    "cp_ring": "context-parallel ring degree (zigzag ring attention)",
    "tp": "tensor-parallel ranks per stage (heads, SwiGLU and expert width, vocabulary split)",
    "stage_tp": "one tensor-parallel size per pipeline rank, e.g. 2,1 (VTP)",
    "freeze": "parts of a vision-language model that do not train: any of vision, projector, "
              "language (e.g. vision,projector)",
    "lr_scale": "a learning-rate factor per part of a vision-language model, e.g. "
                "vision=0.1,projector=1",
    "stage_layers": "decoder layers per stage, e.g. vision+10,14 (a vision-language model's "
                    "tower is on the first stage; vision,24 gives it a stage of its own); "
                    "default: balanced, the tower's cost counted",
    "stage_link": "how stages of different --stage-tp sizes talk: root (tp rank 0 exchanges, "
                  "then broadcasts in its stage; the default) or fanout (every rank linked, "
                  "averaged fan-in)",
    "sequence_parallel": "split norms and residuals along the sequence over the tp ranks",
    "schedule": f"pipeline schedule: {', '.join(SCHEDULES)}",
    "placement": "stage placement: auto (the schedule's own), " + ", ".join(PLACEMENTS),
    "p2p": "pipeline transport: async (isend/irecv as posted) or batched (one "
           "batch_isend_irecv per exchange)",
    "microbatches": "microbatches per step (per data-parallel replica)",
    "microbatch_size": "sequences per microbatch",
    "seq_len": "tokens per sequence",
    "model": f"a Hugging Face model directory (config.json + safetensors) of a {HF_FAMILIES} "
             "decoder to train (empty: the reference transformer)",
    "data": "training data: a .txt file (documents separated by blank lines), a .jsonl or "
            ".parquet file of rows (a text field, chat messages, or prompt and completion), "
            "a folder written by datasets' save_to_disk, or a folder of them; repeat it with a "
            "weight each for a mixture (--data a.jsonl:0.7 --data chat/:0.3) (empty: the "
            "shipped corpus)",
    "val_data": "validation data of your own, read as --data is (empty: the last "
                "documents of each --data source are held out)",
    "text_field": "the column (or jsonl field) of a row that holds plain text",
    "loss_on": "which tokens of chat and prompt/completion rows the loss counts: assistant "
               "(the answers only) or all; plain text always counts every token",
    "chat_template": "a Jinja chat template file that renders the messages rows, instead of "
                     "the tokenizer's own",
    "truncate": "cut a chat or prompt/completion row longer than --seq-len to it, counting "
                "them in one notice line (--no-truncate refuses such a row instead)",
    "tokenizer": "tokenizer directory for --data (transformers AutoTokenizer, offline); "
                 "default: the --model directory's if it has one, else byte-level (vocab 256)",
    "pack": "pack several documents into each sequence (document ids, block-diagonal causal "
            "attention; a microbatch runs as one row of microbatch-size x seq-len tokens); "
            "without it each document is cut into sequences and padding is not trained",
    "data_cache": "directory of the tokenized --data cache (default: <out-dir>/tokens)",
    "export": "at the end, write the trained model here as a Hugging Face directory "
              "(config.json + safetensors) that transformers loads",
    "dim": "model width",
    "layers": "transformer layers (split across all stages)",
    "heads": "query heads",
    "kv_heads": "key/value heads (grouped-query attention)",
    "tie_embeddings": "share the embedding and output head weights",
    "moe_experts": "experts per mixture-of-experts layer (0: dense SwiGLU layers)",
    "moe_top_k": "experts each token is routed to",
    "moe_every": "every Nth layer is a mixture of experts (the first is)",
    "moe_aux_coef": "weight of the load-balancing loss added to the loss",
    "moe_capacity_factor": "tokens an expert takes per microbatch, as a multiple of an even "
                           "share (0: no limit); picks beyond it are dropped and counted",
    "ep": "expert-parallel ranks: experts sharded over ranks of the data x context ranks "
          "of a stage",
    "dtype": "compute precision: fp32, bf16 (bf16 weights with fp32 masters, under autocast) "
             "or fp16 (autocast on fp32 weights, with dynamic loss scaling)",
    "recompute": "activation recompute: none, full (each block) or selective (attention core)",
    "compile": "compile each decoder block with torch.compile (one compiled code for all "
               "blocks; attention cores and communication stay eager: docs/parallelism.md)",
    "chunk_graphs": "under --compile, a stage's dense layers (the reference model's, or a "
                    "common decoder's: docs/parallelism.md) as one graph on a plain "
                    "sequence, each layer a nested region compiled once: auto (on where the "
                    "torch has them, >= 2.11), on or off (one graph a layer)",
    "joint_projections": "q/k/v and gate/up projections as one matrix product each: auto "
                         "(on CUDA, where kernel launches bound an eager step; not on a CPU), "
                         "on or off; never with --compile",
    "grouped_experts": "a mixture-of-experts layer's local experts as grouped matrix "
                       "products (two forward, four backward): auto (on CUDA in bf16), on "
                       "(also on a CPU, as a loop inside one call) or off (one expert at a "
                       "time)",
    "grad_accumulation_fusion": "under --dtype bf16, each linear layer's product (an "
                                "embedding's lookup) adds its weight's gradient straight "
                                "into the float32 master's: auto "
                                "(on CUDA, one addmm into float32), on (also on a CPU) or "
                                "off; under --compile the compiled blocks keep theirs",
    "zero": "shard over the replicas of each weight (dp x cp ranks of a stage; experts: their "
            "expert-data-parallel ranks): 0 nothing, 1 the optimizer states (AdamW moments), "
            "2 also the reduced gradients",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW)",
    "min_lr": "final learning rate of the cosine decay",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "clip the global gradient norm to this (0 disables)",
    "seed": "seed of the model init and the data order",
    "eval_every": "validation loss every N steps, forward-only schedule (0 disables)",
    "out_dir": "where metrics, pictures and checkpoints go",
    "checkpoint_every": "save a checkpoint every N steps (0: only at the end)",
    "checkpoint_async": "write checkpoints in the background: training stops only to copy "
                        "the state to host memory; one write at a time",
    "resume": "continue from the newest complete checkpoint in --out-dir",
    "keep_checkpoints": "checkpoints of this run kept in --out-dir (older ones of this run are "
                        "deleted; other runs' are never touched)",
    "allow_config_change": "with --resume, accept a checkpoint written with other learning "
                           "rates, batch, seed, data or precision (another --steps needs no "
                           "flag; a different model is always refused)",
    "check": "also run the first step in one process and print the loss/gradient difference",
    "timeline_step": "step whose measured per-rank timeline is drawn (0 disables)",
    "progress": "show a progress bar",
    "tensorboard": "also write every metric as TensorBoard scalars under <out-dir>/tensorboard "
                   "(needs pip install 'meshpipe[tb]')",
    "device": "where ranks compute: auto (CUDA when torch sees a GPU), cuda or cpu",
    "backend": "process-group backend: auto (nccl when every rank has a GPU of its own, else "
               "gloo), nccl or gloo (ranks may share a GPU; messages go through host memory)",
    "hang_timeout": "seconds a rank may wait for a peer or run one action before the job is "
                    "reported hung (who waits on whom) and stopped",
    "skip_nonfinite": "skip up to N steps in a row whose loss or gradients are not finite (0: "
                      "stop at the first)",
    "checkpoint_on_signal": "on Ctrl-C or SIGTERM, save a checkpoint at the end of the current "
                            "step before stopping",
    "max_restarts": "after a fault, stop every rank and start the job again from its newest "
                    "checkpoint, up to N times (restarts that gain no step stop as a crash "
                    "loop, exit status 3); the local launcher's (torchrun has its own)",
}
