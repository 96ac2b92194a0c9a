"""Layouts the ranks could not run are refused by the launcher's plan, in one line, before
any process starts: the attention heads against the tensor- and context-parallel degrees."""

import io
import itertools
from contextlib import redirect_stderr

import pytest

from meshpipe import cli
from meshpipe.context.heads import plan_heads
from meshpipe.context.interface import AttentionError
from meshpipe.train.config import TrainConfig
from meshpipe.train.run.plan import plan_run

HEADS = (1, 2, 3, 4, 6, 8)
ULYSSES = (1, 2, 3, 4, 8)


def _ranks_can_deal(heads: int, kv_heads: int, tp: int, ulysses: int) -> bool:
    """What the ranks' Ulysses attention does with the heads one rank holds."""
    try:
        plan_heads(heads // tp, kv_heads // tp, ulysses)
    except AttentionError:
        return False
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_head_and_degree_combination_is_decided_before_processes_start(tp, tmp_path):
    accepted = refused = 0
    for heads, ulysses, ring in itertools.product(HEADS, ULYSSES, (1, 2)):
        for kv_heads in (kv for kv in HEADS if heads % kv == 0):
            flags = dict(heads=heads, kv_heads=kv_heads, tp=tp, cp_ulysses=ulysses,
                         cp_ring=ring)
            runnable = (heads % tp == 0 and kv_heads % tp == 0
                        and _ranks_can_deal(heads, kv_heads, tp, ulysses))
            try:
                plan_run(TrainConfig(dim=96, layers=2, seq_len=48, out_dir=str(tmp_path),
                                     **flags))
            except ValueError as error:
                assert not runnable, f"{flags}: refused ({error}), but the ranks can run it"
                assert "\n" not in str(error)
                refused += 1
            else:
                assert runnable, f"{flags}: planned, but the ranks would fail"
                accepted += 1
    assert accepted and refused


def test_too_many_ulysses_ranks_for_the_heads_are_one_line_before_any_process(tmp_path):
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        status = cli.main(["train", "--cp-ulysses", "8", "--heads", "4", "--dim", "64",
                           "--out-dir", str(tmp_path)])
    assert status == cli.USAGE_ERROR
    assert stderr.getvalue() == (
        "meshpipe: error: --cp-ulysses 8 cannot spread the 4 query heads over 8 ranks: every "
        "Ulysses rank needs at least one head; use --cp-ulysses 4 or less, and --cp-ring for "
        "the rest of the context parallelism\n")
    assert not (tmp_path / "logs").exists()


def test_the_heads_of_a_tensor_parallel_rank_are_what_ulysses_deals(tmp_path):
    with pytest.raises(ValueError, match=r"the 2 query heads of a tensor-parallel rank "
                                         r"\(4 / --tp 2\) over 4 ranks"):
        plan_run(TrainConfig(dim=64, heads=4, kv_heads=2, tp=2, cp_ulysses=4,
                             out_dir=str(tmp_path)))
