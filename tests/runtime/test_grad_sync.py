"""all_reduce_gradients over 2 replicas: sums and scales the gradients that exist, and leaves
``.grad = None`` where no replica had a gradient, so an optimizer skips those parameters as
it would with one replica (no weight decay, no moment update)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshpipe.runtime import all_reduce_gradients
from meshpipe.testing import run_distributed

pytestmark = pytest.mark.distributed

SCALE = 0.5


def _grad_of(owner_ranks: tuple[int, ...], rank: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The gradient rank ``rank`` holds for a parameter that ``owner_ranks`` used."""
    if rank not in owner_ranks:
        return None
    return torch.arange(6, dtype=dtype).reshape(2, 3) + 10 * (rank + 1)


# name -> (dtype, ranks that have a gradient for it)
PARAMETERS = {
    "used_by_both": (torch.float32, (0, 1)),
    "used_by_rank_0": (torch.float32, (0,)),
    "used_by_rank_1": (torch.float32, (1,)),
    "unused": (torch.float32, ()),
    "bf16_used_by_both": (torch.bfloat16, (0, 1)),
    "bf16_used_by_rank_1": (torch.bfloat16, (1,)),
    "bf16_unused": (torch.bfloat16, ()),
    "frozen": (torch.float32, (0, 1)),
}


def _parameters(rank: int, names) -> dict[str, torch.nn.Parameter]:
    params = {}
    for name in names:
        dtype, owners = PARAMETERS[name]
        param = torch.nn.Parameter(torch.ones(2, 3, dtype=dtype), requires_grad=name != "frozen")
        param.grad = _grad_of(owners, rank, dtype)
        params[name] = param
    return params


def _reduce(rank, world_size, names):
    """Gradients after all_reduce_gradients of ``names`` (None where .grad is None)."""
    params = _parameters(rank, names)
    all_reduce_gradients(params.values(), dist.group.WORLD, scale=SCALE)
    return {name: None if p.grad is None else p.grad.clone() for name, p in params.items()}


def _expected(name: str, rank: int, world_size: int) -> torch.Tensor | None:
    dtype, owners = PARAMETERS[name]
    if name == "frozen":  # requires_grad=False: left alone
        return _grad_of(owners, rank, dtype)
    grads = [g for g in (_grad_of(owners, r, dtype) for r in range(world_size)) if g is not None]
    return torch.stack(grads).sum(0) * SCALE if grads else None


def _check(results, names):
    for rank, grads in enumerate(results):
        for name in names:
            expected = _expected(name, rank, len(results))
            if expected is None:
                assert grads[name] is None, f"rank {rank}, {name}: got {grads[name]}"
            else:
                torch.testing.assert_close(grads[name], expected,
                                           msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")


def test_gradients_are_summed_scaled_and_absent_where_no_replica_had_one():
    names = list(PARAMETERS)
    _check(run_distributed(2, _reduce, names), names)


def test_without_a_float32_bucket_the_counts_take_their_own_all_reduce():
    names = [name for name in PARAMETERS if name.startswith("bf16")]
    _check(run_distributed(2, _reduce, names), names)


def _adamw_after_sync(rank, world_size, group_size):
    """One AdamW step with weight decay after syncing over ``group_size`` ranks: a parameter
    this step never used, a used one, and whether the optimizer kept state for the unused."""
    torch.manual_seed(0)
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([used, unused], lr=0.1, weight_decay=0.5)
    (used * torch.arange(3.0)).sum().backward()
    group = dist.group.WORLD if group_size == 2 else dist.new_group([rank])
    all_reduce_gradients([used, unused], group, scale=1.0 / group_size)
    optimizer.step()
    return used.detach().clone(), unused.detach().clone(), unused in optimizer.state


def test_adamw_leaves_an_unused_parameter_alone_at_dp_2_as_at_dp_1():
    replicated = run_distributed(2, _adamw_after_sync, 2)
    alone = run_distributed(2, _adamw_after_sync, 1)
    for (used, unused, has_state), (used_1, unused_1, has_state_1) in zip(replicated, alone):
        torch.testing.assert_close(used, used_1)
        torch.testing.assert_close(unused, unused_1)
        torch.testing.assert_close(unused, torch.ones(3))
        assert not has_state and not has_state_1
