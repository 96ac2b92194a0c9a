"""Workers keep the memory a step frees for the next step (``runtime.host_memory``).

What that saves a Ulysses step in page faults is measured, not asserted:
``benchmarks/host_memory.py``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshpipe.runtime.host_memory import keep_freed_memory

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="mallopt and mallinfo2 are glibc's")

_PROBE = """
import json, sys
sys.path.insert(0, {tests!r})
from malloc_probe import where_large_blocks_go
from meshpipe.runtime.host_memory import keep_freed_memory
took = keep_freed_memory() if {keep} else None
print(json.dumps({{"took": took, "blocks": where_large_blocks_go()}}))
"""


def _fresh_process_blocks(keep: bool) -> dict:
    """Where a fresh process's first large blocks go, with or without keeping memory."""
    script = _PROBE.format(tests=str(Path(__file__).parent.parent), keep=keep)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.distributed
@glibc_only
def test_large_blocks_come_from_the_heap_and_stay_there_once_freed():
    default = _fresh_process_blocks(keep=False)
    kept = _fresh_process_blocks(keep=True)
    # Without the settings glibc maps a fresh process's first 16 MiB blocks on their own
    # and unmaps them when freed: the next step's faults.
    assert default["blocks"]["mapped"] and not default["blocks"]["kept"]
    assert kept["took"] is True
    assert kept["blocks"] == {"mapped": False, "kept": True}


@pytest.mark.parametrize("variable, value", [("MALLOC_TRIM_THRESHOLD_", "131072"),
                                             ("MALLOC_MMAP_THRESHOLD_", "131072"),
                                             ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")])
def test_the_users_own_malloc_settings_win(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    assert keep_freed_memory() is False
