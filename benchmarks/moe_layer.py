"""One mixture-of-experts layer's forward and backward in TFLOP/s: its experts as grouped
products (``--grouped-experts``), one by one, and a dense SwiGLU as wide as the experts one
token uses (the same products' FLOPs, in three large matrices); and one tp 2 rank's share of
the grouped layer (every row, each expert at half its width: how ``--tp`` splits experts).

    python benchmarks/moe_layer.py                    # CUDA, bf16, the shapes below
    python benchmarks/moe_layer.py --shapes mixtral-8x7b --tokens 4096
    python benchmarks/moe_layer.py --cpu-rehearsal    # tiny shapes on CPU processes, fp32

Each shape is (dim, an expert's hidden width, experts, top-k); the layer is meshpipe's
``MoE`` on one rank (no expert parallelism: the all-to-alls are copies), its router and
experts drawn at std 0.02 so that the routing is near even. A round times every runner in
turn (the order rotating from round to round), each for ``--iters`` forward+backward passes
on ``--tokens`` rows after a warm-up; the figures are medians over ``--rounds`` rounds, and
the ratios are taken round by round. FLOPs count the experts' products only (3 products of
2 x rows x dim x hidden per pick forward, twice that backward); the router and the
permutations are in the time, not in the count. The issue's goal: grouped at least 0.6x
the dense layer's TFLOP/s.

Writes ``<out>/moe_layer.json`` and ``.md`` (default ``benchmarks/results``); a CPU
rehearsal writes nothing unless ``--out`` is given: its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import RESULTS, load_average, paired_ratios, publish
from meshpipe.models import grouped_experts, joint
from meshpipe.models.mlp import SwiGLU
from meshpipe.models.moe import MoE

# name: (dim, an expert's hidden width, experts, top-k)
SHAPES = {
    "64-experts-top-8": (2048, 1408, 64, 8),
    "qwen3-moe-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
REHEARSAL_SHAPES = {"64-experts-top-8": (64, 48, 64, 8), "mixtral-8x7b": (64, 96, 8, 2)}
RUNNERS = ("grouped", "one-by-one", "dense", "grouped-tp2-share")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192, help="rows per pass")
    parser.add_argument("--iters", type=int, default=10, help="passes per runner and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where moe_layer.json/.md go (default {RESULTS}; a CPU "
                             "rehearsal writes nothing unless given)")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="tiny shapes in float32 on the CPU, to try the script")
    return parser.parse_args(argv)


def _layers(shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype):
    """The runners' modules: the expert layer laid out for grouped products, the same layer
    as it is, the dense SwiGLU of ``top_k x hidden`` (joint gate/up, as on CUDA), and a tp 2
    rank's share of the grouped layer (each expert ``hidden / 2`` wide)."""
    dim, hidden, experts, top_k = shape
    torch.manual_seed(0)
    apart = MoE(dim, hidden, experts, top_k)
    dense = SwiGLU(dim, hidden * top_k)
    share = MoE(dim, hidden // 2, experts, top_k)
    with torch.no_grad():
        for param in [*apart.parameters(), *dense.parameters(), *share.parameters()]:
            param.normal_(0.0, 0.02)
    apart, dense, share = (module.to(device, dtype) for module in (apart, dense, share))
    grouped = copy.deepcopy(apart)
    if not grouped_experts.lay_out([grouped]) or not grouped_experts.lay_out([share]):
        raise SystemExit(f"moe_layer: shape {shape} cannot be laid out for grouped products")
    joint.lay_out([dense])
    return {"grouped": grouped, "one-by-one": apart, "dense": dense,
            "grouped-tp2-share": share}


def _pass(module, x: torch.Tensor, upstream: torch.Tensor) -> None:
    out = module(x)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(upstream)


def _seconds_per_pass(module, x, upstream, iters: int, device: torch.device) -> float:
    for param in module.parameters():
        param.grad = None
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        _pass(module, x, upstream)
    _sync(device)
    return (time.perf_counter() - start) / iters


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, shape, args, device: torch.device, dtype: torch.dtype) -> dict:
    dim, hidden, experts, top_k = shape
    layers = _layers(shape, device, dtype)
    x = torch.randn(1, args.tokens, dim, device=device, dtype=dtype, requires_grad=True)
    upstream = torch.randn_like(x)
    for module in layers.values():  # warm-up: kernels chosen, memory pooled
        _pass(module, x, upstream)
    seconds = {runner: [] for runner in RUNNERS}
    for round_index in range(args.rounds):
        turn = round_index % len(RUNNERS)
        order = RUNNERS[turn:] + RUNNERS[:turn]
        for runner in order:
            seconds[runner].append(
                _seconds_per_pass(layers[runner], x, upstream, args.iters, device))
    flops = 3 * 3 * 2 * args.tokens * top_k * dim * hidden
    flops_of = {runner: flops / 2 if runner == "grouped-tp2-share" else flops
                for runner in RUNNERS}
    tflops = {runner: flops_of[runner] / statistics.median(times) / 1e12
              for runner, times in seconds.items()}
    return {"shape": name, "dim": dim, "hidden": hidden, "experts": experts, "top_k": top_k,
            "tokens": args.tokens, "flops_per_pass": flops, "seconds": seconds,
            "tflops": tflops,
            "grouped_over_dense": statistics.median(
                paired_ratios(seconds["dense"], seconds["grouped"])),
            "grouped_speedup_over_one_by_one": statistics.median(
                paired_ratios(seconds["one-by-one"], seconds["grouped"])),
            # a tp 2 rank's share against half the whole layer's time: its efficiency
            "tp2_share_efficiency": statistics.median(
                paired_ratios([t / 2 for t in seconds["grouped"]],
                              seconds["grouped-tp2-share"]))}


