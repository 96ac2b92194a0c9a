"""Hugging Face decoders as meshpipe stages, in one process: the chunks are the upstream
model, a rank reads only its stage's tensors, bad model directories fail in one line, and
exports load back in transformers with the same logits."""

import json
import sys

import pytest
import torch

from hf_models import ARCHITECTURES, save_tiny_model

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

from meshpipe.context import LocalAttention  # noqa: E402
from meshpipe.models import hf, hf_export  # noqa: E402
from meshpipe.models.transformer import Transformer, TransformerConfig  # noqa: E402


def _upstream(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)


def _chunks(directory, layers):
    """Every stage's chunk with its weights, and the real parameters by full-model name."""
    skeleton = hf.build_skeleton(directory)
    chunks = hf.split_model(skeleton, layers, LocalAttention())
    names = hf.full_names(skeleton)  # before materialising: keyed by the meta parameters
    real = hf.materialize(skeleton, chunks, directory)
    return chunks, {names[meta]: param for meta, param in real.items()}


def _run(chunks, tokens, positions=None, doc_ids=None):
    """The chunks' logits (a model with experts also returns its load-balancing loss)."""
    message = (tokens, positions, doc_ids)
    for chunk in chunks[:-1]:
        message = chunk(*message)
    out = chunks[-1](*message)
    return out[0] if isinstance(out, tuple) else out


LLAMA3_ROPE = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   rope_theta=500000.0)
MODELS = {**{arch: (arch, {}) for arch in ARCHITECTURES},
          "llama-tied": ("llama", dict(tie_word_embeddings=True)),
          "llama3-rope-scaling": ("llama", LLAMA3_ROPE),
          "mistral-window-32": ("mistral", dict(sliding_window=32))}


@pytest.mark.parametrize("arch,overrides", MODELS.values(), ids=MODELS.keys())
def test_stages_compute_the_upstream_logits(tmp_path, arch, overrides):
    directory = save_tiny_model(tmp_path, arch, **overrides)
    chunks, _ = _chunks(directory, [1, 2, 1])
    tokens = torch.randint(0, 256, (2, 96))  # beyond llama3's original 64 positions
    torch.testing.assert_close(_run(chunks, tokens), _upstream(directory)(tokens).logits)


def test_packed_documents_attend_only_inside_themselves(tmp_path):
    """Positions restart and document ids separate: a pack equals its documents run alone."""
    directory = save_tiny_model(tmp_path)
    chunks, _ = _chunks(directory, [2, 2])
    tokens = torch.randint(0, 256, (1, 20))
    lengths = [7, 13]
    positions = torch.cat([torch.arange(n) for n in lengths])
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    packed = _run(chunks, tokens, positions, doc_ids)
    upstream = _upstream(directory)
    alone = torch.cat([upstream(piece).logits for piece in tokens.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone)


def test_a_rank_reads_only_its_stage_tensors(tmp_path):
    directory = save_tiny_model(tmp_path, tie_word_embeddings=True)
    skeleton = hf.build_skeleton(directory)
    chunks = hf.split_model(skeleton, [2, 2])
    names = hf.full_names(skeleton)
    read = []
    original = hf._WeightReader.get

    def spy(reader, name, rows=None):
        read.append(name)
        return original(reader, name, rows)

    hf._WeightReader.get = spy
    try:
        real = hf.materialize(skeleton, [chunks[1]], directory)
    finally:
        hf._WeightReader.get = original
    assert read and all(name.startswith(("model.layers.2.", "model.layers.3.", "model.norm."))
                        or name == "model.embed_tokens.weight" for name in read)
    assert not any(name.startswith(("model.layers.0.", "model.layers.1.")) for name in read)
    # The tied head is read from the embedding tensor (tied checkpoints store only that)
    # and keeps the embedding's name.
    head = chunks[1].lm_head.weight
    assert [names[meta] for meta, p in real.items() if p is head] == ["model.embed_tokens.weight"]
    assert all(p.device.type == "meta" for p in chunks[0].parameters())


def test_model_directories_meshpipe_cannot_train_fail_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        hf.inspect_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="has no config.json"):
        hf.inspect_model(tmp_path)
    directory = save_tiny_model(tmp_path / "llama")
    for weights in directory.glob("*.safetensors"):
        weights.unlink()
    (directory / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no \\*.safetensors weights .*safe_serialization"):
        hf.inspect_model(directory)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' model; meshpipe trains .*llama, mistral, qwen2, "
                       "qwen3, phi3, gemma2, gemma3_text"):
        hf.inspect_model(gpt2)


