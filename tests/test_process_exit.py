"""``exit_process``: a finished process ends with its status, its atexit handlers run and
its output flushed, without the interpreter's teardown; under torchrun it is sys.exit."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed  # each test starts a process

SCRIPT = """
import atexit, sys
from pathlib import Path
from meshpipe.process_exit import exit_process

marks = Path(sys.argv[1])

class TornDown:
    def __init__(self, path):
        self.path = path

    def __del__(self, open=open):  # builtins are gone by the time the teardown gets here
        with open(self.path, "a") as out:
            out.write("teardown ")

kept = TornDown(marks)
atexit.register(lambda: open(marks, "a").write("atexit "))
print("buffered, no newline", end="")
exit_process(3)
"""


def _run(tmp_path, **env):
    marks = tmp_path / "marks"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(marks)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})
    return done, marks.read_text().split()


def test_a_finished_process_runs_atexit_flushes_and_skips_the_teardown(tmp_path):
    done, marks = _run(tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert marks == ["atexit"]


def test_under_torchrun_the_interpreter_ends_as_usual(tmp_path):
    done, marks = _run(tmp_path, RANK="0", WORLD_SIZE="1")
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert marks == ["atexit", "teardown"]
