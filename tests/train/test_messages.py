"""What a run says when it stops or is given a path that is not there: true, and one line."""

import io
import json
import time
from contextlib import redirect_stderr

import pytest

from meshpipe import cli
from meshpipe.train.config import TrainConfig
from meshpipe.train.data.tokenizers import resolve_tokenizer


def _checkpoint(out_dir, step):
    directory = out_dir / "checkpoint" / f"step-{step:06d}"
    directory.mkdir(parents=True)
    (directory / ".metadata").write_text("")
    (directory / "meta.json").write_text(json.dumps(
        {"step": step, "run_id": "run", "config": {}, "format": 1, "saved_at": time.time()}))


def test_a_stopped_run_says_resume_only_where_it_saved_a_checkpoint(tmp_path):
    config = TrainConfig(out_dir=str(tmp_path))
    assert cli._how_to_go_on(config) == (
        "no checkpoint was saved, so a new run starts from step 1 (--checkpoint-every N saves "
        "during a run, --checkpoint-on-signal when it is stopped)")
    _checkpoint(tmp_path, 3)
    assert cli._how_to_go_on(config) == "resume with --resume (from step-000003)"


def test_a_failure_starts_its_own_line_below_a_progress_bar(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert cli._below_the_bar(TrainConfig(progress=True)) == ""  # not a terminal
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert cli._below_the_bar(TrainConfig(progress=True)) == "\n"
    assert cli._below_the_bar(TrainConfig(progress=False)) == ""


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_export_of_a_path_without_a_checkpoint_says_which(tmp_path, kind):
    path = tmp_path / "run"
    if kind == "empty":
        path.mkdir()
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        status = cli.main(["export", "--checkpoint", str(path), "--out", str(tmp_path / "E")])
    assert status == cli.USAGE_ERROR
    said = ("does not exist" if kind == "missing" else "holds no complete checkpoint")
    assert f"meshpipe: error: {path} {said}" in stderr.getvalue()


def test_a_tokenizer_path_that_is_not_there_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"^--tokenizer \S+ does not exist: give a directory"):
        resolve_tokenizer("", str(tmp_path / "nowhere"))
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer"):
        resolve_tokenizer("", str(tmp_path / "empty"))


def test_a_long_cause_is_cut_after_a_clause_and_says_so():
    from meshpipe.train.supervisor.launch import shortened_cause

    clauses = "; ".join(f"clause {i} says something about the layout" for i in range(30))
    short = shortened_cause(clauses, limit=200)
    assert short.endswith(" [...]") and len(short) <= 206
    assert short[:-len(" [...]")] == "; ".join(clauses.split("; ")[:len(short.split("; "))])
    assert shortened_cause("one line that fits") == "one line that fits"
    words = "word " * 100
    assert shortened_cause(words, limit=42) == "word " * 7 + "word [...]"
