"""Data as people keep it: chat rows with the assistant's tokens found under any template,
prompt/completion rows, Parquet and save_to_disk folders, targets masked in the samplers,
long samples cut or refused, and the one-line errors of bad rows."""

import json
from pathlib import Path

import numpy as np
import pytest

from hf_models import CHATML, save_tiny_tokenizer
from meshpipe.train.data.cache import ReadOptions, tokenize_dataset
from meshpipe.train.data.records import RowBatch
from meshpipe.train.data.sampling import IGNORE_INDEX, TextSampler
from meshpipe.train.data.samples import KIND_SAMPLE, KIND_TEXT, check_messages, encode_rows
from meshpipe.train.data.tokenizers import ByteTokenizer, HFTokenizer

pytest.importorskip("transformers")

# Templates as models carry them: ChatML (Qwen), Llama 3's header markers, Zephyr's tags
# with EOS closing a turn, Mistral's [INST] without system turns and with the answer
# closed by EOS, and one that rewrites earlier assistant turns (breaking the prefixes).
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>\n\n"
          "{{ m['content'] | trim }}</s>{% endfor %}{% if add_generation_prompt %}"
          "<|im_start|>assistant<|im_end|>\n\n{% endif %}")
ZEPHYR = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + "
          "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
           "{{ raise_exception('no system turns') }}{% elif m['role'] == 'user' %}"
           "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + "
           "eos_token }}{% endif %}{% endfor %}")
REWRITING = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
             "A (before): {{ m['content'] }}\n{% elif m['role'] == 'assistant' %}A: "
             "{{ m['content'] }}</s>\n{% else %}{{ m['role'][0] | upper }}: {{ m['content'] }}"
             "\n{% endif %}{% endfor %}{% if add_generation_prompt %}A: {% endif %}")
DROPPING = REWRITING.replace("A (before): {{ m['content'] }}", "A (before): ...")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "zephyr": ZEPHYR, "mistral": MISTRAL}

