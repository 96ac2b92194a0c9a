"""Bad input and failing ranks: clear errors naming rank, stage, microbatch and action; no hang.

Each pool case runs on its own process group (a failed step leaves messages in flight that
must not reach the next case) with an explicit short receive timeout, catches the error on
every rank and returns what it saw. The harness timeout turns any hang into a failure.
A rank raising mid-step under the launcher stops the whole run and is named.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshpipe.comm.p2p import P2PTransport
from meshpipe.runtime import Executor, ExecutorError, Stage
from meshpipe.schedules import build
from meshpipe.schedules.actions import Action
from meshpipe.schedules.lowering import lower
from meshpipe.schedules.schedule import Schedule
from meshpipe.testing import run_distributed
from meshpipe.train.supervisor.launch import LaunchError, launch

pytestmark = pytest.mark.distributed

DIM = 4
MICROBATCHES = 2
# Generous for messages that do come (the machine may be loaded); the silent-peer case,
# which waits it out, uses its own short one.
RECV_TIMEOUT_S = 20.0
SILENT_PEER_TIMEOUT_S = 2.0
HARNESS_TIMEOUT_S = 60.0
# Each case's own group: receives a failed step left posted fail after this and free their
# threads instead of lingering until the worker exits.
GROUP_TIMEOUT = timedelta(seconds=30)


class Producer(nn.Module):
    """A first stage; ``mode`` picks what it sends on."""

    def __init__(self, mode: str = "pair"):
        super().__init__()
        self.mode = mode
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.linear(x)
        if self.mode == "triple":
            return h, h * 2, h * 3
        if self.mode == "float64":
            return h.double(), torch.tanh(h).double()
        return h, torch.tanh(h)


class Consumer(nn.Module):
    """A stage taking ``(hidden, side)``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden, side):
        return self.linear(hidden) + side


