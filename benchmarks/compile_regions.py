"""How a compiled block's number of graphs shows in a step: the reference blocks eager, compiled
by parts (norms, attention, MLP: five graphs a block, as ``--compile`` once did), whole with
positions given (two graphs, cut at the attention core: a pack's off CUDA, or a context-parallel
rank's, block), whole on the plain sequence (one graph: its attention is one SDPA call,
in the graph), the chunk compiled as a whole (one call for all its layers instead of one
a layer, every layer traced and compiled anew) and the chunk's graph of ``--chunk-graphs``
(one call, each block a nested region compiled once), forward + backward of one chunk in
one process, inductor, one thread, in alternating order. The last four compute the same
thing (the given positions are ``0..seq-1``); only the graphs differ. The first step of
the one-graph ways (compiling) is timed too, each in a new process with inductor's cache
in a new directory.

    .venv/bin/python benchmarks/compile_regions.py                 # small and medium sizes
    .venv/bin/python benchmarks/compile_regions.py --sizes 64:64 --rounds 30

Each call of a compiled graph costs host time (guards, the autograd wrapper), which a small
model's step is made of; a large one's is its matrix products. Writes
``<out>/compile_regions.json`` and ``.md`` (default ``benchmarks/results``). A benchmark
records times; it never asserts them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import load_average, write_results
from meshpipe import graph_breaks
from meshpipe.models import Transformer, TransformerConfig, split
from meshpipe.models.compile import compile_blocks

WAYS = ("eager", "by parts", "two graphs", "one graph", "whole chunk", "chunk graph")
PLAIN = ("one graph", "whole chunk", "chunk graph")  # the ways given no positions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["64:64", "256:256"], metavar="DIM:SEQ")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--first-step", nargs=4, default=None, help=argparse.SUPPRESS,
                        metavar=("WAY", "DIM", "SEQ", "LAYERS"))
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
    if way == "chunk graph":
        compile_blocks([chunk], chunk_graphs=True)
    return chunk


def _step(chunk: torch.nn.Module, way: str, seq: int) -> None:
    tokens = torch.randint(0, 256, (1, seq))
    chunk(tokens, None if way in PLAIN else torch.arange(seq)).float().sum().backward()


def first_step_seconds(way: str, dim: int, seq: int, layers: int) -> float:
    """The first (compiling) step of ``way``, in a process of its own with an empty
    inductor cache: nothing compiled for another way or size is reused."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        done = subprocess.run(
            [sys.executable, __file__, "--first-step", way, str(dim), str(seq), str(layers)],
            capture_output=True, text=True, check=True,
            env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(dim: int, seq: int, layers: int, args) -> dict:
    # What an earlier row compiled would make this row's sizes dynamic where code is shared.
    torch._dynamo.reset()
    chunks = {way: build(way, dim, layers, seq) for way in WAYS}

    def step(way) -> None:
        _step(chunks[way], way, seq)

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
    first = {way: first_step_seconds(way, dim, seq, layers) for way in PLAIN}
    row = {"dim": dim, "seq": seq, "layers": layers, "ms": medians, "first_s": first}
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
             "chunk graph (nested blocks) ms | 1 graph vs 2 | 1 graph vs eager | "
             "chunk whole vs 1 graph a block | chunk graph vs 1 graph a block |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    for row in result["rows"]:
        ms = row["ms"]
        lines.append(f"| {row['layers']} | {row['dim']} | {row['seq']} | {ms['eager']:.1f} | "
                     f"{ms['by parts']:.1f} | {ms['two graphs']:.1f} | "
                     f"{ms['one graph']:.1f} | {ms['whole chunk']:.1f} | "
                     f"{ms['chunk graph']:.1f} | "
                     f"{ms['one graph'] / ms['two graphs']:.2f}x | "
                     f"{ms['one graph'] / ms['eager']:.2f}x | "
                     f"{ms['whole chunk'] / ms['one graph']:.2f}x | "
                     f"{ms['chunk graph'] / ms['one graph']:.2f}x |")
    lines += ["", "First step (compiling; each in a new process, inductor's cache empty), s:",
              "", "| layers | dim | seq | " + " | ".join(PLAIN) + " |",
              "| ---: | ---: | ---: |" + " ---: |" * len(PLAIN)]
    for row in result["rows"]:
        lines.append(f"| {row['layers']} | {row['dim']} | {row['seq']} | "
                     + " | ".join(f"{row['first_s'][way]:.1f}" for way in PLAIN) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    graph_breaks.install()
    if args.first_step:
        way, *sizes = args.first_step
        dim, seq, layers = map(int, sizes)
        chunk = build(way, dim, layers, seq)
        start = time.perf_counter()
        _step(chunk, way, seq)
        print(json.dumps(time.perf_counter() - start))
        return 0
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
