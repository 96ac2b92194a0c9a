"""One pipeline stage: a model chunk with forward, full backward and split backward per microbatch.

Messages between stages are pytrees of tensors and small Python values. Backward with
several tensors in and out of a stage:

- only outputs that require grad take part; the gradients given for the others are ignored
  (and may be None);
- a float input that received no gradient gets zeros; a non-differentiable input (integer or
  bool tensor, None, Python value) gets None;
- on the last stage the loss is the root, multiplied by ``loss_scale`` and passed through the
  optional ``grad_scale_fn`` (e.g. a mixed-precision loss scaler);
- a tensor passed through a stage unchanged (a skip connection) gets the gradient of both
  paths, because the received leaf is itself an output of the stage.

Parameter gradients accumulate in ``.grad`` across microbatches; the Stage never zeroes them.

A module with sub-steps (``forward_steps``, see ``meshpipe.runtime.substeps``) is run piece
by piece when training: its autograd graph is cut at each exchange, the exchange is posted
on the communication thread, and backward walks the pieces in reverse with the exchanges'
reverse in between. ``forward_steps``/``backward_steps``/``backward_input_steps`` expose
the pieces as tasks that yield while an exchange travels (what ``OVERLAP`` co-schedules);
``forward``/``backward``/``backward_input`` run them to their end.

One module because forward, full backward, split backward and the sub-step runner share
what a microbatch leaves behind (its saved graph, received leaves and outputs), and each
must free it at the same points for the others to stay exact.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from meshpipe.runtime.split_backward import ReentrantCheckpointError, SplitBackward
from meshpipe.runtime.substeps import Exchange, comm_worker, drain, record_event

Task = Generator[None, None, Any]


class StageError(RuntimeError):
    """A stage could not run an action; the message names rank, stage, microbatch and action."""

    def __init__(self, problem: str, *, stage: int, microbatch: int, action: str, hint: str):
        rank = f"rank {dist.get_rank()}, " if dist.is_available() and dist.is_initialized() else ""
        super().__init__(f"{rank}stage {stage}, microbatch {microbatch}, {action}: "
                         f"{problem.rstrip('.')}. {hint}")
        self.stage = stage
        self.microbatch = microbatch
        self.action = action


class _Boundary:
    """Where a sub-step forward was cut at an exchange: the tensors that left the piece
    before it (its roots in backward) and the fresh leaves the piece after it started from."""

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        send, self._send_spec = tree_flatten(exchange.send)
        keep, self._keep_spec = tree_flatten(exchange.keep)
        self._roots = [(i, get_gradient_edge(t)) for i, t in enumerate(send + keep)
                       if isinstance(t, Tensor) and t.requires_grad]
        self.send_values = tree_unflatten([_detached(t) for t in send], self._send_spec)
        self._kept = [_as_stage_input(_detached(t)) for t in keep]
        self._received: list[Any] = []
        self._received_spec: TreeSpec | None = None
        # The differentiable leaves the piece after the exchange started from.
        self.leaves: list[Tensor] = []

    def resume_value(self, received: Any) -> tuple[Any, Any]:
        """What the piece after the exchange gets: ``(received, kept)`` as fresh leaves."""
        leaves, self._received_spec = tree_flatten(received)
        self._received = [_as_stage_input(t) for t in leaves]
        self.leaves = [t for t in self._received + self._kept if _is_differentiable(t)]
        return (tree_unflatten(self._received, self._received_spec),
                tree_unflatten(self._kept, self._keep_spec))

    def received_gradients(self, leaf_grads: list[Tensor | None]) -> Any:
        """The gradients of the received values (zeros where none reached a leaf, None for
        non-float values), shaped as received: what the reverse exchange sends back."""
        grads = dict(zip(map(id, self.leaves), leaf_grads))
        out = [(torch.zeros_like(t) if grads.get(id(t)) is None else grads[id(t)])
               if _is_differentiable(t) else None for t in self._received]
        return tree_unflatten(out, self._received_spec)

    def roots_and_grads(self, send_grads: Any, leaf_grads: list[Tensor | None]
                        ) -> tuple[list[GradientEdge], list[Tensor]]:
        """The piece before the exchange's roots with their gradients: each sent tensor's
        from the reverse exchange, each kept tensor's from its leaf after the exchange."""
        grads = dict(zip(map(id, self.leaves), leaf_grads))
        by_position = tree_flatten(send_grads)[0] + [grads.get(id(t)) for t in self._kept]
        roots, root_grads = [], []
        for position, edge in self._roots:
            grad = by_position[position]
            if grad is not None:
                roots.append(edge)
                root_grads.append(grad)
        return roots, root_grads


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


