"""Training tokens/s of a Hugging Face Llama against meshpipe's reference transformer of the
same size, layout by layout.

    .venv/bin/python benchmarks/hf_vs_reference.py                    # ~3 min on 2 cores
    .venv/bin/python benchmarks/hf_vs_reference.py --steps 12 --dim 256 --layouts pp1,pp2

The reference transformer (``meshpipe.models.transformer``: RMSNorm, RoPE, grouped-query
attention, SwiGLU, untied head) and a ``transformers.LlamaForCausalLM`` are the same
architecture. The benchmark builds a ``LlamaConfig`` of exactly the reference's sizes
(hidden size ``--dim``, intermediate size the reference's ``TransformerConfig.ffn_width``,
``--layers``, ``--heads``, ``--kv-heads``, head_dim = dim / heads, vocabulary 256, RMSNorm
eps 1e-5, rope theta 10000, untied head), saves a random one with ``save_pretrained`` in a
temporary directory (nothing is downloaded), and checks that both models have the same
parameter count.

For every layout it then runs ``meshpipe.train.run`` with the same ``TrainConfig``
(shipped byte-level corpus, fp32, local gloo processes, one thread each) except the model:
once the reference transformer (``dim``/``layers``/``heads``/``kv_heads``), once
``model=<the Llama directory>``, ``--repeats`` times each, alternating which model runs
first. A model's tokens/s is the median of the per-step ``tokens_per_s`` of
``metrics["history"]`` over its runs, leaving out the first ``--warmup`` steps of each; the
ratio of the two models' fastest timed steps is reported beside it, as a check that is less
sensitive to other processes sharing the machine. Layouts are named
``pp<N>[-ulysses<M>][-ring<M>]``; pp 1 runs schedule ``none``, pp > 1 ``--schedule``.

Writes ``<out>/hf_vs_reference.json`` and ``.md`` (default ``benchmarks/results``).
Benchmarks print and record; they never assert a time.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from harness import write_results
from meshpipe.models.transformer import Transformer, TransformerConfig
from meshpipe.train.config import TrainConfig

VOCAB = 256  # the shipped corpus is byte-level
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps left out of the median (the first ones)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each model per layout, alternating which goes first")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule when pp > 1")
    parser.add_argument("--layouts", default="pp1,pp2,pp2-ulysses2",
                        help="comma-separated pp<N>[-ulysses<M>][-ring<M>]")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no step of --steps {args.steps} to time")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def parse_layout(name: str) -> dict[str, int]:
    match = re.fullmatch(r"pp(\d+)(?:-ulysses(\d+))?(?:-ring(\d+))?", name)
    if not match:
        raise ValueError(f"layout {name!r} is not pp<N>[-ulysses<M>][-ring<M>]")
    pp, ulysses, ring = (int(g) if g else 1 for g in match.groups())
    return {"pp": pp, "cp_ulysses": ulysses, "cp_ring": ring}


def reference_config(args: argparse.Namespace) -> TransformerConfig:
    """The reference transformer the trainer builds for these flags."""
    return TransformerConfig(vocab_size=VOCAB, dim=args.dim, n_layers=args.layers,
                             n_heads=args.heads, n_kv_heads=args.kv_heads,
                             max_seq_len=args.seq_len)


def llama_config(reference: TransformerConfig):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=reference.vocab_size, hidden_size=reference.dim,
        intermediate_size=reference.ffn_width, num_hidden_layers=reference.n_layers,
        num_attention_heads=reference.n_heads, num_key_value_heads=reference.kv_heads,
        head_dim=reference.head_dim, max_position_embeddings=reference.max_seq_len,
        rms_norm_eps=reference.norm_eps, rope_theta=reference.rope_theta,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        attention_dropout=0.0)


def save_llama(reference: TransformerConfig, directory: Path) -> int:
    """A random LlamaForCausalLM of the reference's sizes in ``directory``; its parameters."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(reference))
    model.save_pretrained(str(directory))
    return sum(p.numel() for p in model.parameters())


def reference_parameters(reference: TransformerConfig) -> int:
    return sum(p.numel() for p in Transformer(reference).parameters())


def one_run(config: TrainConfig, warmup: int) -> dict:
    """Train once; the tokens/s of every step and of the steps after ``warmup``."""
    from meshpipe.train.loop.trainer import run

    start = time.perf_counter()
    metrics = run(config)
    wall = time.perf_counter() - start
    history = metrics["history"]
    return {"tokens_per_s_by_step": [round(h["tokens_per_s"], 1) for h in history],
            "timed_tokens_per_s": [h["tokens_per_s"] for h in history[warmup:]],
            "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
            "wall_seconds": round(wall, 2)}


