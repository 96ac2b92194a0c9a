"""README.md and docs/ cannot drift from the code: what they show is checked against it.

- Every ``meshpipe ...`` command they show (in a code block or inline code) parses with the
  real argument parser (nothing runs); a placeholder such as ``S`` or ``OUT-DIR`` stands for a
  value the flag before it takes.
- Every ``--flag`` they name is a flag of a ``meshpipe`` command, of the benchmark script it
  is given to (or of any benchmark script, in prose), or of an outside tool they show
  (``EXTERNAL_FLAGS``).
- Every relative link and image resolves; every ``meshpipe.a.b`` name and every source,
  benchmark or docs path in inline code exists.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

from meshpipe import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("train", "schedule", "tune", "plan", "export", "plot", "demo")
# Flags of the outside tools the pages show next to meshpipe's.
EXTERNAL_FLAGS = {
    "torchrun": {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint",
                 "--rdzv-backend", "--rdzv-id", "--max-restarts", "--standalone"},
    "tensorboard": {"--logdir"},
    "pip": {"--no-deps", "--index-url", "--quiet"},
}
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOTTED = re.compile(r"\bmeshpipe(?:\.[A-Za-z_]\w*)+")
SOURCE_PATH = re.compile(
    r"^(?:src/)?(?:meshpipe|benchmarks|tests|docs)/[\w./-]+\.(?:py|md|png|txt)$")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_.-]*|<[^>]+>)$")
SCRIPT_LINE = re.compile(r"benchmarks/(\w+\.py)([^`|;&>]*)")
COMMAND_END = re.compile(r"\s(?:\||;|&&|>>?|2>&1)\s.*$")


def _code_blocks(text: str) -> list[str]:
    """The commands of fenced blocks: continued lines joined, prompts dropped."""
    lines = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            lines.append(line.strip().removeprefix("$ "))
    return lines


def _inline_spans(text: str) -> list[str]:
    return INLINE.findall(FENCE.sub("", text))


def _meshpipe_command(line: str) -> list[str] | None:
    """The arguments after ``meshpipe`` in ``line`` (also ``-m meshpipe``), if it runs one of
    its commands; a comment or what a shell does after the command is left out."""
    line = COMMAND_END.sub("", line.split(" # ")[0]).strip().rstrip(":")
    match = re.search(r"(?:^|\s|-m\s)meshpipe\s+(" + "|".join(COMMANDS) + r")\b(.*)$", line)
    if match is None:
        return None
    return [match.group(1), *[word for word in shlex.split(match.group(2)) if word != "..."]]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _parser_for(words: list[str]) -> argparse.ArgumentParser:
    parser = cli._parser()
    for word in words:
        parser = _subparsers(parser).get(word, parser)
    return parser


def _placeholder_value(parser: argparse.ArgumentParser, word: str, flag: str | None) -> str:
    """A value that the flag ``flag`` of ``parser`` takes, or without a flag the positional
    argument named ``word``: its first choice, else a number."""
    if flag is not None:
        action = parser._option_string_actions.get(flag)
    else:
        action = next((action for action in parser._actions if not action.option_strings
                       and word in (action.metavar, action.dest.upper())), None)
    if action is not None and action.choices:
        return str(list(action.choices)[0])
    return "1"


def _filled(words: list[str]) -> list[str]:
    """``words`` with each placeholder replaced by a value its flag takes."""
    parser = _parser_for(words)
    filled = []
    for index, word in enumerate(words):
        if PLACEHOLDER.match(word) and not word.startswith("-"):
            previous = words[index - 1] if index else None
            word = _placeholder_value(parser, word, previous if previous
                                      and previous.startswith("-") else None)
        filled.append(word)
    return filled


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for line in _code_blocks(text) + _inline_spans(text):
            words = _meshpipe_command(line)
            if words is not None:
                found.append((f"{page.name}: {line}", words))
    return found


def _names_a_command(words: list[str]) -> bool:
    """Whether ``words`` only name a command (``meshpipe tune``, ``meshpipe schedule
    compare``) rather than show a command line."""
    parser = cli._parser()
    for word in words:
        commands = _subparsers(parser)
        if word not in commands:
            return False
        parser = commands[word]
    return True


def _parse_error(words: list[str]) -> str | None:
    if _names_a_command(words):
        return None
    try:
        cli._parser().parse_args(_filled(words))
    except cli.CommandLineError as error:
        return str(error)
    except SystemExit:  # --help
        return None
    return None


@lru_cache(maxsize=None)
def _meshpipe_flags() -> frozenset[str]:
    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(option for option in action.option_strings if option.startswith("--"))
        for sub in _subparsers(parser).values():
            walk(sub)

    walk(cli._parser())
    return frozenset(flags)


@lru_cache(maxsize=None)
def _script_flags(script: str) -> frozenset[str]:
    """The flags a benchmark script (with the harness it shares) spells out."""
    paths = [ROOT / "benchmarks" / "harness.py"]
    if script:
        paths.append(ROOT / "benchmarks" / script)
    else:
        paths = sorted((ROOT / "benchmarks").glob("*.py"))
    flags: set[str] = set()
    for path in paths:
        for flag in re.findall(r"[\"'](--[a-z][a-z0-9-]*)", path.read_text()):
            flags.update((flag, "--no-" + flag[2:]))
    return frozenset(flags)


def _unknown_flags(text: str) -> list[str]:
    """The flags of ``text`` (a page) that no command they could belong to has: those given
    to a benchmark script on its command line must be that script's."""
    known = _meshpipe_flags() | _script_flags("") | set().union(*EXTERNAL_FLAGS.values())
    unknown = []
    for line in text.splitlines():
        for flag in FLAG.findall(line):
            if flag not in known:
                unknown.append(f"{flag} in: {line.strip()[:100]}")
        for script, arguments in SCRIPT_LINE.findall(line):
            for flag in FLAG.findall(arguments):
                if flag not in _script_flags(script) and flag in known:
                    unknown.append(f"{flag} (not a flag of {script}) in: {line.strip()[:100]}")
    return unknown


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(target)
    return broken


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def _missing_names_and_paths(page: Path) -> list[str]:
    missing = []
    for span in _inline_spans(page.read_text()):
        for name in DOTTED.findall(span):
            if not _resolves(name.rstrip(".")):
                missing.append(name)
        path = span.strip()
        if SOURCE_PATH.match(path) and not ((ROOT / path).exists()
                                            or (ROOT / "src" / path).exists()):
            missing.append(path)
    return missing


