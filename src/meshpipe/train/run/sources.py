"""What a run trains, and on what: the reference transformer or a Hugging Face decoder
(``--model``), on the shipped corpus or on the user's data (``data_sources``).

The launcher calls ``check_sources`` before any process starts: the model directory, the
sequence length against the model's positions, the tokenizer against the model's
vocabulary, and the data (``data_sources.check_data``: tokenized into the cache, so the
ranks then only map the token files). Every rank then builds its stages with
``build_chunks`` and its batches with ``data_sources.samplers``; ``--check`` and
``--export`` use ``reference_step`` and ``export``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from itertools import accumulate
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshpipe.context.heads import plan_heads
from meshpipe.context.interface import AttentionError
from meshpipe.context.shards import document_ids, positions_in_document
from meshpipe.models import (SharedParameter, Transformer, TransformerConfig, causal_lm_loss,
                             shared_parameters, split)
from meshpipe.models.compile import chunk_graphs, compile_blocks
from meshpipe.models.split import held_by_stages
from meshpipe.models.transformer import check_tensor_parallel_sizes
from meshpipe.parallel import TensorParallelRegion
from meshpipe.runtime import DynamicLossScaler, MasterWeights, autocast, weights_dtype
from meshpipe.schedules.builders import SCHEDULE_SPECS
from meshpipe.train.config import TrainConfig
from meshpipe.train.data.corpus import VOCAB_SIZE
from meshpipe.train.run import data_sources
from meshpipe.train.run.data_sources import (check_data, counted_targets, samplers, tokenized,
                                             tokenizer)


@lru_cache(maxsize=None)
def model_info(model_dir: str):
    """The checked description of a ``--model`` directory."""
    from meshpipe.models import hf

    return hf.inspect_model(model_dir)


def num_layers(config: TrainConfig) -> int:
    return model_info(config.model).num_layers if config.model else config.layers


def vocab_size(config: TrainConfig) -> int:
    """Rows of the model's embedding: the model's, the tokenizer's for the reference model
    on ``--data``, else the byte-level 256."""
    if config.model:
        return model_info(config.model).vocab_size
    if config.data:
        return tokenizer(config).vocab_size
    return VOCAB_SIZE


def tower_cost(config: TrainConfig) -> float:
    """A vision-language model's tower in decoder layers' worth of compute on the run's
    data (``hf_vision.tower_cost_in_layers``); 0 for a decoder or data without images. The
    first stage's tp and context-parallel ranks share the images out as they share its
    layers' work, so the ratio holds at any tp and cp."""
    vision = model_info(config.model).vision if config.model else None
    if vision is None or not config.data:
        return 0.0
    from meshpipe.models.hf_vision import parse_parts, tower_cost_in_layers

    weighted = [(tokenized(config, path), weight)
                for path, weight in data_sources.sources(config)]
    # A mixture's sequences come from each source in its weight's share: its patches per
    # token count in that share.
    patches_per_token = sum(weight * part.images.patches() / max(part.num_tokens, 1)
                            for part, weight in weighted if part.images is not None) / sum(
        weight for _, weight in weighted)
    cost = tower_cost_in_layers(vision, patches_per_token, 1)
    # A frozen tower runs its forward only: a third of a forward and backward.
    return cost / 3 if "vision" in parse_parts(config.freeze) else cost


def check_sources(config: TrainConfig) -> list[str]:
    """One-line ValueErrors, before any process starts, for a model or data the run cannot
    use; tokenizes ``--data`` into the cache (with a progress bar on large inputs); the
    notes to show (samples cut to ``--seq-len``)."""
    if config.model:
        from meshpipe.models import hf

        hf.check_sequence_length(model_info(config.model), config.seq_len)
    _check_parts(config)
    if config.model:
        hf.check_experts(model_info(config.model), ep=config.ep,
                         capacity_factor=config.moe_capacity_factor)
    if not config.data:
        if config.model and vocab_size(config) < VOCAB_SIZE:
            raise ValueError(f"the shipped corpus is byte-level (256 token ids) but the model's "
                             f"embedding has {vocab_size(config)} rows: give --data with the "
                             "model's tokenizer")
        return []
    words = tokenizer(config)
    if config.model and words.vocab_size > vocab_size(config):
        raise ValueError(f"the tokenizer has {words.vocab_size} tokens but the model's embedding "
                         f"has {vocab_size(config)} rows: use the model's own tokenizer "
                         "(--tokenizer) or a model with a larger vocabulary")
    return check_data(config)


