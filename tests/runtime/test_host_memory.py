"""Workers keep the memory a step frees for the next step (``runtime.host_memory``)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from meshpipe.runtime.host_memory import keep_freed_memory
from meshpipe.testing import run_distributed

pytestmark = pytest.mark.distributed

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


def _ulysses_page_faults(rank, world, steps, warmup):
    import resource

    import torch

    from meshpipe.context import UlyssesAttention

    seq, heads = 2048, 8
    generator = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, seq // world, heads, 64, generator=generator).requires_grad_()
               for _ in range(3))
    grad = torch.randn(1, seq // world, heads, 64)
    attention = UlyssesAttention()
    faults = []
    for _ in range(warmup + steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        attention(q, k, v, causal=True).backward(grad)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults[warmup:]


@glibc_only
def test_a_ulysses_step_in_a_worker_reuses_the_memory_the_last_one_freed():
    # With glibc's own thresholds each such step trims its heap at the end and faults
    # 2,000-3,000 pages back in (8-12 MiB); kept, a step touches no new page. Now and then
    # one step still faults 256-2,300 pages (a heap growing once): the median of 10 steps
    # stays clear of it, where the median of 4 failed once in 15 runs.
    for rank_faults in run_distributed(2, _ulysses_page_faults, 10, 6):
        assert statistics.median(rank_faults) < 64, rank_faults
