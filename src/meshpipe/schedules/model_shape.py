"""A decoder's shape as the planner needs it: no weights, only the sizes that set its FLOPs,
parameters and activations (``ModelShape``), read from a Hugging Face ``config.json``
(``shape_from_hf_config``) or given directly.

FLOPs are counted as matrix products, two per multiply-add; ``model_flops_per_token`` is the
forward's, and a training step's are three times it (the backward's two products per
forward product), without what recomputation adds, as MFU is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from meshpipe.schedules.ranking import TuneError

ATTENTION_COUNTS = ("causal", "full")
"""How a FLOP count takes a causal mask's attention: half the score products (what the
kernels compute) or all of them (what Megatron's 2024 formula and the PaLM formula count)."""


class ModelShapeError(TuneError):
    """A config.json the planner cannot read a decoder's sizes from."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder: ``ffn_hidden`` is a dense layer's MLP width, ``gated`` its
    kind (SwiGLU's three matrices, or two as GELU's); with ``experts`` > 0, ``moe_layers``
    of the ``layers`` hold ``experts`` experts of width ``moe_ffn_hidden`` of which each
    token takes ``top_k`` (plus ``shared_ffn_hidden`` of shared experts) instead."""

    name: str
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    gated: bool = True
    experts: int = 0
    top_k: int = 0
    moe_ffn_hidden: int = 0
    shared_ffn_hidden: int = 0
    moe_layers: int = 0

    @property
    def query_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    def attention_parameters(self) -> int:
        """A layer's attention projections and its two norms."""
        return (self.hidden * (self.query_width + 2 * self.kv_width)
                + self.query_width * self.hidden + 2 * self.hidden)

    def dense_mlp_parameters(self) -> int:
        return self.mlp_matrices * self.hidden * self.ffn_hidden

    def expert_parameters(self) -> int:
        """One MoE layer's routed experts (all of them)."""
        return self.experts * self.mlp_matrices * self.hidden * self.moe_ffn_hidden

    def moe_shared_parameters(self) -> int:
        """One MoE layer's router and shared experts (replicated like dense weights)."""
        return self.hidden * self.experts + self.mlp_matrices * self.hidden * self.shared_ffn_hidden

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    def head_parameters(self) -> int:
        """The final norm and, untied, the output projection."""
        return self.hidden + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def parameters(self) -> int:
        layers = (self.layers * self.attention_parameters()
                  + self.dense_layers * self.dense_mlp_parameters()
                  + self.moe_layers * (self.expert_parameters() + self.moe_shared_parameters()))
        return layers + self.embedding_parameters() + self.head_parameters()

    def active_parameters(self) -> int:
        """What one token's forward multiplies by (its top-k experts only)."""
        routed = (self.moe_layers * self.top_k * self.mlp_matrices * self.hidden
                  * self.moe_ffn_hidden)
        return (self.parameters() - self.moe_layers * self.expert_parameters() + routed)

    def attention_flops_per_token(self, seq_len: int, attention: str = "causal") -> float:
        """One layer's score and value products for one token of a ``seq_len`` sequence."""
        share = 0.5 if attention == "causal" else 1.0
        return 4.0 * self.query_width * seq_len * share

    def layer_matrix_flops_per_token(self, moe: bool) -> float:
        """One layer's projections for one token: attention, and the MLP or its experts."""
        attention = 2.0 * (self.hidden * (self.query_width + 2 * self.kv_width)
                           + self.query_width * self.hidden)
        if not moe:
            return attention + 2.0 * self.mlp_matrices * self.hidden * self.ffn_hidden
        experts = self.top_k * self.moe_ffn_hidden + self.shared_ffn_hidden
        return attention + 2.0 * (self.hidden * self.experts
                                  + self.mlp_matrices * self.hidden * experts)

    def model_flops_per_token(self, seq_len: int, attention: str = "causal",
                              count_head: bool = True) -> float:
        """A forward's FLOPs per token of ``seq_len`` sequences (see the module docstring)."""
        layers = (self.dense_layers * self.layer_matrix_flops_per_token(False)
                  + self.moe_layers * self.layer_matrix_flops_per_token(True)
                  + self.layers * self.attention_flops_per_token(seq_len, attention))
        return layers + (2.0 * self.hidden * self.vocab if count_head else 0.0)


def _first(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def shape_from_hf_config(config: Mapping[str, Any], name: str = "model") -> ModelShape:
    """The shape of a Hugging Face decoder's ``config.json`` (a vision-language model's
    ``text_config``): Llama, Qwen2/3, Mistral, Gemma, Phi-3 and the MoE families (Mixtral,
    Qwen2/3-MoE, DeepSeek-style ``n_routed_experts``, dense first layers), whose MLPs are all
    gated (SwiGLU or GeGLU: three matrices)."""
    config = config.get("text_config") or config
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as error:
        raise ModelShapeError(f"{name}: config.json lacks {error} (a decoder's "
                              f"hidden_size, num_hidden_layers, num_attention_heads and "
                              f"vocab_size are needed)") from None
    experts = int(_first(config, "num_local_experts", "num_experts", "n_routed_experts",
                         default=0) or 0)
    moe_layers = _moe_layers(config, layers) if experts else 0
    return ModelShape(
        name=name, layers=layers, hidden=hidden,
        ffn_hidden=int(_first(config, "intermediate_size", default=4 * hidden)),
        heads=heads, kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
        head_dim=int(_first(config, "head_dim", default=hidden // heads)), vocab=vocab,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        experts=experts,
        top_k=int(_first(config, "num_experts_per_tok", "moe_top_k", default=2 if experts else 0)),
        moe_ffn_hidden=int(_first(config, "moe_intermediate_size",
                                  default=_first(config, "intermediate_size", default=0))),
        shared_ffn_hidden=_shared_width(config), moe_layers=moe_layers)


def _moe_layers(config: Mapping[str, Any], layers: int) -> int:
    """How many layers hold experts: DeepSeek's dense first layers, Qwen-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step`` leave some dense."""
    dense_first = int(config.get("first_k_dense_replace") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    only_mlp = set(config.get("mlp_only_layers") or ())
    return sum(1 for layer in range(layers) if layer >= dense_first and layer not in only_mlp
               and (layer + 1) % step == 0)


def _shared_width(config: Mapping[str, Any]) -> int:
    if config.get("shared_expert_intermediate_size"):
        return int(config["shared_expert_intermediate_size"])
    shared = int(config.get("n_shared_experts") or 0)
    return shared * int(config.get("moe_intermediate_size") or 0)


def reference_shape(dim: int, layers: int, heads: int, kv_heads: int, vocab: int,
                    moe_experts: int = 0, moe_top_k: int = 1, moe_every: int = 1,
                    tied: bool = False, ffn_multiple_of: int = 32) -> ModelShape:
    """The reference transformer's shape (``models.transformer``: SwiGLU of about 8/3 the
    width, rounded up to ``ffn_multiple_of``; every ``moe_every``-th layer from the first
    holds experts)."""
    ffn = ffn_multiple_of * math.ceil(int(8 * dim / 3) / ffn_multiple_of)
    moe_layers = sum(1 for layer in range(layers) if layer % moe_every == 0) if moe_experts else 0
    return ModelShape("reference", layers, dim, ffn, heads, kv_heads, dim // heads, vocab,
                      tied_embeddings=tied, experts=moe_experts,
                      top_k=moe_top_k if moe_experts else 0,
                      moe_ffn_hidden=ffn if moe_experts else 0, moe_layers=moe_layers)