def to_markdown(result: dict) -> str:
    lines = [f"# One MoE layer, forward + backward: {result['device']}", "",
             f"torch {result['torch']}, {result['dtype']}, {result['rounds']} rounds of "
             f"{result['iters']} passes per runner; load average {result['load_before']} -> "
             f"{result['load_after']}. TFLOP/s of the experts' products (medians); ratios "
             "round by round.", "",
             "| shape | dim | hidden | experts | top-k | rows | grouped TFLOP/s | "
             "one-by-one TFLOP/s | dense TFLOP/s | grouped / dense | grouped speed-up | "
             "tp 2 share TFLOP/s | tp 2 share / grouped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        t = row["tflops"]
        lines.append(f"| {row['shape']} | {row['dim']} | {row['hidden']} | {row['experts']} "
                     f"| {row['top_k']} | {row['tokens']} | {t['grouped']:.3g} | "
                     f"{t['one-by-one']:.3g} | {t['dense']:.3g} | "
                     f"{row['grouped_over_dense']:.2f}x | "
                     f"{row['grouped_speedup_over_one_by_one']:.2f}x | "
                     f"{t['grouped-tp2-share']:.3g} | {row['tp2_share_efficiency']:.2f}x |")
    lines += ["", "The tp 2 share: every row through each expert at half its width, what one "
              "rank computes when `--tp 2` splits the experts (its FLOPs are half the "
              "layer's); its ratio is half the grouped layer's time over its own, round by "
              "round (1.00x: splitting the width costs nothing)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not grouped_experts.available():
        print(f"moe_layer: torch {torch.__version__} has no grouped matrix product")
        return 1
    if args.cpu_rehearsal:
        torch.set_num_threads(1)
        device, dtype, shapes = torch.device("cpu"), torch.float32, REHEARSAL_SHAPES
        args.tokens = min(args.tokens, 256)
        name = "CPU rehearsal (float32; no GPU figures)"
    elif not torch.cuda.is_available():
        print(f"moe_layer: no CUDA device visible to torch {torch.__version__}; "
              "--cpu-rehearsal tries the script on the CPU")
        return 0
    else:
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, SHAPES
        name = torch.cuda.get_device_name(device)
    load_before = load_average()
    rows = []
    for shape_name in args.shapes:
        if shape_name in shapes:
            rows.append(measure(shape_name, shapes[shape_name], args, device, dtype))
            print(f"moe_layer: {shape_name} done", flush=True)
    result = {"device": name, "torch": torch.__version__, "dtype": str(dtype).split(".")[-1],
              "rounds": args.rounds, "iters": args.iters, "load_before": load_before,
              "load_after": load_average(), "rows": rows}
    publish("moe_layer", result, to_markdown(result), args.out, args.cpu_rehearsal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
