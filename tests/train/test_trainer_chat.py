"""Training on chat data and on mixtures: the loss on the assistant's tokens only equals a
reference whose prompt tokens are masked by hand, packed and not, under pp 2 x cp ring 2;
--check on chat data with a Hugging Face model; a mixture's per-source metrics, and a resume
that continues its order."""

import json

import numpy as np
import pytest

from hf_models import CHATML, save_tiny_model, save_tiny_tokenizer
from meshpipe.models import Transformer
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.data.cache import TokenizedData
from meshpipe.train.data.sampling import TextSampler
from meshpipe.train.loop.trainer import Trainer, run
from meshpipe.train.run import data_sources, sources
from trainer_cases import SMALL, check_first_step, for_a_model, train

pytestmark = pytest.mark.distributed

pytest.importorskip("transformers")

CHAT = dict(SMALL, seq_len=32, microbatches=2, steps=2)
WORDS = "the quick brown fox jumps over a lazy dog".split()


def chat_file(path, count=40, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(count):
            turns = [{"role": "system", "content": "be brief"}] if rng.random() < 0.5 else []
            for _ in range(int(rng.integers(1, 3))):
                turns.append({"role": "user", "content": " ".join(rng.choice(WORDS, 2))})
                turns.append({"role": "assistant", "content": " ".join(
                    rng.choice(WORDS, int(rng.integers(1, 5))))})
            out.write(json.dumps({"messages": turns}) + "\n")
    return path


def chatml_answers_by_hand(ids, header, end, newline):
    """ChatML's answers found by reading the tokens: after ``<|im_start|>assistant\\n`` up to
    and with ``<|im_end|>`` and the newline after it."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    inside, k = False, 0
    while k < len(ids):
        if not inside and list(ids[k:k + len(header)]) == header:
            inside, k = True, k + len(header)
            continue
        if inside:
            mask[k] = 1
            if ids[k] == end:
                inside = False
                if k + 1 < len(ids) and ids[k + 1] == newline:
                    mask[k + 1] = 1
                    k += 1
        k += 1
    return mask


def hand_masked(config):
    """The run's data with its mask rebuilt by hand (the cache's is not used)."""
    tokenizer = data_sources.tokenizer(config)._tokenizer
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline, = tokenizer("\n", add_special_tokens=False)["input_ids"]
    data = data_sources.tokenized(config, config.data[0])
    tokens, offsets = np.asarray(data.tokens), np.asarray(data.offsets)
    mask = np.concatenate([chatml_answers_by_hand(tokens[a:b], header, end, newline)
                           for a, b in zip(offsets[:-1], offsets[1:])])
    return TokenizedData(data.tokens, data.offsets, data.vocab_size, mask=mask,
                         kinds=data.kinds, rows=data.rows, files=data.files), data


def hand_built_reference(config):
    """One process: the reference transformer on the first batch, each target kept only where
    the hand-built mask marks an answer's token."""
    by_hand, _ = hand_masked(config)
    train_part, _ = by_hand.split(data_sources.VAL_FRACTION)
    batch = TextSampler(train_part, config.seq_len, config.microbatches * config.microbatch_size,
                        seed=config.seed * 7919, pack=config.pack,
                        pad_id=data_sources.tokenizer(config).pad_id).batch(0)
    model = Transformer(sources.model_config(config))
    loss = sources._replica_loss(config, model, batch)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()
                         if p.grad is not None}


def check_against_hand_built(rank, world_size, config):
    """``--check``'s report with the single process replaced by ``hand_built_reference``."""
    computed = sources.reference_step
    sources.reference_step = hand_built_reference
    try:
        return Trainer(config).check_first_step()
    finally:
        sources.reference_step = computed


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"), chat_template=CHATML)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_assistant_only_loss_equals_a_hand_masked_reference(tmp_path, chat_tokenizer, pack):
    config = TrainConfig(**CHAT, pp=2, cp_ring=2, data=str(chat_file(tmp_path / "chat.jsonl")),
                         tokenizer=str(chat_tokenizer), pack=pack, out_dir=str(tmp_path))
    by_hand, data = hand_masked(config)
    assert np.array_equal(by_hand.mask, data.mask)  # the spans found are the hand-read ones
    assert 0.1 < by_hand.mask.mean() < 0.9
    report = run_distributed(config.world_size, check_against_hand_built, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def test_check_passes_on_chat_data_with_a_hugging_face_model(tmp_path):
    directory = save_tiny_model(tmp_path / "model", "qwen2", vocab_size=320)
    save_tiny_tokenizer(directory, chat_template=CHATML)
    config = TrainConfig(**for_a_model(CHAT), pp=2, model=str(directory), pack=True,
                         data=str(chat_file(tmp_path / "chat.jsonl")), out_dir=str(tmp_path))
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report
    assert report["loss_difference"] < 1e-5


def text_file(path, count=40):
    path.write_text("\n\n".join(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(i % 7 + 3))
                                for i in range(count)), encoding="utf-8")
    return path


