"""Hugging Face decoders (Llama 2/3.x, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3; with
experts Mixtral, Qwen2-MoE and Qwen3-MoE, ``meshpipe.models.hf_moe``) as meshpipe pipeline
stages.

The modeling code is transformers' own: the model is built from its ``config.json`` on the
meta device (no memory, no initialisation), cut into chunks of consecutive decoder layers
like the reference transformer (``meshpipe.models.split``), and only the chunks a rank runs
are materialised, from just their tensors in the safetensors files. No rank reads the whole
model.

Attention goes through transformers' attention-function registry: the name ``"meshpipe"``
maps to an adapter that hands the rotated q, k, v to a meshpipe attention (local, Ulysses,
ring, hybrid) with the token positions and document ids of meshpipe's shard layout, which
travel to it as keyword arguments of the decoder layers. RoPE is computed by the model's own
rotary embedding from those positions (per layer type where the model has several, as
Gemma 3's local and global layers), so a zigzag or packed shard rotates correctly. A layer's
sliding window, the model's attention scale and its attention soft-cap (Gemma 2) reach the
meshpipe attention with each call; a final logit soft-cap (Gemma) is applied after the head
as the model does.

Which model types are supported is data (``SUPPORTED_MODEL_TYPES``), and so are the
configuration features meshpipe cannot run (``UNSUPPORTED_FEATURES``): each is a one-line
refusal before any process starts.

Parameter names are the model's own (``model.layers.3.self_attn.q_proj.weight``), which is
what checkpoints record and what ``meshpipe.models.hf_export`` writes back as safetensors.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from meshpipe.context.interface import Attention
from meshpipe.context.local import LocalAttention
from meshpipe.context.routing import GraphPack, pack_for_graph
from meshpipe.models import hf_moe, hf_norms, hf_vision
from meshpipe.models.hf_attention import attention_adapter, call_layer, meshpipe_arguments
from meshpipe.models.hf_vision import decoder_of
from meshpipe.models.hf_tp import ROWS_ATTR
from meshpipe.models.recompute import maybe_checkpoint
from meshpipe.models.skeleton import real_parameter, replace_parameters
from meshpipe.models.transformer import default_positions
from meshpipe.runtime.substeps import run_steps

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text",
                         "mixtral", "qwen2_moe", "qwen3_moe")
# The transformers major version a model type needs here: Gemma's rotary tables by layer
# type and scaled embedding module are those of transformers 5 (4.x computed them in the
# model's own forward).
TRANSFORMERS_MAJOR = {"gemma2": 5, "gemma3_text": 5}
# (what it is, whether a config has it): features of transformers decoders meshpipe does not
# run.
UNSUPPORTED_FEATURES = (
    ("bidirectional attention (use_bidirectional_attention)",
     lambda config: bool(getattr(config, "use_bidirectional_attention", False))),
    ("router jitter noise (router_jitter_noise)",
     lambda config: bool(getattr(config, "router_jitter_noise", 0.0))),
)
ATTENTION_NAME = "meshpipe"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def require_transformers():
    """transformers, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ValueError("--model needs the Hugging Face extra: pip install 'meshpipe[hf]' "
                         "(transformers, safetensors, tokenizers)") from None
    return transformers


@dataclass(frozen=True)
class HFModelInfo:
    """What the launcher checks of a model directory before any process starts."""

    directory: Path
    model_type: str
    num_layers: int
    vocab_size: int
    max_positions: int
    tie_embeddings: bool
    weight_files: tuple[Path, ...]
    attention_softcap: float | None = None  # Gemma 2 caps its attention scores
    experts: int = 0  # experts per mixture-of-experts layer (0: dense)
    aux_coef: float = 0.0  # the load-balancing loss's weight in the training loss
    vision: hf_vision.VisionInfo | None = None  # a vision-language model's tower and tokens


