"""The strict communication mode executes each pair's point-to-point operations and each
group's collectives in posting order, as NCCL does: an exchange in which both ranks receive
before they send deadlocks under it (and is reported in one line) while plain gloo runs it;
the same exchange in a safe order, a batch, a collective and a pipeline with --check pass."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from meshpipe.comm import strict
from meshpipe.testing import run_distributed
from trainer_cases import SMALL, check_first_step

pytestmark = pytest.mark.distributed


def exchange(rank, world_size, strict_mode, receive_first):
    """Ranks 0 and 1 swap a tensor; ``receive_first``: each posts its receive first."""
    other = 1 - rank
    mine, theirs = torch.full((4,), float(rank)), torch.zeros(4)
    # A group of its own: a deadlock reported leaves its connection closed, not the pool's.
    group = dist.new_group([0, 1])

    def run():
        if receive_first or rank == 1:
            posted = [dist.irecv(theirs, src=other, group=group),
                      dist.isend(mine, dst=other, group=group)]
        else:
            posted = [dist.isend(mine, dst=other, group=group),
                      dist.irecv(theirs, src=other, group=group)]
        for work in posted:
            work.wait()
        return theirs.tolist()

    if not strict_mode:
        return run()
    with strict.installed(timeout_s=3):
        try:
            return run()
        except strict.StrictOrderError as error:
            return str(error)


def test_both_receiving_first_deadlocks_only_in_strict_mode():
    assert run_distributed(2, exchange, False, True) == [[1.0] * 4, [0.0] * 4]
    reports = run_distributed(2, exchange, True, True)
    for rank, report in enumerate(reports):
        assert isinstance(report, str) and "\n" not in report, report
        assert f"rank {rank} would deadlock on NCCL: receive from rank {1 - rank}" in report


def test_a_safe_order_a_batch_and_collectives_pass_in_strict_mode():
    assert run_distributed(2, exchange, True, False) == [[1.0] * 4, [0.0] * 4]
    assert run_distributed(2, batch_and_collectives) == [[1.0, 2.0]] * 2


def batch_and_collectives(rank, world_size):
    other = 1 - rank
    with strict.installed(timeout_s=5):
        mine, theirs = torch.full((2,), float(rank)), torch.zeros(2)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, other),
                                        dist.P2POp(dist.isend, mine, other)])
        for work in works:
            work.wait()
        assert theirs.tolist() == [float(other)] * 2
        total = torch.tensor([1.0, 2.0]) / 2
        dist.all_reduce(total)
        dist.barrier()
        return total.tolist()


STRICT_LAYOUTS = {
    "pp2-1f1b": dict(pp=2, schedule="1f1b"),
    "pp2-interleaved": dict(pp=2, vpp=2, schedule="interleaved"),
    "pp2-zb-v": dict(pp=2, vpp=2, schedule="zb-v"),
    "pp2-batched-p2p": dict(pp=2, p2p="batched"),
    "ring2": dict(pp=1, schedule="none", cp_ring=2),
    "ulysses2": dict(pp=1, schedule="none", cp_ulysses=2),
    "tp2": dict(pp=1, schedule="none", tp=2),
    "dp2-zero2": dict(pp=1, schedule="none", dp=2, zero=2),
    "tp2-sequence-parallel": dict(pp=1, schedule="none", tp=2, sequence_parallel=True),
    "combined-1f1b-ep2": dict(pp=1, dp=2, ep=2, moe_experts=4, schedule="combined-1f1b"),
}
# Four ranks or a longer schedule: make test-slow.
SLOW_STRICT_LAYOUTS = {
    "pp2-dualpipe-v": dict(pp=2, schedule="dualpipe-v"),
    "pp2-vtp-2,1": dict(pp=2, stage_tp="2,1"),
    "pp2-cp-ring2": dict(pp=2, cp_ring=2),
    "hybrid-2x2": dict(pp=1, schedule="none", cp_ring=2, cp_ulysses=2),
    "pp2-dp2-zero1": dict(pp=2, dp=2, zero=1),
}


def strict_check(rank, world_size, config):
    """--check's report under the strict mode, and how many operations went through it."""
    from meshpipe.train.loop.trainer import Trainer

    with strict.installed() as mode:
        report = Trainer(config).check_first_step()
    return report, mode.posted


