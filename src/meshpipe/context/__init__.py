"""Context-parallel attention: local (SDPA), Ulysses, ring and hybrid (USP).

Every attention here has the signature ``attn(q, k, v, *, positions=None, doc_ids=None,
causal=True)`` described in ``interface.py``; ``make_attention`` picks one from the
context-parallel process groups; a model's layer calls it through ``routing.attend``.
"""

from .heads import HeadPlan, plan_heads
from .hybrid import HybridAttention, make_attention
from .interface import Attention, AttentionError
from .local import LocalAttention
from .masks import attention_mask
from .ring import RingAttention
from .ulysses import UlyssesAttention

__all__ = [
    "Attention", "AttentionError", "HeadPlan", "HybridAttention", "LocalAttention",
    "RingAttention", "UlyssesAttention", "attention_mask", "make_attention", "plan_heads",
]
