"""CUDA benchmark: attention at long sequences, and a training step of a GPU-sized model.

    python benchmarks/gpu_bench.py                      # seq 8k/16k/32k; dim 2048 x 16 layers
    python benchmarks/gpu_bench.py --seqs 8192 16384 --layers 8
    python benchmarks/gpu_bench.py --seq-len 2048 8192  # training rows at both lengths

Part 1 times one causal attention forward + backward in bf16 (batch 1, 16 heads of 128) per
sequence length: SDPA with its flash kernel forced (meshpipe's ``LocalAttention``), and
meshpipe's ``RingAttention`` on a group of one rank, which runs the tiles ring attention
runs on CUDA (``context.blockwise.kernel_for``: the flash kernel in bf16, with the
log-sum-exp), so it shows what a ring step costs per tile. Then one packed row of
``--pack-len`` tokens holding ``--documents`` documents (lengths drawn once, seed 0):
``LocalAttention`` with the pack's positions and document ids, SDPA with the pack's mask in
one call and (on CUDA) compiled FlexAttention with a document block mask, against SDPA
causal over the same row unpacked, which is what a pack should approach (TFLOP/s count each
one's live work). A configuration that runs out of memory is recorded as OOM.

Part 2 times training steps of the reference transformer (default dim 2048, 16 layers,
seq 2048 or each ``--seq-len``, bf16: the trainer's bf16 weights with float32 masters, the
plain loop's autocast on float32 weights; 8 microbatches of 1 sequence, AdamW)
through meshpipe's trainer on one GPU (``Trainer.train_step``: the 1F1B executor with one
stage, gradient clipping, optimizer), eager and with ``--compile``, on random tokens and
``--pack``ed from the shipped corpus (documents of a few hundred tokens), also as a Hugging
Face Llama of the same sizes through ``--model`` (``--no-hf`` skips it), beside the same
model stepped by plain PyTorch: step time, tokens/s, model FLOPs utilisation and peak
memory, over ``--rounds`` rounds in alternating order, each runner's round in a process of
its own (on an H100 the rows measured later in one process ran up to 1.5x slower than the
first, whatever they were; ``--no-isolate`` measures them all in this one), each round's
time with the GPU's SM clock, temperature and power after it, and the first step's time
(with ``--compile``, compiling included). MFU counts PaLM's model FLOPs, 6 x parameters + 12 x
layers x dim x seq per token (the attention scores as if not causal), against the GPU's
dense bf16 peak (``PEAK_BF16_TFLOPS``, by name; none on other devices). Pipelines across
GPUs are timed by ``benchmarks/gpu_check.py`` (small model).

Single process, one GPU. Without a CUDA device it says so and exits 0. Writes
``<out>/gpu_bench.json`` and ``.md`` (default ``benchmarks/results``) when run on a GPU; a
``--cpu-rehearsal`` (tiny sizes advised) writes nothing unless ``--out`` is given. A
benchmark records times; it never asserts them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from gpu_attention import attention_rows, measure
from harness import RESULTS, publish
from meshpipe.models import Transformer, causal_lm_loss
from meshpipe.runtime import autocast
from meshpipe.train.config import TrainConfig
from meshpipe.train.data.corpus import load_corpus
from meshpipe.train.loop.trainer import Trainer
from meshpipe.train.run.sources import model_config

# Dense bf16 tensor-core peaks (TFLOP/s, SXM parts) by a name in torch's device name.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
PARTS = ("attention", "train")
# A training step's modes: the flags each adds to the trainer's run. eager-apart: q/k/v and
# gate/up as separate products, eager-unfused: the weight gradients through bf16 .grad into
# the masters, compile-blocks: one compiled graph a block, not a chunk's (what each ran
# before it was made the default on CUDA), until a GPU has timed them in isolated rounds.
MODE_FLAGS = {"eager": {}, "compile": {"compile": True},
              "eager-apart": {"joint_projections": "off"},
              "eager-unfused": {"grad_accumulation_fusion": "off"},
              "compile-blocks": {"compile": True, "chunk_graphs": "off"}}
MODES = tuple(MODE_FLAGS)
DATA = ("random", "pack")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768],
                        help="attention sequence lengths")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dim", type=int, default=2048, help="training step: model width")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--model-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048],
                        help="training step: tokens per sequence (several: rows for each)")
    parser.add_argument("--pack-len", type=int, default=2048,
                        help="tokens in the packed attention row")
    parser.add_argument("--documents", type=int, default=27,
                        help="documents in the packed attention row")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where gpu_bench.json/.md go (default {RESULTS} on a GPU)")
    parser.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the same model as a Hugging Face Llama (--model)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="which parts to run (default both)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="training step: the trainer eager, with --compile, eager with "
                             "--joint-projections off, eager with --grad-accumulation-fusion "
                             "off, --compile with --chunk-graphs off (default: all)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="training step: rounds over the runners, alternating their order "
                             "(the median of the rounds is reported)")
    parser.add_argument("--data", nargs="+", choices=DATA, default=list(DATA),
                        help="training step: random tokens, --pack'ed corpus, or both")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run on the CPU to try the script (use tiny sizes); not a result")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                        help="training step: measure each runner's round in a process of its "
                             "own (default), so that no runner inherits what an earlier one "
                             "left in the process")
    parser.add_argument("--runner-timeout", type=float, default=300,
                        help="seconds a runner's own process may take before it is a failed "
                             "row (--isolate)")
    parser.add_argument("--runner", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--runner-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sources", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def train_config(args, out_dir: str, device: torch.device, seq_len: int,
                 compiled: bool = False, model: str = "", packed_from: str = "",
                 **flags) -> TrainConfig:
    """The benchmark's run at ``seq_len`` tokens per sequence: the reference transformer of
    the arguments' sizes, or the Hugging Face directory ``model`` (which has those sizes:
    ``llama_of``); on random tokens, or ``--pack``ed from the text file ``packed_from``;
    ``flags``: a mode's (``MODE_FLAGS``)."""
    sizes = {} if model else dict(dim=args.dim, layers=args.layers, heads=args.model_heads,
                                  kv_heads=args.kv_heads)
    return TrainConfig(pp=1, device=device.type, **sizes, model=model, seq_len=seq_len,
                       microbatches=args.microbatches, microbatch_size=args.microbatch_size,
                       dtype="bf16", steps=args.warmup + args.iters, warmup_steps=1,
                       eval_every=0, timeline_step=0, progress=False, out_dir=out_dir,
                       data=packed_from, pack=bool(packed_from), **{"compile": compiled, **flags})