def inspect_model(directory: str | Path) -> HFModelInfo:
    """Read ``config.json`` and find the safetensors files; one-line ValueErrors for a
    directory meshpipe cannot train."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"--model {path} is not a directory: give a Hugging Face model "
                         "directory (config.json + *.safetensors, as save_pretrained writes)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--model {path} has no config.json: give the directory "
                         "save_pretrained wrote")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is not valid JSON ({error})") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES + hf_vision.VISION_MODEL_TYPES:
        raise ValueError(f"--model {path} is a {model_type!r} model; meshpipe trains these "
                         f"decoder architectures: {', '.join(SUPPORTED_MODEL_TYPES)}; and these "
                         f"vision-language ones: {', '.join(hf_vision.VISION_MODEL_TYPES)}")
    _check_transformers_version(path, model_type)
    whole = load_config(path)
    vision = (hf_vision.vision_info(path, whole, build_skeleton(path))
              if hf_vision.is_vision_model(model_type) else None)
    config = decoder_config(whole)
    for feature, present in UNSUPPORTED_FEATURES:
        if present(config):
            raise ValueError(f"--model {path} ({model_type}) uses {feature}, which meshpipe "
                             "does not run yet")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"--model {path} has attention_dropout {config.attention_dropout}; "
                         "meshpipe's attention has no dropout: set it to 0.0 in config.json")
    return HFModelInfo(directory=path, model_type=model_type,
                       num_layers=config.num_hidden_layers, vocab_size=config.vocab_size,
                       max_positions=config.max_position_embeddings,
                       tie_embeddings=bool(getattr(whole, "tie_word_embeddings", False)),
                       weight_files=weight_files(path),
                       attention_softcap=getattr(config, "attn_logit_softcapping", None),
                       experts=hf_moe.num_experts(config),
                       aux_coef=hf_moe.aux_coefficient(config), vision=vision)


def load_config(directory: str | Path):
    """The model's transformers config (read offline)."""
    transformers = require_transformers()
    return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)


def decoder_config(config):
    """The config of a model's decoder: a vision-language model's text config."""
    return getattr(config, "text_config", None) or config


def weight_files(directory: Path) -> tuple[Path, ...]:
    """The safetensors files of a model directory (sharded or single)."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = tuple(directory / name for name in sorted(set(weight_map.values())))
    else:
        files = tuple(sorted(directory.glob("*.safetensors")))
    if not files:
        other = sorted(p.name for p in directory.glob("*.bin"))
        hint = (f" (it has {', '.join(other)}: save it again with safe_serialization=True)"
                if other else "")
        raise ValueError(f"--model {directory} has no *.safetensors weights{hint}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"--model {directory}: {SAFETENSORS_INDEX} names missing weight files "
                         f"{', '.join(missing)}")
    return files


def _check_transformers_version(path: Path, model_type: str) -> None:
    needed = TRANSFORMERS_MAJOR.get(model_type)
    version = require_transformers().__version__
    if needed is not None and int(version.split(".")[0]) < needed:
        raise ValueError(f"--model {path} ({model_type}) needs transformers >= {needed}.0 "
                         f"here, found {version}: pip install -U 'transformers>={needed}'")


def check_experts(info: HFModelInfo, *, ep: int, capacity_factor: float) -> None:
    """Expert flags against the model's experts: --ep must divide them, a dense model takes
    none."""
    where = f"--model {info.directory} ({info.model_type})"
    if not info.experts:
        given = [flag for flag, value in (("--ep", ep != 1),
                                          ("--moe-capacity-factor", capacity_factor != 0.0))
                 if value]
        if given:
            raise ValueError(f"{where} has no mixture-of-experts layers: drop "
                             f"{' and '.join(given)}")
        return
    if info.experts % ep:
        raise ValueError(f"{where} has {info.experts} experts per layer, which --ep {ep} does "
                         "not divide: each expert-parallel rank holds as many experts")


def check_sequence_length(info: HFModelInfo, seq_len: int) -> None:
    """A sequence longer than the model's positions is refused before training."""
    if seq_len > info.max_positions:
        raise ValueError(f"--seq-len {seq_len} is above the model's max_position_embeddings "
                         f"{info.max_positions}: use --seq-len {info.max_positions} or less")


def register_attention() -> None:
    """Make ``attn_implementation="meshpipe"`` known to transformers (idempotent)."""
    require_transformers().AttentionInterface.register(ATTENTION_NAME, attention_adapter)