@pytest.mark.parametrize("layout", [*STRICT_LAYOUTS.values(), *(
    pytest.param(layout, marks=pytest.mark.slow) for layout in SLOW_STRICT_LAYOUTS.values())],
    ids=[*STRICT_LAYOUTS, *SLOW_STRICT_LAYOUTS])
def test_layouts_pass_check_in_strict_mode(tmp_path, layout):
    from meshpipe.train.config import TrainConfig

    config = TrainConfig(**{**SMALL, "microbatches": 4, **layout, "out_dir": str(tmp_path)})
    report, posted = run_distributed(config.world_size, strict_check, config)[0]
    assert report["passed"], report
    kind = "p2p" if config.pp > 1 or config.cp_ring > 1 else "collective"
    if config.ep > 1:
        assert posted["collective"] > 0, posted  # the experts' all-to-alls, from their thread
    assert posted[kind] > 0, posted


def test_the_pool_runs_a_function_in_strict_mode(tmp_path):
    from meshpipe.train.config import TrainConfig

    config = TrainConfig(**{**SMALL, "pp": 2, "out_dir": str(tmp_path)})
    report = run_distributed(2, check_first_step, config, strict=True)[0]
    assert report["passed"], report


def strict_steps(rank, world_size, config, strict_mode):
    """Two training steps' losses (the gradient buckets reduced as each stage's backward
    ends, overlapped with the rest of the step), under the strict mode or not."""
    from meshpipe.train.loop.trainer import Trainer

    with strict.installed() if strict_mode else contextlib.nullcontext():
        trainer = Trainer(config)
        return [trainer.train_step(step).loss for step in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_overlapped_bucket_reductions_train_the_same_in_strict_mode(tmp_path, zero):
    """Found by this test: torch's newer collective names (``reduce_scatter_single``), which
    the ZeRO buckets call, went around the strict mode's queue until it replaced them."""
    from meshpipe.train.config import TrainConfig

    config = TrainConfig(**{**SMALL, "pp": 2, "dp": 2, "zero": zero, "microbatches": 4,
                            "out_dir": str(tmp_path)})
    plain = run_distributed(4, strict_steps, config, False)
    assert run_distributed(4, strict_steps, config, True) == plain


@pytest.mark.parametrize("flags", [dict(), pytest.param(dict(cp_ring=2, pack=True),
                                                        marks=pytest.mark.slow)],
                         ids=["pp2", "pp2-ring2-packed"])
def test_a_vision_language_model_passes_check_in_strict_mode(tmp_path, flags):
    """Each microbatch crosses at its own length, so every message changes the layout both
    ways: the headers that say so go over the transport's gloo group, which stays gloo beside
    NCCL and is not ordered (ordering it deadlocked here: each side's first header send
    waited behind the other's)."""
    pytest.importorskip("transformers")
    from hf_models import save_tiny_vision_model
    from meshpipe.train.config import TrainConfig
    from meshpipe.train.data.shapes import write_shapes_corpus
    from trainer_cases import for_a_model

    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    data = write_shapes_corpus(tmp_path / "shapes", 40)
    config = TrainConfig(**{**for_a_model(dict(SMALL, seq_len=64, microbatches=2)), "pp": 2,
                            "model": str(model), "data": str(data), "out_dir": str(tmp_path),
                            **flags})
    report, posted = run_distributed(config.world_size, strict_check, config)[0]
    assert report["passed"], report
    assert posted["p2p"] > 0, posted