def _check_parts(config: TrainConfig) -> None:
    """--freeze and --lr-scale name parts of a vision-language model, and leave some part
    training."""
    vision = bool(config.model) and model_info(config.model).vision is not None
    given = [flag for flag, value in (("--freeze", config.freeze),
                                      ("--lr-scale", config.lr_scale)) if value]
    if given and not vision:
        raise ValueError(f"{' and '.join(given)} name parts of a vision-language model "
                         f"(vision, projector, language), and {config.model or 'the model'} is "
                         "not one: drop them")
    from meshpipe.models.hf_vision import PARTS, parse_parts

    if set(parse_parts(config.freeze)) == set(PARTS):
        raise ValueError(f"--freeze {config.freeze} leaves nothing to train: freeze fewer parts")


def frozen(config: TrainConfig, name: str) -> bool:
    """Whether the weight ``name`` (as the files name it) is in a part ``--freeze`` names."""
    from meshpipe.models.hf_vision import parse_parts, part_of

    return part_of(model_info(config.model).model_type, name) in parse_parts(config.freeze)


def lr_scale_of(config: TrainConfig, name: str) -> float:
    """The learning-rate factor ``--lr-scale`` gives the weight ``name``'s part (1 without)."""
    if not config.lr_scale:
        return 1.0
    from meshpipe.models.hf_vision import parse_lr_scales, part_of

    part = part_of(model_info(config.model).model_type, name)
    return parse_lr_scales(config.lr_scale).get(part, 1.0)


def check_tensor_parallel(config: TrainConfig, tp: int) -> None:
    """A one-line ValueError when the run's model cannot be split over ``tp`` ranks."""
    if not config.model:
        check_tensor_parallel_sizes(model_config(config), tp)
        return
    from meshpipe.models import hf, hf_tp

    hf_tp.check_sizes(hf.decoder_config(hf.load_config(config.model)), tp,
                      f"--model {config.model}")


def attention_heads(config: TrainConfig) -> tuple[int, int]:
    """The model's (query, key/value) attention heads: ``--heads``/``--kv-heads``, or the
    ``--model`` directory's."""
    if not config.model:
        reference = model_config(config)
        return reference.n_heads, reference.kv_heads
    from meshpipe.models import hf, hf_tp

    loaded = hf.decoder_config(hf.load_config(config.model))
    return loaded.num_attention_heads, hf_tp.kv_heads(loaded)


