"""Does a vision-language model trained by meshpipe use the pictures? A tiny random Qwen2-VL
learns the captions of the shapes corpus (``meshpipe.train.data.shapes``: coloured shapes,
0-3 pictures a sample, several sizes), and the same model on the same captions with blank
grey pictures is the control: the colour and shape words can only come from the images.

    python benchmarks/vision_learning.py [--steps 800] [--pp 2]

Prints and records (results/vision_learning.{md,json}) each run's mean training loss over
its last 20 steps and its validation loss at the end. Nothing is downloaded: the model,
tokenizer and image processor are built as the tests build them (tests/hf_models.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from hf_models import save_tiny_vision_model  # noqa: E402
from meshpipe.train.data.shapes import write_shapes_corpus  # noqa: E402


def train(model: Path, data: Path, out: Path, args) -> list[dict]:
    command = [sys.executable, "-m", "meshpipe", "train", "--model", str(model), "--data",
               str(data), "--steps", str(args.steps), "--seq-len", "64", "--microbatches",
               "2", "--microbatch-size", "4", "--lr", str(args.lr), "--pp", str(args.pp),
               "--eval-every", str(args.steps), "--timeline-step", "0", "--no-progress",
               "--out-dir", str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict]) -> dict:
    losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {"train_loss_last_20": sum(losses[-20:]) / len(losses[-20:]),
            "val_loss": val[-1] if val else None, "steps": len(losses)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshpipe-vision-"))
    model = save_tiny_vision_model(work / "model", "qwen2_vl")
    results = {}
    for name, blank in (("images", False), ("blank images (control)", True)):
        data = write_shapes_corpus(work / name.split()[0], args.samples, seed=0, blank=blank)
        results[name] = summary(train(model, data, work / f"run-{blank}", args))
    lines = ["| pictures | train loss (last 20 steps) | validation loss |", "| --- | --- | --- |"]
    lines += [f"| {name} | {r['train_loss_last_20']:.3f} | {r['val_loss']:.3f} |"
              for name, r in results.items()]
    table = "\n".join(lines)
    print(table)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "vision_learning.json").write_text(json.dumps(
            {"args": vars(args), "results": results}, indent=1))
        (RESULTS / "vision_learning.md").write_text(
            f"# Captions learned from the pictures\n\n`python benchmarks/vision_learning.py "
            f"--steps {args.steps} --samples {args.samples} --pp {args.pp}` (2 CPU cores, "
            f"gloo): a tiny random Qwen2-VL on the shapes corpus, and the same captions with "
            f"blank pictures.\n\n{table}\n")


if __name__ == "__main__":
    main()
