"""meshpipe tune: the layout ranking (pure), its errors, the CLI and the measurement."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshpipe import cli
from meshpipe.schedules.ranking import (Layout, Link, MemoryBudgetError, NoLayoutError, Piece,
                                     Profile, TuneError, curve_factor, format_bytes, layouts,
                                     parse_bytes, predict, rank_layouts, stage_costs,
                                     state_bytes)
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.tune import calibrate as calibration
from meshpipe.train.tune import measure as tune_runs
from meshpipe.train.tune import profile as tune_profile
from meshpipe.train.tune import tuner

pytestmark = pytest.mark.distributed

LAYER = Piece(forward=1e-5, backward_input=1e-5, backward_weight=1e-5, backward=2e-5,
              activation_bytes=4096.0, parameters=50_000)
EDGE = Piece(forward=1e-6, backward_input=1e-6, backward_weight=1e-6, backward=2e-6,
             activation_bytes=512.0, parameters=16_000)
TINY = ["--dim", "16", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--seq-len", "16",
        "--microbatch-size", "1", "--microbatches", "2"]


def _profile(message: Link = Link(1e-4, 1e9), all_reduce: Link = Link(1e-4, 1e9)) -> Profile:
    return Profile(layers=4, heads=4, seq_len=64, embedding=EDGE, layer=LAYER, head=EDGE,
                   hidden_bytes_per_token=256.0, message=message, all_reduce=all_reduce)


def test_ranking_follows_predicted_step_time() -> None:
    # A slow all-reduce makes data parallelism lose; slow messages make pipelines lose.
    slow_reduce = rank_layouts(2, _profile(all_reduce=Link(1.0, 1e9)), global_batch=4)
    slow_messages = rank_layouts(2, _profile(message=Link(1.0, 1e9)), global_batch=4)
    assert (slow_reduce[0].layout.pp, slow_reduce[0].layout.dp) == (2, 1)
    assert (slow_messages[0].layout.pp, slow_messages[0].layout.dp) == (1, 2)
    for ranking in (slow_reduce, slow_messages):
        times = [p.step_s for p in ranking]
        assert times == sorted(times) and times[0] < times[-1]


def test_a_known_faster_layout_ranks_ahead_of_a_slower_one() -> None:
    # Same pipeline, more microbatches: a smaller bubble, so a shorter step (free links).
    free = _profile(message=Link(0.0, 1e15), all_reduce=Link(0.0, 1e15))
    ranking = [p.layout for p in rank_layouts(2, free, global_batch=8)]
    eight = Layout(pp=2, vpp=1, dp=1, cp=1, microbatches=8, microbatch_size=1, schedule="1f1b")
    two = replace(eight, microbatches=2, microbatch_size=4)
    assert predict(eight, free).step_s < predict(two, free).step_s
    assert ranking.index(eight) < ranking.index(two)


def test_a_budget_below_every_layout_names_the_smallest_that_fits() -> None:
    profile = _profile()
    peaks = [predict(layout, profile).peak_bytes for layout in layouts(4, profile, 8)]
    smallest = min(peaks)
    with pytest.raises(MemoryBudgetError) as caught:
        rank_layouts(4, profile, 8, memory_budget=smallest - 1)
    assert caught.value.smallest == smallest
    assert format_bytes(smallest) in str(caught.value) and "\n" not in str(caught.value)
    fitting = rank_layouts(4, profile, 8, memory_budget=smallest)
    assert fitting and all(p.peak_bytes <= smallest for p in fitting)
    assert len(rank_layouts(4, profile, 8, memory_budget=max(peaks))) == len(peaks)


def test_zero_levels_are_tried_where_a_stage_has_replicas_and_priced_by_memory() -> None:
    profile = _profile()
    found = layouts(4, profile, global_batch=8)
    assert {layout.zero for layout in found if layout.dp * layout.cp == 1} == {0}
    assert {layout.zero for layout in found if layout.dp * layout.cp > 1} == {0, 1, 2}
    assert state_bytes(0, 4) == 16 and state_bytes(1, 4) == 4 + 4 + 2
    assert state_bytes(2, 4) == 4 + 1 + 2
    # bf16: 2 B weights and 4 B float32 masters, shared out like the moments.
    assert state_bytes(0, 4, masters=True) == 2 + 4 + 4 + 8
    assert state_bytes(1, 4, masters=True) == 2 + 1 + 4 + 2
    plain = Layout(pp=1, vpp=1, dp=4, cp=1, microbatches=2, microbatch_size=1, schedule="none")
    peaks = [predict(replace(plain, zero=zero), profile).peak_bytes for zero in (0, 1, 2)]
    assert peaks[0] > peaks[1] > peaks[2]
    # A budget that only sharded states fit picks them.
    ranked = rank_layouts(4, profile, 8, memory_budget=peaks[1], schedules=["none"])
    assert {p.layout.zero for p in ranked if p.layout.dp == 4} == {1, 2}


def test_a_world_size_without_layouts_is_one_line() -> None:
    with pytest.raises(NoLayoutError) as caught:
        rank_layouts(7, _profile(), global_batch=8)
    message = str(caught.value)
    assert "world size 7 has no valid layout" in message and "\n" not in message
    assert "1, 2, 3, 4, 6, 8" in message


def test_layouts_respect_the_schedules_and_the_model() -> None:
    found = layouts(4, _profile(), global_batch=8)
    assert all(layout.pp * layout.dp * layout.cp == 4 for layout in found)
    assert all(layout.pp * layout.vpp <= 4 for layout in found)  # a layer per stage
    assert all(layout.vpp == 2 for layout in found if layout.schedule in ("zb-v", "dualpipe-v"))
    assert {layout.schedule for layout in found} >= {"none", "1f1b", "zb-h1", "zb-v"}


def test_the_token_curve_prices_each_size_by_its_own_cost_per_token() -> None:
    curve = ((32.0, 2.0), (64.0, 1.0), (256.0, 0.5))
    assert [curve_factor(curve, t) for t in (16, 32, 64, 128, 256, 1024)] == pytest.approx(
        [2.0, 2.0, 1.0, 0.75, 0.5, 0.5])
    assert curve_factor((), 100) == 1.0
    flat, curved = _profile(), replace(_profile(), token_curve=curve)
    small = Layout(2, 1, 1, 2, 4, 1, "1f1b")  # 32 tokens per rank
    large = replace(small, cp=1)  # 64
    for layout, factor in ((small, 2.0), (large, 1.0)):
        assert stage_costs(layout, curved, 2).forward == pytest.approx(
            tuple(factor * f for f in stage_costs(layout, flat, 2).forward))


def test_action_overhead_is_the_line_through_the_measured_sizes() -> None:
    # Two stages, F + B summed: 2 S c + r V at each size, r the curve's cost against size 2.
    c, variable = 0.001, 0.040
    relative = {1: 0.55, 2: 1.0, 4: 1.9}
    measured = replace(_fake_measurement(None, Layout(2, 1, 1, 1, 2, 2, "1f1b")),
                       forward=(0.5 * (4 * c + variable) / 2,) * 2,
                       backward=(0.5 * (4 * c + variable) / 2,) * 2,
                       sizes=tuple((size, 4 * c + r * variable) for size, r in relative.items()))
    assert calibration._action_overhead(measured, relative) == pytest.approx(c)
    # One size says nothing; noise may make it neither negative nor more than half an
    # action at the smallest size.
    assert calibration._action_overhead(replace(measured, sizes=measured.sizes[1:2]),
                                       relative) == 0.0
    assert calibration._action_overhead(
        replace(measured, sizes=((1, 0.01), (2, 0.03), (4, 0.06))), relative) == 0.0
    shrinking = replace(measured, sizes=((1, 0.02), (2, 0.019), (4, 0.018)))
    assert calibration._action_overhead(shrinking, relative) == pytest.approx(0.018 / 8)


def test_calibration_prices_each_measured_size_at_what_training_measured() -> None:
    layout = Layout(2, 1, 1, 1, 4, 2, "1f1b")  # 128 tokens per microbatch
    sizes = ((1, 0.008), (2, 0.012), (4, 0.030))  # F + B per microbatch over both stages
    measured = replace(_fake_measurement(None, layout), sizes=sizes)  # base: 2 x (2 + 4) ms
    profile = replace(_profile(), token_curve=((64.0, 1.2), (128.0, 1.0), (256.0, 0.8),
                                               (512.0, 0.7)))
    priced = calibration.calibrate(profile, measured)

    def forward_and_backward(size: int) -> float:
        costs = stage_costs(tune_runs.size_layout(layout, size), priced, 2)
        return sum(costs.forward) + sum(costs.backward)

    for size, seconds in sizes:
        assert forward_and_backward(size) == pytest.approx(seconds)
    # Beyond the sizes, the curve's shape from the nearest one.
    fixed = 4 * priced.action_overhead_s
    assert (forward_and_backward(8) - fixed) / (forward_and_backward(4) - fixed) == (
        pytest.approx(512 * 0.7 / (256 * 0.8)))


@pytest.mark.parametrize("text, size", [("2GB", 2 * 10**9), ("512MiB", 512 * 2**20),
                                        ("1000000", 10**6), ("1.5 KiB", 1536)])
def test_memory_sizes(text: str, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "1XB", "-3MB", "0"])
def test_bad_memory_sizes(text: str) -> None:
    with pytest.raises(TuneError):
        parse_bytes(text)


@pytest.mark.parametrize("extra, expected", [
    (["--world-size", "7"], "has no valid layout"),
    (["--world-size", "2", "--memory-budget", "1KB"], "the smallest budget that fits is"),
    (["--world-size", "2", "--memory-budget", "lots"], "cannot read 'lots'"),
    (["--world-size", "2", "--pp", "2"], "tune chooses the layout: drop --pp"),
    (["--world-size", "0"], "expected a number >= 1"),
])
def test_cli_bad_input_is_one_line(extra: list[str], expected: str, capsys) -> None:
    assert cli.main(["tune", *TINY, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert expected in captured.err and captured.err.count("\n") == 1


def _fake_measurement(config: TrainConfig, layout: Layout, sizes: list[int] = (),
                      cores: float | None = None, ulysses: dict[int, list[int]] | None = None
                      ) -> tune_runs.Measurement:
    stages = layout.pp * layout.vpp
    return tune_runs.Measurement(layout=layout, forward=(0.002,) * stages,
                                  backward=(0.004,) * stages,
                                  backward_input=(0.002,) * stages,
                                  backward_weight=(0.003,) * stages,
                                  sizes=((layout.microbatch_size, 0.006 * stages),),
                                  pipeline_s=0.03, step_s=0.05, message_s=4e-4,
                                  message=Link(2e-4, 1e9),
                                  all_reduce=Link(5e-4, 1e9), optimizer_s_per_parameter=1e-8)


def test_cli_prints_the_table_and_writes_a_config_train_reads(tmp_path, monkeypatch,
                                                              capsys) -> None:
    monkeypatch.setattr(tuner, "measure", _fake_measurement)
    # The layer's cost per token is timed on this machine: fixed, so that the CLI's ranking
    # and the one recomputed below agree where two layouts are close (they differed once
    # under load: combined-1f1b against gpipe).
    monkeypatch.setattr(tuner, "layer_curve", lambda config, counts, device=None: tuple(
        (float(tokens), 1e-6) for tokens in counts))
    path = tmp_path / "run.toml"
    argv = ["tune", *TINY, "--steps", "7", "--world-size", "4", "--top", "3",
            "--memory-budget", "64MiB", "--write", str(path)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + 3  # header, rule, three layouts
    best = rows[2].split("|")
    result = tuner.tune(cli.train_config_from_arguments(
        cli._parser().parse_args(["train", *TINY, "--steps", "7"])), 4, 64 * 2**20)
    expected = tune_runs.config_for(result.predictions[0].layout, TrainConfig(
        dim=16, layers=2, heads=2, kv_heads=1, seq_len=16, microbatch_size=1, microbatches=2,
        steps=7))
    assert best[9].strip() == expected.schedule and best[6].strip() == str(expected.zero)
    train_args = cli._parser().parse_args(["train", "--config", str(path)])
    assert cli.train_config_from_arguments(train_args) == expected
    assert expected.world_size == 4


def test_in_process_timings_take_the_functions_in_turn(monkeypatch) -> None:
    """A slow spell of the machine spoils one turn of a function, not all its calls (the
    layer curve is the fastest call per size, relative to one size: one spoilt size once
    scaled every prediction by a third)."""
    clock, calls = [0.0], []

    def run(name: str, seconds: float, slow_calls: int = 0):
        def call() -> None:
            calls.append(name)
            clock[0] += 5 * seconds if calls.count(name) <= slow_calls else seconds
        return call

    monkeypatch.setattr(tune_profile, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    per_turn = 1 + tune_profile.CALLS_PER_TURN
    times = tune_profile._seconds_in_turn(
        {"spoilt": run("spoilt", 1.0, slow_calls=per_turn), "steady": run("steady", 2.0)},
        torch.device("cpu"))
    assert calls[:2 * per_turn] == ["spoilt"] * per_turn + ["steady"] * per_turn
    assert len(calls) == 2 * per_turn * tune_profile.TURNS
    assert times["spoilt"][:tune_profile.CALLS_PER_TURN] == [5.0] * tune_profile.CALLS_PER_TURN
    assert min(times["spoilt"]) == 1.0 and set(times["steady"]) == {2.0}


def test_cpu_ranks_share_the_machine_also_under_torchrun(monkeypatch) -> None:
    """torchrun's CPU processes on one machine share its cores as local ones do; ranks on
    GPUs compute apart."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tuner._shared_cores() == os.cpu_count()
    monkeypatch.setattr(tuner, "device_for_this_rank", lambda: torch.device("cuda", 0))
    assert tuner._shared_cores() is None


