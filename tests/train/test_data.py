"""The shipped corpus, the byte tokenizer and the seekable sampler."""

import pytest
import torch

from meshpipe.train.data.corpus import VOCAB_SIZE, CorpusSampler, decode, encode, load_corpus


def test_corpus_ships_with_the_package():
    corpus = load_corpus()
    assert len(corpus) > 100_000
    assert b"Full fathom five thy father lies" in corpus


def test_tokenizer_round_trips_bytes():
    text = "O brave new world,\nThat has such people in't!"
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens) == text


def test_batches_are_a_function_of_the_step():
    tokens = encode(load_corpus())
    a = CorpusSampler(tokens, seq_len=32, batch_size=4, seed=7)
    b = CorpusSampler(tokens, seq_len=32, batch_size=4, seed=7)
    assert torch.equal(a.batch(5).tokens, b.batch(5).tokens)
    assert not torch.equal(a.batch(5).tokens, a.batch(6).tokens)
    batch = a.batch(0)
    assert batch.tokens.shape == batch.targets.shape == (4, 32)
    assert torch.equal(batch.tokens[:, 1:], batch.targets[:, :-1])


def test_validation_split_is_disjoint_from_training():
    tokens = torch.arange(1000)
    train = CorpusSampler(tokens, seq_len=8, batch_size=64, split="train", val_fraction=0.1)
    val = CorpusSampler(tokens, seq_len=8, batch_size=64, split="val", val_fraction=0.1)
    assert int(train.batch(0).targets.max()) < 900
    assert int(val.batch(0).tokens.min()) >= 900


def test_unknown_corpus_and_too_long_sequences_are_rejected():
    with pytest.raises(ValueError, match="shipped corpora: shakespeare"):
        load_corpus("wikipedia")
    with pytest.raises(ValueError, match="use a shorter --seq-len"):
        CorpusSampler(torch.arange(10), seq_len=64, batch_size=1)