def llama_of(config: TrainConfig, directory: str) -> str:
    """The reference transformer of ``config`` (randomly initialised) written as the
    LlamaForCausalLM it is, for the same step through ``--model``."""
    from meshpipe.models.hf_export import export_reference

    model = Transformer(model_config(config))
    export_reference({name: p.detach() for name, p in model.named_parameters()},
                     model.config, directory)
    return directory


def model_flops_per_token(parameters: int, config: TrainConfig) -> float:
    """PaLM's model FLOPs of training one token (forward and backward)."""
    return 6 * parameters + 12 * config.layers * config.dim * config.seq_len


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def _trainer_runner(config: TrainConfig) -> Callable[[], tuple[Callable[[], None], int]]:
    """meshpipe's trainer on ``config``: built when called, its step and parameter count."""
    def build() -> tuple[Callable[[], None], int]:
        trainer = Trainer(config)
        steps = iter(range(config.steps))
        return (lambda: trainer.train_step(next(steps)),
                sum(p.numel() for _, p in trainer.parameters))
    return build


def _plain_runner(config: TrainConfig, device: torch.device
                  ) -> Callable[[], tuple[Callable[[], None], int]]:
    """The same model stepped by a plain PyTorch loop (autocast at ``config.dtype`` on float32
    weights, clipping, AdamW)."""
    def build() -> tuple[Callable[[], None], int]:
        model = Transformer(model_config(config)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                      weight_decay=config.weight_decay)
        batch = torch.randint(0, model.config.vocab_size,
                              (config.microbatches, config.microbatch_size, config.seq_len + 1),
                              device=device)

        def plain_step() -> None:
            for microbatch in batch:
                with autocast(config.dtype, device.type):
                    logits = model(microbatch[:, :-1])
                (causal_lm_loss(logits, microbatch[:, 1:]) / config.microbatches).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return plain_step, sum(p.numel() for p in model.parameters())
    return build


