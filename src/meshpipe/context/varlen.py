"""Many pieces of attention in one call of PyTorch's variable-length flash kernel (CUDA,
bf16/fp16).

The kernel takes tokens flattened to ``[tokens, heads, head_dim]`` and cuts queries and keys
into segments by cumulative lengths (``Segments``): query segment ``i`` attends key segment
``i`` only, every segment causal or none, and no work crosses segments, whatever their
number. Two callers:

- a pack in local attention: the documents (each one run of consecutive positions) are the
  segments, queries and keys alike, with the layer's sliding window if it has one
  (``packed_flash_attention``, derived once per microbatch; a sequence with a window is a
  pack of one document);
- a ring attention step whose pieces (``masks.plan_pieces``) tile the query block and the
  key block in order, all causal squares or all unmasked rectangles: the pieces of a pack
  split across the ranks document by document (``segments_of``). The step is then one
  ``BlockKernel`` tile with its log-sum-exp (``tile_forward`` / ``tile_backward``), where it
  was a call per document.

The aten ops are called directly (their signature has held since torch 2.6, where the
public ``varlen_attn`` changed between releases); grouped key/value heads go in as they are.
Ring tiles need the log-sum-exp per token (``[heads, tokens]``, as recent kernels return it):
``lse_per_token`` asks the op's meta implementation, which mirrors the CUDA one's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from .derived import to_device
from .masks import Piece


@dataclass(frozen=True)
class Segments:
    """Cumulative lengths of the query and key segments of a batch's rows (int32 on the
    device, the rows one after another), the longest of each, and whether each pair is a
    causal square (what a ring tile's pieces are; a pack's call says it with its window,
    ``packed_flash_attention``)."""

    cu_q: Tensor
    cu_k: Tensor
    longest_q: int
    longest_k: int
    causal: bool

    @staticmethod
    def of(q_lengths: list[int], k_lengths: list[int], rows: int, device: torch.device,
           causal: bool) -> Segments:
        """The segments of ``rows`` batch rows that are each cut into ``q_lengths`` queries
        against ``k_lengths`` keys."""
        cu_q = _cumulative(q_lengths, rows, device)
        cu_k = cu_q if k_lengths == q_lengths else _cumulative(k_lengths, rows, device)
        return Segments(cu_q, cu_k, max(q_lengths), max(k_lengths), causal)


def window_sizes(window: int | None, causal: bool) -> dict[str, int]:
    """The kernel's window arguments: keys up to ``window - 1`` positions before a query
    (and, unless causal, any after it); none without a window."""
    if window is None:
        return {}
    return {"window_size_left": window - 1, "window_size_right": 0 if causal else -1}


def _cumulative(lengths: list[int], rows: int, device: torch.device) -> Tensor:
    ends = torch.tensor(lengths).cumsum(0)
    row_starts = torch.arange(rows) * sum(lengths)
    cumulative = torch.cat([torch.zeros(1, dtype=torch.int64),
                            (row_starts[:, None] + ends).flatten()])
    return to_device(cumulative.to(torch.int32), device)


def packed_flash_attention(q: Tensor, k: Tensor, v: Tensor, documents: Segments, causal: bool,
                           window: int | None, scale: float | None) -> Tensor:
    """Attention of ``[b, s, h, d]`` packed rows, each token within its document only
    (``documents``' segments, with this call's ``causal`` and sliding ``window``), as one
    variable-length flash call. The aten op goes through its own autograd formula, eagerly
    and in a compiled block's graph alike: no Python runs in its backward, and TorchDynamo
    traces it (a Python autograd function reading ``Segments`` from its context would cut
    the graph)."""
    out = torch.ops.aten._flash_attention_forward(
        *_rows_end_to_end(q, k, v), documents.cu_q, documents.cu_k, documents.longest_q,
        documents.longest_k, 0.0, causal, False, scale=scale,
        **window_sizes(window, causal))[0]
    return out.view(q.shape)


def _rows_end_to_end(*tensors: Tensor) -> list[Tensor]:
    """``[b, s, h, d]`` -> ``[b * s, h, d]``: the kernel's tokens, the rows one after
    another."""
    return [t.reshape(-1, *t.shape[2:]) for t in tensors]


def segments_of(pieces: list[Piece], q_count: int, k_count: int, rows: int,
                device: torch.device) -> Segments | None:
    """``pieces`` of a ``q_count`` x ``k_count`` tile as the segments of one variable-length
    call, when there are several, all causal or all unmasked, and their query ranges and
    their key ranges each tile their block in order without a gap; else None."""
    if len(pieces) < 2 or len({piece.causal for piece in pieces}) > 1:
        return None
    queries = [piece.rows or slice(0, q_count) for piece in pieces]
    keys = [piece.cols or slice(0, k_count) for piece in pieces]
    if not (_tile_in_order(queries, q_count) and _tile_in_order(keys, k_count)):
        return None
    return Segments.of([r.stop - r.start for r in queries], [c.stop - c.start for c in keys],
                       rows, device, pieces[0].causal)


def _tile_in_order(ranges: list[slice], count: int) -> bool:
    ends = [0, *(r.stop for r in ranges)]
    return (all(r.start == end and r.stop > r.start for r, end in zip(ranges, ends))
            and ends[-1] == count)


def no_rng_state() -> Tensor:
    """The philox seed or offset of a flash kernel run without dropout (unread): a host
    scalar, as the kernels return it then."""
    return torch.zeros((), dtype=torch.int64, device="cpu")


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, segments: Segments,
                   scale: float | None) -> tuple[Tensor, ...]:
    return torch.ops.aten._flash_attention_forward(
        q, k, v, segments.cu_q, segments.cu_k, segments.longest_q, segments.longest_k, 0.0,
        segments.causal, False, scale=scale)


def _flash_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, segments: Segments, scale: float | None,
                    rng: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, segments.cu_q, segments.cu_k, segments.longest_q,
        segments.longest_k, 0.0, segments.causal, *rng, scale=scale)


def _tokens(x: Tensor) -> Tensor:
    """``[b, h, s, d]`` heads first -> ``[b * s, h, d]`` tokens first (a view where ``x`` is a
    transposed ``[b, s, h, d]``)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _heads_first(x: Tensor, batch: int) -> Tensor:
    """``[b * s, h, d]`` -> ``[b, h, s, d]`` float32."""
    return x.view(batch, -1, *x.shape[1:]).transpose(1, 2).float()