def build_skeleton(directory: str | Path, capacity_factor: float = 0.0) -> nn.Module:
    """The whole causal LM on the meta device: modules and names, no memory, no weights;
    only the rotary embedding is real (its small tables are computed, not stored). Sparse
    blocks are meshpipe's expert layers (``meshpipe.models.hf_moe``), each expert taking at
    most ``capacity_factor`` times an even share of a microbatch's picks (0: all); the norms
    with Llama's formula one ``rms_norm`` call (``meshpipe.models.hf_norms``)."""
    transformers = require_transformers()
    register_attention()
    config = load_config(directory)
    if hf_vision.is_vision_model(config.model_type):
        model = hf_vision.build_skeleton(config, ATTENTION_NAME)
    else:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=ATTENTION_NAME)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
        hf_moe.replace_sparse_blocks(model, capacity_factor)
    hf_norms.fuse_norms(model)
    return model


class HFChunk(nn.Module):
    """Decoder layers ``[start, stop)`` of a Hugging Face causal LM, with the embedding if
    first and the final norm and head if last; it speaks the pipeline messages of
    ``meshpipe.models.split`` (``(tokens, positions, doc_ids)`` in, ``(hidden, positions,
    doc_ids)`` between stages, logits out of the last; with experts, the running
    load-balancing loss too)."""

    def __init__(self, model: nn.Module, start: int, stop: int, *, first: bool, last: bool,
                 attention: Attention, recompute: bool = False, sequence_shards: int = 1):
        super().__init__()
        self.sequence_shards = sequence_shards  # > 1: hidden states are sequence-parallel
        base, text_config = decoder_of(model)
        self.is_first = first
        self.is_last = last
        self.layer_range = (start, stop)
        self.attention = attention
        self.recompute = recompute
        if first:
            self.embed_tokens = base.embed_tokens
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in range(start, stop)})
        if last:
            self.norm = base.norm
            self.lm_head = model.lm_head
        self.rotary_emb = base.rotary_emb
        # Gemma 3's rotary tables differ by layer type (local, global); others share one.
        self.layer_types = (getattr(text_config, "layer_types", None)
                            if "layer_type" in inspect.signature(
                                type(base.rotary_emb).forward).parameters else None)
        self.logit_softcap = getattr(text_config, "final_logit_softcapping", None)
        # Each layer's expert block (None: dense), found once; with experts anywhere in the
        # model, every message carries the load-balancing loss.
        self._experts = {index: hf_moe.expert_layer(layer) for index, layer in self.layers.items()}
        for experts in self._experts.values():
            if experts is not None:
                experts.recompute = recompute
        self.is_moe = any(hf_moe.expert_layer(layer) is not None for layer in base.layers)
        self.layers_graph = None  # models.compile.ChunkGraph, set under --compile

    def forward(self, x: Tensor, positions: Tensor | None = None,
                doc_ids: Tensor | None = None, aux: Tensor | None = None) -> Any:
        return run_steps(self.forward_steps(x, positions, doc_ids, aux))

    def forward_steps(self, x: Tensor, positions: Tensor | None = None,
                      doc_ids: Tensor | None = None, aux: Tensor | None = None):
        """``forward`` cut at the experts' exchanges (``meshpipe.runtime.substeps``)."""
        hidden = self.embed_tokens(x) if self.is_first else x
        return (yield from self.decoder_steps(hidden, x, positions, doc_ids, aux))

    def decoder_steps(self, hidden: Tensor, x: Tensor, positions: Tensor | None,
                      doc_ids: Tensor | None, aux: Tensor | None, rope: Tensor | None = None,
                      rope_3d: bool = False):
        """The decoder layers (and the head if last) on the embedded ``hidden``; ``rope``:
        the rotary positions where they are not the token positions (a vision-language
        model's 3D ones, ``[3, batch, seq]``). With ``rope_3d`` and no ``rope`` (rows without
        images) each of the three is the token positions: transformers 5.24's rotary
        embedding expands 2D positions so itself, 5.17's takes only 3D ones."""
        layer_positions = default_positions(
            x, positions, check_values=self.is_first,
            sequence_shards=1 if self.is_first else self.sequence_shards)
        position_ids = layer_positions.unsqueeze(0).expand(hidden.shape[0], -1)
        if rope is None and rope_3d:
            rope = position_ids.expand(3, -1, -1)
        rotary_ids = position_ids if rope is None else rope
        if positions is None:  # the plain sequence, which attention needs no tensor for
            layer_positions = None
        if self.is_moe and aux is None:
            aux = torch.zeros((), device=hidden.device)
        pack = pack_for_graph(self.attention, layer_positions, doc_ids, hidden)
        tables = self._rotary_tables(hidden, rotary_ids)
        graph = self.layers_graph
        layers_out = None if graph is None else graph.run(
            hidden, layer_positions, doc_ids, tuple(tables.values()), position_ids)
        if layers_out is not None:
            hidden = layers_out
        else:
            hidden, aux = yield from self._layer_steps(hidden, aux, tables, position_ids,
                                                       layer_positions, doc_ids, pack)
        if self.is_last:
            logits = self._soft_capped(self.lm_head(self.norm(hidden)))
            return (logits, aux) if self.is_moe else logits
        return (hidden, positions, doc_ids, aux) if self.is_moe else (hidden, positions, doc_ids)

    def _rotary_tables(self, hidden: Tensor,
                       rotary_ids: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """Each layer's rotary tables (by its index), computed once a kind of layer (Gemma
        3's local and global layers have their own)."""
        kinds = {index: self.layer_types[int(index)] if self.layer_types else None
                 for index in self.layers}
        tables = {kind: self.rotary_emb(hidden, rotary_ids, kind) if kind
                  else self.rotary_emb(hidden, rotary_ids)
                  for kind in dict.fromkeys(kinds.values())}
        return {index: tables[kind] for index, kind in kinds.items()}

    def _layer_steps(self, hidden: Tensor, aux: Tensor | None,
                     tables: dict[str, tuple[Tensor, Tensor]], position_ids: Tensor,
                     positions: Tensor | None, doc_ids: Tensor | None, pack: GraphPack | None):
        """Sub-steps of the layers one by one: ``(hidden, aux)`` after the last."""
        for index, layer in self.layers.items():
            inputs = (tables[index], position_ids, positions, doc_ids, pack)
            experts = self._experts[index]
            if experts is None:
                hidden = maybe_checkpoint(self.recompute, self._layer, layer, hidden, *inputs)
                continue
            hidden, aux = yield from hf_moe.moe_layer_steps(
                layer, experts, lambda h, layer=layer, inputs=inputs: maybe_checkpoint(
                    self.recompute, self._attend, layer, h, *inputs), hidden, aux)
        return hidden, aux

    def _soft_capped(self, logits: Tensor) -> Tensor:
        """The logits through the model's final soft-cap (Gemma), as its own forward does."""
        if self.logit_softcap is None:
            return logits
        return torch.tanh(logits / self.logit_softcap) * self.logit_softcap

    def _layer(self, layer: nn.Module, hidden: Tensor, rotary: tuple[Tensor, Tensor],
               position_ids: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
               pack: GraphPack | None) -> Tensor:
        return call_layer(layer, hidden, rotary, position_ids,
                          meshpipe_arguments(self.attention, positions, doc_ids, pack))

    def _attend(self, layer: nn.Module, hidden: Tensor, rotary: tuple[Tensor, Tensor],
                position_ids: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
                pack: GraphPack | None) -> Tensor:
        """The attention half of a pre-norm decoder layer, with its residual."""
        out, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden),
                                 position_embeddings=rotary, attention_mask=None,
                                 position_ids=position_ids,
                                 **meshpipe_arguments(self.attention, positions, doc_ids, pack))
        return hidden + out

    def extra_repr(self) -> str:
        start, stop = self.layer_range
        return f"layers=[{start}, {stop}), first={self.is_first}, last={self.is_last}"


