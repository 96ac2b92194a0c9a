"""Combined 1F1B really overlaps: one microbatch's all-to-all travels while the other computes."""

import warnings

import pytest
import torch
from torch import nn

from meshpipe.testing import run_distributed

pytestmark = pytest.mark.distributed

CONFIG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, moe_experts=4, moe_top_k=2,
              max_seq_len=16)
MICROBATCHES = 3


def _loss(output, target):
    logits, aux = output
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()) + 0.01 * aux


def _data(rank):
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 64, (MICROBATCHES, 2, 16), generator=generator)
    return [(t, None, None) for t in tokens], list(torch.roll(tokens, -1, dims=-1))


def _step(rank, schedule_name, hooks=None):
    import torch.distributed as dist

    from meshpipe.comm.p2p import P2PTransport
    from meshpipe.models import Transformer, TransformerConfig, split
    from meshpipe.runtime import Executor, Stage
    from meshpipe.runtime.substeps import trace_events
    from meshpipe.schedules import build

    model = Transformer(TransformerConfig(**CONFIG), ep_group=dist.group.WORLD)
    stage = Stage(split(model, 1)[0], 0, 1, loss_fn=_loss)
    executor = Executor(build(schedule_name, 1, MICROBATCHES), {0: stage}, pp_rank=0,
                        pipeline_ranks=[rank], transport=P2PTransport(), overlap_hooks=hooks)
    inputs, targets = _data(rank)
    with trace_events() as events:
        result = executor.step(inputs, targets)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return result.losses, grads, events


def _in_flight_while_other_computes(events, posting: str, computing: str) -> bool:
    """Whether an exchange posted by ``posting`` was still unawaited when ``computing`` ran a
    piece (started and finished it)."""
    for i, (_, event, label) in enumerate(events):
        if event != "post" or not label.startswith(posting + ":"):
            continue
        wait = next(j for j in range(i, len(events)) if events[j][1:] == ("wait", label))
        between = [e[1:] for e in events[i:wait]]
        if ("run", computing) in between and ("yield", computing) in between:
            return True
    return False


def _overlapped_and_sequential(rank, world_size):
    from meshpipe.runtime.hooks import OverlapHooks

    calls = []
    hooks = OverlapHooks(*(lambda part, name=name: calls.append((name, str(part)))
                           for name in ("pre_forward", "pre_backward", "post_forward",
                                        "post_backward")))
    combined = _step(rank, "combined-1f1b", hooks)
    sequential = _step(rank, "1f1b")
    events = combined[2]
    return {
        "losses": (combined[0], sequential[0]),
        "max_grad_difference": max((combined[1][n] - sequential[1][n]).abs().max().item()
                                   for n in combined[1]),
        "forward_exchange_hidden": _in_flight_while_other_computes(events, "F0,1", "B0,0"),
        "backward_exchange_hidden": _in_flight_while_other_computes(events, "B0,0", "F0,1"),
        "sequential_hides_nothing": not any(
            _in_flight_while_other_computes(sequential[2], a, b)
            for a, b in (("F0,1", "B0,0"), ("B0,0", "F0,1"), ("F0,2", "B0,1"))),
        "hooks": calls[:4],
    }


def test_combined_1f1b_posts_each_all_to_all_while_the_other_microbatch_computes():
    for result in run_distributed(2, _overlapped_and_sequential):
        assert result["forward_exchange_hidden"]
        assert result["backward_exchange_hidden"]
        assert result["sequential_hides_nothing"]
        combined, sequential = result["losses"]
        torch.testing.assert_close(combined, sequential)
        assert result["max_grad_difference"] < 1e-6
        assert result["hooks"] == [("pre_forward", "0F1"), ("pre_backward", "0B0"),
                                   ("post_forward", "0F1"), ("post_backward", "0B0")]


class _ChunkWithoutSubsteps(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


def _plain_module_under_combined(rank, world_size):
    from meshpipe.comm.p2p import P2PTransport
    from meshpipe.runtime import Executor, Stage
    from meshpipe.schedules import build

    torch.manual_seed(0)
    stage = Stage(_ChunkWithoutSubsteps(), 0, 1, loss_fn=lambda y, t: (y - t).pow(2).mean())
    executor = Executor(build("combined-1f1b", 1, 3), {0: stage}, pp_rank=0,
                        pipeline_ranks=[rank], transport=P2PTransport())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            result = executor.step([torch.ones(2, 4)] * 3, [torch.zeros(2, 4)] * 3)
    notices = [str(w.message) for w in caught if "forward_steps" in str(w.message)]
    return notices, len(result.losses)


def test_a_module_without_substeps_runs_f_then_b_with_one_notice():
    notices, losses = run_distributed(2, _plain_module_under_combined)[0]
    assert losses == 3
    assert len(notices) == 1
    assert "_ChunkWithoutSubsteps" in notices[0] and "hide no communication" in notices[0]