def check_ulysses(config: TrainConfig, tp: int) -> None:
    """A one-line ValueError when ``--cp-ulysses`` cannot deal the heads of a rank of
    tensor-parallel size ``tp`` to its ranks (the rule the ranks' Ulysses attention
    follows: ``context.heads.plan_heads``)."""
    heads, kv_heads = attention_heads(config)
    try:
        plan_heads(heads // tp, kv_heads // tp, config.cp_ulysses)
    except AttentionError:
        of_rank = f" of a tensor-parallel rank ({heads} / --tp {tp})" if tp > 1 else ""
        raise ValueError(
            f"--cp-ulysses {config.cp_ulysses} cannot spread the {heads // tp} query heads"
            f"{of_rank} over {config.cp_ulysses} ranks: every Ulysses rank needs at least one "
            f"head; use --cp-ulysses {heads // tp} or less, and --cp-ring for the rest of the "
            "context parallelism") from None


def model_config(config: TrainConfig) -> TransformerConfig:
    """The reference transformer of the run's flags."""
    return TransformerConfig(vocab_size=vocab_size(config), dim=config.dim,
                             n_layers=config.layers, n_heads=config.heads,
                             n_kv_heads=config.kv_heads, max_seq_len=config.seq_len,
                             tie_embeddings=config.tie_embeddings, init_seed=config.seed,
                             moe_experts=config.moe_experts, moe_top_k=config.moe_top_k,
                             moe_every=config.moe_every,
                             moe_capacity_factor=config.moe_capacity_factor)


def packed_rows(batch, size: int) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """With ``--pack``, each microbatch's ``size`` sequences as one row of ``size x seq_len``
    tokens and the lengths of its documents (the THD layout). No document crosses a
    sequence, so the row's block-diagonal attention is exactly the sequences' own, and one
    document layout serves the whole microbatch."""
    rows = []
    for start in range(0, batch.tokens.shape[0], size):
        lengths = [n for sequence in batch.doc_lens[start:start + size] for n in sequence]
        rows.append((batch.tokens[start:start + size].reshape(1, -1),
                     batch.targets[start:start + size].reshape(1, -1), lengths))
    return rows


def packed_layout(doc_lens, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's position inside its document and its document, for tokens at
    ``positions`` of a pack of documents of lengths ``doc_lens``."""
    return positions_in_document(doc_lens, positions), document_ids(doc_lens, positions)


def num_experts(config: TrainConfig) -> int:
    """Experts per mixture-of-experts layer of the run's model (0: dense)."""
    return model_info(config.model).experts if config.model else config.moe_experts


def aux_coefficient(config: TrainConfig) -> float:
    """The weight of the load-balancing loss in the training loss: ``--moe-aux-coef``, or
    what a ``--model``'s config.json asks transformers to add."""
    return model_info(config.model).aux_coef if config.model else config.moe_aux_coef


@dataclass
class ModelParts:
    """A rank's view of the model: every stage's chunk (only this rank's hold weights for
    a ``--model``), each parameter's full-model name, the parameters stages share, and the
    global index of each mixture-of-experts layer's MLP."""

    chunks: list[nn.Module]
    names: dict[int, str]
    shared: list[SharedParameter]
    moe_index: dict[int, int]


def build_chunks(config: TrainConfig, layers: list[int], attention, my_stages,
                 **groups: Any) -> ModelParts:
    """Cut the model into ``len(layers)`` stages, only the chunks in ``my_stages`` holding
    real tensors (the others stay on the meta device). The reference transformer builds the
    parts those chunks hold (``held_by_stages``; each parameter's initial values a function
    of the seed and its name) and shards them over ``groups`` (tp_group, ep_group,
    token_group); a ``--model``'s chunks in ``my_stages`` read their weights. With
    ``--compile`` the blocks of ``my_stages`` are compiled (``meshpipe.models.compile``)."""
    parts = (_hf_parts if config.model else _reference_parts)(config, layers, attention,
                                                               my_stages, **groups)
    if config.compile:
        compile_blocks((parts.chunks[stage] for stage in my_stages),
                       split_backward=SCHEDULE_SPECS[config.schedule].split_backward,
                       chunk_graphs=chunk_graphs(config.chunk_graphs))
    return parts


def _reference_parts(config: TrainConfig, layers: list[int], attention, my_stages,
                     **groups: Any) -> ModelParts:
    model = Transformer(model_config(config), attention=attention,
                        sequence_parallel=config.sequence_parallel, recompute=config.recompute,
                        held=held_by_stages(layers, my_stages, config.tie_embeddings),
                        **groups)
    chunks = split(model, len(layers), layers)
    moe = [layer for layer in model.layers if layer.is_moe]
    return ModelParts(chunks=chunks,
                      names={id(p): name for name, p in model.named_parameters()},
                      shared=shared_parameters(chunks),
                      moe_index={id(layer.mlp): i for i, layer in enumerate(moe)})


def _hf_parts(config: TrainConfig, layers: list[int], attention, my_stages, *,
              tp_group=None, ep_group=None, token_group=None) -> ModelParts:
    """The ``--model``'s chunks; tensor-parallel shards and this rank's experts are cut on
    the meta skeleton, so only they are read."""
    from meshpipe.models import hf, hf_moe, hf_tp, hf_vision

    skeleton = hf.build_skeleton(config.model, config.moe_capacity_factor)
    region = TensorParallelRegion(tp_group, config.sequence_parallel)
    if region.size > 1:
        hf_tp.shard_skeleton(skeleton, region)
    expert_layers = [hf_moe.expert_layer(layer) for layer in hf.decoder_of(skeleton)[0].layers]
    expert_layers = [layer for layer in expert_layers if layer is not None]
    for layer in expert_layers:
        layer.shard(ep_group, token_group)
    chunks = hf.split_model(skeleton, layers, attention, recompute=config.recompute == "full",
                            sequence_shards=region.sequence_shards)
    vision = model_info(config.model).vision
    if vision is not None:
        chunks = hf_vision.split_vision_model(skeleton, chunks, vision.image_token_id,
                                              tp_group, region.sequence_parallel, token_group)
    shared = shared_parameters(chunks)
    meta_names = hf.full_names(skeleton)
    real = hf.materialize(skeleton, [chunks[s] for s in my_stages], config.model)
    for meta, param in real.items():
        if config.freeze and frozen(config, meta_names[meta]):
            param.requires_grad_(False)
    return ModelParts(chunks=chunks,
                      names={id(p): meta_names[meta] for meta, p in real.items()},
                      shared=shared,
                      moe_index={id(layer): i for i, layer in enumerate(expert_layers)})


def reference_step(config: TrainConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the first step computed by one process on the whole global batch, in
    the run's precision (fp16 with the loss scale the run starts with; bf16 with bfloat16
    weights, the gradients of their float32 masters). For a ``--model``
    the process runs the unmodified transformers model, its own forward and loss."""
    model = _reference_model(config)
    if config.freeze:
        from meshpipe.models.hf_vision import file_name

        for name, param in model.named_parameters():
            param.requires_grad_(not frozen(config, file_name(model.config.model_type, name)))
    named = MasterWeights(model.named_parameters(), weights_dtype(config.dtype)).named
    scale = DynamicLossScaler().scale if config.dtype == "fp16" else 1.0
    losses = []
    with autocast(config.dtype, "cpu"):
        for dp_rank in range(config.dp):
            batch = samplers(config, dp_rank)[0].batch(0)
            losses.append(_replica_loss(config, model, batch))
    loss = torch.stack(losses).mean()
    (loss * scale).backward()
    grads = {name: p.grad / scale for name, p in named if p.grad is not None}
    if config.model and model_info(config.model).experts:
        grads = _in_file_names(config, grads)
    if config.model and model_info(config.model).vision is not None:
        from meshpipe.models.hf_vision import file_name

        grads = {file_name(model.config.model_type, name): grad for name, grad in grads.items()}
    return loss.item(), grads


def _in_file_names(config: TrainConfig, grads: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """The unmodified model's gradients under meshpipe's names, those of the weight files
    (one tensor per expert, where transformers stacks them)."""
    from meshpipe.models import hf_moe

    architecture = hf_moe.ARCHITECTURES[model_info(config.model).model_type]
    return {file_name: piece for name, grad in grads.items()
            for file_name, piece in hf_moe.as_file_tensors(name, grad, architecture).items()}


def _reference_model(config: TrainConfig) -> nn.Module:
    if not config.model:
        return Transformer(model_config(config))
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # SDPA cannot soft-cap scores: such models (Gemma 2) run transformers' eager attention.
    capped = model_info(config.model).attention_softcap is not None
    if model_info(config.model).vision is not None:
        return transformers.AutoModelForImageTextToText.from_pretrained(
            config.model, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        config.model, dtype=torch.float32, attn_implementation="eager" if capped else "sdpa",
        local_files_only=True)


def _replica_loss(config: TrainConfig, model: nn.Module, batch) -> torch.Tensor:
    """One data-parallel replica's loss: the mean over its counted targets (plus, with
    experts, the mean load-balancing loss of its microbatches)."""
    count = max(counted_targets(batch.targets), 1)
    size = config.microbatch_size
    if getattr(batch, "doc_lens", None) is not None:
        microbatches = packed_rows(batch, size)
    else:
        microbatches = [(tokens, targets, None) for tokens, targets in
                        zip(batch.tokens.split(size), batch.targets.split(size))]
    pictures = getattr(batch, "pictures", None)
    vision = bool(config.model) and model_info(config.model).vision is not None
    total = torch.zeros(())
    for index, (tokens, targets, doc_lens) in enumerate(microbatches):
        if vision:
            shown = None if pictures is None else [
                piece for row in pictures[index * size:(index + 1) * size] for piece in row]
            total = total + _upstream_vision_loss(model, model_info(config.model).vision,
                                                  tokens, targets, doc_lens, shown, count)
            continue
        if config.model:
            total = total + _upstream_loss(config, model, tokens, targets, doc_lens, count)
            continue
        positions = doc_ids = None
        if doc_lens is not None:
            positions, doc_ids = packed_layout(doc_lens,
                                                torch.arange(tokens.shape[1], device=tokens.device))
        output = model(tokens, positions, doc_ids)
        logits, aux = output if isinstance(output, tuple) else (output, None)
        total = total + causal_lm_loss(logits, targets, reduction="sum")[0] / count
        if aux is not None:
            total = total + config.moe_aux_coef * aux / config.microbatches
    return total


def _upstream_loss(config: TrainConfig, model: nn.Module, tokens: torch.Tensor,
                   targets: torch.Tensor, doc_lens, count: int) -> torch.Tensor:
    """transformers' own loss, summed over the microbatch's documents and divided by the
    replica's counted targets (``num_items_in_batch``): a packed sequence's documents run
    one by one, which is what the block-diagonal mask means. A model with experts adds each
    layer's load-balancing loss over the microbatch's tokens, from its routers' logits."""
    from meshpipe.models import hf_moe

    pieces = [(0, tokens.shape[1])] if doc_lens is None else [
        (start, length) for start, length in zip(accumulate(doc_lens, initial=0), doc_lens)]
    experts = model_info(config.model).experts > 0
    # transformers' own load-balancing loss is another formula (over all layers at once).
    options = dict(output_router_logits=False) if experts else {}
    total = torch.zeros(())
    with hf_moe.recorded_router_logits(model) as router_logits:
        for start, length in pieces:
            piece_targets = targets[:, start:start + length]
            out = model(input_ids=tokens[:, start:start + length], labels=piece_targets,
                        shift_labels=piece_targets, num_items_in_batch=count, **options)
            total = total + out.loss
    for layer in router_logits:
        aux = hf_moe.load_balancing_loss(torch.cat(layer), model.config.num_experts_per_tok)
        total = total + aux_coefficient(config) * aux / config.microbatches
    return total


def _upstream_vision_loss(model: nn.Module, vision, tokens: torch.Tensor, targets: torch.Tensor,
                          doc_lens, pictures: list | None, count: int) -> torch.Tensor:
    """A vision-language model's own loss on a microbatch, with its images (``pictures``:
    one per row, or per document piece of a packed row; None: data without images), each
    piece on its own as the block-diagonal mask means; the rows of an unpacked microbatch
    together."""
    from meshpipe.models.hf_vision import reference_images
    from meshpipe.train.data.images import Pictures

    image_token = vision.image_token_id
    if doc_lens is None:
        pieces = [(tokens, targets, pictures and Pictures.joined(
            pictures, pictures[0].pixels.shape[1]))]
    else:
        starts = list(accumulate(doc_lens, initial=0))
        pieces = [(tokens[:, start:start + length], targets[:, start:start + length], shown)
                  for start, length, shown in zip(starts, doc_lens, pictures or [None] * len(
                      doc_lens))]
    total = torch.zeros(())
    for piece_tokens, piece_targets, shown in pieces:
        images = reference_images(model.config.model_type, shown.pixels, shown.grids,
                                  model.config) if shown is not None and len(shown.grids) else {}
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            images["mm_token_type_ids"] = (piece_tokens == image_token).int()
        out = model(input_ids=piece_tokens, labels=piece_targets, shift_labels=piece_targets,
                    num_items_in_batch=count, **images)
        total = total + out.loss
    return total


def export(checkpoint_dir: str | Path, out_dir: str | Path, model_dir: str = "") -> Path:
    """A checkpoint as a directory transformers loads: a ``--model`` run in its own
    architecture and names, a reference-transformer run as the Llama it is."""
    from meshpipe.models import hf_export
    from meshpipe.train.checkpoints.store import read_info, read_model_weights

    weights = read_model_weights(Path(checkpoint_dir))
    if model_dir:
        return hf_export.export_model(weights, model_dir, out_dir)
    info = read_info(Path(checkpoint_dir))
    config = TrainConfig(**{**info.config, "resume": False, "check": False})
    if config.moe_experts:
        raise ValueError("a mixture-of-experts reference model has no transformers "
                         "architecture to export to; export runs of dense models")
    return hf_export.export_reference(weights, model_config(config), out_dir)