class FailsOnCall(nn.Module):
    """A middle stage that raises on its ``fail_at``-th forward (one microbatch)."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, hidden, side):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("deliberate failure inside the module")
        return self.linear(hidden), side


def mean_square(output, target):
    return ((output - target) ** 2).mean()


def elementwise_square(output, target):
    return (output - target) ** 2


def data():
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, DIM, generator=generator) for _ in range(MICROBATCHES)]
    targets = [torch.randn(2, DIM, generator=generator) for _ in range(MICROBATCHES)]
    return inputs, targets


def _outcome(error: BaseException) -> dict:
    return {"type": type(error).__name__, "message": str(error),
            "peer": getattr(error, "peer", None),
            "failed_rank": getattr(error, "failed_rank", None)}


def _step_outcome(executor: Executor, inputs, targets) -> dict | None:
    """Run one step; the error it raised, or None. Returns once every rank is done, so that
    no rank drops its transport (and the stop notices in it) while a peer still waits."""
    outcome = None
    try:
        executor.step(inputs, targets)
    except ExecutorError as error:
        outcome = _outcome(error)
    dist.barrier()
    return outcome


def _two_stage_step(rank: int, *, producer: str = "pair", loss_fn=mean_square,
                    inputs="data", targets="data"):
    """One 1F1B step of Producer -> Consumer on a fresh group; None or the error seen."""
    group = dist.new_group([0, 1], timeout=GROUP_TIMEOUT)
    schedule = build("1f1b", 2, MICROBATCHES)
    module = Producer(producer) if rank == 0 else Consumer()
    stage = Stage(module, rank, 2, loss_fn=loss_fn if rank == 1 else None)
    executor = Executor(schedule, {rank: stage}, pp_rank=rank, pipeline_ranks=[0, 1],
                        transport=P2PTransport(group), recv_timeout=RECV_TIMEOUT_S)
    real_inputs, real_targets = data()
    return _step_outcome(executor, real_inputs if inputs == "data" else inputs,
                         real_targets if targets == "data" else targets)


def _case_arity(rank):
    return _two_stage_step(rank, producer="triple")


def _case_dtype(rank):
    return _two_stage_step(rank, producer="float64")


def _case_loss_not_scalar(rank):
    return _two_stage_step(rank, loss_fn=elementwise_square)


def _case_float64_inputs(rank):
    return _two_stage_step(rank, inputs=[x.double() for x in data()[0]])


def _case_missing_inputs(rank):
    return _two_stage_step(rank, inputs=None)


def _case_missing_targets(rank):
    return _two_stage_step(rank, targets=None)


def _case_one_target_missing(rank):
    return _two_stage_step(rank, targets=[data()[1][0], None])


def run_case(rank, world_size, case):
    return globals()[f"_case_{case}"](rank)


def _check_failing_rank(outcome, *fragments):
    assert outcome is not None and outcome["type"] == "ExecutorError", outcome
    for fragment in fragments:
        assert fragment in outcome["message"], (fragment, outcome["message"])


def _check_stopped_by(outcome, failed_rank, *fragments):
    assert outcome is not None and outcome["type"] == "PeerFailedError", outcome
    assert outcome["failed_rank"] == failed_rank
    for fragment in fragments:
        assert fragment in outcome["message"], (fragment, outcome["message"])


def test_a_message_that_does_not_fit_the_module_names_rank_stage_microbatch_action():
    first, second = run_distributed(2, run_case, "arity", timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(second, "global rank 1", "action #", "1F0", "stage 1", "microbatch 0",
                        "does not fit", "Tensor(2, 4):float32")
    _check_stopped_by(first, 1, "global rank 0", "0B0", "stage 1 -> 0, microbatch 0, backward",
                      "does not fit")


def test_a_dtype_mismatch_names_rank_stage_microbatch_action():
    first, second = run_distributed(2, run_case, "dtype", timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(second, "global rank 1", "1F0", "stage 1", "microbatch 0", "float64")
    _check_stopped_by(first, 1, "0B0")


def test_a_bad_input_on_the_first_stage_points_at_the_step_inputs_not_a_previous_stage():
    first, second = run_distributed(2, run_case, "float64_inputs", timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(first, "global rank 0", "0F0", "stage 0", "microbatch 0", "float64",
                        "inputs given to Executor.step(inputs=...)")
    assert "previous stage" not in first["message"]
    _check_stopped_by(second, 0, "1F0", "inputs given to Executor.step(inputs=...)")


def test_a_loss_that_is_not_a_scalar_is_refused_before_backward():
    first, second = run_distributed(2, run_case, "loss_not_scalar", timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(second, "global rank 1", "1F0", "stage 1", "microbatch 0",
                        "not a floating-point scalar", "Tensor(2, 4)")
    _check_stopped_by(first, 1, "0B0")


def test_missing_inputs_on_the_first_stage_stop_the_pipeline():
    first, second = run_distributed(2, run_case, "missing_inputs", timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(first, "global rank 0", "holds stage 0", "needs inputs for 2")
    _check_stopped_by(second, 0, "1F0", "stage 0 -> 1, microbatch 0, forward")


def test_missing_targets_on_the_last_stage_stop_the_pipeline():
    first, second = run_distributed(2, run_case, "missing_targets", timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(second, "global rank 1", "last stage 1", "needs targets for 2")
    _check_stopped_by(first, 1, "0B0")


def test_a_missing_target_of_one_microbatch_names_that_microbatch():
    first, second = run_distributed(2, run_case, "one_target_missing",
                                    timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(second, "global rank 1", "1F1", "microbatch 1", "no target")
    _check_stopped_by(first, 1, "0B1")


# ------------------------------------------- a mismatch, and the failing rank leaves at once

# How long the peer of the failing rank computes before it waits for the message the failure
# replaced: the failing rank is done with its step long before the peer looks. (At 0.5 s a
# loaded machine once let the failing rank's 0.1 s wait and its exit run past it: the peer
# then read the notice, not the closed connection, in the test that leaves.)
PEER_BUSY_S = 1.0


class LaterMismatch(nn.Module):
    """A first stage that sends ``(hidden, side)`` except on microbatch 1, where it sends what
    ``mode`` says; the backward of microbatch 0 takes ``PEER_BUSY_S`` longer."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.linear = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.linear(x)
        if self.calls == 1:
            h.register_hook(lambda grad: time.sleep(PEER_BUSY_S))
        if self.calls == 2 and self.mode == "triple":
            return h, h * 2, h * 3
        if self.calls == 2 and self.mode == "float64":
            return h.double(), torch.tanh(h).double()
        return h, torch.tanh(h)


