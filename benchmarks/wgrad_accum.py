"""CUDA probe: a weight gradient accumulated into a float32 master, fused or not.

    python benchmarks/wgrad_accum.py            # the 740M model's shapes, 2048 tokens
    python benchmarks/wgrad_accum.py --tokens 4096

Under ``--dtype bf16`` each microbatch's weight gradient is a bfloat16 product that a hook
then adds into the master's float32 ``.grad`` (``runtime.master_weights``): on an H100 those
additions took 24 ms of a 206 ms step's GPU time. Fused, the product accumulates into the
float32 gradient itself (``torch.addmm(..., out_dtype=torch.float32, out=master_grad)``,
cuBLAS with a float32 C; the op exists on CUDA only). This times both per shape of one
layer, to decide whether the fusion is worth building. Writes ``<out>/wgrad_accum.json`` and
``.md`` when ``--out`` is given. A benchmark records times; it never asserts them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from harness import write_results

# (rows, columns) of the 740M reference model's weights: q and o, k and v, gate/up, down.
SHAPES = ((2048, 2048), (1024, 2048), (5632, 2048), (2048, 5632))


def timed(fn, iters: int) -> float:
    """Milliseconds per call of ``fn`` on the GPU (CUDA events, after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def shape_row(rows: int, cols: int, tokens: int, iters: int) -> dict:
    grad_out = torch.randn(tokens, rows, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
    master_grad = torch.zeros(rows, cols, device="cuda", dtype=torch.float32)

    def apart() -> None:
        master_grad.add_(grad_out.t().mm(x))

    def fused() -> None:
        torch.addmm(master_grad, grad_out.t(), x, out_dtype=torch.float32, out=master_grad)

    row = {"shape": f"{rows}x{cols}", "tokens": tokens,
           "product only ms": timed(lambda: grad_out.t().mm(x), iters),
           "product + add_ ms": timed(apart, iters)}
    try:
        row["fused addmm ms"] = timed(fused, iters)
        expected = grad_out.t().float().mm(x.float())
        master_grad.zero_()
        fused()
        row["fused max |diff| vs fp32 product"] = (master_grad - expected).abs().max().item()
    except (RuntimeError, TypeError, NotImplementedError) as error:
        row["fused addmm ms"] = f"failed: {type(error).__name__}: {str(error)[:120]}"
    return row


def to_markdown(result: dict) -> str:
    lines = [f"# Weight gradient into a float32 master: {result['device']}", "",
             f"torch {result['torch']}, {result['tokens']} tokens, bf16 inputs.", "",
             "| shape | product ms | product + add_ ms | fused addmm ms | fused max diff |",
             "|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        fused = row["fused addmm ms"]
        lines.append(f"| {row['shape']} | {row['product only ms']:.3f} | "
                     f"{row['product + add_ ms']:.3f} | "
                     f"{fused if isinstance(fused, str) else f'{fused:.3f}'} | "
                     f"{row.get('fused max |diff| vs fp32 product', '-')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("wgrad_accum: no CUDA device; nothing measured")
        return 0
    rows = [shape_row(r, c, args.tokens, args.iters) for r, c in SHAPES]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tokens": args.tokens, "rows": rows}
    print(to_markdown(result))
    if args.out is not None:
        write_results(args.out, "wgrad_accum", result, to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
