"""``meshpipe train --config run.toml``: the file, the flags over it, and ``to_toml``."""

import argparse
import dataclasses
import re

import pytest

import meshpipe.cli
from meshpipe.train.config import TrainConfig
from meshpipe.train.run.arguments import add_arguments, from_arguments
from meshpipe.train.run.toml_config import TomlConfigError, load_toml, read_toml, to_toml

pytestmark = pytest.mark.distributed


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_arguments(parser.parse_args(list(argv)))


RUN = 'pp = 4\nschedule = "interleaved"\nvpp = 2\nseq-len = 128\nlr = 1\nprogress = false\n'


def test_file_values_are_applied_and_the_rest_are_defaults(tmp_path):
    config = parse("--config", str(write(tmp_path, RUN)))
    assert config == TrainConfig(pp=4, schedule="interleaved", vpp=2, seq_len=128, lr=1.0,
                                 progress=False)
    assert isinstance(config.lr, float)


def test_a_train_table_works_like_top_level_keys(tmp_path):
    path = write(tmp_path, "[train]\n" + RUN)
    assert parse("--config", str(path)) == parse("--config", str(write(tmp_path, RUN, "b.toml")))


def test_explicit_flags_override_the_file_even_when_they_equal_the_default(tmp_path):
    path = str(write(tmp_path, RUN + "steps = 50\ncheck = true\n"))
    config = parse("--config", path, "--pp", "2", "--steps", "30", "--no-check")
    assert (config.pp, config.steps, config.check) == (2, 30, False)
    assert (config.schedule, config.seq_len) == ("interleaved", 128)  # not given: the file's


def test_no_progress_overrides_progress_true_in_the_file(tmp_path):
    path = str(write(tmp_path, "progress = true\n"))
    assert parse("--config", path, "--no-progress").progress is False
    assert parse("--config", path).progress is True


def test_without_config_the_flags_and_defaults_make_the_config():
    assert parse() == TrainConfig()
    assert parse("--pp", "3", "--tie-embeddings") == TrainConfig(pp=3, tie_embeddings=True)


def test_a_hand_built_namespace_still_works():
    names = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    assert from_arguments(argparse.Namespace(**{**names, "pp": 4})) == TrainConfig(pp=4)
    assert from_arguments(argparse.Namespace(steps=7)) == TrainConfig(steps=7)


def test_an_unknown_key_is_named_with_the_closest_field(tmp_path):
    path = write(tmp_path, "seq_lenn = 128\n")
    with pytest.raises(TomlConfigError, match=r"run.toml: unknown key 'seq_lenn' "
                       r"\(did you mean 'seq_len'\?\)"):
        read_toml(path)
    with pytest.raises(TomlConfigError, match="unknown key 'zzz'; use a TrainConfig field"):
        read_toml(write(tmp_path, "zzz = 1\n"))


@pytest.mark.parametrize("line, message", [
    ("steps = true", "key 'steps' must be an integer, got true (a boolean)"),
    ("steps = 3.0", "key 'steps' must be an integer, got 3.0 (a float)"),
    ('lr = "3e-4"', 'key \'lr\' must be a number, got "3e-4" (a string)'),
    ("schedule = 1", "key 'schedule' must be a string, got 1 (an integer)"),
    ("check = 1", "key 'check' must be a boolean (true or false), got 1 (an integer)"),
    ("pp = [2]", "key 'pp' must be an integer, got [2] (an array)"),
])
def test_a_wrong_type_names_the_key_the_type_and_the_value(tmp_path, line, message):
    with pytest.raises(TomlConfigError) as error:
        read_toml(write(tmp_path, line + "\n"))
    assert str(error.value) == f"{tmp_path / 'run.toml'}: {message}"


def test_both_spellings_of_one_field_and_mixed_table_are_refused(tmp_path):
    with pytest.raises(TomlConfigError, match="both 'seq_len' and 'seq-len' set seq_len"):
        read_toml(write(tmp_path, "seq_len = 8\nseq-len = 16\n"))
    with pytest.raises(TomlConfigError, match=r"both a \[train\] table and top-level keys "
                       r"\('pp'\)"):
        read_toml(write(tmp_path, "pp = 2\n[train]\nsteps = 3\n"))


def test_a_missing_file_is_named(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(TomlConfigError, match=re.escape(f"{path}: no such file")):
        parse("--config", str(path))


def test_bad_toml_names_the_file_and_the_line(tmp_path):
    path = write(tmp_path, "pp = 2\nsteps = = 3\n")
    expected = re.escape(f"{path}: not valid TOML: ") + ".*at line 2"
    with pytest.raises(TomlConfigError, match=expected):
        read_toml(path)


def test_the_config_is_validated_after_the_merge(tmp_path):
    path = str(write(tmp_path, "heads = 3\nkv_heads = 2\n"))
    with pytest.raises(ValueError, match="--heads 3 must be a multiple"):
        parse("--config", path)
    assert parse("--config", path, "--heads", "4").heads == 4


def test_to_toml_writes_only_the_changes_and_round_trips(tmp_path):
    config = TrainConfig(pp=4, schedule="interleaved", vpp=2, lr=3e-4, min_lr=1e-10,
                         progress=False, out_dir='runs/"quoted" \\back\\slash\ttab\u00e9\x7f')
    text = to_toml(config)
    assert text.startswith("# ")
    assert "lr = 0.0003\n" in text and "progress = false\n" in text and "steps" not in text
    assert load_toml(write(tmp_path, text)) == config


def test_to_toml_of_everything_round_trips_in_field_order(tmp_path):
    text = to_toml(TrainConfig(), only_changed=False)
    keys = [line.split(" = ")[0] for line in text.splitlines() if not line.startswith("#")]
    assert keys == [field.name for field in dataclasses.fields(TrainConfig)]
    assert load_toml(write(tmp_path, text)) == TrainConfig()
    assert load_toml(write(tmp_path, to_toml(TrainConfig()), "empty.toml")) == TrainConfig()


def test_cli_trains_the_merged_config(tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(meshpipe.cli, "_train_and_report",
                        lambda config: trained.append(config) or 0)
    path = str(write(tmp_path, RUN))
    assert meshpipe.cli.main(["train", "--config", path, "--pp", "2"]) == 0
    assert trained == [TrainConfig(pp=2, schedule="interleaved", vpp=2, seq_len=128, lr=1.0,
                                   progress=False)]


def test_cli_reports_a_bad_key_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(meshpipe.cli, "_train_and_report",
                        lambda config: pytest.fail("must not train"))
    path = write(tmp_path, "seq_lenn = 128\n")
    assert meshpipe.cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"meshpipe: error: {path}: unknown key 'seq_lenn' (did you mean "
                   f"'seq_len'?)\n")
