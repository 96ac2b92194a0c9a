"""``meshpipe plan``'s search (``schedules.planner``): the pruned search finds what predicting
every layout finds, simulations are those of the schedules themselves, and requests that
nothing answers are one line."""

from dataclasses import replace

import pytest

from meshpipe.schedules.builders import build
from meshpipe.schedules.cluster import CLUSTERS, GIB
from meshpipe.schedules.model_shape import ModelShape
from meshpipe.schedules.plan_space import PlanRequest, layouts
from meshpipe.schedules.planner import PlanError, fit_efficiency, plan, predict
from meshpipe.schedules.ranking import state_bytes
from meshpipe.schedules.scale import ScaleLayout
from meshpipe.schedules.simulator import simulate

SMALL = ModelShape("small", 8, 1024, 4096, 8, 4, 128, 32000)
MOE = ModelShape("moe", 8, 1024, 4096, 8, 8, 128, 32000, experts=8, top_k=2,
                 moe_ffn_hidden=1024, moe_layers=8)
H100 = CLUSTERS["h100"]


def request(model=SMALL, gpus=16, **changes) -> PlanRequest:
    base = PlanRequest(model, H100, gpus, seq_len=2048, global_batch=32,
                       microbatch_sizes=(1, 2), recompute=("none", "full"))
    return replace(base, **changes)


@pytest.mark.parametrize("model, sizes", [
    (SMALL, dict(gpus=8, global_batch=16, microbatch_sizes=(1,), zero=(0, 1))),
    (SMALL, dict(gpus=4, global_batch=32, microbatch_sizes=(2,), zero=(0,),
                 recompute=("none", "full"))),
    (MOE, dict(gpus=8, global_batch=16, microbatch_sizes=(1,), zero=(0, 1)))],
    ids=["dense", "dense-many-microbatches", "moe"])
def test_the_pruned_search_finds_the_best_of_every_layout(model, sizes):
    asked = request(model, **{"recompute": ("none",), **sizes})
    found = plan(asked, top=5)
    every = [p for p in (predict_or_none(asked, layout) for layout in layouts(asked))
             if p is not None and p.memory_bytes <= H100.memory_bytes]
    every.sort(key=lambda p: (p.step_s, p.memory_bytes))
    assert [p.step_s for p in found.predictions] == pytest.approx(
        [p.step_s for p in every[:5]])
    assert found.simulated < len(every) / 4  # most layouts never reached the simulator
    assert found.layouts == sum(1 for _ in layouts(asked))


def predict_or_none(asked, layout):
    try:
        return predict(asked, layout)
    except PlanError:
        return None


def test_expert_models_search_expert_parallelism_and_combined_1f1b():
    searched = list(layouts(request(MOE)))
    assert {layout.ep for layout in searched} == {1, 2, 4, 8}
    assert "combined-1f1b" in {layout.schedule for layout in searched}
    assert "combined-1f1b" not in {layout.schedule for layout in layouts(request())}
    assert all(8 % layout.ep == 0 and (layout.dp * layout.cp) % layout.ep == 0
               for layout in searched)


