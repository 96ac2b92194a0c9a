"""Mixture-of-experts Hugging Face decoders (``--model`` Mixtral, Qwen2-MoE, Qwen3-MoE) on
pooled ranks: their metrics, a resume under another expert layout, and each rank reading
only its experts (their ``--check`` parity and export round trip are with the other
architectures' in ``test_trainer_hf``)."""

import json

import pytest
import torch

from hf_models import save_tiny_model
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from trainer_cases import SMALL, for_a_model, train

pytestmark = pytest.mark.distributed

pytest.importorskip("transformers")

HF = for_a_model(SMALL)


def test_metrics_report_the_experts_load(tmp_path):
    directory = save_tiny_model(tmp_path / "model", "mixtral")
    config = TrainConfig(**{**HF, "steps": 2}, pp=1, dp=2, ep=2, model=str(directory),
                         out_dir=str(tmp_path))
    run_distributed(2, train, config)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "moe_aux_loss" in record]
    assert len(steps) == 2
    tokens = 2 * 4 * HF["microbatch_size"] * HF["seq_len"]  # dp x microbatches x rows x seq
    for step in steps:
        assert 0 < step["moe_aux_loss"] < 4 * 4  # 4 layers, each at most its 4 experts
        # 2 picks per token over 4 experts: an even share is tokens / 2.
        assert step["min_tokens_per_expert"] <= tokens / 2 <= step["max_tokens_per_expert"]
        assert step["dropped_tokens"] == 0


@pytest.mark.slow
def test_resume_continues_under_another_expert_layout(tmp_path):
    """Each expert is saved under its own name, so ep 2 resumes with ep 1."""
    directory = save_tiny_model(tmp_path / "model", "qwen3_moe")
    base = dict(HF, model=str(directory), out_dir=str(tmp_path / "run"), checkpoint_every=2,
                pp=1, dp=2)
    straight = run_distributed(2, train, TrainConfig(**base, ep=2))[0]
    resumed = run_distributed(2, train, TrainConfig(**base, resume=True),
                              rewind_to="step-000002")[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight))


def _expert_tensors_read(rank, world_size, directory):
    """The expert tensors this ep rank reads for the first of two stages, and the experts
    its layers keep."""
    import torch.distributed as dist

    from meshpipe.models import hf, hf_moe

    read = []
    original = hf._WeightReader.get

    def spy(reader, name, rows=None):
        read.append(name)
        return original(reader, name, rows)

    skeleton = hf.build_skeleton(directory)
    for layer in skeleton.model.layers:
        hf_moe.expert_layer(layer).shard(dist.group.WORLD, None)
    hf._WeightReader.get = spy
    try:
        hf.materialize(skeleton, [hf.split_model(skeleton, [2, 2])[0]], directory)
    finally:
        hf._WeightReader.get = original
    kept = list(hf_moe.expert_layer(skeleton.model.layers[0]).experts)
    return sorted(name for name in read if ".experts." in name), kept


def test_each_expert_parallel_rank_reads_only_its_experts(tmp_path):
    directory = save_tiny_model(tmp_path / "model", "mixtral")
    for rank, (read, kept) in enumerate(run_distributed(2, _expert_tensors_read,
                                                        str(directory))):
        mine = [str(e) for e in (2 * rank, 2 * rank + 1)]
        assert kept == mine
        assert read == sorted(f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                              for layer in (0, 1) for e in mine for w in ("w1", "w2", "w3"))
