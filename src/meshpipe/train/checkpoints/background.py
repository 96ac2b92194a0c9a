"""``--checkpoint-async``: a checkpoint written while training goes on.

Training stops only for the snapshot: the state's tensors (gathered where sharded, as a
synchronous save gathers them) are copied to host memory, pinned on CUDA so that the copy
runs at the link's speed, and a thread writes that copy with dcp and publishes it, exactly
as a synchronous save does (``store.write``): a kill during the write leaves a partial
directory, so the previous checkpoint stays the newest. The thread's collectives (dcp's
plan exchange, the barriers around publishing) go over a gloo group of their own, created
once, so they never interleave with training's on the default group. At most one write is
in flight: the next save, and the end of training, wait for it first (so a copy is never
reused while it is being written), and a write that failed fails them in one line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from meshpipe.comm import strict


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in host memory that nothing else writes (pinned for a GPU's)."""
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return copy.copy_(tensor.detach(), non_blocking=True)


class BackgroundWrites:
    """The rank's checkpoint writer thread, one write at a time (module docstring)."""

    def __init__(self):
        # gloo beside NCCL too: not ordered by the strict communication mode.
        self.group = strict.host_group(dist.new_group(backend="gloo"))
        self._thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None
        self.step: int | None = None  # the step of the write in flight, None when idle

    def start(self, state: dict[str, torch.Tensor], step: int,
              write: Callable[[dict[str, torch.Tensor], dist.ProcessGroup], Path]) -> None:
        """Copy ``state`` to the host and ``write(copy, group)`` it in the background, once
        the previous write is done."""
        self.wait()
        copy = {key: host_copy(tensor) for key, tensor in state.items()}
        if any(tensor.is_pinned() for tensor in copy.values()):
            torch.cuda.current_stream().synchronize()  # the non-blocking copies are done

        def run() -> None:
            try:
                write(copy, self.group)
            except BaseException as error:  # noqa: BLE001 - reported by the next wait
                self._failure = (step, error)

        self.step = step
        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the write in flight is on disk; a one-line RuntimeError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread, self.step = None, None
        if self._failure is not None:
            step, error = self._failure
            self._failure = None
            raise RuntimeError(f"the background write of the checkpoint of step {step} failed "
                               f"({type(error).__name__}: {error}); the previous checkpoint "
                               "is still the newest complete one") from error