SYSTEM = {"role": "system", "content": "answer in few words"}
TWO_TURNS = [{"role": "user", "content": "the fox?"},
             {"role": "assistant", "content": "quick brown"},
             {"role": "user", "content": "and the dog?"},
             {"role": "assistant", "content": "lazy, it jumps over"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"), chat_template=CHATML)


def tokenizer_with(directory, template, tmp_path):
    file = tmp_path / "template.jinja"
    file.write_text(template)
    return HFTokenizer(directory, file)


def trained_text(tokenizer, ids, mask):
    """The text of the tokens the mask makes targets, run by run."""
    runs, current = [], []
    for token, counted in zip(ids, mask):
        if counted:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer._tokenizer.decode(run) for run in runs]


def encode_chats(tokenizer, conversations, loss_on="assistant"):
    batch = RowBatch(list(range(1, len(conversations) + 1)),
                     [{"messages": turns} for turns in conversations], 0)
    return encode_rows(batch, Path("chat.jsonl"), tokenizer, loss_on=loss_on)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
def test_the_assistant_tokens_are_exactly_the_answers(tokenizer_dir, tmp_path, name, system):
    """Under every template, with and without a system turn, the targets are each answer as
    the template writes it (its end-of-turn marker included) and nothing of the prompts."""
    if system and name == "mistral":
        pytest.skip("the template refuses system turns")
    tokenizer = tokenizer_with(tokenizer_dir, TEMPLATES[name], tmp_path)
    turns = ([SYSTEM] if system else []) + TWO_TURNS
    rows = encode_chats(tokenizer, [turns])
    answers = [text.strip() for text in trained_text(tokenizer, rows.ids[0], rows.masks[0])]
    end = {"chatml": "<|im_end|>", "llama3": "</s>", "zephyr": "</s>", "mistral": "</s>"}[name]
    assert answers == [f"quick brown{end}", f"lazy, it jumps over{end}"]
    assert rows.kinds == [KIND_SAMPLE]
    whole = tokenizer.render_chat(turns)
    assert tokenizer._tokenizer.decode(rows.ids[0]) == whole  # the ids are the rendered text


def test_a_template_that_rewrites_earlier_turns_still_finds_the_answers(tokenizer_dir,
                                                                        tmp_path):
    """Where the prefixes break, each answer's content is found in the text in order; an
    answer the template does not write is refused in one line."""
    tokenizer = tokenizer_with(tokenizer_dir, REWRITING, tmp_path)
    rows = encode_chats(tokenizer, [TWO_TURNS])
    assert [text.strip() for text in trained_text(tokenizer, rows.ids[0], rows.masks[0])] == \
        ["quick brown", "lazy, it jumps over</s>"]
    dropping = tokenizer_with(tokenizer_dir, DROPPING, tmp_path)
    with pytest.raises(ValueError, match="chat.jsonl line 1: the chat template does not write "
                                         "assistant message 1 as given"):
        encode_chats(dropping, [TWO_TURNS])


def test_loss_on_all_trains_every_token(tokenizer_dir, tmp_path):
    tokenizer = tokenizer_with(tokenizer_dir, CHATML, tmp_path)
    rows = encode_chats(tokenizer, [TWO_TURNS], loss_on="all")
    assert rows.masks == [None]


def test_prompt_and_completion_rows_train_on_the_completion(tokenizer_dir):
    tokenizer = HFTokenizer(tokenizer_dir)
    batch = RowBatch([1, 2], [{"prompt": "the quick", "completion": " brown fox"},
                              {"text": "the lazy dog"}], 0)
    rows = encode_rows(batch, Path("rows.jsonl"), tokenizer)
    prompt, = tokenizer.encode_batch(["the quick"], eos=False)
    assert rows.ids[0][:len(prompt)] == prompt and rows.ids[0][-1] == tokenizer.eos_id
    assert rows.masks[0].tolist() == [0] * len(prompt) + [1] * (len(rows.ids[0]) - len(prompt))
    assert trained_text(tokenizer, rows.ids[0], rows.masks[0]) == [" brown fox</s>"]
    assert rows.kinds == [KIND_SAMPLE, KIND_TEXT] and rows.masks[1] is None


@pytest.mark.parametrize("turns, message", [
    ([{"role": "assistant", "content": "hi"}], "message 0 is a assistant turn where a user "
                                               "turn belongs"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 1 is a user turn where a assistant turn belongs"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, SYSTEM],
     "message 2 is a system turn where a user turn belongs"),
    ([{"role": "user", "content": "a"}], "the last message is a user turn with no answer"),
    ([{"role": "robot", "content": "a"}], "message 0 must have a \"role\" of system, user, "
                                          "assistant"),
    ([], "must be a non-empty list"),
])
def test_conversations_out_of_order_are_refused_in_one_line(tokenizer_dir, turns, message):
    with pytest.raises(ValueError, match=message) as raised:
        encode_rows(RowBatch([7], [{"messages": turns}], 0), Path("chat.jsonl"),
                    HFTokenizer(tokenizer_dir))
    assert str(raised.value).startswith("chat.jsonl line 7: ") and "\n" not in str(raised.value)
    if turns:
        with pytest.raises(ValueError, match=message):
            check_messages(turns)


def as_text_parts(turns):
    """The turns as datasets keeps a column of conversations: each content a list of parts,
    each part with the keys of all (None where it has none)."""
    return [{**turn, "content": [{"type": "text", "text": turn["content"], "image": None}]}
            for turn in turns]


def test_contents_of_text_parts_are_the_conversation_of_strings(tokenizer_dir):
    """A conversation whose contents are lists of text parts (datasets' and TRL's layout)
    renders and trains as the same conversation with strings; an image in any turn but a
    user's is refused in one line."""
    tokenizer = HFTokenizer(tokenizer_dir)
    rows = encode_rows(RowBatch([0, 1], [{"messages": [SYSTEM, *TWO_TURNS]},
                                         {"messages": as_text_parts([SYSTEM, *TWO_TURNS])}],
                                0), Path("chat.jsonl"), tokenizer)
    assert rows.ids[0] == rows.ids[1] and rows.masks[0].tolist() == rows.masks[1].tolist()
    assert check_messages(as_text_parts(TWO_TURNS)) == TWO_TURNS
    answered_with_a_picture = [TWO_TURNS[0], {"role": "assistant", "content": [
        {"type": "image", "text": None}, {"type": "text", "text": "this"}]}]
    with pytest.raises(ValueError, match=r"message 1 must have .*\(a user's also "
                                         r'\{"type": "image"\} parts'):
        check_messages(answered_with_a_picture)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_bad_rows_name_file_and_line(tmp_path):
    tokenizer = HFTokenizer(save_tiny_tokenizer(tmp_path / "no-template"))
    neither = write_rows(tmp_path / "neither.jsonl", [{"text": "a"}, {"body": "b"}])
    with pytest.raises(ValueError, match=r"neither.jsonl line 2 has neither a string \"text\" "
                                         r"field nor \"messages\""):
        tokenize_dataset(str(neither), tokenizer, tmp_path / "cache")
    chat = write_rows(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    with pytest.raises(ValueError, match="has no chat template to render messages rows with: "
                                         "give one with --chat-template FILE"):
        tokenize_dataset(str(chat), tokenizer, tmp_path / "cache")
    with pytest.raises(ValueError, match="the byte-level tokenizer has none"):
        tokenize_dataset(str(chat), ByteTokenizer(), tmp_path / "cache")
    text_field = write_rows(tmp_path / "body.jsonl", [{"body": "the fox"}])
    data = tokenize_dataset(str(text_field), tokenizer, tmp_path / "cache",
                            options=ReadOptions(text_field="body"))
    assert data.num_documents == 1 and data.mask is None and data.kinds is None


# -- the cache and the samplers ---------------------------------------------------------------


def chat_rows(count, seed=0):
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog".split()
    rows = []
    for _ in range(count):
        turns = [SYSTEM] if rng.random() < 0.5 else []
        for _ in range(int(rng.integers(1, 3))):
            turns.append({"role": "user", "content": " ".join(rng.choice(words, 3))})
            turns.append({"role": "assistant", "content": " ".join(
                rng.choice(words, int(rng.integers(1, 8))))})
        rows.append({"messages": turns})
    return rows


def test_a_chat_cache_keeps_the_mask_kinds_and_rows(tmp_path, tokenizer_dir):
    tokenizer = HFTokenizer(tokenizer_dir)
    file = write_rows(tmp_path / "chat.jsonl", chat_rows(20))
    data = tokenize_dataset(str(file), tokenizer, tmp_path / "cache")
    assert data.mask is not None and data.mask.dtype == np.uint8 and len(data.mask) == \
        data.num_tokens
    assert 0 < data.mask.sum() < data.num_tokens
    assert data.kinds.tolist() == [KIND_SAMPLE] * 20 and data.rows.tolist() == list(range(1, 21))
    assert data.place(4) == f"{file} line 5"
    whole = tokenize_dataset(str(file), tokenizer, tmp_path / "cache",
                             options=ReadOptions(loss_on="all"))
    assert whole.mask is None and np.array_equal(whole.tokens, data.tokens)


def source_positions(sampler, sequence):
    """Where each token of sequence ``sequence`` comes from in the token array, and where
    each of its document pieces ends (a piece's last token has no target)."""
    if sampler._whole:
        pieces = sampler._sequence_pieces(sequence)
        starts, lengths = sampler._piece_starts[pieces], sampler._piece_lengths[pieces]
        return (np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)]),
                np.cumsum(lengths))
    if sampler.pack:
        sources, lengths = sampler._window(sequence * sampler.seq_len)
        ends = np.cumsum(lengths)
        return np.concatenate([np.arange(s, s + n) for s, n in zip(sources, lengths)]), ends
    epoch, index = divmod(sequence, len(sampler._piece_starts))
    piece = sampler._epoch(epoch)[0][index]
    start, length = int(sampler._piece_starts[piece]), int(sampler._piece_lengths[piece])
    return np.arange(start, start + length), np.array([length])


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_samplers_train_exactly_the_masked_tokens(tmp_path, tokenizer_dir, pack):
    """A target counts exactly where the data's mask marks the next token of the same
    document piece, packed or not."""
    file = write_rows(tmp_path / "chat.jsonl", chat_rows(30))
    data = tokenize_dataset(str(file), HFTokenizer(tokenizer_dir), tmp_path / "cache")
    batch_size = 4
    sampler = TextSampler(data, 48, batch_size, seed=3, pack=pack)
    tokens, mask = np.asarray(data.tokens), np.asarray(data.mask)
    for step in range(6):
        batch = sampler.batch(step)
        for row in range(batch_size):
            positions, ends = source_positions(sampler, step * batch_size + row)
            expected = np.full(48, IGNORE_INDEX)
            for k in range(len(positions) - 1):
                if k + 1 not in ends and mask[positions[k + 1]]:
                    expected[k] = tokens[positions[k + 1]]
            assert batch.targets[row].tolist() == expected.tolist()
            assert batch.tokens[row, :len(positions)].tolist() == tokens[positions].tolist()