def test_a_mixture_reports_each_source_and_resumes_its_order(tmp_path, chat_tokenizer):
    """Two sources by weight: every step's metrics give each source's share and loss (the
    shares' weighted losses make the step's loss); --check passes; a run resumed from step
    2 ends where the uninterrupted run does."""
    chat = chat_file(tmp_path / "chat.jsonl")
    text = text_file(tmp_path / "text.txt")
    base = dict(CHAT, pp=2, steps=4, seq_len=64, tokenizer=str(chat_tokenizer), pack=True,
                data=(f"{chat}:0.75", f"{text}:0.25"), checkpoint_every=2, eval_every=2)
    config = TrainConfig(**base, check=True, out_dir=str(tmp_path / "whole"))
    metrics = run(config)
    assert metrics["check"]["passed"], metrics["check"]
    names = ("chat.jsonl", "text.txt")
    for record in metrics["history"]:
        shares = [record[f"data_share_{name}"] for name in names]
        assert abs(sum(shares) - 1) < 1e-9
        mixed = sum(share * record[f"data_loss_{name}"] for share, name in zip(shares, names)
                    if share)
        assert mixed == pytest.approx(record["loss"], rel=1e-5)
    assert all(sum(record[f"data_share_{name}"] > 0 for record in metrics["history"]) >= 2
               for name in names)
    assert {"val_share_chat.jsonl", "val_loss_text.txt"} <= set(metrics["eval"][0])
    lines = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    assert "data_loss_chat.jsonl" in json.loads(lines[0])
    resumed = TrainConfig(**base, out_dir=str(tmp_path / "whole"))
    whole = [record["loss"] for record in metrics["history"]]
    step_2 = sorted((tmp_path / "whole" / "checkpoint").glob("*step-000002"))[0].name
    again = run_distributed(config.world_size, train, resumed, rewind_to=step_2)[0]
    assert again[2:] == whole[2:]  # rank 0 reads steps 1-2 back from metrics.jsonl


MIXED_LAYOUTS = {
    "tp2": dict(pp=1, schedule="none", tp=2),
    "ring2-packed": dict(pp=1, schedule="none", cp_ring=2, pack=True),
    "pp2-ulysses2": dict(pp=2, cp_ulysses=2),
}


@pytest.mark.parametrize("layout", [pytest.param(layout, id=name, marks=() if name == "tp2"
                                                  else pytest.mark.slow)
                                     for name, layout in MIXED_LAYOUTS.items()])
def test_a_mixture_matches_one_process_in_every_layout(tmp_path, chat_tokenizer, layout):
    """The per-source split of the loss under tensor parallelism (the vocabulary-parallel
    loss) and context parallelism (each rank's slice of every sequence's sources)."""
    chat, text = chat_file(tmp_path / "chat.jsonl"), text_file(tmp_path / "text.txt")
    config = TrainConfig(**{**CHAT, "seq_len": 64, "steps": 1, **layout},
                         tokenizer=str(chat_tokenizer), data=(f"{chat}:0.5", f"{text}:0.5"),
                         check=True, out_dir=str(tmp_path))
    metrics = run(config)
    assert metrics["check"]["passed"], metrics["check"]
    record = metrics["history"][0]
    shares = [record[f"data_share_{name}"] for name in ("chat.jsonl", "text.txt")]
    mixed = sum(share * record[f"data_loss_{name}"]
                for share, name in zip(shares, ("chat.jsonl", "text.txt")) if share)
    assert mixed == pytest.approx(record["loss"], rel=1e-5) and min(shares) > 0


def test_val_data_and_bad_data_flags(tmp_path, chat_tokenizer):
    chat = chat_file(tmp_path / "chat.jsonl")
    val = chat_file(tmp_path / "val.jsonl", count=6, seed=1)
    config = TrainConfig(**CHAT, pp=1, schedule="none", data=str(chat), val_data=str(val),
                         tokenizer=str(chat_tokenizer), out_dir=str(tmp_path))
    train_sampler, val_sampler = data_sources.samplers(config, 0)
    assert train_sampler.data.num_documents == 40  # nothing held out of --data
    assert val_sampler.data.num_documents == 6
    long = TrainConfig(**{**CHAT, "seq_len": 16}, pp=2, data=str(chat),
                       tokenizer=str(chat_tokenizer), out_dir=str(tmp_path / "long"))
    notes = sources.check_sources(long)
    assert len(notes) == 1 and "chat or prompt/completion samples are longer than --seq-len " \
        "16 tokens and are cut to it" in notes[0]
    refused = TrainConfig(**{**CHAT, "seq_len": 16}, pp=2, data=str(chat), truncate=False,
                          tokenizer=str(chat_tokenizer), out_dir=str(tmp_path / "refused"))
    with pytest.raises(ValueError, match=r"--no-truncate: .*chat.jsonl line \d+ is a sample of "
                                         r"\d+ tokens, longer than --seq-len 16"):
        run(refused)
    for fields, message in (
            (dict(data=f"{chat}:zero"), "the weight 'zero' after the last ':' is not a number"),
            (dict(data=(str(chat), f"{chat}:-2")), "the weight -2 is not a positive number"),
            (dict(data=str(chat)), "has no chat template"),
            (dict(data=str(chat), chat_template=str(tmp_path / "none.jinja")),
             "--chat-template .*none.jinja does not exist")):
        bad = TrainConfig(**{**CHAT, **fields}, pp=2, tokenizer=str(save_tiny_tokenizer(
            tmp_path / "plain")), out_dir=str(tmp_path / "bad"))
        with pytest.raises(ValueError, match=message) as raised:
            run(bad)
        assert "\n" not in str(raised.value) and not (tmp_path / "bad" / "logs").exists()