def _measure_runner(build: Callable[[], tuple[Callable[[], None], int]],
                    device: torch.device, args) -> tuple[dict, int | None]:
    """One runner built, measured and freed, with the GPU's state right after it (read in
    the process that ran it: after that process ends the GPU idles); a runner that fails is
    a row saying how (the other rows still run)."""
    try:
        step, parameters = build()
        measured = measure(step, device, args)
        del step
        return {**measured, "gpu": gpu_state()}, parameters
    except Exception as error:  # a benchmark row, not a test: record it and go on
        traceback.print_exc()
        return _failed(f"{type(error).__name__}: {str(error)[:160]}")
    finally:
        gc.collect()  # this runner's memory, before the next one's


def gpu_state() -> str | None:
    """The GPU's SM clock, temperature and power now (``nvidia-smi``), or None: a row
    measured at a lower clock than another is slower for it."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def train_rows(args, device: torch.device) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="meshpipe-gpu-bench-") as scratch:
        corpus, llama = _sources(args, device, scratch)
        return [row for seq_len in args.seq_len
                for row in _train_rows_at(seq_len, args, device, scratch, corpus, llama)]


def _sources(args, device: torch.device, scratch: str) -> tuple[str, str]:
    """The corpus packs are cut from, and the Hugging Face directory of the model (or ""),
    written into ``scratch``; a runner's own process reads those its parent wrote
    (``--sources``: a 740M model's export takes seconds)."""
    if args.sources is not None:
        return (str(args.sources / "corpus.txt"),
                str(args.sources / "llama") if args.hf else "")
    corpus = Path(scratch, "corpus.txt")
    corpus.write_bytes(load_corpus())
    longest = train_config(args, scratch, device, max(args.seq_len))
    return str(corpus), llama_of(longest, f"{scratch}/llama") if args.hf else ""


def _train_rows_at(seq_len: int, args, device: torch.device, scratch: str, corpus: str,
                   llama: str) -> list[dict]:
    """meshpipe's trainer (reference model and ``llama``, random tokens and packed from
    ``corpus``, eager and compiled) and the plain loop, at ``seq_len``, in ``--rounds``
    rounds: the runners in order, then in reverse, and so on, so that a drift of the
    machine over the run (rows measured later ran slower) falls on every runner alike.
    With ``--isolate`` each runner's round runs in a fresh process (``_measure_apart``): in
    one process, on an H100 host, a runner measured after a compiled one ran up to 1.4x
    slower, whatever it was."""
    runners, config = _runners_at(seq_len, args, device, scratch, corpus, llama)
    measured: dict[str, list[dict]] = {name: [] for name in runners}
    parameters = None
    for round_index in range(args.rounds):
        order = list(runners) if round_index % 2 == 0 else list(runners)[::-1]
        for name in order:
            result, counted = (_measure_apart(name, seq_len, args, scratch) if args.isolate
                               else _measure_runner(runners[name], device, args))
            parameters = counted or parameters
            measured[name].append(result)
            print(_round_line(name, seq_len, round_index, args.rounds, result), flush=True)
    return [_train_row(name, rounds, seq_len, parameters, config, device)
            for name, rounds in measured.items()]


def _round_line(name: str, seq_len: int, round_index: int, rounds: int, result: dict) -> str:
    """One runner's round as it finishes: its record if the benchmark is stopped before it
    writes its table."""
    if result["status"] != "ok":
        figures = result["status"]
    else:
        figures = (f"{result['seconds'] * 1e3:.1f} ms/step, first step "
                   f"{result['first_seconds']:.1f} s"
                   + (f", peak {result['peak_gib']:.1f} GiB" if result["peak_gib"] is not None
                      else "") + (f" ({result['gpu']})" if result.get("gpu") else ""))
    return f"gpu_bench: round {round_index + 1}/{rounds} {name} seq {seq_len}: {figures}"


def _runners_at(seq_len: int, args, device: torch.device, scratch: str, corpus: str,
                llama: str) -> tuple[dict[str, Callable], TrainConfig]:
    """The runners at ``seq_len`` by name (each builds its step when called), and the
    plain loop's configuration."""
    data = [source for kind, source in (("random", ""), ("pack", corpus)) if kind in args.data]
    models = [("", "")] + ([(llama, ", --model Llama")] if llama else [])
    runners = {
        "meshpipe Trainer (1F1B, 1 stage)" + what + (", --pack" if packed_from else "")
        + _flags_named(MODE_FLAGS[mode]):
        _trainer_runner(train_config(args, scratch, device, seq_len, model=model,
                                     packed_from=packed_from, **MODE_FLAGS[mode]))
        for model, what in models for packed_from in data for mode in args.modes}
    config = train_config(args, scratch, device, seq_len)
    runners["plain PyTorch (same model and batch)"] = _plain_runner(config, device)
    return runners, config


def _flags_named(flags: dict) -> str:
    """What a mode's flags add to its row's name: `` --compile``, `` --joint-projections
    off``."""
    return "".join(f" --{name.replace('_', '-')}" + ("" if value is True else f" {value}")
                   for name, value in flags.items())


def _measured_model(config: TrainConfig) -> dict:
    """The sizes of the step a row times, for ``meshpipe plan --efficiency-from``."""
    model = model_config(config)
    return {"dim": model.dim, "layers": model.n_layers, "heads": model.n_heads,
            "kv_heads": model.kv_heads, "vocab": model.vocab_size, "seq_len": config.seq_len,
            "microbatches": config.microbatches, "microbatch_size": config.microbatch_size}


def _train_row(name: str, rounds: list[dict], seq_len: int, parameters: int | None,
               config: TrainConfig, device: torch.device) -> dict:
    """A runner's row: the median of its rounds, tokens/s and MFU."""
    times = [r["seconds"] for r in rounds if r["status"] == "ok"]
    failed = next((r for r in rounds if r["status"] != "ok"), None)
    seconds = statistics.median(times) if times and failed is None else None
    tokens = config.tokens_per_step
    tokens_per_s = tokens / seconds if seconds else None
    peak = peak_tflops(device)
    row = {"part": "train step", "runner": name,
           "status": failed["status"] if failed else "ok", "seconds": seconds,
           "first_step_s": rounds[0]["first_seconds"],
           "peak_gib": max((r["peak_gib"] for r in rounds if r["peak_gib"] is not None),
                           default=None),
           "rounds": rounds, "seq": seq_len, "parameters": parameters,
           "tokens_per_step": tokens, "tokens_per_s": tokens_per_s,
           "model": _measured_model(config),
           "mfu": (tokens_per_s * model_flops_per_token(parameters, config) / 1e12 / peak
                   if tokens_per_s and peak else None)}
    print(_train_line(row), flush=True)
    return row


# What _one_rank_world sets, which a runner's own process must not inherit (it makes its own).
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _measure_apart(name: str, seq_len: int, args, sources: str) -> tuple[dict, int | None]:
    """One round of runner ``name`` in a fresh process of this script (``--runner``), on the
    corpus and model this process wrote into ``sources``."""
    with tempfile.TemporaryDirectory(prefix="meshpipe-gpu-bench-runner-") as scratch:
        out = Path(scratch, "runner.json")
        command = [sys.executable, __file__, *args.argv, "--parts", "train", "--seq-len",
                   str(seq_len), "--runner", name, "--runner-out", str(out),
                   "--sources", sources]
        env = {key: value for key, value in os.environ.items() if key not in WORLD_VARIABLES}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=args.runner_timeout)
        except subprocess.TimeoutExpired:
            return _failed(f"no result in {args.runner_timeout:.0f} s (--runner-timeout)")
        if done.returncode != 0 or not out.exists():
            print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return _failed(f"exit {done.returncode}: {last[:160]}")
        measured = json.loads(out.read_text())
        return measured["result"], measured["parameters"]


