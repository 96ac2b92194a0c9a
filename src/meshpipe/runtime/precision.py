"""Mixed precision: autocast contexts, a dynamic loss scaler that pipeline ranks agree on,
and the tolerance a low-precision parity check uses.

``autocast`` runs matmuls (and whatever else torch's autocast lists cover) in bfloat16 or
float16. Under fp16 the parameters and their ``.grad`` stay float32; under bf16 the trainer
makes them bfloat16 with float32 masters (``weights_dtype``, ``runtime.master_weights``).
float16 gradients underflow without loss scaling, so an fp16 run multiplies the loss by
``DynamicLossScaler.scale`` (the last stage's ``grad_scale_fn``) and divides the gradients
back before the optimizer step::

    scaler = DynamicLossScaler()
    stage = Stage(AutocastChunk(chunk, "fp16"), index, num_stages, loss_fn=loss,
                  grad_scale_fn=scaler.scale_loss)
    executor.step(inputs, targets)
    found_inf = scaler.unscale_(chunk.parameters())  # every rank gets the same answer
    if not found_inf:
        optimizer.step()
    scaler.update(found_inf)
    optimizer.zero_grad()

Autocast wraps the forwards only, as torch advises (backward runs each op in the dtype
its forward used). bfloat16 has float32's exponent range and needs no scaler.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator, Iterable
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshpipe.comm import ops
from meshpipe.runtime.substeps import resume_within

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
"""The precision names of ``meshpipe train --dtype`` and the compute dtype each stands for."""


def _dtype(dtype_name: str) -> torch.dtype:
    try:
        return DTYPES[dtype_name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown precision {dtype_name!r}: choose from "
                         f"{', '.join(DTYPES)}") from None


def autocast(dtype_name: str, device_type: str) -> ContextManager[Any]:
    """The context a forward runs in at precision ``dtype_name`` ("fp32", "bf16", "fp16") on
    ``device_type`` ("cpu", "cuda"): ``torch.autocast`` for bf16 and fp16 (both supported on
    CPU and CUDA by torch 2.13), a context that does nothing for fp32.

    Autocast is thread-local: enter it in the thread that runs the forwards. Backward runs
    each op in the dtype its forward used, so it needs no context of its own; a recomputed
    forward (activation checkpointing) re-enters the autocast state of its original forward.
    """
    dtype = _dtype(dtype_name)
    if dtype is torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def weights_dtype(dtype_name: str) -> torch.dtype:
    """The dtype of the model's weights at precision ``dtype_name``: bfloat16 for bf16 (with
    float32 masters for everything after the backward: ``runtime.master_weights``), float32
    otherwise (fp16 keeps float32 weights under autocast: its loss scaling unscales float32
    gradients)."""
    return torch.bfloat16 if _dtype(dtype_name) is torch.bfloat16 else torch.float32


def weights_cast_once(dtype_name: str, device_type: str) -> ContextManager[Any]:
    """Around a pipeline step at bf16/fp16: each float32 weight is cast to the compute dtype
    once for the whole step, not once per microbatch's forward.

    Autocast keeps the low-precision copies of the weights it casts (leaf tensors that
    require grad) until the outermost autocast context exits; each forward enters its own,
    so without this the copies are dropped and made again microbatch after microbatch. This
    is an outer autocast context that is itself disabled: backward and everything between
    the forwards run as they did, and the copies live until the step ends (before the
    optimizer changes the weights). The casts are the same, so results are bit for bit."""
    if _dtype(dtype_name) is torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


# Per compute dtype: (rtol, atol as a fraction of the reference's largest magnitude).
_TOLERANCES: dict[str, tuple[float, float]] = {"bf16": (1.6e-2, 3e-2), "fp16": (1e-3, 5e-3)}
# torch.testing.assert_close's defaults for float32.
_FP32_TOLERANCE = (1.3e-6, 1e-5)
# The largest gradient magnitude of the reference transformer at its defaults (dim 64,
# 4 layers, init std 0.02): the scale assumed when no reference is given.
_DEFAULT_SCALE = 1e-2


class AutocastChunk(nn.Module):
    """A model chunk whose forward runs under ``autocast(dtype_name, device_type)``.

    Only the forward: backward then runs each op in the dtype its forward used, and custom
    autograd functions (ring attention, tensor-parallel collectives) keep the precision of
    their own backward, as in a one-process run whose backward is outside autocast.
    """

    def __init__(self, chunk: nn.Module, dtype_name: str, device_type: str = "cpu"):
        super().__init__()
        self.chunk = chunk
        self.dtype_name = dtype_name
        self.device_type = device_type

    def forward(self, *args: Any) -> Any:
        with autocast(self.dtype_name, self.device_type):
            return self.chunk(*args)

    @property
    def forward_steps(self) -> Callable[..., Generator] | None:
        """The chunk's sub-steps (None if it has none), each piece run under autocast."""
        steps = getattr(self.chunk, "forward_steps", None)
        if not callable(steps):
            return None
        return lambda *args: resume_within(
            steps(*args), lambda: autocast(self.dtype_name, self.device_type))


