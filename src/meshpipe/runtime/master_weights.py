"""bfloat16 weights with float32 masters (``meshpipe train --dtype bf16``).

Under autocast alone the weights are float32: every matrix product casts its weight to
bfloat16 (once a step, ``precision.weights_cast_once``) and its float32 input activations,
and every weight gradient goes back to float32 before it accumulates, microbatch after
microbatch. Here the model's parameters themselves are bfloat16, so the forward casts no
weight, and the activations between the products stay bfloat16 (norms still compute in
float32 inside). Each parameter has a float32 master: as a microbatch's gradient
lands in the parameter's ``.grad``, a hook adds it into the master's ``.grad`` and drops it,
so a step's gradients accumulate in float32 (Megatron's mixed precision).

Everything after the backward works on the masters: the reductions over replicas, the norm,
clipping, the optimizer and its moments, checkpoints, ``--check``. After the masters change
(an optimizer step, a checkpoint loaded) each stage's parameters are copied from them before
its next forward (``refresh``). Under ``--zero 1/2`` a sharded bucket keeps the values of
its shard of the masters instead, and gathers them into the parameters itself: the masters
are released (``release``) and each replica holds a shard of them::

    masters = MasterWeights(model.named_parameters(), torch.bfloat16)
    optimizer = torch.optim.AdamW(masters.params)
    ...backward of every microbatch...
    optimizer.step(); optimizer.zero_grad(); masters.updated()
    masters.refresh(model.parameters())   # before the next forward
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn


def _into_master(master: nn.Parameter, param: nn.Parameter) -> None:
    """The hook after ``param.grad`` was accumulated: move it into ``master.grad``. A
    product that added the gradient into the master itself (``--grad-accumulation-fusion``)
    leaves ``param.grad`` None."""
    grad, param.grad = param.grad, None
    if grad is None:
        return
    if master.grad is None:
        master.grad = grad.to(torch.float32)
    else:
        master.grad.add_(grad)


class MasterWeights:
    """Float32 masters of ``parameters`` (``(name, parameter)`` pairs; a parameter listed
    twice, a tied one, gets one master), whose own data become ``dtype`` in place: the
    modules holding them run in ``dtype``. The masters carry the parameters' attributes
    (tensor-parallel and expert marks), so whatever reads those reads them the same. A
    parameter that is float32 and stays so is its own master (``dtype`` float32: a no-op)."""

    def __init__(self, parameters: Iterable[tuple[str, nn.Parameter]], dtype: torch.dtype):
        self._master_of: dict[int, nn.Parameter] = {}
        self._model_of: dict[int, nn.Parameter] = {}
        self.named: list[tuple[str, nn.Parameter]] = []
        for name, param in parameters:
            if id(param) in self._master_of:
                continue
            if param.dtype == dtype == torch.float32:
                self._master_of[id(param)] = self._model_of[id(param)] = param
                self.named.append((name, param))
                continue
            master = nn.Parameter(param.detach().to(torch.float32, copy=True),
                                  requires_grad=param.requires_grad)
            for key, value in vars(param).items():
                setattr(master, key, value)
            with torch.no_grad():
                param.data = param.data.to(dtype)
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(functools.partial(_into_master, master))
            self._master_of[id(param)] = master
            self._model_of[id(master)] = param
            self.named.append((name, master))
        self._stale: set[int] = set()
        self._released: set[int] = set()
        self.dtype = dtype

    @property
    def params(self) -> list[nn.Parameter]:
        return [master for _, master in self.named]

    def master_of(self, param: nn.Parameter) -> nn.Parameter:
        return self._master_of[id(param)]

    def model_of(self, master: nn.Parameter) -> nn.Parameter:
        """The parameter the model computes with for ``master``."""
        return self._model_of[id(master)]

    @property
    def twin_of(self) -> Callable[[nn.Parameter], nn.Parameter] | None:
        """``model_of`` where the masters are not the model's own parameters, else None:
        what a sharded bucket writes its gathered shards into (``parallel.zero``)."""
        return self.model_of if self.dtype != torch.float32 else None

    def own_masters(self, weights: Iterable[nn.Parameter]) -> list[nn.Parameter] | None:
        """The float32 masters of ``weights``, in order, where each has one of its own (not
        itself) and trains; else None: what a product adding its weights' gradient into
        their masters' needs (``models.master_grads.fuse``)."""
        weights = list(weights)
        masters = [self._master_of.get(id(weight)) for weight in weights]
        if any(master is None or master is weight or not weight.requires_grad
               for master, weight in zip(masters, weights)):
            return None
        return masters

    def masters_of(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """The masters of ``params`` in their order, each once."""
        unique = {id(param): param for param in params}
        return [self._master_of[key] for key in unique]

    def release(self, masters: Iterable[nn.Parameter]) -> None:
        """Free the values of ``masters``, which a sharded bucket now holds a shard of and
        writes into their parameters itself (``parallel.zero``, twins): each keeps its shape,
        for its ``.grad``, over no memory."""
        with torch.no_grad():
            for master in masters:
                master.data = master.new_zeros(()).expand(master.shape)
                self._released.add(id(self._model_of[id(master)]))

    def updated(self) -> None:
        """The masters changed (an optimizer step, a load): every parameter with a master
        of its own that holds its values is stale."""
        self._stale = {key for key, master in self._master_of.items()
                       if id(master) != key and key not in self._released}

    def refresh(self, params: Iterable[nn.Parameter]) -> None:
        """Copy the masters into those of ``params`` that are stale (before a forward), in
        one ``_foreach_copy_`` (a few kernels, not one per parameter)."""
        stale = list({id(p): p for p in params if id(p) in self._stale}.values())
        if not stale:
            return
        with torch.no_grad():
            torch._foreach_copy_(stale, [self._master_of[id(param)] for param in stale])
        self._stale.difference_update(id(param) for param in stale)
