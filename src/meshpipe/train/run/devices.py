"""Where a run's ranks compute and how they talk, decided once before any process starts.

``--device auto|cuda|cpu``: auto is CUDA when torch sees a GPU. ``--backend auto|nccl|gloo``:
auto is NCCL when every rank of a machine has a GPU of its own, else gloo. NCCL refuses two
ranks of one communicator on one GPU, so with more ranks than GPUs the ranks share them
(rank ``r`` of a machine on GPU ``r mod G``) over gloo: compute stays on the GPU and
messages and collectives travel through host buffers (``meshpipe.comm.ops``, the host
buffers of ``P2PTransport``). That is for checking layouts and for a one-GPU workstation,
not for speed; the run says so in one line.

Locally the launcher starts one process per rank on this machine; under torchrun the
machine's ranks are ``LOCAL_WORLD_SIZE`` and a rank's index among them ``LOCAL_RANK``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DEVICES = ("auto", "cuda", "cpu")
BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class DevicePlan:
    """The devices and process-group backend of one machine's ``local_ranks`` ranks."""

    device_type: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    gpus: int = 0  # GPUs the ranks use (0 on the CPU)
    local_ranks: int = 1

    @classmethod
    def cpu(cls, local_ranks: int = 1) -> DevicePlan:
        return cls("cpu", "gloo", 0, local_ranks)

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda"

    @property
    def shares_gpus(self) -> bool:
        """Several ranks on one GPU: gloo, messages through host buffers."""
        return self.on_gpu and self.backend == "gloo"

    def device(self, local_rank: int) -> torch.device:
        """The device of the machine's rank ``local_rank``."""
        if not self.on_gpu:
            return torch.device("cpu")
        return torch.device("cuda", local_rank % self.gpus)

    def notice(self) -> str | None:
        """One line for the user where the placement is not one rank per device."""
        if not self.shares_gpus:
            return None
        per_gpu = -(-self.local_ranks // self.gpus)
        return (f"{self.local_ranks} ranks share {self.gpus} GPU(s) (up to {per_gpu} per "
                "GPU) over gloo: compute runs on the GPU, messages and collectives go "
                "through host memory; this checks a layout, it is not fast (give each rank a "
                "GPU of its own for NCCL)")


def plan_devices(device: str = "auto", backend: str = "auto",
                 local_ranks: int = 1) -> DevicePlan:
    """The plan for ``local_ranks`` ranks on this machine; a one-line ValueError for a
    device or backend this machine cannot give."""
    if device not in DEVICES or backend not in BACKENDS:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)} and --backend one of "
                         f"{', '.join(BACKENDS)}; got --device {device} --backend {backend}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        build = (f"built for CUDA {torch.version.cuda}" if torch.version.cuda
                 else "a CPU-only build")
        raise ValueError(f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA "
                         "device on this machine; use --device cpu or auto")
    if device == "cpu" or (device == "auto" and gpus == 0):
        if backend == "nccl":
            raise ValueError("--backend nccl needs CUDA devices; on the CPU the backend is "
                             "gloo (drop --backend, or give --device cuda on a GPU machine)")
        return DevicePlan.cpu(local_ranks)
    if backend == "nccl" and local_ranks > gpus:
        raise ValueError(f"--backend nccl: {local_ranks} ranks on this machine but {gpus} "
                         "GPU(s), and NCCL refuses two ranks on one GPU; use --backend gloo "
                         "(ranks share the GPUs) or at most one rank per GPU")
    if backend == "auto":
        backend = "nccl" if local_ranks <= gpus else "gloo"
    return DevicePlan("cuda", backend, gpus, local_ranks)


def local_ranks(world_size: int) -> int:
    """Ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else the whole (local) run."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def local_rank(rank: int) -> int:
    """This process's index among its machine's ranks (``LOCAL_RANK`` under torchrun)."""
    return int(os.environ.get("LOCAL_RANK", rank))
