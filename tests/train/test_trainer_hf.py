"""Training Hugging Face decoders (``--model``) on pooled ranks: ``--check`` parity against the
unmodified transformers model under pipeline and context-parallel layouts, resume, and the
round trip of an export back into transformers."""

from pathlib import Path

import pytest
import torch

from hf_models import save_tiny_model, write_documents
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from trainer_cases import SMALL, check_first_step, for_a_model, train, train_then_logits

pytestmark = pytest.mark.distributed

pytest.importorskip("transformers")

HF = for_a_model(SMALL)

LAYOUTS = {
    "llama-pp2-ring2": ("llama", {}, dict(pp=2, cp_ring=2)),
    "mistral-pp2-ulysses2": ("mistral", {}, dict(pp=2, cp_ulysses=2)),
    "qwen2-tied-hybrid2x2": ("qwen2", dict(tie_word_embeddings=True),
                             dict(pp=1, schedule="none", cp_ring=2, cp_ulysses=2)),
    "llama-tied-zbv-dp2": ("llama", dict(tie_word_embeddings=True),
                           dict(pp=2, schedule="zb-v", dp=2)),
    "qwen2-interleaved-recompute": ("qwen2", {}, dict(pp=2, vpp=2, schedule="interleaved",
                                                      recompute="full")),
    "qwen3-pp2-ring2-packed": ("qwen3", {}, dict(pp=2, cp_ring=2, pack=True)),
    "gemma3-window6-pp2-ulysses2": ("gemma3_text", {}, dict(pp=2, cp_ulysses=2)),
    "gemma3-window6-ring2-packed": ("gemma3_text", {}, dict(pp=1, schedule="none", cp_ring=2,
                                                            pack=True)),
    "llama-pp2-tp2-sequence-parallel": ("llama", {}, dict(pp=2, tp=2, sequence_parallel=True)),
    "llama-stage-tp-2-1": ("llama", {}, dict(pp=2, stage_tp="2,1")),
    "gemma3-tied-pp2-tp2": ("gemma3_text", {}, dict(pp=2, tp=2)),
    "gemma2-softcap-window6-pp2-ulysses2": ("gemma2", {}, dict(pp=2, cp_ulysses=2)),
    "gemma2-softcap-window6-ring2-packed": ("gemma2", {}, dict(pp=1, schedule="none", cp_ring=2,
                                                                pack=True)),
    "phi3-fused-pp2-tp2": ("phi3", {}, dict(pp=2, tp=2)),
    # Experts with the load-balancing loss in the training loss (output_router_logits), so
    # the routers' gradients check it too.
    "mixtral-dp2-ep2-combined": ("mixtral", {}, dict(pp=1, dp=2, ep=2,
                                                     schedule="combined-1f1b")),
    "qwen3_moe-pp2-dp2-ep2-grouped": ("qwen3_moe", {}, dict(pp=2, dp=2, ep=2,
                                                            grouped_experts="on")),
    "qwen2_moe-shared-pp2-ring2-packed": ("qwen2_moe", {}, dict(pp=2, cp_ring=2, pack=True)),
    # Each expert's width (and the shared expert's) split over tp (hf_tp._split_experts).
    "mixtral-tp2-dp2-ep2-combined": ("mixtral", {}, dict(pp=1, tp=2, dp=2, ep=2,
                                                         schedule="combined-1f1b")),
    "qwen2_moe-shared-pp2-tp2-grouped": ("qwen2_moe", {}, dict(pp=2, tp=2,
                                                               grouped_experts="on")),
    "qwen2_moe-shared-tp2-sequence-parallel": ("qwen2_moe", {}, dict(pp=1, tp=2,
                                                                     sequence_parallel=True)),
    "mixtral-stage-tp-2-1": ("mixtral", {}, dict(pp=2, stage_tp="2,1")),
}


@pytest.mark.parametrize("arch,model,layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_training_step_matches_upstream_transformers(tmp_path, arch, model, layout):
    directory = save_tiny_model(tmp_path / "model", arch, **model)
    if layout.get("pack"):  # documents of 1 to 40 words, several to a packed sequence
        layout = dict(layout, data=str(write_documents(tmp_path / "docs.txt")))
    config = TrainConfig(**{**HF, **layout}, model=str(directory), out_dir=str(tmp_path))
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == []
    assert report["passed"], report
    assert report["loss_difference"] < 1e-5


def test_resume_continues_exactly_in_another_layout(tmp_path):
    directory = save_tiny_model(tmp_path / "model", "qwen2", tie_word_embeddings=True)
    (tmp_path / "run").mkdir()
    base = dict(HF, model=str(directory), out_dir=str(tmp_path / "run"), checkpoint_every=2)
    straight = run_distributed(2, train, TrainConfig(**base, pp=2))[0]
    other_layout = TrainConfig(**base, pp=1, schedule="none", cp_ulysses=2, resume=True)
    resumed = run_distributed(2, train, other_layout, rewind_to="step-000002")[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight))


