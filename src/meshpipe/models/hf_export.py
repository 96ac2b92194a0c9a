"""Checkpoints as directories transformers loads: a ``--model`` run in its own architecture,
names and tokenizer files, and a reference-transformer run as the Llama it is."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import Tensor

from meshpipe.models.hf import build_skeleton, full_names, require_transformers

# Files of a model directory that describe it beside its weights and config; export copies
# them.
DESCRIPTION_FILES = ("generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                     "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                     "preprocessor_config.json", "processor_config.json")


def export_model(state: dict[str, Tensor], model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``state`` (full-model names, float32) as a directory transformers loads: the
    model directory's config (in float32) and tokenizer files, and one safetensors file."""
    source, out = Path(model_dir), Path(out_dir)
    skeleton = build_skeleton(source)
    expected = sorted(full_names(skeleton).values())
    missing = [name for name in expected if name not in state]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's weights "
                         f"({', '.join(missing[:3])}...): it was not written for {source}")
    out.mkdir(parents=True, exist_ok=True)
    for name in DESCRIPTION_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return _write_pretrained(skeleton.config, {name: state[name] for name in expected}, out)


def _write_pretrained(config, tensors: dict[str, Tensor], out: Path) -> Path:
    """``config`` (as float32) and ``tensors`` in one safetensors file, in ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    save_file({name: tensor.detach().to("cpu", torch.float32).contiguous()
               for name, tensor in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# The reference transformer's names, and the Llama names of the same weights.
_LLAMA_NAMES = (("embedding.", "model.embed_tokens."), ("attention_norm.", "input_layernorm."),
                ("mlp_norm.", "post_attention_layernorm."), ("attention.wq.", "self_attn.q_proj."),
                ("attention.wk.", "self_attn.k_proj."), ("attention.wv.", "self_attn.v_proj."),
                ("attention.wo.", "self_attn.o_proj."), ("mlp.w_gate.", "mlp.gate_proj."),
                ("mlp.w_up.", "mlp.up_proj."), ("mlp.w_down.", "mlp.down_proj."))


def llama_name(name: str) -> str:
    """The transformers Llama name of a reference-transformer weight."""
    if name.startswith("layers."):
        name = "model." + name
    elif name.startswith("norm."):
        return "model." + name
    elif name.startswith("head."):
        return "lm_head." + name.removeprefix("head.")
    for ours, theirs in _LLAMA_NAMES:
        name = name.replace(ours, theirs)
    return name


def export_reference(state: dict[str, Tensor], config, out_dir: str | Path) -> Path:
    """The reference transformer (a ``TransformerConfig`` without experts) as the
    LlamaForCausalLM it is: same RMSNorm, rotary pairing, grouped-query attention, SwiGLU."""
    transformers = require_transformers()
    llama = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim,
        intermediate_size=config.ffn_width, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_seq_len,
        rope_theta=config.rope_theta, rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings, attention_bias=False, mlp_bias=False)
    llama.architectures = ["LlamaForCausalLM"]
    tensors = {llama_name(name): tensor for name, tensor in state.items()}
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    return _write_pretrained(llama, tensors, Path(out_dir))
