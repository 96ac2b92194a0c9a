"""Training on the user's text (``--data``, ``--pack``, ``--tokenizer``): parity with one
process under every context-parallel layout, padding and document ends left out of the loss,
bad model and data input refused before any process starts, and the issue's command line."""

import json
import subprocess
import sys

import pytest
import torch

from hf_models import save_tiny_model, save_tiny_tokenizer, write_documents
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import run
from meshpipe.train.run import data_sources
from trainer_cases import SMALL, check_first_step, for_a_model

pytestmark = pytest.mark.distributed

pytest.importorskip("transformers")

DATA = dict(SMALL, seq_len=32, microbatches=2, steps=2)
HF = for_a_model(DATA)

PACKED_LAYOUTS = {
    "ring2": dict(pp=1, schedule="none", cp_ring=2),
    "pp2-ulysses2": dict(pp=2, cp_ulysses=2),
    "hybrid2x2": dict(pp=1, schedule="none", cp_ring=2, cp_ulysses=2),
}


@pytest.mark.parametrize("layout", PACKED_LAYOUTS.values(), ids=PACKED_LAYOUTS.keys())
def test_packed_documents_train_as_in_one_process(tmp_path, layout):
    """The reference model on packed documents (byte-level): each rank holds its piece of
    every document and attention keeps to documents, exactly as one process computes it."""
    data = write_documents(tmp_path / "docs.txt", max_words=4)
    config = TrainConfig(**{**DATA, **layout}, data=str(data), pack=True,
                         out_dir=str(tmp_path))
    batch = data_sources.samplers(config, 0)[0].batch(0)
    assert all(len(lens) > 1 for lens in batch.doc_lens)  # several documents per sequence
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def test_a_model_with_its_own_tokenizer_trains_on_padded_documents(tmp_path):
    """Without --pack, documents are cut into sequences; padding is not trained. The model
    directory's tokenizer is used, and --check runs transformers' own model and loss."""
    directory = save_tiny_model(tmp_path / "model", "mistral", vocab_size=320)
    save_tiny_tokenizer(directory)
    data = write_documents(tmp_path / "docs.txt")
    config = TrainConfig(**HF, pp=2, cp_ring=2, model=str(directory), data=str(data),
                         out_dir=str(tmp_path))
    assert data_sources.tokenizer(config).vocab_size == 292
    targets = data_sources.samplers(config, 0)[0].batch(0).targets
    assert 0 < data_sources.counted_targets(targets) < targets.numel()  # padding is left out
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report
    assert report["loss_difference"] < 1e-5


def test_a_packed_model_matches_upstream_under_zero_bubble(tmp_path):
    directory = save_tiny_model(tmp_path / "model", "qwen2", tie_word_embeddings=True)
    data = write_documents(tmp_path / "docs.txt")
    config = TrainConfig(**HF, pp=2, schedule="zb-v", cp_ulysses=2, model=str(directory),
                         data=str(data), pack=True, out_dir=str(tmp_path))
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def _bad_inputs(tmp_path):
    """(config fields, the message) for input that must fail before any process starts."""
    model = save_tiny_model(tmp_path / "model", num_hidden_layers=2,
                            max_position_embeddings=64)
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    no_weights = save_tiny_model(tmp_path / "no-weights")
    for weights in no_weights.glob("*.safetensors"):
        weights.unlink()
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    data = write_documents(tmp_path / "docs.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    big_tokenizer = save_tiny_tokenizer(tmp_path / "tokenizer")
    m = str(model)
    return [
        (dict(model=str(no_config)), "has no config.json"),
        (dict(model=str(no_weights)), "has no \\*.safetensors weights"),
        (dict(model=str(gpt2)), "'gpt2' model; meshpipe trains these decoder architectures: "
                                "llama, mistral, qwen2"),
        (dict(model=m, pp=4, schedule="1f1b"), "the 2 layers of --model .* cannot fill the 4 "
                                               "stages"),
        (dict(model=m, seq_len=128), "--seq-len 128 is above the model's "
                                     "max_position_embeddings 64"),
        (dict(model=m, data=str(tmp_path / "missing.txt")), "missing.txt"),
        (dict(data=str(empty)), "holds no text"),
        (dict(data=str(latin)), "latin.txt is not UTF-8 at byte offset 3"),
        (dict(model=m, data=str(data), tokenizer=str(big_tokenizer)),
         "the tokenizer has 292 tokens but the model's embedding has 256 rows"),
        (dict(model=m, dim=128), "--dim describes the reference transformer"),
        (dict(model=str(save_tiny_model(tmp_path / "small-vocab", vocab_size=100))),
         "byte-level \\(256 token ids\\) but the model's embedding has 100 rows"),
        (dict(pack=True), "--pack packs the documents of --data"),
    ]


def test_bad_model_and_data_input_fails_in_one_line_before_any_process(tmp_path):
    base = {key: value for key, value in HF.items()}
    for fields, message in _bad_inputs(tmp_path):
        out = tmp_path / f"out-{len(message)}"
        with pytest.raises(ValueError, match=message) as raised:
            run(TrainConfig(**{**base, "pp": 2, "out_dir": str(out), **fields}))
        assert "\n" not in str(raised.value)
        assert not (out / "logs").exists()  # no process started


@pytest.mark.slow
def test_the_issue_command_line_trains_checks_and_exports(tmp_path):
    """The acceptance command: Llama, byte-level data, pp 2 x ring 2, packed, --check and
    --export, from the command line."""
    import transformers

    model = save_tiny_model(tmp_path / "M")
    data = write_documents(tmp_path / "D.txt")
    command = [sys.executable, "-m", "meshpipe", "train", "--model", str(model), "--data",
               str(data), "--pp", "2", "--cp-ring", "2", "--pack", "--seq-len", "64",
               "--steps", "3", "--check", "--out-dir", str(tmp_path / "R"), "--export",
               str(tmp_path / "E"), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    check = json.loads((tmp_path / "R" / "metrics.json").read_text())["check"]
    assert check["passed"] and check["loss_difference"] < 1e-5
    assert "|diff|" in done.stdout and "exported step 3" in done.stdout
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "E"))
    assert exported.config.model_type == "llama"
    tokens = torch.randint(0, 256, (1, 8))
    assert torch.isfinite(exported(tokens).logits).all()


def test_a_resumed_run_on_packed_data_continues_exactly(tmp_path):
    from trainer_cases import train

    data = write_documents(tmp_path / "docs.txt", max_words=4)
    (tmp_path / "run").mkdir()
    base = dict(DATA, steps=4, pp=1, schedule="none", data=str(data), pack=True,
                out_dir=str(tmp_path / "run"), checkpoint_every=2)
    straight = run_distributed(1, train, TrainConfig(**base))[0]
    resumed = run_distributed(1, train, TrainConfig(**base, resume=True),
                              rewind_to="step-000002")[0]
    assert resumed == straight
