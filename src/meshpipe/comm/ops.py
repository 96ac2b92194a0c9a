"""Every collective meshpipe runs on tensors goes through here.

Two things are decided in this one place instead of at every call:

- **Ranks sharing a GPU.** NCCL refuses two ranks of one communicator on one GPU, so a run
  with more ranks than GPUs uses gloo, which cannot move CUDA tensors in every collective
  (point-to-point, all-to-all, reduce-scatter...). A tensor that is not on the CPU and goes
  through a gloo-only group travels through a host buffer here: copied to the CPU, the
  collective runs on the copy, the result is copied back. Compute stays on the GPU; this is
  for checking layouts and one-GPU workstations, not for speed.
- **torch's names.** ``all_gather_single`` and ``reduce_scatter_single`` are the newer
  names of ``all_gather_into_tensor`` and ``reduce_scatter_tensor``; the one this torch has
  is used (meshpipe runs on torch >= 2.6).

The functions take the arguments of their ``torch.distributed`` namesakes (synchronous
calls); the ``*_started`` ones start the collective and return what to ``wait()`` on (where
a host copy is needed they finish before returning). The pipeline transport does not come
through here: it sends from host buffers itself when ranks share a GPU
(``P2PTransport(device="cpu", deliver_to=...)``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor



def _gather_into(*args: Any, **options: Any) -> Any:
    """``all_gather_single`` or ``all_gather_into_tensor``, looked up at each call (the
    strict mode, ``comm.strict``, replaces them while it is on)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        *args, **options)


def _reduce_scatter_into(*args: Any, **options: Any) -> Any:
    """``reduce_scatter_single`` or ``reduce_scatter_tensor``, looked up at each call."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        *args, **options)

def host_only(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) moves only CPU tensors (gloo alone)."""
    backend = str(dist.get_backend(group))
    return "gloo" in backend and "nccl" not in backend


def through_host(tensor: Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether ``tensor`` must be staged on the host to travel through ``group``."""
    return tensor.device.type != "cpu" and host_only(group)


def _staged(call: Callable[[list[Tensor], list[Tensor]], None], outputs: Sequence[Tensor],
            inputs: Sequence[Tensor], group: dist.ProcessGroup | None) -> None:
    """``call(outputs, inputs)``, through host copies where the group needs them."""
    if not outputs or not through_host(outputs[0], group):
        call(list(outputs), list(inputs))
        return
    host_inputs = [tensor.to("cpu", copy=True) for tensor in inputs]
    host_of = {id(tensor): host for tensor, host in zip(inputs, host_inputs)}
    host_outputs = [host_of[id(tensor)] if id(tensor) in host_of  # in place: one copy
                    else torch.empty_like(tensor, device="cpu") for tensor in outputs]
    call(host_outputs, host_inputs)
    for tensor, host in zip(outputs, host_outputs):
        tensor.copy_(host)


def alone(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) has this rank only: a reduction or a
    broadcast over it leaves the tensor as it is, and is skipped (gloo hands even those to
    its thread: about 1 ms a call on this project's CPUs, two a step of a one-process run)."""
    return dist.get_world_size(group) == 1


def all_reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               group: dist.ProcessGroup | None = None) -> None:
    if alone(group):
        return
    _staged(lambda out, _: dist.all_reduce(out[0], op=op, group=group), [tensor], [tensor],
            group)


def broadcast(tensor: Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    if alone(group):
        return
    _staged(lambda out, _: dist.broadcast(out[0], src=src, group=group), [tensor], [tensor],
            group)


def all_gather_into(output: Tensor, tensor: Tensor,
                    group: dist.ProcessGroup | None = None) -> None:
    """Every rank's ``tensor`` (same shape everywhere) concatenated on dim 0 into ``output``."""
    _staged(lambda out, inp: _gather_into(out[0], inp[0], group=group), [output], [tensor],
            group)


def all_gather(outputs: list[Tensor], tensor: Tensor,
               group: dist.ProcessGroup | None = None) -> None:
    """Every rank's ``tensor`` into ``outputs`` (one per rank, in group-rank order)."""
    _staged(lambda out, inp: dist.all_gather(out, inp[0], group=group), outputs, [tensor],
            group)


def reduce_scatter_into(output: Tensor, tensor: Tensor,
                        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                        group: dist.ProcessGroup | None = None) -> None:
    """The sum over ranks of ``tensor``, this rank's equal dim-0 chunk into ``output``."""
    _staged(lambda out, inp: _reduce_scatter_into(out[0], inp[0], op=op, group=group),
            [output], [tensor], group)


class _Finished:
    """The handle of a collective that already finished (it went through the host)."""

    def wait(self) -> bool:
        return True


def _started(call: Callable[..., Any], output: Tensor, tensor: Tensor,
             group: dist.ProcessGroup | None) -> Any:
    """``call(output, tensor, async_op=True)``'s handle; through the host it runs at once."""
    if through_host(output, group):
        _staged(lambda out, inp: call(out[0], inp[0], group=group), [output], [tensor], group)
        return _Finished()
    return call(output, tensor, group=group, async_op=True)


def all_reduce_started(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Any:
    """Start summing ``tensor`` over ``group`` in place."""
    return _started(lambda out, _, **options: dist.all_reduce(out, **options), tensor, tensor,
                    group)


def reduce_scatter_started(output: Tensor, tensor: Tensor,
                           group: dist.ProcessGroup | None = None) -> Any:
    """Start ``reduce_scatter_into`` (a sum)."""
    return _started(_reduce_scatter_into, output, tensor, group)


def all_gather_started(output: Tensor, tensor: Tensor,
                       group: dist.ProcessGroup | None = None) -> Any:
    """Start ``all_gather_into``."""
    return _started(_gather_into, output, tensor, group)


def all_to_all_single_started(output: Tensor, tensor: Tensor,
                              output_split_sizes: list[int] | None = None,
                              input_split_sizes: list[int] | None = None,
                              group: dist.ProcessGroup | None = None) -> Any:
    """Start ``dist.all_to_all_single``; on NCCL it runs on the communicator's own stream
    and ``wait()`` makes the current stream (not the host) wait for it."""
    return _started(lambda out, inp, **options: dist.all_to_all_single(
        out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
        **options), output, tensor, group)


def all_to_all_single(output: Tensor, tensor: Tensor,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None,
                      group: dist.ProcessGroup | None = None) -> None:
    _staged(lambda out, inp: dist.all_to_all_single(
        out[0], inp[0], output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes, group=group), [output], [tensor], group)
