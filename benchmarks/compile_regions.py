"""How a compiled block's number of graphs shows in a step: the reference blocks eager, compiled
by parts (norms, attention, MLP: five graphs a block, as ``--compile`` once did), whole with
positions given (two graphs, cut at the attention core: a pack's off CUDA, or a context-parallel
rank's, block), whole on the plain sequence (one graph: its attention is one SDPA call,
in the graph), and the chunk compiled as a whole (one call for all its layers instead of one
a layer), forward + backward of one chunk in one process, inductor, one thread, in
alternating order. The last three compute the same thing (the given positions are
``0..seq-1``); only the graphs differ.

    .venv/bin/python benchmarks/compile_regions.py                 # small and medium sizes
    .venv/bin/python benchmarks/compile_regions.py --sizes 64:64 --rounds 30

Each call of a compiled graph costs host time (guards, the autograd wrapper), which a small
model's step is made of; a large one's is its matrix products. Writes
``<out>/compile_regions.json`` and ``.md`` (default ``benchmarks/results``). A benchmark
records times; it never asserts them.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from harness import load_average, write_results
from meshpipe import graph_breaks
from meshpipe.models import Transformer, TransformerConfig, split

WAYS = ("eager", "by parts", "two graphs", "one graph", "whole chunk")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["64:64", "256:256"], metavar="DIM:SEQ")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def build(way: str, dim: int, layers: int, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=dim // 32,
                               max_seq_len=seq)
    (chunk,) = split(Transformer(config), 1)
    for block in chunk.layers.values():
        if way in ("two graphs", "one graph"):
            block.compile()
        elif way == "by parts":
            block._forward = block._forward_by_parts
            for part in (block.attention_norm, block.attention, block.mlp_norm, block.mlp):
                part.compile()
    if way == "whole chunk":
        chunk.compile()
    return chunk


def measure(dim: int, seq: int, layers: int, args) -> dict:
    chunks = {way: build(way, dim, layers, seq) for way in WAYS}
    tokens = torch.randint(0, 256, (1, seq))
    given = {way: None if way in ("one graph", "whole chunk") else torch.arange(seq)
             for way in WAYS}

    def step(way) -> None:
        chunks[way](tokens, given[way]).float().sum().backward()

    for way in WAYS:
        for _ in range(3):  # compiles, then warm
            step(way)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_index in range(args.rounds):
        order = WAYS if round_index % 2 == 0 else WAYS[::-1]
        for way in order:
            start = time.perf_counter()
            step(way)
            times[way].append(time.perf_counter() - start)
    medians = {way: statistics.median(t) * 1e3 for way, t in times.items()}
    row = {"dim": dim, "seq": seq, "layers": layers, "ms": medians}
    print(row, flush=True)
    return row


def to_markdown(result: dict) -> str:
    lines = [f"# Compiled blocks by parts and whole ({result['machine']}, torch "
             f"{result['torch']}, inductor, 1 thread)", "",
             f"Forward + backward of a chunk of the reference transformer, batch 1; median "
             f"of {result['rounds']} rounds in alternating order. Load average before "
             f"{result['load_before']}, after {result['load_after']}.", "",
             "| layers | dim | seq | eager ms | by parts (5 graphs a block) ms | whole, positions "
             "given (2 graphs) ms | whole, plain (1 graph) ms | the chunk compiled whole ms | "
             "1 graph vs 2 | 1 graph vs eager | chunk vs 1 graph a block |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        ms = row["ms"]
        lines.append(f"| {row['layers']} | {row['dim']} | {row['seq']} | {ms['eager']:.1f} | "
                     f"{ms['by parts']:.1f} | {ms['two graphs']:.1f} | "
                     f"{ms['one graph']:.1f} | {ms['whole chunk']:.1f} | "
                     f"{ms['one graph'] / ms['two graphs']:.2f}x | "
                     f"{ms['one graph'] / ms['eager']:.2f}x | "
                     f"{ms['whole chunk'] / ms['one graph']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    graph_breaks.install()
    before = load_average()
    rows = [measure(*map(int, size.split(":")), layers, args)
            for layers in args.layers for size in args.sizes]
    result = {"machine": platform.machine(), "torch": torch.__version__,
              "rounds": args.rounds, "load_before": before,
              "load_after": load_average(), "rows": rows}
    table = to_markdown(result)
    print(table)
    write_results(args.out, "compile_regions", result, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
