"""Rotary position embedding (RoPE), looked up by each token's position."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from meshpipe.context.derived import derived


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on ``[batch, seq, heads, head_dim]`` tensors.

    The rotation of each token is looked up by its position (not by its local offset), so
    any slice of a sequence (zigzag, packed documents) rotates correctly. The cos/sin table
    covers ``max_seq_len`` positions; dimension ``i`` is paired with ``i + head_dim / 2``.
    The rotation computes in the dtype of its input, the table rows rounded to it (as
    Megatron-Core's unfused path and transformers' Llama do): in bf16 or fp16 an eager
    step casts no query or key to float32 and back, four kernels a layer and microbatch
    forward and four backward. The sine table holds its first half negated (``sin_signed``),
    so the rotation swaps the halves without negating one: a kernel fewer per query and
    key, forward and backward, bit for bit the same.
    """

    def __init__(self, head_dim: int, theta: float, max_seq_len: int):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        angles = torch.arange(max_seq_len, dtype=torch.float64).unsqueeze(1) / theta**exponents
        # Each table twice over, one entry per dimension (both halves turn by one angle).
        sin = angles.sin().float()
        self.register_buffer("cos", angles.cos().float().repeat(1, 2), persistent=False)
        self.register_buffer("sin_signed", torch.cat((-sin, sin), dim=1), persistent=False)

    def tables(self, positions: Tensor | None, dtype: torch.dtype,
               seq: int) -> tuple[Tensor, Tensor]:
        """The cos and signed sin rows of ``positions`` (None: ``0..seq-1``, the tables' first rows)
        in ``dtype``, ``[1, seq, 1, head_dim]``: looked up once per positions tensor (or
        length) and dtype and reused by every query and key of every layer sharing this
        module (a microbatch's, or a loader's reused tensor's, for the whole run), except
        inside a compiled graph, which fuses the lookup into the rotation."""
        if positions is None and seq > self.cos.shape[0]:
            raise ValueError(f"a sequence of {seq} tokens is longer than the RoPE table of "
                             f"{self.cos.shape[0]} positions; raise "
                             f"TransformerConfig.max_seq_len")
        if torch.compiler.is_compiling():
            return self._look_up(positions, dtype, seq)
        return derived(("rotary tables", dtype, seq), (self.cos, self.sin_signed, positions),
                       lambda: self._look_up(positions, dtype, seq))

    def _look_up(self, positions: Tensor | None, dtype: torch.dtype,
                 seq: int) -> tuple[Tensor, Tensor]:
        rows = slice(0, seq) if positions is None else positions
        try:
            cos, sin = self.cos[rows], self.sin_signed[rows]
        except IndexError as exc:
            raise ValueError(f"a token position is outside the RoPE table of "
                             f"{self.cos.shape[0]} positions ({exc}); raise "
                             f"TransformerConfig.max_seq_len") from exc
        return tuple(row.to(dtype)[None, :, None, :] for row in (cos, sin))

    def forward(self, x: Tensor, positions: Tensor | None) -> Tensor:
        cos, sin_signed = self.tables(positions, x.dtype, x.shape[1])
        # (first, second) -> (first cos - second sin, second cos + first sin), in two
        # products where the pairs written out take four (on GPUs launches bound a step).
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((second, first), dim=-1) * sin_signed
