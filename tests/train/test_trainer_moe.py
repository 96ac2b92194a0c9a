"""Mixture of experts in training: every layout's first step equals one process; metrics,
checkpoints and bad flags."""

import pytest

from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig

from trainer_cases import SMALL, check_first_step, train

pytestmark = pytest.mark.distributed

MOE = dict(SMALL, moe_experts=4)
LAYOUTS = {
    "pp2-vpp2-no-ep-interleaved": dict(pp=2, vpp=2, schedule="interleaved"),
    "dp2-ep2-combined": dict(pp=1, dp=2, ep=2, schedule="combined-1f1b"),
    "pp2-vpp2-dp2-ep2-combined": dict(pp=2, vpp=2, dp=2, ep=2, schedule="combined-1f1b"),
    "pp2-vpp2-dp2-ep2-top2-zbv": dict(pp=2, vpp=2, dp=2, ep=2, moe_top_k=2, schedule="zb-v"),
    "dp2-ring2-ep4-combined": dict(pp=1, dp=2, cp_ring=2, ep=4, schedule="combined-1f1b"),
    "ulysses2-dp2-ep4-top2": dict(pp=1, dp=2, cp_ulysses=2, ep=4, moe_top_k=2, moe_experts=8,
                                  schedule="1f1b"),
    "pp2-dp2-ep2-capacity-dualpipev": dict(pp=2, dp=2, ep=2, moe_capacity_factor=1.0,
                                           schedule="dualpipe-v"),
    "pp2-dp2-ep2-every2-recompute": dict(pp=2, dp=2, ep=2, moe_every=2, recompute="full"),
    # The experts' products recomputed in backward, under a split backward (ZB-V).
    "pp2-vpp2-dp2-ep2-zbv-grouped-recompute": dict(pp=2, vpp=2, dp=2, ep=2, moe_top_k=2,
                                                   schedule="zb-v", grouped_experts="on",
                                                   recompute="full"),
    # The experts as grouped products (models.grouped_experts; auto is off on a CPU).
    "dp2-ep2-combined-grouped": dict(pp=1, dp=2, ep=2, moe_top_k=2, schedule="combined-1f1b",
                                     grouped_experts="on"),
    "pp2-dp2-ep2-capacity-dualpipev-grouped": dict(pp=2, dp=2, ep=2, moe_capacity_factor=1.0,
                                                   schedule="dualpipe-v",
                                                   grouped_experts="on"),
    "pp2-vpp2-dp2-ep2-top2-zbv-grouped": dict(pp=2, vpp=2, dp=2, ep=2, moe_top_k=2,
                                              schedule="zb-v", grouped_experts="on"),
    # Each expert's hidden width split over the tensor-parallel ranks (MoE.split_width).
    "tp2-top2": dict(pp=1, tp=2, moe_top_k=2),
    "tp2-sequence-parallel-grouped": dict(pp=1, tp=2, moe_top_k=2, sequence_parallel=True,
                                          grouped_experts="on"),
    "dp2-ep2-tp2-sequence-parallel-every2-combined": dict(pp=1, dp=2, ep=2, tp=2,
                                                          moe_every=2, sequence_parallel=True,
                                                          schedule="combined-1f1b"),
    # Stages of different tp sizes (VTP): each stage's experts split over its own tp.
    "pp2-stage-tp-2-1-root": dict(pp=2, stage_tp="2,1", stage_link="root", moe_top_k=2),
    "pp2-dp2-ep2-stage-tp-1-2-fanout": dict(pp=2, dp=2, ep=2, stage_tp="1,2",
                                            stage_link="fanout", moe_top_k=2),
    "pp2-tp2-grouped-1f1b": dict(pp=2, tp=2, moe_top_k=2, grouped_experts="on"),
    "dp2-ep2-tp2-combined": dict(pp=1, dp=2, ep=2, tp=2, moe_top_k=2,
                                 schedule="combined-1f1b"),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_moe_step_matches_single_process(layout):
    config = TrainConfig(**{**MOE, **layout})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == []
    assert report["passed"], report
    assert report["max_grad_difference"] < 1e-5


@pytest.mark.parametrize("grouped", ["off", "on"])
def test_bf16_combined_step_matches_single_process_in_bf16(grouped):
    config = TrainConfig(**{**MOE, "pp": 1, "dp": 2, "ep": 2, "schedule": "combined-1f1b",
                            "dtype": "bf16", "grouped_experts": grouped})
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["passed"], report


def _history(rank, world_size, config):
    from meshpipe.train.loop.trainer import Trainer

    return Trainer(config).fit()["history"]


def test_metrics_report_load_balance_and_dropped_tokens(tmp_path):
    base = dict(MOE, pp=1, dp=2, ep=2, moe_top_k=2, steps=2, out_dir=str(tmp_path))
    free = run_distributed(2, _history, TrainConfig(**base))[0]
    limited = run_distributed(2, _history, TrainConfig(**base, moe_capacity_factor=0.5))[0]
    tokens = 2 * SMALL["microbatch_size"] * 4 * SMALL["seq_len"]  # dp x batch x seq
    for step in free:
        assert step["dropped_tokens"] == 0
        assert 0 < step["moe_aux_loss"] < 4 * SMALL["layers"]
        assert step["min_tokens_per_expert"] <= tokens * 2 / 4 <= step["max_tokens_per_expert"]
    capacity_per_rank = 0.5 * SMALL["microbatch_size"] * SMALL["seq_len"] * 2 / 4
    assert all(step["dropped_tokens"] > 0 for step in limited)
    assert all(step["max_tokens_per_expert"] >= capacity_per_rank for step in limited)


def test_tensor_parallel_ranks_count_their_shared_tokens_once():
    """A tensor-parallel group's ranks route the same tokens: the metrics of tp 2 are those
    of one process, not twice them."""
    base = dict(MOE, pp=1, moe_top_k=2, steps=1)
    alone = run_distributed(1, _history, TrainConfig(**base))[0][0]
    split = run_distributed(2, _history, TrainConfig(**base, tp=2))[0][0]
    for key in ("max_tokens_per_expert", "min_tokens_per_expert", "dropped_tokens"):
        assert split[key] == alone[key], key
    assert split["moe_aux_loss"] == pytest.approx(alone["moe_aux_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(grouped_experts="off"), dict(grouped_experts="on"),
                                    dict(tp=2, grouped_experts="on")],
                         ids=["one-by-one", "grouped", "tp2-grouped"])
def test_expert_shards_resume_exactly(tmp_path, layout):
    """Laid out for grouped products, the experts' weights are views of one storage each
    projection: saved and loaded as the parameters they are; split over tensor-parallel
    ranks too, saved whole and each rank's slice loaded."""
    base = dict(MOE, pp=1, dp=2, ep=2, schedule="combined-1f1b", out_dir=str(tmp_path),
                checkpoint_every=2, **layout)
    world = TrainConfig(**base).world_size
    straight = run_distributed(world, train, TrainConfig(**base))[0]
    resumed = run_distributed(world, train, TrainConfig(**base, resume=True),
                              rewind_to="step-000002")[0]
    assert resumed == straight  # the same layout: bit for bit, the history continued


@pytest.mark.slow
def test_experts_split_over_tp_resume_whole_at_tp_1(tmp_path):
    """A checkpoint holds each expert whole: a tp 2 run resumes at tp 1 (the losses within
    float32 rounding of the other layout's sums)."""
    import torch

    base = dict(MOE, pp=1, moe_top_k=2, out_dir=str(tmp_path), checkpoint_every=2)
    straight = run_distributed(2, train, TrainConfig(**base, tp=2))[0]
    resumed = run_distributed(1, train, TrainConfig(**base, resume=True),
                              rewind_to="step-000002")[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight))


