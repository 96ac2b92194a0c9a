"""Defaults that work together: any one numeric flag changed to a typical value plans a run,
and the defaults that follow other flags (``DERIVED_DEFAULTS``) follow them."""

import argparse
import dataclasses

import pytest

from meshpipe.train.config import DERIVED_DEFAULTS, TrainConfig, field_kind
from meshpipe.train.run.arguments import add_arguments, from_arguments
from meshpipe.train.run.plan import plan_run
from meshpipe.train.run.toml_config import read_toml, to_toml

# Values people give, one flag at a time. Every numeric field is here (a test checks it).
TYPICAL = {
    "pp": [1, 2, 4], "vpp": [1, 2], "dp": [1, 2, 4, 8], "cp_ulysses": [2, 4],
    "cp_ring": [2, 4], "tp": [2, 4], "microbatches": [1, 2, 8, 32],
    "microbatch_size": [1, 4, 8], "seq_len": [16, 128, 1024, 4096],
    "dim": [32, 128, 512, 1024], "layers": [2, 8, 32], "heads": [1, 2, 8, 16],
    "kv_heads": [1, 4], "moe_experts": [2, 8], "steps": [1, 2, 5, 100, 10000],
    "lr": [1e-5, 1e-4, 3e-4, 1e-3, 1e-2], "min_lr": [0.0, 1e-5, 1e-4],
    "warmup_steps": [0, 1, 10, 2000], "weight_decay": [0.0, 0.1], "grad_clip": [0.0, 5.0],
    "seed": [1, 1234], "eval_every": [0, 1, 100], "checkpoint_every": [0, 1, 100],
    "keep_checkpoints": [1, 5], "timeline_step": [0, 1, 5], "hang_timeout": [5.0, 600.0],
    "skip_nonfinite": [1, 3], "zero": [1, 2], "max_restarts": [1, 3],
    "moe_top_k": [1, 2], "moe_every": [1, 2], "moe_aux_coef": [0.0, 0.1],
    "moe_capacity_factor": [1.0, 1.25], "ep": [2, 4],
}
# The flags that mean nothing alone, walked with what they need: the expert flags need
# experts, and --ep shards them over data-parallel replicas.
PARTNERS = {**{name: {"moe_experts": 4} for name in ("moe_top_k", "moe_every", "moe_aux_coef",
                                                      "moe_capacity_factor")},
            "ep": {"moe_experts": 4, "dp": 4}}


def test_every_numeric_flag_is_walked():
    numeric = {f.name for f in dataclasses.fields(TrainConfig)
               if field_kind(f.name) in ("int", "float")}
    assert numeric == set(TYPICAL)


@pytest.mark.parametrize("name,value", [(name, value) for name, values in TYPICAL.items()
                                        for value in values])
def test_one_flag_alone_plans_a_run(name, value, tmp_path):
    given = {name: value, **PARTNERS.get(name, {})}
    plan = plan_run(TrainConfig(**given, out_dir=str(tmp_path), device="cpu"))
    assert getattr(plan.config, name) == value


def test_min_lr_follows_lr_unless_given():
    assert TrainConfig(lr=1e-4).min_lr == pytest.approx(1e-5)
    assert TrainConfig().min_lr == pytest.approx(3e-4)  # the default before it followed --lr
    assert TrainConfig(lr=1e-4, min_lr=0.0).min_lr == 0.0
    with pytest.raises(ValueError, match="--min-lr <= --lr"):
        TrainConfig(lr=1e-4, min_lr=3e-4)


def test_timeline_step_is_the_second_step_or_the_only_one():
    assert TrainConfig().timeline_step == 2
    assert TrainConfig(steps=1).timeline_step == 1
    with pytest.raises(ValueError, match="--timeline-step 5 is after the last step 3"):
        TrainConfig(steps=3, timeline_step=5)


@pytest.mark.parametrize("given,kv_heads", [
    ({}, 2), ({"heads": 8}, 2), ({"heads": 1}, 1), ({"heads": 3, "dim": 48}, 3),
    ({"tp": 2}, 2), ({"tp": 4}, 4), ({"stage_tp": "4,1"}, 4), ({"kv_heads": 1}, 1),
])
def test_kv_heads_are_grouped_where_heads_and_tp_allow(given, kv_heads):
    assert TrainConfig(**given).kv_heads == kv_heads


def test_help_says_the_rule_of_each_derived_default():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for rule in DERIVED_DEFAULTS.values():
        assert f"(default: {rule.says})" in text


def test_derived_defaults_parse_from_flags_and_round_trip_through_toml(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = from_arguments(parser.parse_args(["--lr", "1e-4", "--kv-heads", "1"]))
    assert (config.min_lr, config.kv_heads) == (pytest.approx(1e-5), 1)
    written = to_toml(config)
    assert "min_lr" not in written and "kv_heads = 1" in written
    path = tmp_path / "run.toml"
    path.write_text(written)
    assert TrainConfig(**read_toml(path)) == config


# How ``--model``'s help names each model type meshpipe trains.
FAMILY_OF_TYPE = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                  "phi3": "Phi-3", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3",
                  "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE"}


def test_the_model_flags_help_names_every_supported_family():
    from meshpipe.models.hf import SUPPORTED_MODEL_TYPES
    from meshpipe.train.config import FIELD_HELP, HF_FAMILIES

    assert set(FAMILY_OF_TYPE) == set(SUPPORTED_MODEL_TYPES)
    assert [name for name in FAMILY_OF_TYPE.values() if name not in HF_FAMILIES] == []
    assert HF_FAMILIES in FIELD_HELP["model"]