def split_model(model: nn.Module, layers_per_stage: list[int], attention: Attention | None = None,
                *, recompute: bool = False, sequence_shards: int = 1) -> list[HFChunk]:
    """Chunks of consecutive decoder layers, ``layers_per_stage[s]`` on stage ``s`` (zeros
    allowed), the embedding on the first and the head on the last; ``sequence_shards``: the
    tensor-parallel ranks the hidden states are split over (sequence parallelism)."""
    n_layers = len(decoder_of(model)[0].layers)
    if sum(layers_per_stage) != n_layers or min(layers_per_stage) < 0:
        raise ValueError(f"layers_per_stage {layers_per_stage} must be non-negative and sum to "
                         f"the model's {n_layers} layers")
    attention = LocalAttention() if attention is None else attention
    chunks, start = [], 0
    for stage, count in enumerate(layers_per_stage):
        chunks.append(HFChunk(model, start, start + count, first=stage == 0,
                              last=stage == len(layers_per_stage) - 1, attention=attention,
                              recompute=recompute, sequence_shards=sequence_shards))
        start += count
    return chunks


class _WeightReader:
    """Tensors by name from a model directory's safetensors files, read one at a time."""

    def __init__(self, files: Iterable[Path]):
        from safetensors import safe_open

        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: handle for handle in self._handles for name in handle.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, rows: list[tuple[int, int, int]] | None = None) -> Tensor:
        """Tensor ``name``, or only its ``rows``: (dim, start, stop) slices concatenated (a
        tensor-parallel shard): safetensors reads just those bytes."""
        if rows is None:
            return self._where[name].get_tensor(name)
        whole = self._where[name].get_slice(name)
        pieces = []
        for dim, start, stop in rows:
            index = [slice(None)] * len(whole.get_shape())
            index[dim] = slice(start, stop)
            pieces.append(whole[tuple(index)])
        return torch.cat(pieces, rows[0][0])