def test_sequences_the_model_cannot_take_are_refused(tmp_path):
    info = hf.inspect_model(save_tiny_model(tmp_path / "a", max_position_embeddings=64))
    hf.check_sequence_length(info, 64)
    with pytest.raises(ValueError, match="--seq-len 65 is above .*max_position_embeddings 64"):
        hf.check_sequence_length(info, 65)


@pytest.mark.parametrize("arch,feature,overrides", [
    ("gemma3_text", "bidirectional attention", dict(use_bidirectional_attention=True)),
    ("mixtral", "router jitter noise", dict(router_jitter_noise=0.1))])
def test_features_meshpipe_cannot_run_are_refused_by_name(tmp_path, arch, feature, overrides):
    directory = save_tiny_model(tmp_path, arch, **overrides)
    with pytest.raises(ValueError, match=rf"\({arch}\) uses {feature} .*, which "
                                         "meshpipe does not run yet"):
        hf.inspect_model(directory)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_export_loads_in_transformers_with_the_trained_weights(tmp_path, arch):
    directory = save_tiny_model(tmp_path / "model", arch)
    chunks, state = _chunks(directory, [2, 2])
    with torch.no_grad():
        for param in state.values():
            param.add_(torch.randn_like(param) * 0.01)  # "trained"
    exported = hf_export.export_model(state, directory, tmp_path / "export")
    assert json.loads((exported / "config.json").read_text())["model_type"] == arch
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(_upstream(exported)(tokens).logits, _run(chunks, tokens))
    with pytest.raises(ValueError, match="lacks 1 of the model's weights"):
        hf_export.export_model({k: v for k, v in state.items() if k != "model.norm.weight"}, directory,
                        tmp_path / "bad")


@pytest.mark.parametrize("tied", [False, True])
def test_the_reference_transformer_exports_as_the_llama_it_is(tmp_path, tied):
    config = TransformerConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                               tie_embeddings=tied)
    model = Transformer(config)
    state = {name: param.detach() for name, param in model.named_parameters()}
    exported = hf_export.export_reference(state, config, tmp_path)
    tokens = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(_upstream(exported)(tokens).logits, model(tokens))


@pytest.mark.parametrize("arch,tp,message", [
    ("llama", 8, r"--tp 8 must divide the attention heads \(num_attention_heads\) of --model "
                 r".*, 4; use a tp that divides 4"),
    ("qwen3", 4, r"--tp 4 must divide the key/value heads \(num_key_value_heads\) of --model "
                 r".*, 2; use a tp that divides 2")])
def test_a_tensor_parallel_size_the_model_cannot_take_is_one_line(tmp_path, arch, tp, message):
    from meshpipe.train.config import TrainConfig
    from meshpipe.train.run.plan import plan_run

    directory = save_tiny_model(tmp_path / "model", arch)
    config = TrainConfig(model=str(directory), pp=1, schedule="none", tp=tp, seq_len=16,
                         out_dir=str(tmp_path / "run"), device="cpu")
    with pytest.raises(ValueError, match=message) as caught:
        plan_run(config)
    assert "\n" not in str(caught.value)


def test_gemma_needs_the_transformers_it_was_built_on(tmp_path, monkeypatch):
    directory = save_tiny_model(tmp_path, "gemma3_text")
    # The module transformers' lazy loader leaves in sys.modules once it has loaded.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ValueError, match=r"\(gemma3_text\) needs transformers >= 5.0 here, "
                                         r"found 4.57.1"):
        hf.inspect_model(directory)
    hf.inspect_model(save_tiny_model(tmp_path / "llama", "llama"))  # others still load