def test_samples_are_packed_whole(tmp_path, tokenizer_dir):
    """Packed chat data: every sequence holds whole samples (a long one cut to seq_len, a
    long text document in pieces) and padding; an epoch places every piece once; a sampler
    made afresh for a late step gives the same batch."""
    rows = chat_rows(60) + [{"text": "the quick brown fox " * 30}]
    file = write_rows(tmp_path / "mixed.jsonl", rows)
    data = tokenize_dataset(str(file), HFTokenizer(tokenizer_dir), tmp_path / "cache")
    seq_len, batch_size = 64, 4
    sampler = TextSampler(data, seq_len, batch_size, seed=1, pack=True)
    tokens, offsets = np.asarray(data.tokens), np.asarray(data.offsets)
    whole = {(int(offsets[d]), min(int(offsets[d + 1] - offsets[d]), seq_len))
             for d in range(data.num_documents - 1)}
    placed = []
    sampler._sequence_pieces(0)
    epoch_length = sampler._epoch_firsts[1]  # sequences in the first epoch
    for sequence in range(epoch_length):
        batch = sampler.sequences([sequence])
        assert sum(batch.doc_lens[0]) == seq_len
        pieces = sampler._sequence_pieces(sequence)
        at = 0
        for piece in pieces:
            start, length = int(sampler._piece_starts[piece]), int(sampler._piece_lengths[piece])
            assert start < offsets[-2] or length <= seq_len  # the text document's pieces
            if start < offsets[-2]:
                assert (start, length) in whole  # a sample, whole from its start
            assert batch.tokens[0, at:at + length].tolist() == tokens[start:start + length].tolist()
            at += length
        assert (batch.targets[0, at:] == IGNORE_INDEX).all()  # padding trains nothing
        placed.append(pieces)
    in_first_epoch = np.concatenate(placed)
    assert sorted(in_first_epoch.tolist()) == list(range(len(sampler._piece_starts)))
    late = TextSampler(data, seq_len, batch_size, seed=1, pack=True).batch(37)
    assert late.tokens.equal(sampler.batch(37).tokens)
    assert late.doc_lens == sampler.batch(37).doc_lens


