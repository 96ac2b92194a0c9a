"""The learning-rate schedule and its re-span when a resume changes ``--steps``, value by
value against the rule written out here (learning_rate.py's docstring)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.learning_rate import LearningRate

LR, MIN_LR = 1e-3, 1e-4


def cosine(progress: float) -> float:
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))


def config(steps: int, warmup: int = 0) -> TrainConfig:
    return TrainConfig(steps=steps, warmup_steps=warmup, lr=LR, min_lr=MIN_LR)


def test_a_fresh_run_warms_up_then_decays_to_min_lr_at_the_last_step():
    rate = LearningRate.of(config(steps=20, warmup=5))
    expected = [LR * (s + 1) / 5 for s in range(5)] + [cosine((s - 5) / 15) for s in range(5, 20)]
    assert [rate.at(s) for s in range(20)] == pytest.approx(expected, rel=1e-12)
    assert rate.at(20) == pytest.approx(MIN_LR)


def test_extending_2_to_3_steps_goes_on_from_the_last_step_trained():
    saved = LearningRate.of(config(steps=2))
    assert [saved.at(0), saved.at(1)] == pytest.approx([cosine(0), cosine(0.5)])
    resumed = saved.respanned(2, config(steps=3))
    assert resumed.anchor == {"step": 1, "progress": 0.5}
    # From progress 0.5 at step 1, the rest of the decay spreads over steps 2..3.
    assert resumed.at(2) == pytest.approx(cosine(0.75), rel=1e-12)
    assert resumed.at(3) == pytest.approx(MIN_LR)


def test_shortening_4_to_2_steps_speeds_the_decay_up():
    saved = LearningRate.of(config(steps=4))
    resumed = saved.respanned(1, config(steps=2))
    assert resumed.anchor == {"step": 0, "progress": 0.0}
    assert resumed.at(1) == pytest.approx(cosine(0.5), rel=1e-12)  # was cosine(0.25)


def test_the_same_steps_keep_the_schedule_wherever_a_resume_starts():
    saved = LearningRate.of(config(steps=12, warmup=3))
    for start in range(1, 12):
        resumed = saved.respanned(start, config(steps=12, warmup=3))
        assert resumed == saved


def test_a_resume_inside_warm_up_keeps_warming_up_then_decays_to_the_new_end():
    saved = LearningRate.of(config(steps=10, warmup=4))
    resumed = saved.respanned(2, config(steps=20, warmup=4))
    assert resumed == LearningRate.of(config(steps=20, warmup=4))


def test_resumes_chain_through_the_saved_anchor():
    first = LearningRate.of(config(steps=10))
    second = first.respanned(5, config(steps=20))
    saved_second = LearningRate.of(config(steps=20), second.anchor)  # as its checkpoint has it
    third = saved_second.respanned(12, config(steps=15))
    assert second.anchor == {"step": 4, "progress": pytest.approx(0.4)}
    # 0.4 at step 4, +0.6 over 16 steps: step 11 (the last trained) is at 0.4 + 0.6 * 7/16.
    assert third.anchor == {"step": 11, "progress": pytest.approx(0.4 + 0.6 * 7 / 16)}
    assert third.at(15) == pytest.approx(MIN_LR)


@given(warmup=st.integers(0, 5), saved_steps=st.integers(1, 40), steps=st.integers(1, 40),
       start=st.integers(1, 40))
def test_a_changed_length_never_jumps_and_ends_at_min_lr(warmup, saved_steps, steps, start):
    if start >= steps or start > saved_steps:
        return  # nothing to train, or a checkpoint past the saved run's end
    saved = LearningRate.of(config(saved_steps, warmup))
    resumed = saved.respanned(start, config(steps, warmup))
    last = start - 1
    assert resumed.at(last) == pytest.approx(saved.at(last), rel=1e-12)
    rates = [resumed.at(s) for s in range(max(last, warmup), steps + 1)]
    assert all(a >= b - 1e-15 for a, b in zip(rates, rates[1:]))
    if steps > warmup:  # a run that is all warm-up never decays
        assert resumed.at(steps) == pytest.approx(MIN_LR)
