"""Single-process attention through ``scaled_dot_product_attention``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .blockwise import FLASH_DTYPES, flash_runs_on, flash_takes
from .derived import derived
from .interface import check_attention_inputs
from .masks import MAX_RUNS, attention_mask, is_plain_sequence, token_runs, window_applies
from .ring import split_causal_attention
from .tiles import CAUSAL_LEAF, runs_on_cpu_kernel
from .varlen import Segments, packed_flash_attention, takes_windows


# Longer packs run document by document on CUDA too: one call would hold a [seq, seq] mask.
MASKED_PACK_TOKENS = 8192


class LocalAttention(nn.Module):
    """Attention over the tokens this process holds, with SDPA.

    A plain sequence (no packing, positions 0..n-1) takes SDPA's ``is_causal`` fast path; on
    CPU in float32, bf16 or fp16, a causal one longer than ``tiles.CAUSAL_LEAF`` tokens runs
    instead as causal squares of at most that length and unmasked rectangles
    (``ring.split_causal_attention``), which skips the masked work the CPU kernel computes in
    one large causal call. A pack whose documents each lie in one run of consecutive
    positions, and a sequence with a sliding window, run on CUDA in bf16/fp16 as one call of
    the variable-length flash kernel (``varlen``). On CPU such a pack runs document by
    document, each in the same fast path, with no mask and no work across documents; on
    CUDA in float32 as one call with its mask (``_per_document``). Anything else builds the
    mask from ``positions`` and ``doc_ids`` (and a sliding ``window`` shorter than the span
    of the positions). Grouped-query attention goes to SDPA as is (``enable_gqa``), without
    repeating key/value heads. What is read from ``positions`` and ``doc_ids`` (plain or
    not, the documents, the mask) is derived once per microbatch, at its first layer
    (``context.derived``).
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Tensor | None = None,
                doc_ids: Tensor | None = None, causal: bool = True, window: int | None = None,
                scale: float | None = None, softcap: float | None = None) -> Tensor:
        check_attention_inputs(q, k, v, positions, doc_ids, "LocalAttention")
        scale = self.scale if scale is None else scale
        if softcap is not None:
            return soft_capped_attention(q, k, v, positions, doc_ids, causal, window, scale,
                                         softcap)
        seq = q.shape[1]
        if positions is None and doc_ids is None:  # the plain sequence: nothing to derive
            windowed = _window_cuts(window, seq)
            plain = not windowed
        else:
            windowed = window is not None and derived(
                ("window", window, seq), (positions,),
                lambda: window_applies(window, positions, seq))
            plain = not windowed and derived(
                "plain", (positions, doc_ids), lambda: is_plain_sequence(positions, doc_ids))
        if plain and causal and _in_causal_squares(q):
            return split_causal_attention(q, k, v, scale)
        sliding = window if windowed else None
        if not plain and _varlen_takes(q) and (sliding is None or takes_windows()):
            documents = _derived_documents(positions, doc_ids, seq, q.shape[0], q.device)
            if documents is not None:
                return packed_flash_attention(q, k, v, documents, causal, sliding, scale)
        gqa = q.shape[2] != k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if plain:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                 enable_gqa=gqa)
            return out.transpose(1, 2)
        documents = None if windowed or not _per_document(q) else derived(
            ("documents", seq), (positions, doc_ids), lambda: _documents(positions, doc_ids, seq))
        if documents is not None:
            out = torch.cat([F.scaled_dot_product_attention(
                q[:, :, rows], k[:, :, rows], v[:, :, rows], is_causal=causal,
                scale=scale, enable_gqa=gqa) for rows in documents], dim=2)
        else:
            mask = derived(("mask", seq, causal, window if windowed else None, q.dtype, q.device),
                           (positions, doc_ids),
                           lambda: _additive_mask(positions, doc_ids, causal,
                                                  window if windowed else None, seq, q))
            out = _masked_sdpa(q, k, v, mask, scale, gqa)
        return out.transpose(1, 2)

    def runs_in_graph(self, q: Tensor, positions: Tensor | None, doc_ids: Tensor | None,
                      window: int | None, softcap: float | None) -> bool:
        """Whether this call is one SDPA call that reads nothing from the token layout, so
        that a compiled block can hold it in its graph: the plain sequence (``positions`` and
        ``doc_ids`` None), no sliding window shorter than it, no soft-cap, and not the CPU's
        causal squares (``split_causal_attention``, planned tiles under a custom autograd
        function)."""
        return (positions is None and doc_ids is None and softcap is None
                and not _window_cuts(window, q.shape[1]) and not _in_causal_squares(q))

    def extra_repr(self) -> str:
        return "" if self.scale is None else f"scale={self.scale}"


def _window_cuts(window: int | None, seq: int) -> bool:
    """Whether a sliding ``window`` is shorter than a plain sequence of ``seq`` tokens."""
    return window is not None and window < seq


def _in_causal_squares(q: Tensor) -> bool:
    """Whether a plain causal sequence of queries ``q`` runs as the CPU kernel's causal
    squares (``split_causal_attention``) rather than one SDPA call."""
    return runs_on_cpu_kernel(q) and q.shape[1] > CAUSAL_LEAF