def test_long_samples_are_cut_to_the_sequence(tmp_path, tokenizer_dir):
    """A chat sample longer than seq_len gives one sequence (its start), not several; a
    document of text still gives several."""
    rows = [{"messages": [{"role": "user", "content": "the fox " * 20},
                          {"role": "assistant", "content": "lazy dog " * 20}]},
            {"text": "the quick brown fox " * 20}]
    file = write_rows(tmp_path / "mixed.jsonl", rows)
    data = tokenize_dataset(str(file), HFTokenizer(tokenizer_dir), tmp_path / "cache")
    seq_len = 16
    assert data.samples_longer_than(seq_len).tolist() == [0] and data.lengths[1] > 2 * seq_len
    sampler = TextSampler(data, seq_len, 1)
    pieces = sampler._piece_lengths
    assert len(pieces) == 1 + -(-int(data.lengths[1]) // seq_len)
    packed = TextSampler(data, seq_len, 1, pack=True)
    assert packed._stream_tokens == seq_len + int(data.lengths[1])


# -- Parquet and save_to_disk -----------------------------------------------------------------


def same_cache(left, right):
    return (np.array_equal(left.tokens, right.tokens) and np.array_equal(left.offsets,
                                                                         right.offsets)
            and (left.mask is None) == (right.mask is None)
            and (left.mask is None or np.array_equal(left.mask, right.mask))
            and (left.kinds is None) == (right.kinds is None)
            and (left.kinds is None or np.array_equal(left.kinds, right.kinds)))


@pytest.mark.parametrize("kind", ["chat", "text", "prompt"])
def test_parquet_and_save_to_disk_give_the_jsonl_cache(tmp_path, tokenizer_dir, kind):
    """The same rows as jsonl, as a Parquet file read in small batches, and as a folder
    written by datasets' save_to_disk in several shards: one token cache."""
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rows = {"chat": chat_rows(40),
            "text": [{"text": f"the quick fox {i} " * (i % 5 + 1)} for i in range(40)],
            "prompt": [{"prompt": f"the dog {i}?", "completion": " lazy" * (i % 4 + 1)}
                       for i in range(40)]}[kind]
    tokenizer = HFTokenizer(tokenizer_dir)
    jsonl = tokenize_dataset(str(write_rows(tmp_path / "rows.jsonl", rows)), tokenizer,
                             tmp_path / "cache")
    parquet.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=7)
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=3)
    for path in (tmp_path / "rows.parquet", folder):
        assert same_cache(jsonl, tokenize_dataset(str(path), tokenizer, tmp_path / "cache"))
    assert tokenize_dataset(str(folder), tokenizer, tmp_path / "cache").place(39).endswith(
        "data-00002-of-00003.arrow row 12")


