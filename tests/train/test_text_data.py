"""User text data: reading .txt/.jsonl, tokenizers, the token cache, splits and samplers."""

import json
import os

import numpy as np
import pytest
import torch

from meshpipe.train.data import cache as text_data
from meshpipe.train.data import records
from meshpipe.train.data.cache import TokenizedData, tokenize_dataset
from meshpipe.train.data.corpus import encode
from meshpipe.train.data.records import data_files, read_rows
from meshpipe.train.data.samples import encode_rows
from meshpipe.train.data.sampling import IGNORE_INDEX, TextSampler
from meshpipe.train.data.tokenizers import ByteTokenizer, HFTokenizer, has_tokenizer, resolve_tokenizer

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "the end"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny word-level tokenizer with BOS added by its post-processor, saved offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        SENTENCES, trainer=trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf(hf_dir):
    return HFTokenizer(hf_dir)


def read_documents(file):
    """The texts of a file's rows as the cache tokenizes them (byte-level: the bytes back)."""
    for batch in read_rows(file):
        for ids in encode_rows(batch, file, ByteTokenizer()).ids:
            yield bytes(ids).decode("utf-8")


def write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def documents(lengths):
    """TokenizedData whose tokens are 0, 1, 2, ...: a token names its document and place."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedData(np.arange(offsets[-1], dtype=np.int32), offsets, int(offsets[-1]))


# -- reading ----------------------------------------------------------------------------------


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    file = write(tmp_path / "a.txt", "\n  first line\nsecond line  \n\n\n  second doc\n \t \n"
                                     "third\r\n\r\nfourth\n\n   \n")
    assert list(read_documents(file)) == ["first line\nsecond line", "second doc", "third",
                                          "fourth"]


def test_jsonl_documents_keep_their_text(tmp_path):
    lines = [json.dumps({"text": "  indented\n\ncode"}), "", json.dumps({"text": "  "}),
             json.dumps({"text": "café", "id": 3})]
    file = write(tmp_path / "a.jsonl", "\n".join(lines) + "\n")
    assert list(read_documents(file)) == ["  indented\n\ncode", "café"]


def test_folder_reads_every_txt_and_jsonl_in_sorted_order(tmp_path):
    write(tmp_path / "b.txt", "bee")
    write(tmp_path / "a.jsonl", json.dumps({"text": "ay"}))
    write(tmp_path / "sub" / "c.txt", "sea\n\ncee")
    write(tmp_path / "notes.md", "ignored")
    assert data_files(str(tmp_path)) == [tmp_path / "a.jsonl", tmp_path / "b.txt",
                                         tmp_path / "sub" / "c.txt"]
    data = tokenize_dataset(str(tmp_path), ByteTokenizer(), tmp_path / "cache", progress=False)
    assert bytes(np.asarray(data.tokens, dtype=np.uint8)) == b"aybeeseacee"
    assert data.offsets.tolist() == [0, 2, 5, 8, 11]


def test_non_utf8_bytes_are_located(tmp_path):
    txt = write(tmp_path / "a.txt", b"hello\n\nw\xffrld")
    with pytest.raises(ValueError, match=r"a\.txt is not UTF-8 at byte offset 8 .*0xff.*"
                                         r"convert it to UTF-8"):
        list(read_documents(txt))
    first = json.dumps({"text": "ok"}).encode() + b"\n"
    jsonl = write(tmp_path / "a.jsonl", first + b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"at byte offset {len(first) + 13} "):
        list(read_documents(jsonl))


def test_invalid_utf8_offset_counts_characters_cut_by_a_chunk_edge(tmp_path):
    file = write(tmp_path / "a.txt", "ééé".encode() + b"\xc3(")
    assert records._invalid_utf8(file, chunk_size=3)[0] == 6
    truncated = write(tmp_path / "b.txt", "éé".encode() + b"\xe2\x82")
    assert records._invalid_utf8(truncated, chunk_size=3)[0] == 4


def test_bad_json_and_missing_text_name_the_line(tmp_path):
    good = json.dumps({"text": "fine"})
    bad = write(tmp_path / "bad.jsonl", f"{good}\n\n{{'text': 1}}\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3 is not valid JSON"):
        list(read_documents(bad))
    missing = write(tmp_path / "missing.jsonl", f'{good}\n{{"body": "x"}}\n')
    with pytest.raises(ValueError, match=r'missing\.jsonl line 2 has neither a string "text" '
                                         'field'):
        list(read_documents(missing))
    number = write(tmp_path / "number.jsonl", '{"text": 5}\n')
    with pytest.raises(ValueError, match="line 1 has neither a string"):
        list(read_documents(number))


def test_data_path_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        data_files(str(tmp_path / "nowhere"))
    write(tmp_path / "empty" / "readme.md", "no text here")
    with pytest.raises(ValueError, match="folder with no .txt, .jsonl, .parquet or .arrow"):
        data_files(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="is not a .txt, .jsonl, .parquet or .arrow"):
        data_files(str(tmp_path / "empty" / "readme.md"))


def test_blank_data_holds_no_text(tmp_path):
    write(tmp_path / "data" / "a.txt", "\n \n\t\n")
    write(tmp_path / "data" / "b.jsonl", json.dumps({"text": " "}) + "\n")
    with pytest.raises(ValueError, match="holds no text"):
        tokenize_dataset(str(tmp_path / "data"), ByteTokenizer(), tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


# -- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_matches_the_corpus_encoding():
    text = "O brave new world — ça va?"
    assert ByteTokenizer().encode_batch([text]) == [encode(text).tolist()]
    assert (ByteTokenizer.vocab_size, ByteTokenizer.eos_id, ByteTokenizer.pad_id) == (256, None, 0)


def test_hf_tokenizer_adds_bos_and_a_single_eos(hf, hf_dir):
    bos, eos = hf._tokenizer.bos_token_id, hf._tokenizer.eos_token_id
    cat, ended = hf.encode_batch(["the cat sat", "the end </s>"])
    assert cat[0] == bos and cat[-1] == eos and len(cat) == 5
    assert ended[-1] == eos and ended[-2] != eos
    assert hf.eos_id == eos and hf.pad_id == eos and hf.vocab_size == len(hf._tokenizer)
    assert hf.name.startswith(f"hf:{hf_dir.resolve()}:")


def test_tokenizer_resolution(tmp_path, hf_dir):
    model = write(tmp_path / "model" / "config.json", "{}").parent
    assert has_tokenizer(hf_dir) and not has_tokenizer(model)
    assert isinstance(resolve_tokenizer("", ""), ByteTokenizer)
    assert isinstance(resolve_tokenizer(str(model), ""), ByteTokenizer)
    assert isinstance(resolve_tokenizer(str(hf_dir), ""), HFTokenizer)
    assert isinstance(resolve_tokenizer(str(model), str(hf_dir)), HFTokenizer)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        resolve_tokenizer(str(hf_dir), str(model))


def test_out_of_vocabulary_ids_are_rejected(tmp_path):
    class Broken(ByteTokenizer):
        name = "broken"
        vocab_size = 100

    write(tmp_path / "a.txt", "zebra")
    with pytest.raises(ValueError, match="produced id 122 .* vocabulary of 100"):
        tokenize_dataset(str(tmp_path / "a.txt"), Broken(), tmp_path / "cache")


# -- the cache --------------------------------------------------------------------------------


def test_second_tokenization_reads_the_cache(tmp_path, monkeypatch, hf):
    data_file = write(tmp_path / "a.jsonl", "\n".join(json.dumps({"text": s}) for s in SENTENCES))
    first = tokenize_dataset(str(data_file), hf, tmp_path / "cache", progress=False)
    assert first.num_documents == 3 and first.vocab_size == hf.vocab_size
    assert first.max_token == max(max(ids) for ids in hf.encode_batch(SENTENCES))

    def refuse(self, texts, **options):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(HFTokenizer, "encode_batch", refuse)
    again = tokenize_dataset(str(data_file), hf, tmp_path / "cache", progress=False)
    assert isinstance(again.tokens, np.memmap) and again.tokens.dtype == np.int32
    assert again.offsets.dtype == np.int64
    assert np.array_equal(first.tokens, again.tokens)
    entry, = (tmp_path / "cache").iterdir()
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["tokenizer"] == hf.name and meta["num_tokens"] == first.num_tokens


def test_a_changed_file_is_tokenized_again(tmp_path):
    data_file = write(tmp_path / "a.txt", "one\n\ntwo")
    before = tokenize_dataset(str(data_file), ByteTokenizer(), tmp_path / "cache")
    write(data_file, "three\n\nfour")
    stat = data_file.stat()
    os.utime(data_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    after = tokenize_dataset(str(data_file), ByteTokenizer(), tmp_path / "cache")
    assert before.num_tokens == 6 and after.num_tokens == 9
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_an_interrupted_tokenization_leaves_no_entry(tmp_path, monkeypatch):
    data_file = write(tmp_path / "a.txt", "\n\n".join(f"document {i}" for i in range(3000)))
    calls = []

    def interrupted(self, texts, **options):
        calls.append(len(texts))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return [list(text.encode()) for text in texts]

    with monkeypatch.context() as patch:
        patch.setattr(ByteTokenizer, "encode_batch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tokenize_dataset(str(data_file), ByteTokenizer(), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    assert tokenize_dataset(str(data_file), ByteTokenizer(), tmp_path / "cache").num_documents \
        == 3000


def test_leftovers_of_a_killed_tokenization_are_ignored_and_cleaned(tmp_path):
    data_file = write(tmp_path / "a.txt", "alpha\n\nbeta")
    cache = tmp_path / "cache"
    key = text_data.cache_key([data_file], ByteTokenizer())
    host = text_data.socket.gethostname()
    dead = write(cache / f".tmp-{key[:16]}-{host}-99999999-abcd1234" / "tokens.npy", b"junk")
    live = write(cache / f".tmp-{key[:16]}-{host}-{os.getpid()}-abcd1234" / "tokens.npy", b"x")
    data = tokenize_dataset(str(data_file), ByteTokenizer(), cache)
    assert data.num_tokens == 9
    assert not dead.parent.exists() and live.exists()
    assert (cache / key / "meta.json").is_file()


def test_a_concurrent_writer_that_loses_the_rename_discards_its_copy(tmp_path):
    data_file = write(tmp_path / "a.txt", "alpha")
    cache = tmp_path / "cache"
    tokenize_dataset(str(data_file), ByteTokenizer(), cache)
    key = text_data.cache_key([data_file], ByteTokenizer())
    text_data._build_entry(str(data_file), [data_file], ByteTokenizer(), cache, key, False,
                           text_data.ReadOptions())
    assert [p.name for p in cache.iterdir()] == [key]


def test_large_data_shows_a_progress_bar(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(text_data, "PROGRESS_MIN_BYTES", 0)
    write(tmp_path / "a.txt", "some text")
    tokenize_dataset(str(tmp_path / "a.txt"), ByteTokenizer(), tmp_path / "cache")
    assert "tokenizing" in capsys.readouterr().err


# -- splits -----------------------------------------------------------------------------------


def test_split_holds_out_the_last_documents():
    data = documents([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    train, val = data.split(0.2)
    assert (train.num_documents, val.num_documents) == (8, 2)
    assert train.tokens.tolist() == list(range(31))
    assert val.offsets.tolist() == [0, 5, 8] and val.tokens.tolist() == list(range(31, 39))
    train, val = documents([4, 4]).split(0.05)
    assert (train.num_documents, val.num_documents) == (1, 1)
    with pytest.raises(ValueError, match="add documents"):
        documents([4, 4]).split(1.0)


def test_a_single_document_is_cut_in_two():
    train, val = documents([100]).split(0.1)
    assert train.tokens.tolist() == list(range(90)) and val.tokens.tolist() == list(range(90, 100))
    assert train.offsets.tolist() == [0, 90] and val.offsets.tolist() == [0, 10]
    with pytest.raises(ValueError, match="too short"):
        documents([1]).split(0.1)


# -- sampling without packing -----------------------------------------------------------------


def test_unpacked_batches_pad_short_pieces_and_end_every_piece(tmp_path):
    sampler = TextSampler(documents([10]), seq_len=4, batch_size=3, seed=1, pad_id=7)
    batch = sampler.batch(0)
    assert batch.tokens.shape == batch.targets.shape == (3, 4) and batch.doc_lens is None
    assert batch.tokens.dtype == batch.targets.dtype == torch.int64
    rows = sorted(batch.tokens.tolist())
    assert rows == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 7, 7]]
    for tokens, targets in zip(batch.tokens.tolist(), batch.targets.tolist()):
        length = 2 if tokens[0] == 8 else 4
        assert targets[:length - 1] == tokens[1:length]
        assert targets[length - 1:] == [IGNORE_INDEX] * (4 - length + 1)


def test_unpacked_batches_are_a_function_of_seed_and_step():
    data = documents(np.random.default_rng(0).integers(1, 40, size=200))
    sampler = TextSampler(data, seq_len=16, batch_size=8, seed=3)
    first = sampler.batch(5)
    sampler.batch(900)
    again, fresh = sampler.batch(5), TextSampler(data, seq_len=16, batch_size=8, seed=3).batch(5)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.tokens, fresh.tokens)
    assert torch.equal(first.targets, fresh.targets)
    assert not torch.equal(first.tokens, sampler.batch(6).tokens)
    other_seed = TextSampler(data, seq_len=16, batch_size=8, seed=4)
    assert not torch.equal(first.tokens, other_seed.batch(5).tokens)


def test_every_epoch_visits_every_piece_once():
    lengths = [5, 1, 12, 7, 3, 8]
    sampler = TextSampler(documents(lengths), seq_len=4, batch_size=3, seed=0)
    pieces = sum(-(-n // 4) for n in lengths)  # 2+1+3+2+1+2 = 11: batches cross epochs
    firsts = torch.cat([sampler.batch(step).tokens[:, 0] for step in range(11)]).tolist()
    starts = sorted(offset + k for offset, n in zip(np.cumsum([0] + lengths), lengths)
                    for k in range(0, n, 4))
    epochs = [firsts[i * pieces:(i + 1) * pieces] for i in range(3)]
    assert all(sorted(epoch) == starts for epoch in epochs)
    assert epochs[0] != epochs[1]


# -- sampling with packing --------------------------------------------------------------------


def packed_pieces(batch, seq_len):
    """Every sequence's document pieces (lists of tokens), checking that they fill the
    sequence and that targets stay inside them."""
    pieces = []
    for tokens, targets, lens in zip(batch.tokens.tolist(), batch.targets.tolist(),
                                     batch.doc_lens):
        assert sum(lens) == seq_len and min(lens) > 0
        start = 0
        for length in lens:
            piece = tokens[start:start + length]
            assert targets[start:start + length] == piece[1:] + [IGNORE_INDEX]
            pieces.append(piece)
            start += length
    return pieces


def assert_runs_of_one_document(pieces, lengths):
    """With ``documents(lengths)``: each piece is consecutive tokens of a single document."""
    starts = set(np.cumsum([0] + list(lengths)).tolist())
    for piece in pieces:
        assert piece == list(range(piece[0], piece[0] + len(piece)))
        assert not starts.intersection(piece[1:])


def test_packed_sequences_are_the_stream_of_permuted_documents():
    lengths = [5, 1, 12, 7, 3, 8]
    total = sum(lengths)
    starts = set(np.cumsum([0] + lengths[:-1]).tolist())
    ends = set(np.cumsum(lengths).tolist())
    sampler = TextSampler(documents(lengths), seq_len=8, batch_size=2, seed=2, pack=True)
    stream = []
    for step in range(9):  # 9 * 2 * 8 = 144 tokens: 4 epochs of 36
        batch = sampler.batch(step)
        assert_runs_of_one_document(packed_pieces(batch, 8), lengths)
        stream += batch.tokens.flatten().tolist()
    epochs = [stream[e * total:(e + 1) * total] for e in range(4)]
    for epoch in epochs:  # every document, whole and in order, one after another
        assert sorted(epoch) == list(range(total)) and epoch[0] in starts
        breaks = [i for i in range(1, total) if epoch[i] != epoch[i - 1] + 1]
        assert all(epoch[i - 1] + 1 in ends and epoch[i] in starts for i in breaks)
    assert epochs[0] != epochs[1]


def test_packing_one_document_repeats_it_as_separate_documents():
    batch = TextSampler(documents([5]), seq_len=12, batch_size=1, pack=True).batch(0)
    assert batch.tokens.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]]
    assert batch.doc_lens == ((5, 5, 2),)
    assert batch.targets.tolist() == [[1, 2, 3, 4, IGNORE_INDEX, 1, 2, 3, 4, IGNORE_INDEX, 1,
                                       IGNORE_INDEX]]


def test_packed_batches_are_deterministic():
    lengths = np.random.default_rng(1).integers(1, 30, size=300)
    data = documents(lengths)
    a = TextSampler(data, seq_len=32, batch_size=4, seed=9, pack=True)
    b = TextSampler(data, seq_len=32, batch_size=4, seed=9, pack=True)
    assert torch.equal(a.batch(77).tokens, b.batch(77).tokens)
    assert a.batch(77).doc_lens == b.batch(77).doc_lens
    assert torch.equal(a.batch(3).targets, a.batch(3).targets)
    assert not torch.equal(a.batch(3).tokens, a.batch(4).tokens)
    assert_runs_of_one_document(packed_pieces(a.batch(1000), 32), lengths)


def test_sampler_on_a_cached_split(tmp_path, hf):
    data_file = write(tmp_path / "a.txt", "\n\n".join(SENTENCES * 7))
    train, val = tokenize_dataset(str(data_file), hf, tmp_path / "cache").split(0.1)
    batch = TextSampler(train, seq_len=16, batch_size=2, pack=True, pad_id=hf.pad_id).batch(3)
    pieces = packed_pieces(batch, 16)
    row_ends = np.cumsum([len(lens) for lens in batch.doc_lens]) - 1
    assert all(piece[-1] == hf.eos_id for i, piece in enumerate(pieces) if i not in row_ends)
    unpacked = TextSampler(val, seq_len=16, batch_size=4, pad_id=hf.pad_id).batch(0)
    assert (unpacked.tokens[unpacked.targets == IGNORE_INDEX] != hf.eos_id).sum() == 0


def test_data_without_tokens_cannot_give_a_sequence():
    empty = TokenizedData(np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64), 256)
    with pytest.raises(ValueError, match="no tokens.*add text"):
        TextSampler(empty, seq_len=8, batch_size=1)


def test_concurrent_tokenizations_of_one_dataset_tokenize_once(tmp_path):
    """Ranks that reach an uncached dataset together: one tokenizes, the others wait and
    read its cache."""
    import threading
    import time

    data_file = write(tmp_path / "a.txt", "\n\n".join(SENTENCES))
    calls = []

    class Slow(ByteTokenizer):
        def encode_batch(self, texts, **options):
            calls.append(len(texts))
            time.sleep(0.3)
            return super().encode_batch(texts, **options)

    results = []
    threads = [threading.Thread(target=lambda: results.append(
        tokenize_dataset(str(data_file), Slow(), tmp_path / "cache", progress=False)))
        for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(results) == 3 and all(np.array_equal(r.tokens, results[0].tokens)
                                     for r in results)