def soft_capped_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None,
                          doc_ids: Tensor | None, causal: bool, window: int | None,
                          scale: float | None, softcap: float) -> Tensor:
    """Attention whose scores are capped at ``softcap * tanh(score / softcap)`` before the
    mask and the softmax (Gemma 2), written out: no fused kernel caps scores."""
    seq = q.shape[1]
    if positions is None:
        positions = torch.arange(seq, device=q.device)
    groups = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    mask = attention_mask(positions, positions, doc_ids, doc_ids, causal, window)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2)


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None,
                 gqa: bool) -> Tensor:
    """SDPA with a mask on ``[b, h, s, d]``. SDPA's fused CUDA kernels refuse grouped
    key/value heads beside a mask: it would fall back to its math kernel, which holds the
    whole ``[b, h, s, s]`` scores in float32. Off the CPU the key/value heads are repeated
    for it instead (their gradients sum back through the repeat)."""
    if gqa and q.device.type != "cpu":
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _varlen_takes(q: Tensor) -> bool:
    """Whether a pack of ``[b, s, h, d]`` queries can go to the variable-length flash kernel:
    on CUDA, where ``blockwise.flash_takes`` them (bf16/fp16)."""
    return q.device.type == "cuda" and flash_takes(q)


def _varlen_runs_on(device: torch.device) -> bool:
    """Whether the variable-length flash kernel runs on ``device`` (``_varlen_takes`` without
    the queries' dtype and head size)."""
    return device.type == "cuda" and flash_runs_on(device)


def pack_documents(positions: Tensor, doc_ids: Tensor | None,
                   hidden: Tensor) -> Segments | None:
    """The documents of a pack as causal segments of the variable-length flash kernel, for
    the layers of ``hidden`` ``[batch, seq, dim]``, where the kernel runs on its device in
    its dtype (bf16/fp16; under autocast the autocast dtype) and each document is one run
    of consecutive positions; else None. Derived once per microbatch and shared with the
    eager path's derivation: what a compiled block's graph reads instead of the token
    layout (``routing.pack_for_graph``)."""
    device = hidden.device
    if not _varlen_runs_on(device):
        return None
    dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
             else hidden.dtype)
    if dtype not in FLASH_DTYPES:
        return None
    return _derived_documents(positions, doc_ids, positions.shape[0], hidden.shape[0], device)


def _derived_documents(positions: Tensor | None, doc_ids: Tensor | None, seq: int, rows: int,
                       device: torch.device) -> Segments | None:
    return derived(("varlen documents", seq, rows), (positions, doc_ids),
                   lambda: _varlen_documents(positions, doc_ids, seq, rows, device))


def _varlen_documents(positions: Tensor | None, doc_ids: Tensor | None, seq: int, rows: int,
                      device: torch.device) -> Segments | None:
    """The pack's documents (a plain sequence: one) as causal segments of the
    variable-length kernel, when each is one run of consecutive positions (else None):
    within a run, positions and offsets differ by the same amount, so the kernel's sliding
    window over offsets is the window over positions. Every layer's call reads them, with
    its own ``causal`` and window."""
    documents = _documents(positions, doc_ids, seq, limit=seq)
    if documents is None:
        return None
    lengths = [tokens.stop - tokens.start for tokens in documents]
    return Segments.of(lengths, lengths, rows, device, causal=True)


def _per_document(q: Tensor) -> bool:
    """Whether a pack runs document by document (``q``: ``[b, h, seq, d]``): on the CPU,
    whose flash kernel is cheap to call and then does no work across documents, and for
    packs longer than ``MASKED_PACK_TOKENS``. Elsewhere (CUDA) the pack is one SDPA call with
    its block-diagonal mask: SDPA's CUDA backends plan anew for every new sequence length,
    which per document cost 6.78 ms for the 27 documents of a 2048-token row on an H200,
    where one causal call over the row took 0.32 ms."""
    return q.device.type == "cpu" or q.shape[2] > MASKED_PACK_TOKENS


def _additive_mask(positions: Tensor | None, doc_ids: Tensor | None, causal: bool,
                   window: int | None, seq: int, q: Tensor) -> Tensor | None:
    """The mask of the tokens as SDPA adds it to the scores (0 where a query may attend a
    key, -inf elsewhere) in ``q``'s dtype: what SDPA would convert a boolean mask to in
    every call, made once per microbatch (``derived``)."""
    if positions is None:
        positions = torch.arange(seq, device=q.device)
    allowed = attention_mask(positions, positions, doc_ids, doc_ids, causal, window)
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~allowed, float("-inf"))


def _documents(positions: Tensor | None, doc_ids: Tensor | None, seq: int,
               limit: int = MAX_RUNS) -> list[slice] | None:
    """The token ranges of the documents, when each document is one run of consecutive
    positions (its tokens then see only each other: one unmasked or causal square apiece)
    and there are at most ``limit``, else None."""
    if positions is None:
        positions = torch.arange(seq, device=None if doc_ids is None else doc_ids.device)
    runs = token_runs(positions, doc_ids, limit)
    if runs is None or len({run.doc for run in runs}) < len(runs):
        return None
    return [slice(run.offset, run.offset + run.length) for run in runs]
