"""Vision-language models (Qwen2-VL, Qwen2.5-VL) through the pipeline: --check against the
unmodified transformers model with 0-3 images of mixed sizes per sample, packed and not,
with data parallelism and the sharded optimizer; captions and chats with images in the
cache; each microbatch at its own length; bad input refused in one line."""

import json

import numpy as np
import pytest
import torch

from hf_models import save_tiny_vision_model
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.data.shapes import write_shapes_corpus
from meshpipe.train.run import data_sources, sources
from trainer_cases import SMALL, check_first_step, for_a_model

pytest.importorskip("transformers")

VISION = dict(SMALL, seq_len=64, microbatches=2, steps=2)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_shapes_corpus(tmp_path_factory.mktemp("shapes"), 40)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vision_model(request, tmp_path_factory):
    return save_tiny_vision_model(tmp_path_factory.mktemp(request.param), request.param)


def vision_config(model, data, tmp_path, **flags):
    return TrainConfig(**{**for_a_model(VISION), "pp": 2, "model": str(model),
                          "data": str(data), "out_dir": str(tmp_path), **flags})


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [dict(), dict(pack=True)], ids=["unpacked", "packed"])
def test_check_passes_with_the_tower_on_the_first_stage(vision_model, shapes, tmp_path, flags):
    config = vision_config(vision_model, shapes, tmp_path, **flags)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report
    assert report["loss_difference"] < 1e-5


def test_the_first_batch_shows_images_of_several_sizes_and_the_tower_costs_layers(
        vision_model, shapes, tmp_path):
    """What the --check tests above rest on: images of mixed sizes in the first batch; and
    the split gives the first stage, which carries the tower, no more layers than the
    others."""
    from meshpipe.train.run.plan import build_schedule, layers_per_stage

    config = vision_config(vision_model, shapes, tmp_path)
    sources.check_sources(config)
    batch = data_sources.samplers(config, 0)[0].batch(0)
    grids = {tuple(g) for row in batch.pictures for piece in row for g in piece.grids.tolist()}
    assert len(grids) >= 2
    assert sources.tower_cost(config) > 0
    layers = layers_per_stage(config, build_schedule(config))
    assert sum(layers) == 4 and layers[0] <= layers[1]
