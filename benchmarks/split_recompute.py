"""A split backward (I then W) of a recomputed stage: W's calls sharing one recomputation,
against a recomputation per call (how W ran before).

    python benchmarks/split_recompute.py                     # 4 blocks, 512 tokens, dim 256
    python benchmarks/split_recompute.py --seq-len 1024 --out benchmarks/results

One stage of reference blocks, one thread, fp32 on the CPU. Per ``--recompute`` mode it
times the forward (F), the full backward (B), and I and W, each W both ways: sharing one
recomputation of each checkpointed block (``split_backward``'s default) and with one per
backward call (the group switched off). It also counts how often the blocks ran in each
pass. The cases alternate within each round; the table gives the medians. Writes
``<out>/split_recompute.json`` and ``.md`` when ``--out`` is given. A benchmark records
times; it never asserts them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch
from torch.autograd.graph import get_gradient_edge

from harness import load_average, write_results
from meshpipe.models.transformer import Transformer, TransformerConfig
from meshpipe.runtime import split_backward
from meshpipe.runtime.split_backward import SplitBackward

MODES = ("none", "selective", "full")
W_WAYS = {"one recomputation": None, "one per call": nullcontext}


def blocks_of(mode: str, args: argparse.Namespace) -> tuple[torch.nn.ModuleList, list[int]]:
    """The stage's blocks, and a list that grows by one at every start of a block (a pre-hook
    on its first module: an early-stopped recomputation ends inside the block)."""
    config = TransformerConfig(dim=args.dim, n_heads=args.heads, n_layers=args.layers,
                               max_seq_len=args.seq_len)
    blocks = Transformer(config, recompute=mode).layers
    starts: list[int] = []
    for block in blocks:
        block.attention_norm.register_forward_pre_hook(lambda module, inputs: starts.append(1))
    return blocks, starts


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def one_round(blocks: torch.nn.ModuleList, starts: list[int], args: argparse.Namespace
              ) -> dict[str, tuple[float, int]]:
    """Milliseconds and block starts of F, B, I and each way of W, in one round."""
    def forward():
        x = torch.randn(1, args.seq_len, args.dim, requires_grad=True)
        hidden = x
        for block in blocks:
            hidden = block(hidden, None, None)
        return x, hidden

    measured: dict[str, tuple[float, int]] = {}

    def record(name: str, fn) -> None:
        before = len(starts)
        measured[name] = (timed(fn), len(starts) - before)

    held: dict[str, object] = {}
    record("F", lambda: held.update(zip(("x", "out"), forward())))
    out = held["out"]
    record("B", lambda: out.backward(torch.ones_like(out)))
    for way, replacement in W_WAYS.items():
        x, out = forward()
        split = SplitBackward([get_gradient_edge(out)], [torch.ones_like(out)], [x])
        record(f"I ({way})", split.input_grads)
        patch = (nullcontext() if replacement is None
                 else mock.patch.object(split_backward, "_one_recomputation", replacement))
        with patch:
            record(f"W ({way})", split.accumulate_weight_grads)
    return measured


def measure(mode: str, args: argparse.Namespace) -> dict:
    blocks, starts = blocks_of(mode, args)
    one_round(blocks, starts, args)  # warm-up
    rounds = [one_round(blocks, starts, args) for _ in range(args.rounds)]
    return {name: {"ms": statistics.median(r[name][0] for r in rounds),
                   "block starts": rounds[-1][name][1]} for name in rounds[0]}


def to_markdown(result: dict) -> str:
    names = list(next(iter(result["modes"].values())))
    lines = [f"# Split backward of a recomputed stage: {result['device']}", "",
             f"torch {result['torch']}, {result['layers']} blocks, {result['seq_len']} tokens, "
             f"dim {result['dim']}, {result['heads']} heads, fp32, one thread; median of "
             f"{result['rounds']} rounds, ms (block starts in the pass). Load average "
             f"{result['load_before']} before, {result['load_after']} after.", "",
             "| recompute | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]
    for mode, row in result["modes"].items():
        cells = [f"{row[name]['ms']:.1f} ({row[name]['block starts']})" for name in names]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    result = {"device": "CPU", "torch": torch.__version__, "layers": args.layers,
              "seq_len": args.seq_len, "dim": args.dim, "heads": args.heads,
              "rounds": args.rounds, "load_before": load_average()}
    result["modes"] = {mode: measure(mode, args) for mode in MODES}
    result["load_after"] = load_average()
    print(to_markdown(result))
    if args.out is not None:
        write_results(args.out, "split_recompute", result, to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
