"""Weighted mixtures of --data sources: shares, a pure function of (seed, step), each source
in its own order, and the one-line errors of a bad weight."""

import numpy as np
import pytest

from meshpipe.train.data.cache import TokenizedData
from meshpipe.train.data.mixture import (ROUND, MixtureSampler, parse_source, round_counts,
                                         source_names)
from meshpipe.train.data.sampling import TextSampler


def source(first_token, documents=50, length=9):
    """Documents of ``length`` tokens, all ``first_token`` + their index (so a token says
    which source and document it came from)."""
    tokens = np.repeat(np.arange(documents, dtype=np.int32) + first_token, length)
    offsets = np.arange(documents + 1, dtype=np.int64) * length
    return TokenizedData(tokens, offsets, vocab_size=1000)


def mixture(weights, pack=False, seed=5, batch=8):
    samplers = [TextSampler(source(100 * (index + 1)), 8, batch, seed=index, pack=pack)
                for index in range(len(weights))]
    return MixtureSampler(samplers, weights, batch, seed=seed)


def test_two_sources_come_in_their_weights_over_1000_steps():
    sampler = mixture([0.7, 0.3])
    sources = np.concatenate([sampler.batch(step).sources for step in range(1000)])
    shares = np.bincount(sources, minlength=2) / len(sources)
    assert abs(shares[0] - 0.7) < 0.02 * 0.7 and abs(shares[1] - 0.3) < 0.02 * 0.3
    assert len(set(sampler.batch(0).sources)) == 2  # shuffled, not in blocks


def test_the_order_is_a_function_of_seed_and_step():
    """A resumed run (a fresh sampler asked for step 700) continues the same order."""
    first, resumed = mixture([0.7, 0.3]), mixture([0.7, 0.3])
    for step in range(0, 700, 50):
        first.batch(step)
    for step in (700, 701, 1249):  # 1249 x 8 crosses a round of ROUND sequences
        a, b = first.batch(step), resumed.batch(step)
        assert a.tokens.equal(b.tokens) and a.targets.equal(b.targets) and a.sources == b.sources
    assert not mixture([0.7, 0.3], seed=6).batch(3).tokens.equal(first.batch(3).tokens)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_each_source_runs_through_its_own_order(pack):
    """Source s's k-th sequence of the mixture is its own sampler's sequence k."""
    sampler = mixture([2.0, 1.0, 1.0], pack=pack)
    seen = [[] for _ in range(3)]
    for step in range(20):
        batch = sampler.batch(step)
        for row, index in enumerate(batch.sources):
            seen[index].append(batch.tokens[row])
            if pack:
                assert sum(batch.doc_lens[row]) == 8
    for index, rows in enumerate(seen):
        own = sampler.samplers[index].sequences(range(len(rows)))
        assert all(own.tokens[k].equal(row) for k, row in enumerate(rows))
        assert all((row // 100 == index + 1).all() for row in rows if (row > 0).all())


def test_round_counts_add_up_and_follow_the_weights():
    counts = round_counts([1, 1, 1])
    assert counts.sum() == ROUND and counts.max() - counts.min() <= 1
    assert round_counts([0.7, 0.3]).tolist() == [7000, 3000]


def test_sources_and_their_weights(tmp_path):
    assert parse_source("a.jsonl:0.7") == ("a.jsonl", 0.7)
    assert parse_source("chat/") == ("chat/", 1.0)
    odd = tmp_path / "x:y.txt"
    odd.write_text("a")
    assert parse_source(str(odd)) == (str(odd), 1.0)  # an existing path keeps its colon
    for text, message in (("a.jsonl:heavy", "the weight 'heavy' after the last ':' is not a "
                                            "number"),
                          ("a.jsonl:0", "the weight 0 is not a positive number"),
                          ("a.jsonl:-1", "the weight -1 is not a positive number"),
                          ("a.jsonl:nan", "the weight nan is not a positive number")):
        with pytest.raises(ValueError, match=f"--data {text}: {message}"):
            parse_source(text)
    assert source_names(["a/train.jsonl", "b/train.jsonl", "chat/"]) == [
        "train.jsonl#0", "train.jsonl#1", "chat"]


def test_sources_in_a_toml_config_and_from_an_older_checkpoint(tmp_path):
    """``data`` is a list in TOML (or one string), written back as one; a checkpoint of an
    older version that saved one string compares equal to the same single source."""
    from meshpipe.train.checkpoints.resume import _saved_values
    from meshpipe.train.config import TrainConfig
    from meshpipe.train.run.toml_config import read_toml, to_toml

    file = tmp_path / "run.toml"
    file.write_text('data = ["a.jsonl:0.7", "chat/:0.3"]\nval-data = "v.jsonl"\n')
    config = TrainConfig(**read_toml(file))
    assert config.data == ("a.jsonl:0.7", "chat/:0.3") and config.val_data == "v.jsonl"
    file.write_text(to_toml(config))
    assert TrainConfig(**read_toml(file)) == config
    file.write_text('data = "a.txt"\n')
    assert TrainConfig(**read_toml(file)).data == ("a.txt",)
    file.write_text("data = [1, 2]\n")
    with pytest.raises(ValueError, match="key 'data' must be an array of strings"):
        read_toml(file)
    assert _saved_values({"data": "a.txt"})["data"] == TrainConfig(data="a.txt").data