@pytest.mark.slow
def test_one_process_is_measured_without_messages() -> None:
    """With one rank the measuring run sends nothing (a ping-pong to a rank that does not
    exist crashed the process): the message link is free, the rest is measured."""
    config = TrainConfig(dim=16, layers=2, heads=2, kv_heads=1, seq_len=16, microbatch_size=2,
                         microbatches=2)
    result = tuner.tune(config, 1, None)
    measured = result.measurement
    assert (measured.layout.pp, measured.layout.dp, measured.layout.schedule) == (1, 1, "none")
    assert measured.message == tune_profile.UNMEASURED_LINK
    assert measured.step_s >= measured.pipeline_s > 0 and min(measured.forward) > 0
    assert result.predictions and all(p.layout.pp == 1 for p in result.predictions)


@pytest.mark.slow
def test_under_torchrun_every_rank_measures_and_rank_0_reports(tmp_path) -> None:
    """torchrun runs the command on every rank: each gets the measurement (each its own
    result file), and only rank 0 prints the table and writes the config."""
    path = tmp_path / "run.toml"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "-m", "meshpipe", "tune", *TINY, "--world-size", "2", "--top", "2",
         "--write", str(path)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("| rank | pp |") == 1, done.stdout
    assert done.stdout.count(f"wrote {path}") == 1
    config = cli.train_config_from_arguments(cli._parser().parse_args(
        ["train", "--config", str(path)]))
    assert config.world_size == 2