@pytest.mark.parametrize("arch,flags,message", [
    ("mixtral", dict(dp=3, ep=3), r"\(mixtral\) has 4 experts per layer, which --ep 3 does not "
                                  r"divide"),
    ("llama", dict(dp=2, ep=2, moe_capacity_factor=1.0),
     r"\(llama\) has no mixture-of-experts layers: drop --ep and --moe-capacity-factor"),
    ("mixtral", dict(moe_top_k=2), r"--moe-top-k describes the reference transformer"),
    ("qwen2_moe", dict(moe_aux_coef=0.1), r"--moe-aux-coef describes the reference transformer")])
def test_expert_flags_the_model_cannot_take_are_one_line(tmp_path, arch, flags, message):
    from meshpipe.train.config import TrainConfig
    from meshpipe.train.run.plan import plan_run

    directory = save_tiny_model(tmp_path / "model", arch)
    with pytest.raises(ValueError, match=message) as caught:
        plan_run(TrainConfig(**{**dict(pp=1, schedule="none", seq_len=16, device="cpu"), **flags},
                             model=str(directory), out_dir=str(tmp_path / "run")))
    assert "\n" not in str(caught.value)


def test_gradients_of_stacked_experts_take_the_files_names():
    """transformers stacks a layer's experts; its files (and meshpipe) keep one tensor per
    expert and projection, gate rows before up rows in the stack."""
    from meshpipe.models import hf_moe

    mixtral = hf_moe.ARCHITECTURES["mixtral"]
    stacked = torch.arange(2 * 6 * 3.0).view(2, 6, 3)  # 2 experts, 2 x 3 rows, 3 columns
    pieces = hf_moe.as_file_tensors("model.layers.1.mlp.experts.gate_up_proj", stacked, mixtral)
    assert sorted(pieces) == [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
                              for e in (0, 1) for w in ("w1", "w3")]
    torch.testing.assert_close(pieces["model.layers.1.block_sparse_moe.experts.1.w3.weight"],
                               stacked[1, 3:])
    assert list(hf_moe.as_file_tensors("model.layers.1.mlp.gate.weight", stacked, mixtral)) == [
        "model.layers.1.block_sparse_moe.gate.weight"]
    qwen = hf_moe.ARCHITECTURES["qwen2_moe"]
    down = hf_moe.as_file_tensors("model.layers.0.mlp.experts.down_proj", stacked, qwen)
    assert sorted(down) == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (0, 1)]


def test_an_expert_layer_is_cut_at_its_exchanges(tmp_path):
    """Combined 1F1B needs a chunk's forward as sub-steps: each Qwen2-MoE sparse layer
    yields its dispatch and combine (layer 2 is dense: mlp_only_layers), and the chunk's
    messages carry the load-balancing loss."""
    from meshpipe.runtime.substeps import Exchange

    chunks, _ = _chunks(save_tiny_model(tmp_path, "qwen2_moe"), [3, 1])
    steps = chunks[0].forward_steps(torch.randint(0, 256, (2, 16)))
    names = []
    try:
        exchange = next(steps)
        while True:
            assert isinstance(exchange, Exchange)
            names.append(exchange.name)
            exchange = steps.send((exchange.communicate(exchange.send), exchange.keep))
    except StopIteration as done:
        hidden, positions, doc_ids, aux = done.value
    assert names == ["dispatch", "combine"] * 2
    assert hidden.shape == (2, 16, 32) and aux.item() > 0


@pytest.mark.parametrize("recompute", [True, False])
def test_full_recompute_reaches_the_expert_layers(tmp_path, recompute):
    from meshpipe.models import hf_moe

    skeleton = hf.build_skeleton(save_tiny_model(tmp_path, "mixtral"))
    hf.split_model(skeleton, [2, 2], recompute=recompute)
    experts = [hf_moe.expert_layer(layer) for layer in hf.decoder_of(skeleton)[0].layers]
    assert [layer.recompute for layer in experts] == [recompute] * len(experts) != []
