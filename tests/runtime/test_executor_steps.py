"""The Executor over several steps and in forward-only mode, on a 2-rank pipeline.

- a buffer the first stage sends on survives the step (only activations are freed), so a
  second step still matches a single process;
- a failed step is final: the stages are reset, every later step is refused with the first
  failure's reason, and the same stages run again under a new transport and executor;
- forward-only without targets returns the outputs and no losses; with targets, the losses;
- loss scales may be a tensor or a numpy array;
- the losses are read (a host synchronisation on a GPU) once the step's work is queued.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshpipe.comm.p2p import P2PTransport
from meshpipe.runtime import Executor, ExecutorError, Stage
from meshpipe.schedules import build
from meshpipe.testing import run_distributed

pytestmark = pytest.mark.distributed

DIM = 4
MICROBATCHES = 2
RECV_TIMEOUT_S = 20.0
HARNESS_TIMEOUT_S = 90.0
# A failed step leaves receives posted on its group; they fail after this and free their
# threads instead of lingering until the worker exits.
GROUP_TIMEOUT = timedelta(seconds=30)


class SendsItsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, DIM))

    def forward(self, x):
        return self.linear(x), self.scale


class UsesTheBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden, scale):
        return torch.tanh(self.linear(hidden)) * scale


def mean_square(output, target):
    return ((output - target) ** 2).mean()


def _modules() -> list[nn.Module]:
    torch.manual_seed(0)
    return [SendsItsBuffer(), UsesTheBuffer()]


def _data(step: int):
    generator = torch.Generator().manual_seed(10 + step)
    inputs = [torch.randn(3, DIM, generator=generator) for _ in range(MICROBATCHES)]
    targets = [torch.randn(3, DIM, generator=generator) for _ in range(MICROBATCHES)]
    return inputs, targets


def _reference(step: int, loss_scales=None):
    """One process: per-microbatch losses, outputs and the gradients of the scaled losses."""
    modules = _modules()
    inputs, targets = _data(step)
    scales = loss_scales if loss_scales is not None else [1 / MICROBATCHES] * MICROBATCHES
    losses, outputs = [], []
    for x, target, scale in zip(inputs, targets, scales):
        output = modules[1](*modules[0](x))
        loss = mean_square(output, target)
        (loss * float(scale)).backward()
        losses.append(loss.item())
        outputs.append(output.detach())
    grads = {f"{s}.{n}": p.grad for s, m in enumerate(modules) for n, p in m.named_parameters()}
    return losses, outputs, grads


def _stage(rank: int, modules: list[nn.Module]) -> Stage:
    return Stage(modules[rank], rank, 2, loss_fn=mean_square if rank == 1 else None)


def _executor(rank: int, stage: Stage, transport: P2PTransport, forward_only: bool = False):
    schedule = build("1f1b", 2, MICROBATCHES, forward_only=forward_only)
    return Executor(schedule, {rank: stage}, pp_rank=rank, pipeline_ranks=[0, 1],
                    transport=transport, recv_timeout=RECV_TIMEOUT_S)


def _grads(rank: int, stage: Stage) -> dict[str, torch.Tensor]:
    return {f"{rank}.{n}": p.grad.clone() for n, p in stage.module.named_parameters()}


def _check_against_reference(results, losses, grads, loss_key="loss"):
    torch.testing.assert_close(torch.tensor(results[1][loss_key]), torch.tensor(losses))
    seen = {name: grad for result in results for name, grad in result["grads"].items()}
    assert seen.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(seen[name], grad, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- buffers across steps


def _two_steps_sending_a_buffer(rank, world_size):
    modules = _modules()
    stage = _stage(rank, modules)
    executor = _executor(rank, stage, P2PTransport())
    for step in range(2):
        stage.module.zero_grad(set_to_none=True)
        inputs, targets = _data(step)
        result = executor.step(inputs, targets)
    return {"loss": result.losses, "grads": _grads(rank, stage),
            "buffer": modules[0].scale.clone()}


def test_a_buffer_sent_as_an_output_survives_the_step_and_training_stays_exact():
    results = run_distributed(2, _two_steps_sending_a_buffer, timeout=HARNESS_TIMEOUT_S)
    torch.testing.assert_close(results[0]["buffer"], torch.linspace(0.5, 2.0, DIM))
    losses, _, grads = _reference(step=1)
    _check_against_reference(results, losses, grads)


def _timeline_on_the_shared_clock(rank, world_size):
    stage = _stage(rank, _modules())
    executor = _executor(rank, stage, P2PTransport())
    inputs, targets = _data(0)
    before = time.perf_counter()
    result = executor.step(inputs, targets)
    after = time.perf_counter()
    return before, result.origin, [(result.origin + t.start, result.origin + t.end)
                                   for t in result.timeline], after


def test_a_steps_timeline_is_placed_on_perf_counters_clock_by_its_origin():
    for before, origin, spans, after in run_distributed(2, _timeline_on_the_shared_clock,
                                                        timeout=HARNESS_TIMEOUT_S):
        assert before <= origin and spans
        assert all(origin <= start <= end <= after for start, end in spans)


# ------------------------------------------------------------------ a failed step


def _failed_step_then_a_new_executor(rank, world_size):
    stage = _stage(rank, _modules())
    inputs, targets = _data(0)
    failed = _executor(rank, stage, P2PTransport(dist.new_group([0, 1], timeout=GROUP_TIMEOUT)))
    errors = []
    for step_targets in ([targets[0], None], targets):  # microbatch 1 has no target
        try:
            failed.step(inputs, step_targets)
        except ExecutorError as error:
            errors.append(str(error))
    live_after_failure = stage.live_microbatches
    dist.barrier()
    stage.module.zero_grad(set_to_none=True)
    fresh = _executor(rank, stage, P2PTransport(dist.new_group([0, 1], timeout=GROUP_TIMEOUT)))
    result = fresh.step(inputs, targets)
    dist.barrier()
    return {"errors": errors, "live_after_failure": live_after_failure,
            "loss": result.losses, "grads": _grads(rank, stage)}


def test_a_failed_step_is_final_and_its_stages_run_again_under_a_new_executor():
    results = run_distributed(2, _failed_step_then_a_new_executor, timeout=HARNESS_TIMEOUT_S)
    for rank, result in enumerate(results):
        assert result["live_after_failure"] == 0, f"rank {rank} still holds forwards"
        first, refused = result["errors"]
        assert "no target" in first
        assert f"global rank {rank}" in refused
        assert "a previous step of this executor failed" in refused
        assert "new P2PTransport over a new process group" in refused
        assert "new Executor" in refused
        assert "microbatch 1" in refused and "no target" in refused  # the first failure
    losses, _, grads = _reference(step=0)
    _check_against_reference(results, losses, grads)


# ------------------------------------------------------- forward-only, loss scales


def _forward_only_steps(rank, world_size):
    stage = _stage(rank, _modules())
    transport = P2PTransport()
    executor = _executor(rank, stage, transport, forward_only=True)
    inputs, targets = _data(0)
    without_targets = executor.step(inputs, None)
    with_targets = executor.step(inputs, targets if rank == 1 else None)
    return {"outputs": without_targets.outputs, "no_target_losses": without_targets.losses,
            "loss": with_targets.losses, "outputs_with_loss": with_targets.outputs}


def test_forward_only_returns_outputs_without_targets_and_losses_with_them():
    results = run_distributed(2, _forward_only_steps, timeout=HARNESS_TIMEOUT_S)
    losses, outputs, _ = _reference(step=0)
    last = results[1]
    assert last["no_target_losses"] == []
    torch.testing.assert_close(last["outputs"], outputs)
    torch.testing.assert_close(last["outputs_with_loss"], outputs)
    torch.testing.assert_close(torch.tensor(last["loss"]), torch.tensor(losses))


def _loss_scales_as_arrays(rank, world_size, kind):
    stage = _stage(rank, _modules())
    executor = _executor(rank, stage, P2PTransport())
    inputs, targets = _data(0)
    scales = [0.25, 0.75]
    scales = torch.tensor(scales) if kind == "tensor" else np.array(scales)
    result = executor.step(inputs, targets, loss_scales=scales)
    return {"loss": result.losses, "grads": _grads(rank, stage)}


def test_loss_scales_may_be_a_tensor_or_a_numpy_array():
    for kind in ("tensor", "numpy"):
        results = run_distributed(2, _loss_scales_as_arrays, kind, timeout=HARNESS_TIMEOUT_S)
        losses, _, grads = _reference(step=0, loss_scales=[0.25, 0.75])
        _check_against_reference(results, losses, grads)


def _forward_only_with_a_missing_target(rank, world_size):
    """A one-rank pipeline (nothing to stop on other ranks): the error text."""
    schedule = build("1f1b", 1, MICROBATCHES, forward_only=True)
    stage = Stage(nn.Linear(DIM, DIM), 0, 1, loss_fn=mean_square)
    executor = Executor(schedule, {0: stage}, pp_rank=0, pipeline_ranks=[rank],
                        transport=P2PTransport())
    inputs, targets = _data(0)
    try:
        executor.step(inputs, [targets[0], None])
    except ExecutorError as error:
        return str(error)
    return None


def test_forward_only_with_some_targets_missing_is_refused():
    message = run_distributed(2, _forward_only_with_a_missing_target,
                              timeout=HARNESS_TIMEOUT_S)[0]
    assert message is not None and "none for microbatches [1]" in message
    assert "targets=None for outputs without losses" in message


class _Recorded(torch.Tensor):
    """A loss that notes when the executor reads its value."""

    events: list[str] = []

    def __float__(self):
        _Recorded.events.append("read")
        return super().__float__()

    def tolist(self):
        _Recorded.events.append("read")
        return super().tolist()


def _when_losses_are_read(rank, world_size):
    """A one-rank pipeline of two microbatches: the order of backwards and loss reads."""
    _Recorded.events = []
    schedule = build("1f1b", 1, MICROBATCHES)
    module = nn.Linear(DIM, DIM)
    module.register_full_backward_hook(lambda *args: _Recorded.events.append("backward"))
    stage = Stage(module, 0, 1, loss_fn=lambda output, target: mean_square(
        output, target).as_subclass(_Recorded))
    executor = Executor(schedule, {0: stage}, pp_rank=0, pipeline_ranks=[rank],
                        transport=P2PTransport())
    inputs, targets = _data(0)
    result = executor.step(inputs, targets)
    expected = [mean_square(module(x), t).item() for x, t in zip(inputs, targets)]
    return _Recorded.events, result.losses, expected


def test_the_losses_are_read_once_the_steps_work_is_queued():
    """Reading a loss makes the host wait for the device; the executor reads them after the
    last backward, not after each forward, all in one read."""
    events, losses, expected = run_distributed(2, _when_losses_are_read,
                                               timeout=HARNESS_TIMEOUT_S)[0]
    assert events == ["backward", "backward", "read"]
    assert losses == pytest.approx(expected)
