"""Hugging Face decoders' RMSNorms as torch's ``rms_norm``: one fused kernel on CUDA where
transformers' formula written out launches eight forward (two casts, ``pow``, ``mean``, the
epsilon's addition, ``rsqrt``, two products) and about as many backward, twice a layer and
microbatch (four times with Qwen3's query and key norms). An eager GPU step is bound by
the host launching kernels (``docs/gpu.md``).

Only the norms whose formula is Llama's, ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x)``
(``LLAMA_FORMULA``), and only where the input has the weight's dtype: torch computes in
float32 inside and rounds once, where transformers rounds the normalised input to its
dtype before the gain (in bf16 the two differ by a rounding; in float32 they agree).
Gemma's norms scale by ``1 + weight`` and stay as they are. The norm keeps its class's
name ending and is an instance of its class (``fuse_norms`` makes a subclass of it in
place), so whatever finds norms by either finds it.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor, nn

from meshpipe.models.transformer import RMSNorm

# transformers' RMSNorm classes with Llama's formula (each checked against it by the tests).
LLAMA_FORMULA = ("LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm",
                 "Qwen2MoeRMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm",
                 "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm")


def fuse_norms(model: nn.Module) -> int:
    """Make every norm of ``model`` with Llama's formula compute through ``rms_norm``; how
    many. Not on a torch before 2.8, whose ``rms_norm`` rounds before the gain."""
    if not RMSNorm.torch_computes_in_float32:
        return 0
    fused = 0
    for module in model.modules():
        if type(module).__name__ in LLAMA_FORMULA:
            module.__class__ = _fused_class(type(module))
            fused += 1
    return fused


@functools.cache
def _fused_class(cls: type) -> type:
    def forward(self, hidden_states: Tensor) -> Tensor:
        if hidden_states.dtype != self.weight.dtype:  # transformers' promotes to the weight's
            return cls.forward(self, hidden_states)
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight,
                          self.variance_epsilon)

    return type(f"Fused{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