@pytest.mark.slow
def test_fused_tensor_parallel_shards_resume_without_tensor_parallelism(tmp_path):
    """Phi-3's fused q/k/v and gate/up shards are saved whole (each part gathered) and load
    back into a run without tensor parallelism, which continues exactly."""
    directory = save_tiny_model(tmp_path / "model", "phi3")
    base = dict(HF, model=str(directory), out_dir=str(tmp_path / "run"), checkpoint_every=2,
                pp=2)
    straight = run_distributed(4, train, TrainConfig(**base, tp=2))[0]
    resumed = run_distributed(2, train, TrainConfig(**base, resume=True),
                              rewind_to="step-000002")[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight))


@pytest.mark.parametrize("arch,layout", [
    pytest.param("llama", dict(pp=2), id="llama-pp2"),
    pytest.param("mixtral", dict(pp=1, dp=2, ep=2), id="mixtral-dp2-ep2", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", dict(pp=1, tp=2), id="qwen2_moe-tp2", marks=pytest.mark.slow)])
def test_the_export_loads_in_transformers_with_the_trained_logits(tmp_path, arch, layout):
    """Mixtral's experts are written one tensor per expert, as save_pretrained does; experts
    split over tp ranks whole."""
    import transformers

    directory = save_tiny_model(tmp_path / "model", arch)
    export = tmp_path / "export"
    (tmp_path / "run").mkdir()
    config = TrainConfig(**HF, **layout, model=str(directory), out_dir=str(tmp_path / "run"),
                         export=str(export))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    trained = [out for out in run_distributed(2, train_then_logits, config, tokens)
               if out is not None][0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    untrained = transformers.AutoModelForCausalLM.from_pretrained(str(directory),
                                                                   dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, trained)
        assert not torch.allclose(untrained(tokens).logits, trained)  # training changed it
    assert sorted(p.name for p in Path(export).iterdir()) == ["config.json",
                                                              "generation_config.json",
                                                              "model.safetensors"]


def test_meshpipe_export_writes_a_reference_run_as_a_llama(tmp_path):
    import transformers

    from meshpipe.cli import main
    from meshpipe.models import Transformer
    from meshpipe.train.checkpoints.store import read_model_weights
    from meshpipe.train.run.sources import model_config

    config = TrainConfig(**SMALL, pp=2, out_dir=str(tmp_path), tie_embeddings=True)
    run_distributed(2, train, config)
    assert main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "E")]) == 0
    trained = Transformer(model_config(config))
    weights = read_model_weights(tmp_path / "checkpoint" / "step-000004")
    result = trained.load_state_dict(weights, strict=False)
    assert result.missing_keys == ["head.weight"] and not result.unexpected_keys  # tied
    assert torch.equal(trained.head.weight, weights["embedding.weight"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "E"))
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, trained(tokens))
    assert main(["export", "--checkpoint", str(tmp_path / "nothing"), "--out",
                 str(tmp_path / "F")]) == 2


def _bytes_read_for_stage_and_shard(rank, world_size, directory):
    """This tp rank's bytes read from the files for the first of two stages, and the bytes
    of the parameters it holds."""
    import torch.distributed as dist

    from meshpipe.models import hf, hf_tp
    from meshpipe.parallel import TensorParallelRegion

    counted = []
    original = hf._WeightReader.get

    def counting(reader, name, rows=None):
        tensor = original(reader, name, rows)
        counted.append(tensor.numel() * tensor.element_size())
        return tensor

    hf._WeightReader.get = counting
    try:
        skeleton = hf.build_skeleton(directory)
        hf_tp.shard_skeleton(skeleton, TensorParallelRegion(dist.group.WORLD))
        real = hf.materialize(skeleton, [hf.split_model(skeleton, [2, 2])[0]], directory)
    finally:
        hf._WeightReader.get = original
    return sum(counted), sum(p.numel() * p.element_size() for p in real.values())


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2_moe"])
def test_each_tensor_parallel_rank_reads_only_its_shards(tmp_path, arch):
    """Of its experts too: each expert's slice of the width, and the shared expert's."""
    import transformers

    directory = save_tiny_model(tmp_path / "model", arch)
    stage = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")
    whole = sum(p.numel() * 4 for name, p in transformers.AutoModelForCausalLM.from_pretrained(
        str(directory)).named_parameters() if name.startswith(stage))
    for read, held in run_distributed(2, _bytes_read_for_stage_and_shard, str(directory)):
        assert read == held  # the bytes of its own shards (and replicated norms), no more
        assert read < 0.55 * whole