def _step_then_leave(make) -> dict:
    """Run one step of the executor ``make()`` builds (with its inputs and targets); a rank
    whose own error stopped it then leaves at once, as a process that exits on the error
    would: its executor, transport and process group go while its peers still run their
    step. The error each rank saw and how long its step took."""
    executor, inputs, targets = make()
    start = time.monotonic()
    outcome = None
    try:
        executor.step(inputs, targets)
    except ExecutorError as error:
        outcome = _outcome(error)
    elapsed = time.monotonic() - start
    if outcome is not None and outcome["type"] == "ExecutorError":
        group = executor.transport.group
        del executor
        gc.collect()  # the executor holds cycles; its transport keeps the sends in flight
        dist.destroy_process_group(group)
        del group
        gc.collect()
    dist.barrier()
    return {"outcome": outcome, "elapsed": elapsed}


def _mismatch_then_leave(rank, world_size, mode, failing_timeout=RECV_TIMEOUT_S):
    """Stage 0 sends a message stage 1 cannot take on microbatch 1 (``mode``); stage 1 fails
    and leaves, while stage 0 is still busy with microbatch 0's backward."""

    def make():
        group = dist.new_group([0, 1], timeout=GROUP_TIMEOUT)
        schedule = build("1f1b", 2, MICROBATCHES)
        module = LaterMismatch(mode) if rank == 0 else Consumer()
        stage = Stage(module, rank, 2, loss_fn=mean_square if rank == 1 else None)
        executor = Executor(schedule, {rank: stage}, pp_rank=rank, pipeline_ranks=[0, 1],
                            transport=P2PTransport(group),
                            recv_timeout=failing_timeout if rank == 1 else RECV_TIMEOUT_S)
        inputs, targets = data()
        return executor, inputs if rank == 0 else None, targets if rank == 1 else None

    return _step_then_leave(make)