def test_the_pages_show_commands():
    assert len(_commands()) > 50


@pytest.mark.parametrize("where, words", _commands(), ids=lambda value: None)
def test_every_command_shown_parses(where, words):
    assert _parse_error(words) is None, f"{where}: {_parse_error(words)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_flag_named_exists(page):
    assert _unknown_flags(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_resolves(page):
    assert _broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_module_name_and_path_exists(page):
    pytest.importorskip("transformers")  # meshpipe.models.hf imports it
    assert _missing_names_and_paths(page) == []


def test_a_made_up_flag_fails():
    page = "Run `meshpipe train --pp 2 --frobnicate 3` to train.\n"
    assert _unknown_flags(page) == [f"--frobnicate in: {page.strip()}"]
    assert "--frobnicate" in _parse_error(_meshpipe_command(INLINE.findall(page)[0]))


def test_a_misspelt_benchmark_flag_fails():
    line = "python3 benchmarks/gpu_check.py --only pp1 --roundz 2"
    assert _unknown_flags(line) == [f"--roundz in: {line}"]


def test_placeholders_take_a_value_of_their_flag():
    words = _meshpipe_command("meshpipe schedule show NAME --pp P -m 4 --png OUT.png")
    assert _filled(words)[:3] == ["schedule", "show", "none"]
    assert _parse_error(words) is None
    assert _parse_error(["schedule", "compare", "--recompute", "full"]) is not None


def test_a_broken_link_and_a_moved_module_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[gone](nowhere.md) [here](page.md) `meshpipe.train.TrainConfig` "
                    "`meshpipe.train.config.TrainConfig` `src/meshpipe/train/gone.py`\n")
    assert _broken_links(page) == ["nowhere.md"]
    assert _missing_names_and_paths(page) == ["meshpipe.train.TrainConfig",
                                              "src/meshpipe/train/gone.py"]