@dataclass
class _Microbatch:
    """What one forward keeps until its backward."""

    input_leaves: list[Any]
    input_spec: TreeSpec
    outputs: list[Any]
    output_spec: TreeSpec
    roots: list[GradientEdge]
    root_shapes: list[torch.Size]
    # Index of each root in the flattened output; empty for the loss root of the last stage.
    root_output_indices: list[int]
    # The gradient that seeds a loss root (ones); None on stages that receive output grads.
    loss_grad: Tensor | None
    # Where a sub-step forward was cut, in forward order (empty for a module run in one go).
    boundaries: list[_Boundary] = field(default_factory=list)
    # The split backward of each piece, last piece first, from I until W.
    split: list[SplitBackward] | None = None


def _is_differentiable(value: Any) -> bool:
    return isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex())


def _as_stage_input(value: Any) -> Any:
    """A received float tensor becomes a fresh leaf that collects the gradient to send back."""
    if _is_differentiable(value):
        return value.detach().requires_grad_(True)
    return value


def _describe(values: list[Any]) -> str:
    def one(value: Any) -> str:
        if isinstance(value, Tensor):
            return f"Tensor{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__
    return "(" + ", ".join(one(v) for v in values) + ")"


def _storage_use_count(tensor: Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@cache
def _exclusive_use_counts() -> tuple[int, int]:
    """Use counts of a tensor that nothing else references, and of its storage, counted
    the way ``_shared`` counts: measured once rather than assumed, since they depend on
    how torch's Python wrappers hold their references."""
    tensor = torch.empty(1, device="cpu")
    return tensor._use_count(), _storage_use_count(tensor)


def _shared(tensor: Tensor) -> bool:
    """Whether anything besides this Python tensor holds the tensor or its storage.

    Autograd saves a tensor that an op takes as input by holding the tensor itself, and
    an op's own result by holding another tensor on the same storage; a view of the
    tensor saved by a later op, or alive anywhere else, also holds the storage.
    """
    try:
        own_tensor, own_storage = _exclusive_use_counts()
        return tensor._use_count() > own_tensor or _storage_use_count(tensor) > own_storage
    except AttributeError:  # a torch without these (private) counters: keeping is always safe
        return True


class Stage:
    """One model chunk of a pipeline: runs forward and backward actions per microbatch.

    ``loss_fn(output, target)`` (last stage) must return a scalar tensor. ``grad_scale_fn``
    maps the scaled loss to the tensor whose backward is taken (a loss scaler's hook).
    """

    def __init__(self, module: nn.Module, index: int, num_stages: int, *,
                 loss_fn: Callable[[Any, Any], Tensor] | None = None,
                 grad_scale_fn: Callable[[Tensor], Tensor] | None = None):
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} is outside 0..{num_stages - 1}")
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        if loss_fn is not None and not self.is_last:
            raise ValueError(f"stage {index} of {num_stages} got a loss_fn; only the last stage "
                             f"computes the loss")
        self.loss_fn = loss_fn
        self.grad_scale_fn = grad_scale_fn
        self._saved: dict[int, _Microbatch] = {}
        self._finished: dict[int, str] = {}
        try:
            self._signature: inspect.Signature | None = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self._signature = None

    @property
    def live_microbatches(self) -> int:
        """Forwards whose saved state (activations, graph) is still held."""
        return len(self._saved)

    def reset(self) -> None:
        """Forget every held microbatch (activations, graphs, split-backward state) and which
        backwards ran, as after a failed step. Parameter ``.grad`` keeps what the backwards
        that did run accumulated: zero it before training on."""
        self._saved.clear()
        self._finished.clear()

    def _error(self, problem: str, microbatch: int, action: str, hint: str) -> StageError:
        return StageError(problem, stage=self.index, microbatch=microbatch, action=action,
                          hint=hint)

    def _input_hint(self, fits: str, otherwise: str) -> str:
        """Where to fix a forward input that does not fit: on the first stage the data (the
        microbatch's entry of the step's inputs), which must be ``fits``; elsewhere the
        previous stage's output (``otherwise``)."""
        if self.is_first:
            return ("the first stage takes the data itself: check this microbatch's entry of "
                    "the inputs given to Executor.step(inputs=...) (a tuple or list is "
                    f"unpacked into positional arguments); it must be {fits}")
        return otherwise

    def _output_grads_hint(self, check: str) -> str:
        """Where to fix the gradients a backward starts from: the loss on the last stage, the
        gradients received from the next stage elsewhere."""
        if self.is_last:
            if self.loss_fn is None:
                return ("this last stage has no loss_fn, so its backward needs the "
                        "gradients of its outputs: give it Stage(..., loss_fn=...), or pass "
                        "output_grads shaped like its output")
            return ("the last stage's backward starts from its loss: check loss_fn (and "
                    "what it returns) and the chunk's forward, e.g. for an in-place change "
                    "to a tensor autograd saved")
        return check

    # ----------------------------------------------------------------- forward

    def forward(self, microbatch: int, message: Any, *, target: Any = None,
                loss_scale: float = 1.0, keep_for_backward: bool = True) -> Any:
        """Run the chunk on ``message``; returns the output message, or ``(output, loss)``.

        The last stage with a ``loss_fn`` returns the unscaled loss (detached) beside its
        output. With ``keep_for_backward=False`` (forward-only) no graph is built or kept,
        and a last stage given no ``target`` skips the loss and returns its output alone.
        """
        return drain(self.forward_steps(microbatch, message, target=target,
                                        loss_scale=loss_scale,
                                        keep_for_backward=keep_for_backward))

    def forward_steps(self, microbatch: int, message: Any, *, target: Any = None,
                      loss_scale: float = 1.0, keep_for_backward: bool = True) -> Task:
        """``forward`` as a task that yields while each exchange of a sub-step module travels
        (a module run in one go never yields); its result is what ``forward`` returns."""
        if keep_for_backward and microbatch in self._saved:
            raise self._error("a forward of this microbatch is still waiting for its backward",
                              microbatch, "forward",
                              "run its backward first, or use a distinct microbatch id")
        leaves, spec = tree_flatten(message)
        if not self.is_first and keep_for_backward:
            leaves = [_as_stage_input(leaf) for leaf in leaves]
            message = tree_unflatten(leaves, spec)
        args = tuple(message) if isinstance(message, (tuple, list)) else (message,)
        self._check_arity(args, microbatch)
        boundaries: list[_Boundary] = []
        if keep_for_backward and self.has_substeps:
            output = yield from self._run_pieces(args, microbatch, boundaries)
        else:
            with torch.set_grad_enabled(keep_for_backward):
                output = self._call_module(args, microbatch)
        loss = root = None
        if self.computes_loss(target, keep_for_backward):
            with torch.set_grad_enabled(keep_for_backward):
                loss, root = self._loss(output, target, loss_scale, microbatch)
        if keep_for_backward:
            self._saved[microbatch] = self._record(leaves, spec, output, root)
            self._saved[microbatch].boundaries = boundaries
            self._finished.pop(microbatch, None)
        if loss is None:
            return output
        return output, loss.detach()

    @property
    def has_substeps(self) -> bool:
        """Whether the module cuts its forward at its exchanges (``forward_steps``)."""
        return callable(getattr(self.module, "forward_steps", None))

    def _run_pieces(self, args: tuple, microbatch: int, boundaries: list[_Boundary]) -> Task:
        """Run ``module.forward_steps`` piece by piece, posting each exchange on the
        communication thread and yielding until its result is needed."""
        label = f"F{self.index},{microbatch}"
        steps = self.module.forward_steps(*args)
        value = None
        while True:
            record_event("run", label)
            try:
                with torch.enable_grad():
                    exchange = steps.send(value)
            except StopIteration as done:
                record_event("yield", label)
                return done.value
            except Exception as exc:
                raise self._module_error(exc, args, microbatch) from exc
            if not isinstance(exchange, Exchange):
                raise self._error(f"forward_steps yielded a {type(exchange).__name__}, not an "
                                  "Exchange", microbatch, "forward",
                                  "yield meshpipe.runtime.substeps.Exchange objects only")
            boundary = _Boundary(exchange)
            in_flight = comm_worker().post(f"{label}:{exchange.name}", exchange.communicate,
                                           boundary.send_values)
            record_event("yield", label)
            yield
            value = boundary.resume_value(in_flight.wait())
            boundaries.append(boundary)

    def computes_loss(self, target: Any, keep_for_backward: bool = True) -> bool:
        """Whether ``forward`` with this ``target`` returns a loss: on the last stage with a
        ``loss_fn``, always when training (a missing target is an error), and only when a
        target is given in forward-only mode."""
        if not self.is_last or self.loss_fn is None:
            return False
        return keep_for_backward or target is not None

    def _check_arity(self, args: tuple, microbatch: int) -> None:
        if self._signature is None:
            return
        try:
            self._signature.bind(*args)
        except TypeError as exc:
            raise self._error(
                f"the message {_describe(list(args))} does not fit the module's forward"
                f"{self._signature} ({exc})", microbatch, "forward",
                self._input_hint("exactly the values the first chunk's forward takes",
                                 "make the previous stage return exactly the values this "
                                 "chunk takes")) from None

    def _call_module(self, args: tuple, microbatch: int) -> Any:
        try:
            return self.module(*args)
        except Exception as exc:
            raise self._module_error(exc, args, microbatch) from exc

    def _module_error(self, exc: Exception, args: tuple, microbatch: int) -> StageError:
        return self._error(
            f"the module raised {type(exc).__name__}: {exc} (message was "
            f"{_describe(list(args))})", microbatch, "forward",
            self._input_hint("what the first chunk expects (count, dtypes, shapes)",
                             "check that the previous stage's output matches what this chunk "
                             "expects (count, dtypes, shapes)"))

    def _loss(self, output: Any, target: Any, loss_scale: float,
              microbatch: int) -> tuple[Tensor, Tensor]:
        if target is None:
            raise self._error("the last stage has a loss_fn but got no target", microbatch,
                              "forward", "pass target= with the microbatch's labels")
        try:
            loss = self.loss_fn(output, target)
        except Exception as exc:
            raise self._error(f"loss_fn raised {type(exc).__name__}: {exc}", microbatch,
                              "forward", "check the target against the last stage's output "
                              f"{_describe(tree_flatten(output)[0])}") from exc
        if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            got = _describe([loss])
            raise self._error(f"loss_fn returned {got}, not a floating-point scalar", microbatch,
                              "forward", "reduce the loss to one value (mean or sum)")
        root = loss * loss_scale
        if self.grad_scale_fn is not None:
            root = self.grad_scale_fn(root)
            if not isinstance(root, Tensor) or root.dim() != 0:
                raise self._error(f"grad_scale_fn returned {_describe([root])}, not a scalar",
                                  microbatch, "forward", "return the scaled loss tensor")
        return loss, root

    def _record(self, input_leaves: list[Any], input_spec: TreeSpec, output: Any,
                loss_root: Tensor | None) -> _Microbatch:
        outputs, output_spec = tree_flatten(output)
        if loss_root is not None:
            takes_part = [loss_root] if loss_root.requires_grad else []
            indices: list[int] = []
        else:
            indices = [i for i, value in enumerate(outputs)
                       if isinstance(value, Tensor) and value.requires_grad]
            takes_part = [outputs[i] for i in indices]
        return _Microbatch(
            input_leaves=input_leaves, input_spec=input_spec, outputs=outputs,
            output_spec=output_spec, roots=[get_gradient_edge(t) for t in takes_part],
            root_shapes=[t.shape for t in takes_part], root_output_indices=indices,
            loss_grad=None if loss_root is None else torch.ones_like(loss_root))

    # ---------------------------------------------------------------- backward

    def backward(self, microbatch: int, output_grads: Any = None) -> Any:
        """Full backward (B): accumulates parameter grads, returns the input grads.

        The result is a pytree like the received message (None on the first stage, which has
        no upstream to send to).
        """
        return drain(self.backward_steps(microbatch, output_grads))

    def backward_steps(self, microbatch: int, output_grads: Any = None) -> Task:
        """``backward`` as a task that yields while each reverse exchange travels."""
        saved = self._held(microbatch, "backward")
        roots, grads = self._roots_and_grads(saved, output_grads, microbatch, "backward")
        float_inputs = self._float_inputs(saved)
        del self._saved[microbatch]
        leaf_grads = yield from self._backward_pieces(
            saved, roots, grads, float_inputs, microbatch, "backward",
            lambda r, g, leaves: self._accumulate(r, g, leaves))
        self._finish(microbatch, "backward")
        return self._input_grads(saved, leaf_grads)

    def backward_input(self, microbatch: int, output_grads: Any = None) -> Any:
        """Input-gradient half (I) of the backward; ``backward_weight`` must follow.

        Returns the same input grads as ``backward`` would. See ``SplitBackward`` for how the
        weight half is kept for later and what it costs.
        """
        return drain(self.backward_input_steps(microbatch, output_grads))

    def backward_input_steps(self, microbatch: int, output_grads: Any = None) -> Task:
        """``backward_input`` as a task that yields while each reverse exchange travels."""
        saved = self._held(microbatch, "backward_input")
        roots, grads = self._roots_and_grads(saved, output_grads, microbatch, "backward_input")
        float_inputs = self._float_inputs(saved)
        saved.split = []

        def input_half(roots, grads, leaves) -> list[Tensor | None]:
            saved.split.append(SplitBackward(roots, grads, leaves))
            return saved.split[-1].input_grads()

        try:
            leaf_grads = yield from self._backward_pieces(
                saved, roots, grads, float_inputs, microbatch, "backward_input", input_half)
        except StageError:
            del self._saved[microbatch]
            raise
        result = self._input_grads(saved, leaf_grads)
        saved.input_leaves, saved.outputs, saved.boundaries = [], [], []
        return result

    def backward_weight(self, microbatch: int) -> None:
        """Weight-gradient half (W): accumulates the parameter grads that I deferred."""
        saved = self._held(microbatch, "backward_weight")
        del self._saved[microbatch]
        try:
            for split in saved.split:
                split.accumulate_weight_grads()
        except RuntimeError as exc:
            raise self._autograd_error(exc, microbatch, "backward_weight",
                                       "report this with the model: the weight pass should not "
                                       "fail after its input pass succeeded") from exc
        self._finish(microbatch, "backward_weight")

    @staticmethod
    def _accumulate(roots: list[GradientEdge], grads: list[Tensor],
                    leaves: list[Tensor]) -> list[Tensor | None]:
        """A full backward of one piece: parameter grads accumulate, the leaves' are returned."""
        if roots:
            torch.autograd.backward(roots, grads)
        return [leaf.grad for leaf in leaves]

    def _backward_pieces(self, saved: _Microbatch, roots: list[GradientEdge],
                         grads: list[Tensor], float_inputs: list[Tensor], microbatch: int,
                         action: str, run_piece) -> Task:
        """Backward through the pieces of a forward, last first: ``run_piece(roots, grads,
        leaves)`` backpropagates one piece and returns its leaves' gradients; between two
        pieces the reverse exchange is posted and the task yields until it returns.
        Returns the gradients of the stage's float inputs."""
        label = f"{'B' if action == 'backward' else 'I'}{self.index},{microbatch}"
        hint = self._output_grads_hint("check the output gradients received from the next "
                                       "stage")
        for boundary in reversed(saved.boundaries):
            record_event("run", label)
            leaves = boundary.leaves
            try:
                leaf_grads = run_piece(roots, grads, leaves)
            except RuntimeError as exc:
                raise self._autograd_error(exc, microbatch, action, hint) from exc
            in_flight = comm_worker().post(f"{label}:{boundary.exchange.name}",
                                           boundary.exchange.communicate_backward,
                                           boundary.received_gradients(leaf_grads))
            record_event("yield", label)
            yield
            roots, grads = boundary.roots_and_grads(in_flight.wait(), leaf_grads)
        record_event("run", label)
        try:
            input_grads = run_piece(roots, grads, float_inputs)
        except RuntimeError as exc:
            raise self._autograd_error(exc, microbatch, action, hint) from exc
        record_event("yield", label)
        return input_grads

    def _autograd_error(self, exc: RuntimeError, microbatch: int, action: str,
                        hint: str) -> StageError:
        """A failed backward as a StageError; a split backward through a reentrant checkpoint
        (which supports neither ``autograd.grad`` nor ``backward(inputs=...)``) gets its fix."""
        if isinstance(exc, ReentrantCheckpointError):
            hint = ("use torch.utils.checkpoint(..., use_reentrant=False) with zero-bubble "
                    "schedules, whose split backward (I then W) needs it")
        return self._error(f"autograd failed: {exc}", microbatch, action, hint)

    def _held(self, microbatch: int, action: str) -> _Microbatch:
        """The state of ``microbatch`` if ``action`` may run on it now; a StageError otherwise."""
        saved = self._saved.get(microbatch)
        if saved is None:
            done = self._finished.get(microbatch)
            if done is not None:
                raise self._error(f"its backward already ran ({done})", microbatch, action,
                                  "each forward allows one backward: B, or I followed by W")
            raise self._error("no forward of this microbatch is held", microbatch, action,
                              "run forward with keep_for_backward=True first (forward-only "
                              "runs keep nothing)")
        if action == "backward_weight" and saved.split is None:
            raise self._error("backward_weight needs backward_input first", microbatch, action,
                              "run backward_input (I) before backward_weight (W), or use backward")
        if action != "backward_weight" and saved.split is not None:
            raise self._error("backward_input already ran for this microbatch", microbatch, action,
                              "finish it with backward_weight")
        return saved

    def _finish(self, microbatch: int, action: str) -> None:
        self._finished[microbatch] = action

    def _float_inputs(self, saved: _Microbatch) -> list[Tensor]:
        if self.is_first:
            return []
        return [leaf for leaf in saved.input_leaves if _is_differentiable(leaf)]

    def _roots_and_grads(self, saved: _Microbatch, output_grads: Any, microbatch: int,
                         action: str) -> tuple[list[GradientEdge], list[Tensor]]:
        if saved.loss_grad is not None:
            if output_grads is not None:
                raise self._error("the last stage backpropagates its own loss but got output "
                                  "gradients", microbatch, action, "pass output_grads=None")
            return saved.roots, [saved.loss_grad] if saved.roots else []
        grad_leaves = self._grad_leaves(saved, output_grads, microbatch, action)
        roots, grads = [], []
        for edge, shape, index in zip(saved.roots, saved.root_shapes, saved.root_output_indices):
            grad = grad_leaves[index]
            if grad is None:
                continue
            if not isinstance(grad, Tensor) or grad.shape != shape:
                raise self._error(
                    f"output {index} has shape {tuple(shape)} but its gradient is "
                    f"{_describe([grad])}", microbatch, action,
                    "send back one gradient per output, shaped like that output")
            roots.append(edge)
            grads.append(grad)
        return roots, grads

    def _grad_leaves(self, saved: _Microbatch, output_grads: Any, microbatch: int,
                     action: str) -> list[Any]:
        n_outputs = saved.output_spec.num_leaves
        if output_grads is None:
            if saved.roots:
                raise self._error("no output gradients given for outputs that require grad",
                                  microbatch, action, self._output_grads_hint(
                                      "pass the gradients received from the next stage"))
            return [None] * n_outputs
        if isinstance(output_grads, Tensor) and len(saved.roots) == 1:
            grad_leaves = [None] * n_outputs
            grad_leaves[saved.root_output_indices[0]] = output_grads
            return grad_leaves
        grad_leaves, _ = tree_flatten(output_grads)
        if len(grad_leaves) != n_outputs:
            raise self._error(
                f"got {len(grad_leaves)} output gradients for {n_outputs} outputs", microbatch,
                action, "send back a pytree shaped like this stage's output (None where no "
                "gradient)")
        return grad_leaves

    def _input_grads(self, saved: _Microbatch, float_grads: list[Tensor | None]) -> Any:
        """Map gradients of the float inputs back onto the received message's structure."""
        if self.is_first:
            return None
        grads = iter(float_grads)
        leaves = []
        for leaf in saved.input_leaves:
            if _is_differentiable(leaf):
                grad = next(grads)
                leaves.append(torch.zeros_like(leaf) if grad is None else grad)
            else:
                leaves.append(None)
        return tree_unflatten(leaves, saved.input_spec)

    # ------------------------------------------------------------------ memory

    def release_output(self, microbatch: int) -> None:
        """Free the storage of this microbatch's outputs once they are sent.

        The next stage holds its own copy, and backward only needs the outputs' autograd
        nodes, which stay. Only an output that a differentiable op produced (one with a
        ``grad_fn``) is freed: parameters, buffers, constants, integer tensors and anything
        computed without grad are the module's or the caller's, and stay. An output is also
        kept when freeing it would break backward or free nothing: it is a view; it shares
        its storage with a stage input (a value passed through, which the caller may still
        use, e.g. the positions of every microbatch); or something besides the stage holds
        the tensor or its storage (checked in O(1) per output from their use counts): an op
        that saved it for backward (``tanh``, ``sigmoid``, ``softmax`` save their result; an
        op consuming the output inside the stage may save it, or a view of it, as input),
        any other live view of it. A plain Python reference is not counted: a forward hook
        or module attribute that keeps a sent activation sees it emptied (keep a ``clone()``
        instead), and so does a saved-tensor hook that packs the very tensor object (neither
        a copy nor a ``detach()``). Call it once the outputs' send is posted (the transport
        sends from a copy). A microbatch with nothing held (forward-only, or backward done)
        is left alone.
        """
        saved = self._saved.get(microbatch)
        if saved is None or saved.split is not None:
            return
        inputs = {leaf.untyped_storage().data_ptr() for leaf in saved.input_leaves
                  if isinstance(leaf, Tensor)}
        for value in saved.outputs:
            if (not isinstance(value, Tensor) or value.grad_fn is None or value._base is not None
                    or value.numel() == 0):
                continue
            if value.untyped_storage().data_ptr() not in inputs and not _shared(value):
                value.data = torch.empty(0, dtype=value.dtype, device=value.device)