def low_precision_tolerance(dtype_name: str,
                            reference: Tensor | float | None = None) -> dict[str, float]:
    """``rtol`` and ``atol`` for ``torch.testing.assert_close`` between a parallel run and a
    one-process run of the same model in the same precision.

    fp32: torch's defaults (rtol 1.3e-6, atol 1e-5). bf16 and fp16 round every matmul output
    to 8 or 11 significant bits, so a different reduction order (tensor-parallel partial sums,
    ring attention's log-sum-exp merge, gradients accumulated per microbatch) moves a
    gradient by a few units of that rounding *of the tensor's largest values*, also on
    elements near zero. The error therefore scales with the tensor, not with each element:
    ``atol`` is a fraction of ``reference``'s largest magnitude (a tensor, or that magnitude
    as a number; None assumes 1e-2, the largest gradient of the reference transformer at its
    defaults). Pass the reference tensor: a fixed atol that lets the largest gradients pass
    is blind to errors in tensors whose gradients are 100x smaller (the query/key weights
    at initialisation).

    bf16: rtol 1.6e-2, atol 3e-2 x max|reference|; fp16: rtol 1e-3, atol 5e-3 x
    max|reference|. Measured on the reference transformer (GQA, SwiGLU, RMSNorm; 4 and 8
    layers, dim 64 and 128, 3 seeds, fp16 with loss scale 2**16) under autocast on CPU,
    against the unsplit one-process run: 4 or 8 microbatches, the MLP down-projection split in
    two summed halves, attention over two key chunks merged by log-sum-exp, and these
    combined, moved no gradient tensor by more than 1.2e-2 x its largest magnitude in bf16
    (1.6e-3 in fp16), so every element passes with at least 2.5x margin. A gradient 10%
    short (one tensor x 0.9, also on top of the reorderings) or one of 8 microbatches
    missing fails in every tensor: 10% of the largest element exceeds the 4.6% (bf16) and
    0.6% (fp16) allowed there. fp16 without loss scaling loses small gradients to underflow
    (deviations up to 7e-2 measured): compare fp16 runs that both use the scaler.
    Re-measured since bf16 trains bfloat16 weights with float32 masters: the tests' model
    (dim 32, 4 layers) under pp 2 (4 and 8 microbatches), pp 2 x tp 2, ring 2, dp 2 with
    ``--zero 1`` and ZB-V moved no gradient by more than 0.98e-2 x its largest magnitude
    (0.97e-2 since RoPE computes in bfloat16).

    The loss is a float32 reduction of low-precision logits: it moved by at most 1e-5
    (relative) in the same runs, so ``rtol`` alone is a loose but safe bound for it.
    """
    _dtype(dtype_name)
    if dtype_name == "fp32":
        rtol, atol = _FP32_TOLERANCE
        return {"rtol": rtol, "atol": atol}
    rtol, atol_fraction = _TOLERANCES[dtype_name]
    if reference is None:
        scale = _DEFAULT_SCALE
    elif isinstance(reference, Tensor):
        scale = reference.detach().abs().max().item() if reference.numel() else 0.0
    else:
        scale = abs(float(reference))
    if not math.isfinite(scale):
        raise ValueError(f"the reference's largest magnitude is {scale}: a tolerance needs a "
                         f"finite reference")
    return {"rtol": rtol, "atol": atol_fraction * scale}