def test_a_parquet_file_without_the_column_is_refused_in_one_line(tmp_path, tokenizer_dir):
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pa.Table.from_pylist([{"body": "a", "id": 1}]), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x.parquet has no column \"text\" nor \"messages\" "
                                         r".*its columns are body, id: name the text column "
                                         "with --text-field NAME"):
        tokenize_dataset(str(tmp_path / "x.parquet"), HFTokenizer(tokenizer_dir),
                         tmp_path / "cache")


def test_chats_render_directly_only_after_transformers_agreed(tokenizer_dir):
    """The first CHECKED_RENDERS renders go through apply_chat_template and are compared
    with the compiled template's; one disagreement keeps every render on transformers'."""
    from meshpipe.train.data.tokenizers import CHECKED_RENDERS

    agreeing = HFTokenizer(tokenizer_dir)
    exact = agreeing._tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    for _ in range(CHECKED_RENDERS):
        assert agreeing.render_chat(TWO_TURNS) == exact
    direct_calls = []
    direct = agreeing._direct
    agreeing._direct = lambda *args: direct_calls.append(args) or direct(*args)
    assert agreeing.render_chat(TWO_TURNS) == exact and len(direct_calls) == 1
    disagreeing = HFTokenizer(tokenizer_dir)
    disagreeing._direct = lambda messages, add_generation_prompt: "something else"
    for _ in range(CHECKED_RENDERS + 2):
        assert disagreeing.render_chat(TWO_TURNS) == exact
    assert disagreeing._direct is None


def test_the_mask_file_starts_where_a_token_is_first_left_out(tmp_path, tokenizer_dir,
                                                              monkeypatch):
    """Text rows only: no mask file. Text rows, then (batches later) chat rows: the mask
    holds ones for every text token written before it started."""
    from meshpipe.train.data import records

    monkeypatch.setattr(records, "BATCH_ROWS", 2)
    tokenizer = HFTokenizer(tokenizer_dir)
    texts = [{"text": f"the quick fox {i}"} for i in range(5)]
    plain = tokenize_dataset(str(write_rows(tmp_path / "plain.jsonl", texts)), tokenizer,
                             tmp_path / "cache")
    assert plain.mask is None and not list((tmp_path / "cache").glob("*/mask.npy"))
    mixed = tokenize_dataset(str(write_rows(tmp_path / "mixed.jsonl", texts + chat_rows(4))),
                             tokenizer, tmp_path / "cache")
    chats = tokenize_dataset(str(write_rows(tmp_path / "chats.jsonl", chat_rows(4))),
                             tokenizer, tmp_path / "cache")
    text_tokens = plain.num_tokens
    assert np.asarray(mixed.mask[:text_tokens]).all()
    assert np.array_equal(mixed.mask[text_tokens:], chats.mask)
