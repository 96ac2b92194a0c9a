"""benchmarks/gpu_check.py without running a layout: every layout parses and names only inputs
the check makes, the Gemma 3 checkpoint it makes slides a window shorter than its layout's
sequences, and the closing line compares --zero 1 and 2 with --zero 0."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_check  # noqa: E402

KNOWN_INPUTS = {*gpu_check.DECODERS, *gpu_check.VISION_MODELS, "shapes"}


def test_every_layout_parses_and_names_only_inputs_the_check_makes():
    for layout in gpu_check.LAYOUTS:
        assert layout.ranks >= 1, layout.name
        assert gpu_check.placeholders(layout.args) <= KNOWN_INPUTS, layout.name
    used = set().union(*(gpu_check.placeholders(layout.args) for layout in gpu_check.LAYOUTS))
    assert used == KNOWN_INPUTS


def test_the_zero_layouts_differ_only_in_their_level():
    layouts = {layout.name: layout for layout in gpu_check.LAYOUTS}
    args = [layouts[name].args for name in gpu_check.ZERO_LAYOUTS.values()]
    levels = [a.index("--zero") for a in args]
    assert [a[i + 1] for a, i in zip(args, levels)] == ["0", "1", "2"]
    assert len({a[:i] + a[i + 2:] for a, i in zip(args, levels)}) == 1
    assert {layouts[name].ranks for name in gpu_check.ZERO_LAYOUTS.values()} == {2}


def test_the_gemma3_checkpoint_slides_a_window_shorter_than_the_layouts_sequences(
        tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda **options: str(tmp_path))
    gpu_check.made_input.cache_clear()
    layout = next(layout for layout in gpu_check.LAYOUTS if "{gemma3}" in layout.args)
    args = gpu_check._filled(layout.args)
    gpu_check.made_input.cache_clear()
    config = json.loads((Path(args[args.index("--model") + 1]) / "config.json").read_text())
    assert config["sliding_window"] < int(args[args.index("--seq-len") + 1])
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}


def _records(bytes_per_rank: list[int], on_cuda: bool) -> list[dict]:
    """``metrics.json``'s ``memory`` (``train.outputs.memory``)."""
    return [{"rank": rank, "optimizer_state_allocator_bytes": size if on_cuda else None,
             "optimizer_state_bytes": size - 64, "peak_allocated_bytes": None}
            for rank, size in enumerate(bytes_per_rank)]


def test_the_closing_line_compares_each_ranks_state_with_zero_0():
    mib = 2**20
    rows = [{"layout": name, "how": "shared",
             "memory": _records([size, size], on_cuda=True)}
            for name, size in zip(gpu_check.ZERO_LAYOUTS.values(), (4 * mib, 2 * mib, 2 * mib))]
    assert gpu_check.optimizer_state_comparison(rows, gpu_check.HOW) == [
        "", "Optimizer state per rank at dp 2, bf16 (gloo, ranks share the GPU(s); read from "
            "the allocator): --zero 0 4.000 / 4.000 MiB; --zero 1 2.000 / 2.000 MiB (0.50x); "
            "--zero 2 2.000 / 2.000 MiB (0.50x)."]
    rows[1]["memory"] = _records([2 * mib + 64, mib + 64], on_cuda=False)
    assert ("read from the allocator and state tensors): --zero 0 4.000 / 4.000 MiB; "
            "--zero 1 2.000 / 1.000 MiB (0.50x);") in \
        gpu_check.optimizer_state_comparison(rows, gpu_check.HOW)[1]
    assert gpu_check.optimizer_state_comparison(rows[:2], gpu_check.HOW) == []
