"""``--check``: the first step of a run against one process running the same model on the
same data, loss and every gradient compared.

Every rank sends its gradients (tensor-parallel shards with their dim and tp rank) to rank
0, which puts each model replica's gradients back together (``whole_gradients``) and
compares them with a single-process step in the run's precision
(``compare_with_single_process``: fp32 at torch's default tolerances, bf16/fp16 at
``low_precision_tolerance``), printing one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from meshpipe.parallel import shard_dim, shard_parts, unshard
from meshpipe.runtime import low_precision_tolerance
from meshpipe.train.config import TrainConfig
from meshpipe.train.run import sources

def check_step(config: TrainConfig, loss: float,
               parameters: Sequence[tuple[str, torch.nn.Parameter]],
               tp_rank: int) -> dict[str, Any] | None:
    """Every rank's gradients of the step just run (reduced, unscaled; ``loss`` its loss over
    the job) to rank 0, compared there with one process: rank 0's report, None elsewhere."""
    grads = {name: GradientPiece(p.grad.detach().cpu(), shard_dim(p), tp_rank, shard_parts(p))
             for name, p in parameters if p.grad is not None}
    is_main = dist.get_rank() == 0
    gathered: list[Any] = [None] * dist.get_world_size() if is_main else None
    dist.gather_object(grads, gathered, dst=0)
    if not is_main:
        return None
    return compare_with_single_process(config, loss, whole_gradients(config.layout, gathered))


@dataclass
class GradientPiece:
    """One rank's gradient of a parameter: whole, or its tensor-parallel shard."""

    grad: torch.Tensor
    shard_dim: int | None
    tp_rank: int
    parts: tuple[int, ...] | None = None  # a fused weight's parts (``shard_parts``)


def whole_gradients(layout, gathered: list[dict[str, GradientPiece]]
                    ) -> list[dict[str, torch.Tensor]]:
    """Every model replica's gradients (one dict per data x context coordinate and per
    pipeline copy), tensor-parallel shards concatenated in tp order."""
    replicas: dict[tuple, dict[str, dict[int, GradientPiece]]] = {}
    for rank, pieces in enumerate(gathered):
        coords = layout.coords(rank)
        replica = (coords["dp"], coords["cp_ring"], coords["cp_ulysses"])
        for name, piece in pieces.items():
            key = replica if piece.shard_dim is not None else (*replica, rank)
            replicas.setdefault(key, {}).setdefault(name, {})[piece.tp_rank] = piece
    whole: list[dict[str, torch.Tensor]] = []
    for by_name in replicas.values():
        grads = {}
        for name, shards in by_name.items():
            pieces = [shards[t] for t in sorted(shards)]
            dim = pieces[0].shard_dim
            grads[name] = pieces[0].grad if dim is None else unshard(
                [p.grad for p in pieces], dim, pieces[0].parts)
        whole.append(grads)
    return whole


def compare_with_single_process(config: TrainConfig, loss: float,
                                gathered: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Compare a run's first step's loss and gradients with one process in the same precision.

    fp32 uses torch's default tolerances; bf16/fp16 scale the absolute tolerance with each
    gradient's largest magnitude (``low_precision_tolerance``), reported as ``atol_factor``.
    """
    reference_loss, reference = sources.reference_step(config)
    tolerance = low_precision_tolerance(config.dtype, 1.0)
    worst_grad, worst_name = 0.0, ""
    reported = {name for grads in gathered for name in grads}
    mismatched = sorted(set(reference) ^ reported)  # a gradient missing on every rank fails
    for grads in gathered:
        for name, grad in grads.items():
            if name not in reference:
                continue
            if grad.shape != reference[name].shape:
                mismatched.append(name)
                continue
            difference = (grad - reference[name]).abs().max().item()
            if difference > worst_grad:
                worst_grad, worst_name = difference, name
            try:
                torch.testing.assert_close(
                    grad, reference[name], **low_precision_tolerance(config.dtype, reference[name])
                    if config.dtype != "fp32" else {})
            except AssertionError:
                mismatched.append(name)
    loss_difference = abs(loss - reference_loss)
    loss_tolerance = low_precision_tolerance("fp32")
    passed = not mismatched and math.isclose(loss, reference_loss, rel_tol=tolerance["rtol"],
                                             abs_tol=loss_tolerance["atol"])
    rtol = tolerance["rtol"]
    atol = (f"atol {tolerance['atol']:.1e}" if config.dtype == "fp32"
            else f"atol {tolerance['atol']:.0e} x max|grad|")
    report = {"loss": loss, "reference_loss": reference_loss,
              "loss_difference": loss_difference, "max_grad_difference": worst_grad,
              "worst_parameter": worst_name, "mismatched": sorted(set(mismatched)),
              "dtype": config.dtype,
              "tolerance": {"rtol": rtol, ("atol" if config.dtype == "fp32" else "atol_factor"):
                            tolerance["atol"]},
              "passed": passed}
    verdict = "PASS" if passed else f"FAIL ({len(set(mismatched))} gradients differ)"
    print(f"--check step 1 vs one process ({config.dtype}, rtol {rtol:.1e}, {atol}): loss "
          f"{loss:.6f} vs {reference_loss:.6f} (|diff| {loss_difference:.2e}), largest "
          f"gradient |diff| {worst_grad:.2e} ({worst_name}): {verdict}")
    return report