def _failed(why: str) -> tuple[dict, None]:
    """A runner's round that gave no time: a row saying why."""
    return {"status": f"failed: {why}", "seconds": None, "first_seconds": None,
            "peak_gib": None}, None


def _run_one_runner(args, device: torch.device) -> None:
    """``--runner``: measure that runner once, in this process, into ``--runner-out``."""
    (seq_len,) = args.seq_len
    with tempfile.TemporaryDirectory(prefix="meshpipe-gpu-bench-") as scratch:
        corpus, llama = _sources(args, device, scratch)
        runners, _ = _runners_at(seq_len, args, device, scratch, corpus, llama)
        result, parameters = _measure_runner(runners[args.runner], device, args)
    args.runner_out.write_text(json.dumps({"result": result, "parameters": parameters}))


def _train_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['runner']:<56} seq {row['seq']}: {row['status']}"
    peak = f", peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""
    mfu = f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] is not None else ""
    return (f"{row['runner']:<56} seq {row['seq']}: {row['seconds'] * 1e3:9.1f} ms/step, "
            f"{row['tokens_per_s']:,.0f} tokens/s{mfu}{peak}")


def _one_rank_world(device: torch.device) -> None:
    """A process group of this process alone, as torchrun would set it up (the trainer and
    ring attention need one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


def to_markdown(result: dict) -> str:
    def figure(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"# GPU benchmark: {result['device']}", "",
             f"torch {result['torch']}, CUDA {result['cuda']}; median of {result['iters']} "
             f"after {result['warmup']} warm-up."]
    if result["attention"]:
        lines += ["", f"Attention forward + backward, causal, bf16, batch 1, {result['heads']} "
                      f"heads x {result['head_dim']}:", "",
                  "| kernel | seq | ms | TFLOP/s | peak GiB |", "|---|---:|---:|---:|---:|"]
    for row in result["attention"]:
        ms = figure(row["seconds"] and row["seconds"] * 1e3, ".2f") if row["status"] == "ok" \
            else row["status"]
        lines.append(f"| {row['kernel']} | {row['seq']} | {ms} | {figure(row['tflops'], '.1f')}"
                     f" | {figure(row['peak_gib'], '.1f')} |")
    train = result["train"]
    if train:
        parameters = train[0]["parameters"]
        size = f"{parameters / 1e6:.0f}M parameters" if parameters else "no runner finished"
        lines += ["", f"Training step: {size}, "
                      f"{result['sequences']} sequences per step, bf16 (the trainer: bf16 "
                      f"weights, fp32 masters; the plain loop: autocast), AdamW:",
                  "", "| runner | seq | ms/step | first step s | tokens/s | MFU % | peak GiB | "
                      "rounds: ms (SM MHz, temp, power) |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for row in train:
            ms = figure(row["seconds"] and row["seconds"] * 1e3, ".1f") \
                if row["status"] == "ok" else row["status"]
            mfu = figure(row.get("mfu") and 100 * row["mfu"], ".1f")
            rounds = "; ".join(
                f"{figure(r['seconds'] and r['seconds'] * 1e3, '.1f')}"
                + (f" ({r['gpu']})" if r.get("gpu") else "") for r in row.get("rounds", []))
            lines.append(f"| {row['runner']} | {row['seq']} | {ms} | "
                         f"{figure(row.get('first_step_s'), '.1f')} | "
                         f"{figure(row['tokens_per_s'], ',.0f')} | "
                         f"{mfu} | {figure(row['peak_gib'], '.1f')} | {rounds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_rehearsal:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        print(f"gpu_bench: no CUDA device (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}): nothing to benchmark")
        return 0
    if "WORLD_SIZE" in os.environ:
        print("gpu_bench: run it as one process (python benchmarks/gpu_bench.py), not under "
              "torchrun", file=sys.stderr)
        return 2
    _one_rank_world(device)
    if args.runner is not None:
        try:
            _run_one_runner(args, device)
        finally:
            dist.destroy_process_group()
        return 0
    try:
        result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                  else "CPU rehearsal (not a GPU result)",
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "warmup": args.warmup, "iters": args.iters, "heads": args.heads,
                  "head_dim": args.head_dim,
                  "attention": attention_rows(args, device) if "attention" in args.parts
                  else [],
                  "sequences": args.microbatches * args.microbatch_size,
                  "train": train_rows(args, device) if "train" in args.parts else []}
    finally:
        dist.destroy_process_group()
    publish("gpu_bench", result, to_markdown(result), args.out, args.cpu_rehearsal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