@pytest.mark.slow
def test_a_failed_measuring_run_is_one_line_naming_the_rank_and_its_kept_log(
        monkeypatch, capsys) -> None:
    monkeypatch.setenv("MESHPIPE_FAULT", "kind=raise,at=forward,rank=1,step=1")
    assert cli.main(["tune", *TINY, "--world-size", "2"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("meshpipe: the measuring run failed: rank 1 failed at step 1")
    assert error.count("\n") == 1
    log = Path(re.search(r"(\S+rank-1\.log)", error).group(1))
    assert "injected fault at forward of step 1" in log.read_text()
    shutil.rmtree(log.parent)


def _measure_body(rank: int, world_size: int, phases: list[list[TrainConfig]], path: str,
                  ulysses: dict[int, list[int]]) -> None:
    tune_runs._measure_on_this_rank(phases, path, ulysses)


def test_measurement_on_processes_prices_the_profile(tmp_path) -> None:
    config = TrainConfig(dim=16, layers=2, heads=2, kv_heads=1, seq_len=16, microbatch_size=2,
                         microbatches=2, timeline_step=0)
    profile = tune_profile.model_profile(config)
    assert not profile.masters
    assert tune_profile.model_profile(replace(config, dtype="bf16")).masters
    layout = tune_runs.base_layout(2, profile, 4, 2)
    assert (layout.pp, layout.schedule) == (2, "1f1b")
    sizes = tune_runs.measured_sizes(rank_layouts(2, profile, 4), layout, profile)
    assert sizes == [1, 2, 4]
    phases = tune_runs.run_configs(config, layout, sizes, steps=3)
    assert [[(c.schedule, c.microbatches, c.microbatch_size) for c in configs]
            for configs in phases] == [[("1f1b", 2, 2), ("zb-h1", 2, 2)],
                                       [("1f1b", 4, 1), ("1f1b", 2, 2), ("1f1b", 1, 4)]]
    ulysses = tune_profile.ulysses_sizes(profile, 2, 4)
    assert ulysses == {2: [1, 4]}  # cp 2 x 1 to 4 microbatches of 4 to 1 sequences
    path = tmp_path / "measured.json"
    run_distributed(2, _measure_body, phases, str(path), ulysses)
    measurement = tune_runs._measurement(layout, json.loads(path.read_text()), sizes)
    ((cp, overhead),) = measurement.ulysses
    assert cp == 2 and overhead.latency >= 0 and overhead.bytes_per_s > 0
    assert min(measurement.forward + measurement.backward + measurement.backward_weight) > 0
    assert [size for size, _ in measurement.sizes] == sizes
    # The size runs give ratios; the base run (fewer runs beside it) the level.
    assert dict(measurement.sizes)[2] == pytest.approx(
        sum(measurement.forward) + sum(measurement.backward))
    assert min(seconds for _, seconds in measurement.sizes) > 0
    assert measurement.step_s >= measurement.pipeline_s > 0
    assert measurement.message_s is not None  # stage 1's first forward waits for stage 0's
    priced = calibration.calibrate(profile, measurement, cores=2)
    predicted = predict(layout, priced)
    assert predicted.step_s == pytest.approx(measurement.step_s, rel=0.01) or (
        priced.step_overhead_s == 0 and predicted.step_s > measurement.step_s)
    assert profile.layer.activation_bytes > 0 and profile.layer.parameters > 0
    assert priced.ulysses == measurement.ulysses


def test_a_bf16_run_is_profiled_in_bf16() -> None:
    """The activations a layer saves and the messages between stages are measured in the
    run's precision: bfloat16 weights and hidden states halve the messages, and a layer
    of this model saves 0.6 of its float32 bytes (RoPE computes in float32 inside)."""
    config = TrainConfig(dim=32, layers=2, heads=2, kv_heads=1, seq_len=32, microbatch_size=2)
    fp32 = tune_profile.model_profile(config, torch.device("cpu"))
    bf16 = tune_profile.model_profile(replace(config, dtype="bf16"), torch.device("cpu"))
    assert (fp32.hidden_bytes_per_token, bf16.hidden_bytes_per_token) == (4.0 * 32, 2.0 * 32)
    assert 0.4 < bf16.layer.activation_bytes / fp32.layer.activation_bytes < 0.7
    assert bf16.layer.parameters == fp32.layer.parameters
    layer = tune_profile.timed_layer(replace(config, dtype="bf16"), torch.device("cpu"))
    assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}
    ((_, per_token),) = tune_profile.layer_curve(replace(config, dtype="bf16"), [64],
                                                 torch.device("cpu"))
    assert per_token > 0


def test_measured_ulysses_overhead_prices_context_parallel_layers() -> None:
    layout = Layout(1, 1, 1, 2, 2, 2, "none")  # cp 2: 64 tokens of 256 bytes per rank
    estimated = stage_costs(layout, _profile(), 1).a2a[0]
    assert estimated > 0  # no measurement: the message-based estimate
    overhead = Link(latency=1e-3, bytes_per_s=1e6)
    measured = replace(_profile(), ulysses=((2, overhead),))
    # Half of a layer's overhead in each pass, four layers on the one stage.
    assert stage_costs(layout, measured, 1).a2a[0] == pytest.approx(
        4 * overhead.seconds(256.0 * 64) / 2)
    costlier = replace(_profile(), ulysses=((2, Link(5e-3, 1e6)),))
    assert predict(layout, costlier).step_s > predict(layout, measured).step_s
    # A cp size without a measurement keeps the estimate.
    four = Layout(1, 1, 1, 4, 2, 2, "none")
    assert stage_costs(four, measured, 1).a2a == stage_costs(four, _profile(), 1).a2a


def test_ulysses_overhead_is_a_line_in_bytes_priced_as_if_alone() -> None:
    times = [(2, 1000.0, 0.005, 0.002), (2, 3000.0, 0.009, 0.004),  # overheads 3 and 5 ms
             (4, 1000.0, 0.010, 0.002), (4, 3000.0, 0.012, 0.002)]  # 8 and 10 ms on 4 ranks
    links = dict(tune_runs._ulysses_links(times, cores=2))
    assert links[2].seconds(1000.0) == pytest.approx(0.003)
    assert links[2].seconds(3000.0) == pytest.approx(0.005)
    assert links[2].latency == pytest.approx(0.002)
    # Four ranks on two cores ran at half speed: alone, half the time.
    assert links[4].seconds(1000.0) == pytest.approx(0.004)
    assert links[4].seconds(3000.0) == pytest.approx(0.005)
    # Noise: an overhead that shrinks with size, or a negative one, is flat and not below 0.
    flat = dict(tune_runs._ulysses_links([(2, 1000.0, 0.006, 0.002),
                                           (2, 3000.0, 0.001, 0.002)], cores=None))[2]
    assert flat.seconds(0.0) == pytest.approx(0.002) == flat.seconds(1e6)


def test_fused_and_split_backwards_are_priced_apart() -> None:
    profile = replace(_profile(), layer=replace(LAYER, backward=5e-5))  # B > I + W
    fused = stage_costs(Layout(2, 1, 1, 1, 4, 1, "1f1b"), profile, 2)
    split = stage_costs(Layout(2, 1, 1, 1, 4, 1, "zb-h1"), profile, 2)
    assert fused.backward[1] > split.backward[1]
    assert split.backward_input[0] == 0.0  # stage 0's input is token ids


def test_a_split_backward_is_priced_with_the_gradients_it_holds_from_i_to_w() -> None:
    holding = replace(_profile(), layer=replace(LAYER, held_for_weights=1000.0),
                      head=replace(EDGE, held_for_weights=100.0))
    split = Layout(2, 1, 1, 1, 4, 1, "zb-h1")
    assert stage_costs(split, holding, 2).held_for_weights == (0.0, (2 * 1000 + 100) * 64)
    assert predict(split, holding).peak_bytes > predict(split, _profile()).peak_bytes
    fused = replace(split, schedule="1f1b")
    assert stage_costs(fused, holding, 2).held_for_weights is None
    assert predict(fused, holding).peak_bytes == predict(fused, _profile()).peak_bytes


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_profile_measures_the_gradients_a_split_backward_holds(recompute) -> None:
    """What I captures for W: the gradient at the output of each weight product (float32,
    per token): a layer's q, k, v, o, gate, up and down and its two norms' scales; the head's
    norm scale and logits. Recomputation does not change it; the embedding holds none."""
    config = TrainConfig(dim=32, layers=2, heads=2, kv_heads=1, seq_len=32, microbatch_size=2,
                         recompute=recompute)
    profile = tune_profile.model_profile(config, torch.device("cpu"))
    dim, kv_dim, ffn = 32, 16, 96  # one key/value head of 16
    assert profile.layer.held_for_weights == 4 * (dim + 2 * kv_dim + dim + 2 * ffn + dim
                                                  + 2 * dim)
    assert profile.head.held_for_weights == 4 * (32 + 256)
    assert profile.embedding.held_for_weights == 0.0


def test_contention_slows_layouts_that_keep_more_ranks_busy() -> None:
    alone = _profile(message=Link(0.0, 1e15))
    shared = replace(alone, cores=2)
    busy = Layout(1, 1, 4, 1, 2, 1, "none")  # no bubble: 4 ranks busy on 2 cores
    assert predict(busy, shared).pipeline_s == pytest.approx(
        2 * predict(busy, alone).pipeline_s)
    # One microbatch through two stages, two replicas: never more than two ranks busy.
    turns = Layout(2, 1, 2, 1, 1, 2, "1f1b")
    assert predict(turns, shared).pipeline_s == pytest.approx(predict(turns, alone).pipeline_s)


def test_measured_actions_are_priced_as_if_they_ran_alone() -> None:
    records = {0: [("0F0", 0.0, 2.0)], 1: [("1F0", 0.0, 2.0), ("1B0", 2.0, 3.0)]}
    alone = tune_runs._alone(records, cores=1)
    assert alone == {0: [("0F0", 0.0, 1.0)], 1: [("1F0", 0.0, 1.0), ("1B0", 2.0, 3.0)]}
