"""The attention rows of ``gpu_bench.py`` (its part 1), and the timing both its parts use:
causal attention forward + backward in bf16 through SDPA's flash kernel and ring attention's
tiles on one rank at each sequence length, and one packed row through ``LocalAttention``,
SDPA with the pack's mask, FlexAttention with a document block mask and SDPA causal
unpacked. Run ``gpu_bench.py``; this module is its part, not a script.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from typing import Callable

import torch

from meshpipe.context import LocalAttention, RingAttention
from meshpipe.context.blockwise import kernel_for


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_calls(fn: Callable[[], object], device: torch.device, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def measure(fn: Callable[[], object], device: torch.device, args) -> dict:
    """Median seconds after the warm-up calls, the first call's seconds (a compiled step's
    includes compiling) and peak memory of ``fn``, or ``status: OOM``."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        times = _timed_calls(fn, device, args.warmup + args.iters)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"status": "OOM", "seconds": None, "first_seconds": None, "peak_gib": None}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"status": "ok", "seconds": statistics.median(times[args.warmup:]),
            "first_seconds": times[0], "peak_gib": peak}


def attention_rows(args, device: torch.device) -> list[dict]:
    return [*(row for seq in args.seqs for row in _attention_at(seq, args, device)),
            *_packed_attention(args, device)]


def _timed_attention(name: str, seq: int, flop: float, step: Callable[[], None],
                     device: torch.device, args) -> dict:
    row = {"part": "attention", "kernel": name, "seq": seq, **measure(step, device, args)}
    row["tflops"] = flop / row["seconds"] / 1e12 if row["seconds"] else None
    print(_attention_line(row), flush=True)
    return row


def document_lengths(seq: int, documents: int) -> torch.Tensor:
    """``documents`` lengths (each at least 1) that fill ``seq`` tokens, drawn with seed 0."""
    generator = torch.Generator().manual_seed(0)
    cuts = torch.randperm(seq - 1, generator=generator)[:documents - 1] + 1
    edges = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([seq])])
    return edges.diff()


def _packed_attention(args, device: torch.device) -> list[dict]:
    """One packed row through meshpipe's ``LocalAttention`` and through the kernels it could
    have used (SDPA with the pack's mask in one call; FlexAttention with a document block
    mask, on CUDA), and SDPA causal over the row unpacked. A kernel that fails is a row
    saying how."""
    seq = args.pack_len
    lengths = document_lengths(seq, args.documents).to(device)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    positions = torch.arange(seq, device=device) - (torch.cumsum(lengths, 0) - lengths)[doc_ids]
    shape = (1, seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
    packed, whole = int((lengths * lengths).sum()), seq * seq
    attention = LocalAttention()
    kernels = [(f"LocalAttention, a pack of {len(lengths)} documents", packed,
                lambda: lambda q, k, v: attention(q, k, v, positions=positions, doc_ids=doc_ids)),
               ("SDPA, the pack's mask in one call", packed,
                lambda: _masked_sdpa(positions, doc_ids)),
               ("SDPA causal, the same row unpacked", whole, lambda: attention)]
    if device.type == "cuda":
        kernels.insert(2, ("FlexAttention, a document block mask", packed,
                           lambda: _flex_attention(doc_ids, device)))
    rows = []
    for name, live, build in kernels:
        try:
            run = build()

            def step() -> None:
                run(q, k, v).backward(grad)
                q.grad = k.grad = v.grad = None
            rows.append(_timed_attention(name, seq, 7 * live * args.head_dim * args.heads,
                                         step, device, args))
        except Exception as error:  # a benchmark row, not a test: record it and go on
            traceback.print_exc()
            rows.append({"part": "attention", "kernel": name, "seq": seq, "seconds": None,
                         "peak_gib": None, "tflops": None,
                         "status": f"failed: {type(error).__name__}: {str(error)[:160]}"})
    return rows


def _masked_sdpa(positions: torch.Tensor, doc_ids: torch.Tensor) -> Callable:
    """SDPA on ``[b, s, h, d]`` with the pack's block-diagonal causal mask, made once."""
    allowed = (positions[None, :] <= positions[:, None]) & (doc_ids[None, :] == doc_ids[:, None])
    mask = torch.zeros(allowed.shape, dtype=torch.bfloat16, device=allowed.device)
    mask.masked_fill_(~allowed, float("-inf"))
    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2)


def _flex_attention(doc_ids: torch.Tensor, device: torch.device) -> Callable:
    """Compiled FlexAttention on ``[b, s, h, d]`` with a causal document block mask, made
    once."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def same_document_causal(batch, head, query, key):
        return (key <= query) & (doc_ids[query] == doc_ids[key])

    seq = doc_ids.shape[0]
    blocks = create_block_mask(same_document_causal, None, None, seq, seq, device=device)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(*(t.transpose(1, 2) for t in (q, k, v)),
                                    block_mask=blocks).transpose(1, 2)


def _attention_at(seq: int, args, device: torch.device) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flash = (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)) if device.type == "cuda" \
        else contextlib.nullcontext
    shape = (1, seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
    # Causal forward + backward: 2 + 5 matmuls of s x s x d per head, half of them live.
    flop = 7 * seq * seq * args.head_dim * args.heads
    rows = []
    tiles = kernel_for(device, dtype=torch.bfloat16).name
    for name, attention, context in (
            ("SDPA flash", LocalAttention(), flash),
            (f"ring, 1 rank ({tiles} tiles)", RingAttention(), contextlib.nullcontext)):
        def step() -> None:
            with context():
                attention(q, k, v).backward(grad)
            q.grad = k.grad = v.grad = None
        rows.append(_timed_attention(name, seq, flop, step, device, args))
    return rows


def _attention_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['kernel']:<30} seq {row['seq']:>6}: {row['status']}"
    peak = f", peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""
    return (f"{row['kernel']:<30} seq {row['seq']:>6}: {row['seconds'] * 1e3:9.2f} ms, "
            f"{row['tflops']:.1f} TFLOP/s{peak}")