def materialize(model: nn.Module, modules: Iterable[nn.Module], directory: str | Path,
                device: torch.device | str = "cpu") -> dict[int, nn.Parameter]:
    """Give ``modules`` (parts of ``model`` on the meta device) their weights from the model
    directory, in float32 on ``device``; returns each real parameter by the id of the meta
    parameter it replaced (whose name in ``full_names`` is its name).

    A parameter shared by several names (tied embeddings) becomes one real parameter on this
    rank, read under whichever of its names the files hold (tied checkpoints store only the
    embedding). Only these modules' tensors are read from the files.
    """
    names_of: dict[int, list[str]] = {}
    model_type = model.config.model_type
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).extend(
            dict.fromkeys((hf_vision.file_name(model_type, name), name)))
    reader = _WeightReader(weight_files(Path(directory)))
    real: dict[int, nn.Parameter] = {}
    for module in modules:
        for owner in module.modules():
            for param in owner.parameters(recurse=False):
                if id(param) in names_of and id(param) not in real:
                    real[id(param)] = _read_parameter(reader, names_of[id(param)], param, device)
            replace_parameters([owner], real)
            _rebuild_buffers(owner, device)
    return real


def _rebuild_buffers(owner: nn.Module, device: torch.device | str) -> None:
    """Give ``owner``'s buffers left on the meta device their values. Such buffers are not in
    the weight files (non-persistent); the one transformers decoders have outside the rotary
    embedding is a scale kept beside its float (Gemma 3's ``embed_scale`` and
    ``scalar_embed_scale``)."""
    for name, buffer in list(owner.named_buffers(recurse=False)):
        if not buffer.is_meta:
            continue
        value = getattr(owner, f"scalar_{name}", None)
        if value is None:
            raise ValueError(f"{type(owner).__name__}.{name} is a buffer that is not in the "
                             "weight files and that meshpipe cannot compute")
        owner.register_buffer(name, torch.tensor(value, dtype=torch.float32, device=device),
                              persistent=False)


def _read_parameter(reader: _WeightReader, names: list[str], param: nn.Parameter,
                    device: torch.device | str) -> nn.Parameter:
    name = next((n for n in names if reader.has(n)), None)
    if name is None:
        raise ValueError(f"the model's weights have no tensor {names[0]}: the safetensors "
                         "files do not match config.json")
    tensor = reader.get(name, getattr(param, ROWS_ATTR, None))
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)} where config.json "
                         f"implies {tuple(param.shape)}")
    return real_parameter(param, tensor.to(device=device, dtype=torch.float32).contiguous())


def full_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's name in the whole model as the weight files write it (a tied head is
    the embedding)."""
    model_type = model.config.model_type
    return {id(param): hf_vision.file_name(model_type, name)
            for name, param in model.named_parameters()}