class DynamicLossScaler:
    """fp16 dynamic loss scaling whose skip decision every rank of a pipeline shares.

    ``scale_loss`` is the last stage's ``grad_scale_fn``:
    backward then produces gradients ``scale`` times too large, which keeps small float16
    gradients above underflow. ``unscale_`` divides them back and finds any inf or NaN;
    one all-reduce (MAX) makes the verdict the same on every rank, since the stage that
    overflowed is usually not the one holding every parameter. ``update`` backs the scale
    off after an overflow (the step must then be skipped) and grows it after
    ``growth_interval`` good steps in a row. Unlike ``torch.amp.GradScaler`` it does not
    wrap the optimizer: the caller steps it or not.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0) -> None:
        self._check(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.good_steps = 0
        """Steps without overflow since the last growth or backoff."""
        self.skipped_steps = 0
        """Steps whose gradients overflowed (and were therefore skipped), in total."""

    @staticmethod
    def _check(init_scale: float, growth_factor: float, backoff_factor: float,
               growth_interval: int, min_scale: float) -> None:
        problems = []
        if not (math.isfinite(min_scale) and min_scale > 0):
            problems.append(f"min_scale must be finite and > 0, got {min_scale}")
        elif not (math.isfinite(init_scale) and init_scale >= min_scale):
            problems.append(f"init_scale must be finite and >= min_scale {min_scale}, "
                            f"got {init_scale}")
        if not (math.isfinite(growth_factor) and growth_factor >= 1):
            problems.append(f"growth_factor must be finite and >= 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            problems.append(f"backoff_factor must lie in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or growth_interval < 1:
            problems.append(f"growth_interval must be a whole number >= 1, got "
                            f"{growth_interval!r}")
        if problems:
            raise ValueError("DynamicLossScaler: " + "; ".join(problems))

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss * scale``, computed in float32 when the loss is half precision (a float16
        loss times 2**16 would overflow). Reads the current scale on every call."""
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss * self.scale

    def unscale_(self, parameters: Iterable[Tensor],
                 group: dist.ProcessGroup | None = None) -> bool:
        """Divide every ``.grad`` in ``parameters`` by ``scale`` in place (in float32) and
        say whether any gradient of any rank of ``group`` (None: the default group) holds
        an inf or NaN.

        Every rank of ``group`` must call it (one all-reduce, MAX); all get the same
        answer. Call it once per step, after every backward and the gradient all-reduce,
        before clipping (clipping must see true gradient norms). Parameters without a
        gradient are skipped.
        """
        grads = [p.grad for p in parameters if p.grad is not None]
        device = _flag_device(grads, group)
        found = torch.zeros((), dtype=torch.float32, device=device)
        with torch.no_grad():
            for grad in grads:
                if grad.dtype is torch.float32 or grad.dtype is torch.float64:
                    grad.div_(self.scale)
                else:
                    grad.copy_(grad.float().div_(self.scale))
                finite = torch.isfinite(grad).all()
                found = torch.maximum(found, (~finite).to(device=device, dtype=torch.float32))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            ops.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """After an overflow: scale x ``backoff_factor`` (not below ``min_scale``), count a
        skipped step and start counting good steps afresh. Otherwise count a good step and,
        at ``growth_interval`` in a row, scale x ``growth_factor``."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers: the scale, the counters and the settings (for checkpoints)."""
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "min_scale": self.min_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``'s result; a missing or unknown key is a KeyError."""
        expected = set(self.state_dict())
        if set(state) != expected:
            missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
            raise KeyError(f"DynamicLossScaler state: missing {missing}, unknown {unknown}")
        scale, interval = float(state["scale"]), int(state["growth_interval"])
        self._check(scale, float(state["growth_factor"]), float(state["backoff_factor"]),
                    interval, float(state["min_scale"]))
        self.scale = scale
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = interval
        self.min_scale = float(state["min_scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale:g}, good_steps={self.good_steps}, "
                f"skipped_steps={self.skipped_steps})")


def _flag_device(grads: list[Tensor], group: dist.ProcessGroup | None) -> torch.device:
    """Where the overflow flag lives: beside the gradients, or, on a rank without any, on the
    device the group's backend communicates from (NCCL: the current CUDA device)."""
    if grads:
        return grads[0].device
    if (dist.is_available() and dist.is_initialized()
            and dist.get_backend(group) == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