def _expert_runs(rank, world_size, config, rewind_to=None):
    """Train (resumed from ``rewind_to`` if given), counting how the experts ran and the
    attentions' joint q/k/v products."""
    from _pytest.monkeypatch import MonkeyPatch

    from meshpipe.models import grouped_experts, joint
    from meshpipe.models.mlp import SwiGLU

    runs = {"grouped": 0, "one by one": 0, "joint q/k/v": 0}

    def counted(original, key):
        def call(*args):
            runs[key] += 1
            return original(*args)
        return call

    with MonkeyPatch.context() as patch:
        patch.setattr(grouped_experts, "run", counted(grouped_experts.run, "grouped"))
        patch.setattr(SwiGLU, "forward", counted(SwiGLU.forward, "one by one"))
        patch.setattr(joint._JointLinear, "apply", counted(joint._JointLinear.apply, "joint q/k/v"))
        train(rank, world_size, config, rewind_to)
    return runs


def test_laid_out_weights_stay_so_through_sharded_steps_and_a_resume(tmp_path):
    """Nothing that writes the weights (the masters' refresh, --zero 2's gathers, into the
    experts sharded over their 2 expert-data-parallel ranks too, a checkpoint's load) takes
    them out of their layout: every expert layer of every microbatch runs as grouped
    products, none one by one, and every attention projects q/k/v jointly."""
    base = dict(MOE, pp=1, dp=4, ep=2, zero=2, dtype="bf16", grouped_experts="on",
                joint_projections="on", checkpoint_every=2, out_dir=str(tmp_path))
    per_step = 4 * SMALL["layers"]  # microbatches x (expert) layers
    first = run_distributed(4, _expert_runs, TrainConfig(**{**base, "steps": 2}))
    resumed = run_distributed(4, _expert_runs, TrainConfig(**{**base, "steps": 3}, resume=True),
                              rewind_to="step-000002")
    for runs, steps in ((first, 2), (resumed, 1)):
        want = steps * per_step
        assert runs == [{"grouped": want, "one by one": 0, "joint q/k/v": want}] * 4


BAD = {
    "ep does not divide dp x cp": (dict(dp=2, ep=4, moe_experts=4), "--ep 4 must divide"),
    "experts not divisible by ep": (dict(dp=2, ep=2, moe_experts=3),
                                    "--moe-experts 3 is not divisible by --ep 2"),
    "top-k above experts": (dict(moe_experts=2, moe_top_k=3), "--moe-top-k 3"),
    "moe flags without experts": (dict(moe_top_k=2, ep=2, dp=2),
                                  "--moe-top-k, --ep apply only to mixture-of-experts"),
}


@pytest.mark.parametrize("flags, message", BAD.values(), ids=BAD.keys())
def test_bad_moe_flags_fail_before_any_process_starts(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**SMALL, "pp": 1, **flags})