def measure(args: argparse.Namespace, model_dir: Path, workdir: Path) -> list[dict]:
    base = TrainConfig(seq_len=args.seq_len, microbatches=args.microbatches,
                       microbatch_size=args.microbatch_size, steps=args.steps, warmup_steps=1,
                       eval_every=0, timeline_step=0, progress=False)
    rows = []
    for name in args.layouts.split(","):
        name = name.strip()
        layout = parse_layout(name)
        schedule = "none" if layout["pp"] == 1 else args.schedule
        common = replace(base, schedule=schedule, **layout)
        configs = {"reference": replace(common, dim=args.dim, layers=args.layers,
                                        heads=args.heads, kv_heads=args.kv_heads),
                   "hf": replace(common, model=str(model_dir))}
        runs: dict[str, list[dict]] = {"reference": [], "hf": []}
        for repeat in range(args.repeats):
            # Alternate which model goes first, so a drift in the machine's load does not
            # favour one of them.
            order = ("reference", "hf") if repeat % 2 == 0 else ("hf", "reference")
            for label in order:
                out_dir = workdir / f"{name}-{label}-{repeat}"
                runs[label].append(one_run(replace(configs[label], out_dir=str(out_dir)),
                                           args.warmup))
        timed = {label: [t for r in done for t in r.pop("timed_tokens_per_s")]
                 for label, done in runs.items()}
        median = {label: statistics.median(values) for label, values in timed.items()}
        # The fastest timed step: the least disturbed by other processes on a shared machine.
        best = {label: max(values) for label, values in timed.items()}
        row = {"layout": name, **layout, "schedule": schedule,
               "processes": common.world_size,
               "reference_tokens_per_s": round(median["reference"], 1),
               "hf_tokens_per_s": round(median["hf"], 1),
               "hf_over_reference": round(median["hf"] / median["reference"], 3),
               "reference_best_step_tokens_per_s": round(best["reference"], 1),
               "hf_best_step_tokens_per_s": round(best["hf"], 1),
               "hf_over_reference_best_step": round(best["hf"] / best["reference"], 3),
               "reference_runs": runs["reference"], "hf_runs": runs["hf"]}
        print(f"{name:<16} {common.world_size} proc  reference "
              f"{row['reference_tokens_per_s']:>8,.0f} tok/s  HF {row['hf_tokens_per_s']:>8,.0f}"
              f" tok/s  HF/ref {row['hf_over_reference']:.2f}", flush=True)
        rows.append(row)
    return rows


def describe_layout(row: dict) -> str:
    parts = [f"pp {row['pp']}"]
    if row["cp_ulysses"] > 1:
        parts.append(f"Ulysses {row['cp_ulysses']}")
    if row["cp_ring"] > 1:
        parts.append(f"ring {row['cp_ring']}")
    parts.append(f"schedule {row['schedule']}")
    return ", ".join(parts) + f" ({row['processes']} proc)"


def to_markdown(args: argparse.Namespace, rows: list[dict], params: dict) -> str:
    lines = ["| layout | reference tok/s | HF Llama tok/s | HF / reference | "
             "HF / reference, fastest steps |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {describe_layout(row)} | {row['reference_tokens_per_s']:,.0f} | "
                     f"{row['hf_tokens_per_s']:,.0f} | {row['hf_over_reference']:.2f} | "
                     f"{row['hf_over_reference_best_step']:.2f} |")
    lines += ["", f"Model: dim {args.dim}, {args.layers} layers, {args.heads} heads, "
              f"{args.kv_heads} key/value heads, SwiGLU width {params['ffn_width']}, "
              f"vocabulary {VOCAB}, untied head; {params['reference']:,} parameters (reference) "
              f"vs {params['hf']:,} (LlamaForCausalLM). Batch: {args.microbatches} microbatches "
              f"x {args.microbatch_size} sequences x {args.seq_len} tokens per step, fp32, "
              f"shipped byte-level corpus; tokens/s is the median over steps "
              f"{args.warmup + 1}-{args.steps} of {args.steps} of {args.repeats} runs of each "
              f"model (alternating which runs first); the last column compares each model's "
              "fastest timed step, the one least slowed by other processes.",
              "",
              f"Machine: {os.cpu_count()} CPU cores, gloo, one thread per process (layouts "
              "with more processes than cores oversubscribe them). Other processes may have "
              "been running during the measurement, so the timings are noisy: read the ratios "
              "to within roughly +-10-20%."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name in args.layouts.split(","):
        parse_layout(name.strip())  # a bad layout fails before anything runs
    reference = reference_config(args)
    with tempfile.TemporaryDirectory(prefix="meshpipe-hf-vs-ref-") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "llama"
        params = {"reference": reference_parameters(reference),
                  "hf": save_llama(reference, model_dir), "ffn_width": reference.ffn_width}
        print(f"parameters: reference {params['reference']:,}, LlamaForCausalLM "
              f"{params['hf']:,} (SwiGLU width {reference.ffn_width})", flush=True)
        if params["reference"] != params["hf"]:
            print("warning: the two models differ in size", flush=True)
        rows = measure(args, model_dir, workdir)
    table = to_markdown(args, rows, params)
    print(table)
    import transformers

    json_path, _ = write_results(
        args.out, "hf_vs_reference",
        {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                     "torch": torch.__version__, "transformers": transformers.__version__},
         "arguments": {k: str(v) for k, v in vars(args).items()},
         "model": {"dim": args.dim, "layers": args.layers, "heads": args.heads,
                   "kv_heads": args.kv_heads, "head_dim": reference.head_dim,
                   "ffn_width": reference.ffn_width, "vocab_size": VOCAB,
                   "seq_len": args.seq_len, "tie_embeddings": False},
         "parameters": {"reference": params["reference"], "hf_llama": params["hf"]},
         "layouts": rows}, table)
    print(f"wrote {json_path} and .md")


if __name__ == "__main__":
    main()
