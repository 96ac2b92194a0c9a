"""CUDA benchmark: a vision-language training step, images and text through meshpipe's
trainer on one GPU, with images/s, tokens/s and model FLOPs utilisation that counts the
vision tower's work.

    python benchmarks/gpu_bench_vision.py                    # Qwen2-VL-like, 448 px images
    python benchmarks/gpu_bench_vision.py --cpu-rehearsal --dim 64 --layers 2 \\
        --vision-dim 32 --vision-depth 2 --image 56 --seq-len 512 --iters 2

A random Qwen2-VL of the arguments' sizes (nothing downloaded: the tokenizer and image
processor are made as the tests make them) trains on the shapes corpus
(``meshpipe.train.data.shapes``) drawn at ``--image`` pixels a side, 1-2 pictures a
caption, packed (``--pack``) into ``--seq-len`` tokens, in bf16 (the trainer's bf16 weights
with float32 masters), pp 1. Model FLOPs per step: 6 x decoder parameters x tokens plus the
attention scores (12 x layers x dim x seq_len per token, as if not causal), and 6 x tower
parameters x image patches plus the tower's attention over each image's patches; MFU is
that over the step time and the GPU's dense bf16 peak. A benchmark records times; it never
asserts them. Writes ``<out>/gpu_bench_vision.{json,md}`` (default ``benchmarks/results``)
on a GPU; a ``--cpu-rehearsal`` writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gpu_attention import measure  # noqa: E402
from gpu_bench import RESULTS, _one_rank_world, gpu_state, peak_tflops  # noqa: E402
from harness import write_results  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1536, help="decoder width")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vision-dim", type=int, default=1024, help="tower width")
    parser.add_argument("--vision-depth", type=int, default=16)
    parser.add_argument("--image", type=int, default=448, help="pixels a side")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run on the CPU to try the script (use tiny sizes); not a result")
    return parser.parse_args(argv)


def vision_model(args, directory: Path) -> Path:
    """A random Qwen2-VL of the arguments' sizes with its tokenizer and image processor."""
    import transformers
    from hf_models import VISION_TOKENS, save_tiny_tokenizer, vision_chatml
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    save_tiny_tokenizer(directory, chat_template=vision_chatml(
        "<|vision_start|><|image_pad|><|vision_end|>"), extra_special=VISION_TOKENS)
    words = transformers.AutoTokenizer.from_pretrained(str(directory))
    ids = {token: words.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    head_dim = args.dim // args.heads
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=320, hidden_size=args.dim, intermediate_size=4 * args.dim,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=32768,
                         bos_token_id=0, eos_token_id=1,
                         rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                              mrope_section=[head_dim // 8, head_dim // 8 * 3 // 2,
                                                             head_dim // 8 * 3 // 2])),
        vision_config=dict(depth=args.vision_depth, embed_dim=args.vision_dim,
                           hidden_size=args.dim, num_heads=max(1, args.vision_dim // 64),
                           mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(str(directory))
    pixels = args.image * args.image
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                             min_pixels=pixels, max_pixels=pixels).save_pretrained(str(directory))
    return directory


def step_flops(args, info, batches: list) -> tuple[float, int, int]:
    """Model FLOPs of the measured steps' batches on average, and their images and tokens."""
    tokens = sum(int(batch.tokens.numel()) for batch in batches) / len(batches)
    grids = [g for batch in batches for row in batch.pictures for piece in row
             for g in piece.grids.tolist()]
    images = len(grids) / len(batches)
    patches = sum(t * h * w for t, h, w in grids) / len(batches)
    per_image = patches / max(images, 1)
    decoder = 6 * info.layer_parameters * args.layers * tokens + \
        12 * args.layers * args.dim * args.seq_len * tokens
    tower = 6 * info.tower_parameters * patches + \
        12 * args.vision_depth * args.vision_dim * per_image * patches
    return decoder + tower, images, tokens


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu_rehearsal and not torch.cuda.is_available():
        print("gpu_bench_vision: no CUDA device: nothing to measure")
        return 0
    from meshpipe.models import hf
    from meshpipe.train.config import TrainConfig
    from meshpipe.train.data.shapes import write_shapes_corpus
    from meshpipe.train.loop.trainer import Trainer
    from meshpipe.train.run.sources import check_sources

    device = torch.device("cpu" if args.cpu_rehearsal else "cuda")
    scratch = Path(tempfile.mkdtemp(prefix="meshpipe-gpu-bench-vision-"))
    model = vision_model(args, scratch / "model")
    data = write_shapes_corpus(scratch / "shapes", args.samples, min_images=1, max_images=2,
                               sizes=((args.image, args.image),))
    config = TrainConfig(pp=1, device=device.type, model=str(model), data=str(data),
                         pack=True, seq_len=args.seq_len, microbatches=args.microbatches,
                         microbatch_size=1, dtype="bf16", steps=args.warmup + args.iters,
                         warmup_steps=1, eval_every=0, timeline_step=0, progress=False,
                         out_dir=str(scratch / "run"))
    check_sources(config)
    _one_rank_world(device)
    trainer = Trainer(config)
    steps = iter(range(config.steps))
    measured = measure(lambda: trainer.train_step(next(steps)), device, args)
    batches = [trainer.train_data.batch(step) for step in range(args.warmup, config.steps)]
    flops, images, tokens = step_flops(args, hf.inspect_model(model).vision, batches)
    peak = peak_tflops(device)
    seconds = measured["seconds"]
    row = {**measured, "images_per_s": images / seconds if seconds else None,
           "tokens_per_s": tokens / seconds if seconds else None,
           "model_tflops": flops / seconds / 1e12 if seconds else None,
           "mfu": flops / seconds / 1e12 / peak if seconds and peak else None,
           "images_per_step": images, "tokens_per_step": tokens, "gpu": gpu_state()}
    name = "CPU rehearsal" if args.cpu_rehearsal else torch.cuda.get_device_name(0)
    table = "\n".join([
        f"# Vision-language training step on {name}", "",
        f"Qwen2-VL-like, decoder {args.dim} x {args.layers}, tower {args.vision_dim} x "
        f"{args.vision_depth}, {args.image} px images, packed {args.seq_len} tokens, "
        f"{args.microbatches} microbatches, bf16, pp 1; torch {torch.__version__}.", "",
        "| step s | images/s | tokens/s | model TFLOP/s | MFU | peak GiB |",
        "|---:|---:|---:|---:|---:|---:|",
        "| " + " | ".join("-" if row[key] is None else f"{row[key]:{spec}}" for key, spec in (
            ("seconds", ".3f"), ("images_per_s", ".1f"), ("tokens_per_s", ",.0f"),
            ("model_tflops", ".1f"), ("mfu", ".1%"), ("peak_gib", ".1f"))) + " |"])
    print(table)
    out = args.out or (None if args.cpu_rehearsal else RESULTS)
    if out is not None:
        write_results(out, "gpu_bench_vision", {"args": vars(args) | {"out": str(out)},
                                                "device": name, "row": row}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
