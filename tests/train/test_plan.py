"""``meshpipe plan`` on the command line: the table, ``--write``'s TOML that ``meshpipe
train`` reads (and, scaled down to CPU processes, trains with ``--check``), one-line errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from meshpipe import cli
from meshpipe.schedules.cluster import CLUSTERS
from meshpipe.schedules.plan_space import PlanRequest
from meshpipe.schedules.planner import plan
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.tune.planning import config_for_layout, model_shape

from trainer_cases import check_first_step

LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096,
                "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
                "vocab_size": 32000, "tie_word_embeddings": False}


@pytest.fixture
def config_only(tmp_path):
    """A model directory holding only its config.json (no weights: plan reads none)."""
    directory = tmp_path / "llama"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    return directory


def _rows(printed: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("|")[1:-1]]
            for line in printed.splitlines() if line.startswith("| ")][2:]


def test_plan_prints_the_ranked_layouts_and_writes_a_config_train_reads(config_only, tmp_path,
                                                                        capsys):
    path = tmp_path / "run.toml"
    argv = ["plan", "--model", str(config_only), "--seq-len", "4096", "--global-batch", "64",
            "--gpus", "16", "--cluster", "h100", "--top", "3", "--write", str(path)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "llama: 0." in printed and "16 GPUs of h100" in printed
    rows = _rows(printed)
    assert len(rows) == 3 and [row[0] for row in rows] == ["1", "2", "3"]
    steps = [float(row[12]) for row in rows]
    assert steps == sorted(steps)
    given = TrainConfig(model=str(config_only), seq_len=4096)
    best = plan(PlanRequest(model_shape(given), CLUSTERS["h100"], 16, 4096, 64), 1)
    expected = config_for_layout(best.predictions[0].layout, given)
    read = cli.train_config_from_arguments(cli._parser().parse_args(
        ["train", "--config", str(path)]))
    assert read == expected and read.world_size == 16 and read.dtype == "bf16" and read.compile
    assert read.dp * read.microbatches * read.microbatch_size == 64


@pytest.mark.parametrize("extra, expected", [
    (["--pp", "2"], "plan chooses the layout: drop --pp"),
    (["--cluster", "tpu"], "unknown cluster 'tpu'"),
    (["--gpus", "9"], "no layout of 9 GPUs"),
])
def test_plan_bad_input_is_one_line(config_only, capsys, extra, expected):
    argv = ["plan", "--model", str(config_only), "--seq-len", "4096", "--global-batch", "64",
            "--gpus", "16", *extra]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert expected in error and error.count("\n") == 1


def test_a_model_directory_without_its_config_is_one_line(tmp_path, capsys):
    assert cli.main(["plan", "--model", str(tmp_path), "--gpus", "8",
                     "--global-batch", "8"]) == 2
    assert "config.json: no such file" in capsys.readouterr().err


@pytest.mark.distributed
def test_the_plans_pick_for_a_small_cluster_trains_with_check(tmp_path, capsys):
    """Scaled down: the reference transformer on a cluster of 4 GPUs, each with little
    memory, planned; the written layout runs one step on 4 CPU processes with --check."""
    cluster = tmp_path / "tiny.toml"
    cluster.write_text('[cluster]\nbase = "h100"\ngpus_per_node = 2\nmemory_gib = 1\n'
                       'reserved_gib = 0.5\n')
    path = tmp_path / "run.toml"
    assert cli.main(["plan", "--dim", "32", "--layers", "4", "--heads", "4", "--kv-heads", "2",
                     "--seq-len", "32", "--global-batch", "8", "--gpus", "4", "--cluster",
                     str(cluster), "--top", "1", "--write", str(path)]) == 0
    assert "tiny" in capsys.readouterr().out
    planned = cli.train_config_from_arguments(cli._parser().parse_args(
        ["train", "--config", str(path), "--steps", "1", "--check", "--device", "cpu",
         "--out-dir", str(tmp_path / "out")]))
    config = replace(planned, compile=False)  # compiling costs a CPU test minutes
    assert config.world_size == 4
    report = run_distributed(4, check_first_step, config)[0]
    assert report["passed"], report


def _gpu_bench_json(path, seconds, sizes=True):
    """A run of ``gpu_bench.py`` whose compiled step took ``seconds``, followed by a row of
    the same step with another flag (which ``--efficiency-from`` must not fit)."""
    rows = []
    for runner, row_seconds in (("--compile", seconds), ("--compile --chunk-graphs off", 60)):
        row = {"part": "train step", "runner": f"meshpipe Trainer (1F1B, 1 stage) {runner}",
               "status": "ok", "seconds": row_seconds}
        if sizes:
            row["model"] = {"dim": 256, "layers": 4, "heads": 4, "kv_heads": 2, "vocab": 256,
                            "seq_len": 512, "microbatches": 4, "microbatch_size": 2}
        rows.append(row)
    path.write_text(json.dumps({"runs": [{"result": {"device": "a GPU", "train": rows}}]}))
    return path


def test_the_efficiency_is_fitted_to_a_measured_gpu_step(config_only, tmp_path, capsys):
    argv = ["plan", "--model", str(config_only), "--seq-len", "4096", "--global-batch", "64",
            "--gpus", "16", "--top", "1"]
    assert cli.main(argv) == 0
    default_step = float(_rows(capsys.readouterr().out)[0][12])
    measured = _gpu_bench_json(tmp_path / "gpu_bench.json", seconds=0.5)
    assert cli.main([*argv, "--efficiency-from", str(measured)]) == 0
    printed = capsys.readouterr().out
    assert "step (a GPU): measured 500.0 ms" in printed and "scaled by 0." in printed
    assert float(_rows(printed)[0][12]) > default_step  # a slower GPU than the curve's


def test_a_gpu_bench_file_without_the_models_sizes_is_one_line(config_only, tmp_path, capsys):
    old = _gpu_bench_json(tmp_path / "old.json", seconds=0.5, sizes=False)
    assert cli.main(["plan", "--model", str(config_only), "--gpus", "8", "--global-batch", "8",
                     "--efficiency-from", str(old)]) == 2
    error = capsys.readouterr().err
    assert "no compiled meshpipe training step with its model's sizes" in error
    assert error.count("\n") == 1


def test_experts_with_tensor_parallelism_are_runnable_layouts_the_planner_may_pick():
    """meshpipe splits each expert's width over tp: a MoE layout at tp 2 (with the sequence
    parallelism plan's runs use) is one ``meshpipe train`` runs."""
    from meshpipe.schedules.scale import ScaleLayout
    from meshpipe.train.tune.planning import runnable_by_meshpipe

    config = TrainConfig(dim=256, layers=4, heads=8, kv_heads=4, moe_experts=8, moe_top_k=2,
                         seq_len=1024)
    runnable = runnable_by_meshpipe(config, model_shape(config))
    assert runnable(ScaleLayout(tp=2, pp=2, vpp=1, cp=1, dp=2, ep=2, microbatch_size=1,
                                microbatches=4, schedule="1f1b"))
    assert not runnable(ScaleLayout(tp=3, pp=1, vpp=1, cp=1, dp=2, ep=2, microbatch_size=1,
                                    microbatches=4, schedule="1f1b"))  # 8 heads over 3