def test_layouts_keep_tp_inside_a_node_and_dividing_the_heads():
    searched = list(layouts(request(gpus=64)))
    assert {layout.tp for layout in searched} == {1, 2, 4}  # 4 kv heads
    wider = list(layouts(request(replace(SMALL, kv_heads=8), gpus=64)))
    assert {layout.tp for layout in wider} == {1, 2, 4, 8}  # 8 GPUs a node
    assert all(layout.gpus == 64 and 32 % layout.dp == 0 for layout in searched)
    ulysses = {layout.cp for layout in searched if layout.cp_kind == "ulysses"}
    assert ulysses
    assert not any(layout.cp_kind == "ulysses" and (8 // layout.tp) % layout.cp
                   for layout in searched)


def test_the_bubble_is_the_simulated_schedules_own():
    layout = ScaleLayout(tp=2, pp=4, vpp=2, cp=1, dp=2, microbatch_size=1, microbatches=16,
                         schedule="interleaved")
    predicted = predict(request(), layout)
    unit_costs = simulate(build("interleaved", 4, 16, stages_per_rank=2))
    assert 0 < predicted.bubble < 0.5
    # longer stages at the end (the head) and messages make its bubble differ from unit costs
    assert predicted.bubble != pytest.approx(unit_costs.bubble_ratio, abs=1e-6)
    assert predicted.pipeline_s <= predicted.step_s


def test_memory_counts_the_state_at_the_zero_level_and_the_live_activations():
    layout = ScaleLayout(tp=1, pp=1, vpp=1, cp=1, dp=16, microbatch_size=1, microbatches=2,
                         schedule="none")
    zero0, zero1 = (predict(request(), replace(layout, zero=zero)) for zero in (0, 1))
    saved = zero0.memory_bytes - zero1.memory_bytes
    parameters = SMALL.parameters()
    assert saved == pytest.approx(parameters * (state_bytes(0, 16, True)
                                                - state_bytes(1, 16, True)), rel=1e-6)
    assert zero0.memory_bytes > parameters * state_bytes(0, 16, True) + H100.reserved_bytes


def test_a_model_too_large_for_every_layout_is_one_line():
    huge = ModelShape("huge", 8, 65536, 262144, 64, 8, 1024, 32000)
    with pytest.raises(PlanError, match="huge .* fits no layout of 8 h100 GPUs .* the smallest "
                                        "layout needs .*GiB: give more --gpus") as raised:
        plan(request(huge, gpus=8))
    assert "\n" not in str(raised.value)


def test_a_gpu_count_without_layouts_is_one_line():
    with pytest.raises(PlanError, match="no layout of 7 GPUs .* tp x cp x pp x dp must equal"):
        plan(request(replace(SMALL, layers=4), gpus=7, global_batch=4))


def test_the_published_style_layout_is_priced_with_the_heads_and_embeddings_stages():
    layout = ScaleLayout(tp=2, pp=2, vpp=1, cp=1, dp=4, microbatch_size=1, microbatches=8,
                         schedule="1f1b")
    predicted = predict(request(), layout)
    assert 0 < predicted.mfu < 1
    assert predicted.tflops_per_gpu == pytest.approx(predicted.mfu * H100.peak_flops / 1e12)
    assert predicted.memory_bytes < 80 * GIB


@pytest.mark.parametrize("slower", [1.3, 1.1])
def test_a_fitted_efficiency_predicts_the_measured_step(slower):
    asked = request(gpus=1, global_batch=8)
    layout = ScaleLayout(tp=1, pp=1, vpp=1, cp=1, dp=1, microbatch_size=2, microbatches=4,
                         schedule="none")
    measured = slower * predict(asked, layout).step_s
    efficiency, factor = fit_efficiency(asked, layout, measured)
    assert predict(replace(asked, efficiency=efficiency), layout).step_s == pytest.approx(
        measured, rel=1e-6)
    assert factor < 1
    assert efficiency.matmul == pytest.approx(asked.efficiency.matmul * factor)


def test_a_step_faster_than_any_efficiency_makes_it_stops_at_the_whole_peak():
    asked = request(gpus=1, global_batch=8)
    layout = ScaleLayout(tp=1, pp=1, vpp=1, cp=1, dp=1, microbatch_size=2, microbatches=4,
                         schedule="none")
    efficiency, _ = fit_efficiency(asked, layout, predict(asked, layout).step_s / 100)
    assert max(efficiency.matmul, efficiency.memory) == pytest.approx(1.0)


def test_an_overlap_hides_each_all_to_all_only_behind_the_other_microbatchs_layer():
    from meshpipe.schedules.planner import _unhidden_all_to_all
    from meshpipe.schedules.scale import LayerCosts

    short = LayerCosts(forward=1.0, backward_input=1.0, backward_weight=1.0, exposed_comm=0.0,
                       a2a=0.5, activation_bytes=0.0)
    assert _unhidden_all_to_all(short) == 0.0
    # 3 s of all-to-all: 1 s shows behind the 2 s backward, 2 s behind the 1 s forward
    assert _unhidden_all_to_all(replace(short, a2a=3.0)) == pytest.approx(3.0)


def test_combined_1f1b_is_priced_with_what_its_overlaps_leave_unhidden(monkeypatch):
    import meshpipe.schedules.planner as planner

    slow_network = replace(H100, gpus_per_node=2, network=replace(H100.network,
                                                                  bytes_per_s=10e9))
    asked = request(MOE, gpus=8, global_batch=16, cluster=slow_network)
    layout = ScaleLayout(tp=1, pp=2, vpp=2, cp=1, dp=4, microbatch_size=1, microbatches=8,
                         schedule="combined-1f1b", ep=4)
    priced = predict(asked, layout)
    monkeypatch.setattr(planner, "_unhidden_all_to_all", lambda layer: 0.0)
    perfect = predict(asked, layout)
    waiting = predict(asked, replace(layout, schedule="interleaved"))
    assert perfect.step_s < priced.step_s < waiting.step_s
    assert perfect.exposed_comm_s < priced.exposed_comm_s