def tile_forward(q: Tensor, k: Tensor, v: Tensor, segments: Segments,
                 scale: float) -> tuple[Tensor, Tensor]:
    """A ``BlockKernel`` forward on heads-first ``[b, h, s, d]`` blocks: float32 output and
    the log-sum-exp as ``[b, h, s]``."""
    batch, heads, seq = q.shape[:3]
    out, lse, *_ = _flash_forward(_tokens(q), _tokens(k), _tokens(v), segments, scale)
    return _heads_first(out, batch), lse.view(heads, batch, seq).transpose(0, 1)


def tile_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  segments: Segments, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """A ``BlockKernel`` backward on heads-first blocks, given the final ``out`` and ``lse``
    (``[b, h, s]``); float32 gradients."""
    batch, heads, seq = q.shape[:3]
    per_token = lse.transpose(0, 1).reshape(heads, batch * seq)
    grads = _flash_backward(_tokens(grad_out), _tokens(q), _tokens(k), _tokens(v),
                            _tokens(out), per_token, segments, scale,
                            (no_rng_state(), no_rng_state()))
    return tuple(_heads_first(grad, batch) for grad in grads)


@cache
def takes_windows() -> bool:
    """Whether this torch's variable-length flash ops take a sliding window (their schemas
    name ``window_size_left``)."""
    return all("window_size_left" in {argument.name for argument in op.default._schema.arguments}
               for op in (torch.ops.aten._flash_attention_forward,
                          torch.ops.aten._flash_attention_backward))


@cache
def lse_per_token() -> bool:
    """Whether this torch's variable-length flash kernel returns its log-sum-exp as
    ``[heads, tokens]`` (what ring tiles read), asked of the op's meta implementation."""
    q = torch.empty(3, 2, 8, device="meta", dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device="meta")
    try:
        _, lse, *_ = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 2, 2, 0.0, False,
                                                              False)
    except (RuntimeError, NotImplementedError):
        return False
    return tuple(lse.shape) == (2, 3)