@pytest.mark.parametrize("mode,cause", [
    ("triple", "does not fit the module's forward"),
    ("float64", "got Double and Float"),
])
def test_a_mismatch_on_a_later_microbatch_stops_the_peer_though_the_failing_rank_leaves(
        mode, cause):
    """The failing rank waits until its peer took the stop notice before it raises, so a
    process that exits (or destroys its group) on the error does not cut the notice off:
    the peer raises PeerFailedError naming the rank and the cause, not gloo's "Connection
    closed by peer", and promptly."""
    first, second = run_distributed(2, _mismatch_then_leave, mode, timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(second["outcome"], "global rank 1", "1F1", "microbatch 1", cause)
    _check_stopped_by(first["outcome"], 1, "global rank 0", "0B1",
                      "'stage 1 -> 0, microbatch 1, backward' from global rank 1", cause)
    assert first["outcome"]["peer"] == 1
    assert first["elapsed"] < RECV_TIMEOUT_S / 2, first


def test_a_peer_that_takes_longer_than_the_failing_rank_waits_still_gets_peer_failed_error():
    """The failing rank waits for its notices only briefly (here 0.1 s, its receive timeout,
    while the peer is busy for 0.5 s) and leaves: the peer finds the connection closed and
    raises PeerFailedError naming that rank, instead of the transport's error."""
    first, second = run_distributed(2, _mismatch_then_leave, "triple", failing_timeout=0.1,
                                    timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(second["outcome"], "global rank 1", "1F1", "does not fit")
    _check_stopped_by(first["outcome"], 1, "global rank 0", "0B1", "closed its connection",
                      "see global rank 1's error")
    assert first["outcome"]["peer"] == 1
    assert first["elapsed"] < RECV_TIMEOUT_S / 2, first


def _swapped_microbatches(schedule):
    """``schedule`` with microbatches 0 and 1 swapped on every rank: a valid schedule that
    posts its messages in another order than the original."""
    swap = {0: 1, 1: 0}
    ranks = [[Action(a.kind, a.stage, swap.get(a.microbatch, a.microbatch)) for a in actions]
             for actions in schedule.ranks]
    return Schedule(schedule.num_ranks, schedule.num_stages, schedule.num_microbatches,
                    schedule.placement, ranks, name="swapped")


def _label_mismatch_then_leave(rank, world_size):
    """Rank 1 runs its microbatches in another order than its neighbours: its first receive
    gets a message whose label is not the one it expects (MessageMismatchError)."""

    def make():
        group = dist.new_group([0, 1, 2], timeout=GROUP_TIMEOUT)
        schedule = lower(build("1f1b", 3, 3))
        if rank == 1:
            schedule = _swapped_microbatches(schedule)
        module = Producer() if rank == 0 else Consumer() if rank == 2 else FailsOnCall(0)
        stage = Stage(module, rank, 3, loss_fn=mean_square if rank == 2 else None)
        executor = Executor(schedule, {rank: stage}, pp_rank=rank, pipeline_ranks=[0, 1, 2],
                            transport=P2PTransport(group), recv_timeout=RECV_TIMEOUT_S)
        generator = torch.Generator().manual_seed(2)
        inputs = [torch.randn(2, DIM, generator=generator) for _ in range(3)]
        targets = [torch.randn(2, DIM, generator=generator) for _ in range(3)]
        return executor, inputs if rank == 0 else None, targets if rank == 2 else None

    return _step_then_leave(make)


def test_a_label_mismatch_stops_both_neighbours_with_peer_failed_error():
    """The stop notices of a rank that failed on a label mismatch come in its own (wrong)
    order: the neighbours take them as notices, not as one more label mismatch."""
    outcomes = run_distributed(3, _label_mismatch_then_leave, timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(outcomes[1]["outcome"], "global rank 1", "carries a different label")
    for rank in (0, 2):
        _check_stopped_by(outcomes[rank]["outcome"], 1, f"global rank {rank}",
                          "carries a different label")
        assert outcomes[rank]["outcome"]["peer"] == 1
        assert outcomes[rank]["elapsed"] < RECV_TIMEOUT_S / 2, outcomes[rank]


# ---------------------------------------------------------------- construction


def _construct(rank, world_size, case):
    """Build an Executor from inconsistent pieces on every rank; the error text or None."""
    schedule = build("interleaved" if case == "vpp_schedule" else "1f1b", 2, 4,
                     stages_per_rank=2 if case == "vpp_schedule" else 1)
    if case == "vpp_schedule":  # one stage per rank given for a schedule of two per rank
        stages = {rank: Stage(Consumer(), rank, 2)}
    elif case == "wrong_index":  # keyed by this rank's stage but built as the other one
        stages = {rank: Stage(Consumer(), 1 - rank, 2)}
    elif case == "wrong_count":
        stages = {rank: Stage(Consumer(), rank, 3)}
    else:  # "no_loss": the last stage of a training schedule without loss_fn
        stages = {rank: Stage(Consumer(), rank, 2)}
    try:
        Executor(schedule, stages, pp_rank=rank, pipeline_ranks=[0, 1],
                 transport=P2PTransport(), recv_timeout=RECV_TIMEOUT_S)
    except (ExecutorError, TypeError) as error:
        return _outcome(error)
    return None


@pytest.mark.parametrize("case,rank,fragments", [
    ("vpp_schedule", 0, ["pipeline rank 0", "given stages [0]", "stages [0, 2]"]),
    ("vpp_schedule", 1, ["pipeline rank 1", "given stages [1]", "stages [1, 3]"]),
    ("wrong_index", 0, ["stages[0] was built as stage 1 of 2", "Stage(module, 0, 2"]),
    ("wrong_count", 1, ["stages[1] was built as stage 1 of 3", "stage 1 of 2"]),
    ("no_loss", 1, ["stage 1 is the last stage", "no loss_fn", "forward_only=True"]),
])
def test_stages_that_do_not_match_the_schedule_are_refused(case, rank, fragments):
    outcomes = run_distributed(2, _construct, case, timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(outcomes[rank], *fragments)


# ------------------------------------------------------------- failing ranks


def _silent_peer(rank, world_size, forward_only):
    """Rank 1 never runs its step: rank 0's wait for it must end in a named error."""
    group = dist.new_group([0, 1], timeout=GROUP_TIMEOUT)
    if rank == 1:
        dist.barrier()
        return None
    schedule = build("1f1b", 2, MICROBATCHES, forward_only=forward_only)
    executor = Executor(schedule, {0: Stage(Producer(), 0, 2)}, pp_rank=0,
                        pipeline_ranks=[0, 1], transport=P2PTransport(group),
                        recv_timeout=SILENT_PEER_TIMEOUT_S)
    return _step_outcome(executor, data()[0], None)


def test_a_receive_that_times_out_names_the_peer_and_the_awaited_message():
    outcome, _ = run_distributed(2, _silent_peer, False, timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(outcome, "global rank 0", "0B0", "timed out",
                        "'stage 1 -> 0, microbatch 0, backward' from rank 1")


def test_sends_never_received_by_the_end_of_the_step_name_the_peer_and_the_message():
    outcome, _ = run_distributed(2, _silent_peer, True, timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(outcome, "global rank 0", "at the end of the step", "timed out",
                        "'stage 0 -> 1, microbatch 0, forward' sent to rank 1")


def _four_stage_executor(fail_rank: int, fail_at: int) -> Executor:
    """A 1F1B pipeline over 4 ranks whose stage ``fail_rank`` raises on one microbatch."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(4)), timeout=GROUP_TIMEOUT)
    schedule = build("1f1b", 4, 4)
    if rank == 0:
        module = Producer()
    elif rank == 3:
        module = Consumer()
    else:
        module = FailsOnCall(fail_at if rank == fail_rank else 0)
    stage = Stage(module, rank, 4, loss_fn=mean_square if rank == 3 else None)
    return Executor(schedule, {rank: stage}, pp_rank=rank, pipeline_ranks=list(range(4)),
                    transport=P2PTransport(group), recv_timeout=RECV_TIMEOUT_S)


def _four_stage_data(rank: int):
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, DIM, generator=generator) for _ in range(4)]
    targets = [torch.randn(2, DIM, generator=generator) for _ in range(4)]
    return inputs if rank == 0 else None, targets if rank == 3 else None


def _mid_step_failure_in_pool(rank, world_size):
    executor = _four_stage_executor(fail_rank=2, fail_at=2)
    return _step_outcome(executor, *_four_stage_data(rank))


def test_a_rank_raising_mid_step_stops_every_rank_with_the_cause():
    outcomes = run_distributed(4, _mid_step_failure_in_pool, timeout=HARNESS_TIMEOUT_S)
    _check_failing_rank(outcomes[2], "global rank 2", "2F1", "microbatch 1",
                        "deliberate failure inside the module")
    for rank in (0, 1, 3):
        _check_stopped_by(outcomes[rank], 2, f"global rank {rank}",
                          "deliberate failure inside the module")
    # Rank 0 does not talk to rank 2: the stop reached it through rank 1.
    assert [outcomes[rank]["peer"] for rank in (0, 1, 3)] == [1, 2, 2]


def _mid_step_failure_under_launcher():
    executor = _four_stage_executor(fail_rank=1, fail_at=3)
    executor.step(*_four_stage_data(dist.get_rank()))


def test_the_launcher_stops_every_rank_and_names_the_one_that_raised():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_mid_step_failure_under_launcher, 4, timeout_s=600)
    elapsed = time.monotonic() - start
    message = str(info.value)
    # A neighbour may record its PeerFailedError a moment before rank 1 records its own
    # error; the launcher still names rank 1, whose failure is not a consequence.
    assert info.value.rank == 1, message
    assert "deliberate failure inside the module" in message
    assert "1F2" in message and "microbatch 2" in message
    # The acceptance bound of issue 3; with a 600 s group timeout only the stop path meets it.
    assert elapsed < 60, f"the run took {elapsed:.0f} s to stop"
