"""The tuner's measurements in this process (``model_profile``, ``layer_curve``): each
piece's parameters (embedding, one transformer layer, final norm + head), the activation
bytes it saves for backward per token (what ``torch.autograd.graph.saved_tensors_hooks``
sees in one microbatch's forward, weights excluded) and its forward time per token, which
only sets the pieces' relative weights; and a layer's forward + backward per token, one
thread, at every token count a layout gives a rank (the shape of cost against size). Timed
calls take turns (``clocked``, ``TURNS`` x ``CALLS_PER_TURN``) after a CUDA synchronize on
GPUs. Step 1 of ``meshpipe.train.tune.tuner``.

Everything is measured in the run's precision (``--dtype``), as the trainer computes: the
weights in ``weights_dtype`` (bfloat16 with float32 masters in bf16), the forwards under
autocast, the hidden states between the pieces, and so the messages between stages, in
the weights' dtype. In bf16 a layer of the tests' model (dim 32) saves 0.6 of the
bytes it saves in fp32, and a message is half as large.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, ContextManager

import torch
from torch.autograd.graph import get_gradient_edge

from meshpipe.models import causal_lm_loss
from meshpipe.models.transformer import Transformer
from meshpipe.runtime import MasterWeights, SplitBackward, autocast, weights_dtype
from meshpipe.schedules.ranking import Link, Piece, Profile, layouts
from meshpipe.train.config import TrainConfig
from meshpipe.train.run import sources
from meshpipe.train.supervisor.launch import device_for_this_rank

# In-process timings (``_seconds_in_turn``): turns over the timed functions, calls per turn.
TURNS = 3
CALLS_PER_TURN = 3
# Placeholder link of the first, compute-free pass (memory and input checks only).
UNMEASURED_LINK = Link(latency=0.0, bytes_per_s=1e12)


def model_profile(config: TrainConfig, device: torch.device | None = None) -> Profile:
    """The in-process part of the profile (parameters, activation bytes and relative
    forward time per piece), on ``device`` (default: this rank's training device); links
    and overheads are placeholders until ``calibrate``."""
    device = device_for_this_rank() if device is None else device
    torch.manual_seed(config.seed)
    model = in_training_precision(
        Transformer(sources.model_config(config), recompute=config.recompute).to(device), config)
    tokens = config.microbatch_size * config.seq_len
    pieces, hidden = _pieces(model, config, device)
    with torch.no_grad():
        seconds = _seconds_in_turn(pieces, device)
        sent = pieces["layer"]()
    # The embedding's input is token ids: its whole backward runs in W, holding nothing more.
    inputs = {"embedding": [], "layer": [hidden], "head": [hidden]}
    measured = {name: (_saved_bytes(run, model) / tokens,
                       statistics.median(seconds[name]) / tokens,
                       _held_for_weights(run, inputs[name]) / tokens)
                for name, run in pieces.items()}
    parameters = {"embedding": model.embedding.weight.numel(),
                  "layer": sum(p.numel() for p in model.layers[0].parameters()),
                  "head": sum(p.numel() for p in (*model.norm.parameters(),
                                                  *model.head.parameters()))}

    def piece(name: str) -> Piece:
        saved, seconds, held = measured[name]
        return Piece(seconds, seconds, seconds, 2 * seconds, saved, parameters[name], held)

    return Profile(layers=config.layers, heads=config.heads, seq_len=config.seq_len,
                   embedding=piece("embedding"), layer=piece("layer"), head=piece("head"),
                   hidden_bytes_per_token=float(sent.element_size() * config.dim),
                   message=UNMEASURED_LINK,
                   all_reduce=UNMEASURED_LINK,
                   masters=weights_dtype(config.dtype) != torch.float32)


def _pieces(model: Transformer, config: TrainConfig, device: torch.device
            ) -> tuple[dict[str, Callable[[], torch.Tensor]], torch.Tensor]:
    """One microbatch's forward through each piece in the run's precision, as a function
    returning its output; and the hidden states the layer and the head take."""
    vocab = model.config.vocab_size
    shape = (config.microbatch_size, config.seq_len)
    tokens = torch.randint(vocab, shape, device=device)
    targets = torch.randint(vocab, shape, device=device)
    hidden = hidden_states(config, shape, device)

    def head() -> torch.Tensor:
        return causal_lm_loss(model.head(model.norm(hidden)), targets, reduction="sum")[0]

    def in_precision(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run_in_precision() -> torch.Tensor:
            with forward_precision(config, device):
                return run()
        return run_in_precision

    return {"embedding": in_precision(lambda: model.embedding(tokens)),
            "layer": in_precision(lambda: model.layers[0](hidden, None, None)),
            "head": in_precision(head)}, hidden


def in_training_precision(module: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    """``module`` with the weights the trainer computes with at ``config.dtype``: made
    bfloat16 in place in bf16, each gradient moved into a float32 master as it lands, as in
    training (the masters live on in those hooks)."""
    MasterWeights(module.named_parameters(), weights_dtype(config.dtype))
    return module


def forward_precision(config: TrainConfig, device: torch.device) -> ContextManager[Any]:
    """The context the trainer runs a forward in at ``config.dtype``."""
    return autocast(config.dtype, device.type)


def layer_step(layer: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor | None,
               config: TrainConfig, device: torch.device) -> None:
    """One forward of ``layer`` in the run's precision, and its backward (``positions``
    None: the plain sequence, as a rank without context parallelism trains it)."""
    with forward_precision(config, device):
        out = layer(hidden, positions, None)
    out.sum().backward()


def hidden_states(config: TrainConfig, shape: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    """Random hidden states ``[*shape, dim]`` in the dtype a stage receives them in (the
    weights' dtype: the residual stream keeps it), requiring grad."""
    return torch.randn(*shape, config.dim, dtype=weights_dtype(config.dtype), device=device,
                       requires_grad=True)


def _saved_bytes(run: Callable[[], torch.Tensor], model: torch.nn.Module) -> float:
    """Bytes of the distinct tensors autograd saves for backward in ``run``, weights not
    counted (they are counted as parameters)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return float(sum(saved.values()))


def _held_for_weights(run: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> float:
    """Bytes a split backward of ``run`` holds from its I to its W, taking the gradient
    toward ``inputs`` (``SplitBackward.held_bytes``): 0 without inputs."""
    if not inputs:
        return 0.0
    out = run()
    split = SplitBackward([get_gradient_edge(out)], [torch.ones_like(out)], inputs)
    split.input_grads()
    return float(split.held_bytes())


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: CUDA runs asynchronously, and the host's
    clock must see its end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clocked(run: Callable[[], Any], device: torch.device,
             start_together: Callable[[], Any] = lambda: None) -> float:
    """Seconds of one call of ``run``, its device work included, started on an idle
    device (and after ``start_together``, a barrier where ranks time together)."""
    _synchronize(device)
    start_together()
    start = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - start


def _seconds_in_turn(runs: dict[Any, Callable[[], Any]],
                     device: torch.device) -> dict[Any, list[float]]:
    """The seconds of ``CALLS_PER_TURN`` calls of each of ``runs``, in ``TURNS`` turns over
    the runs, each turn's calls after an untimed one (the run's data back in the caches
    the other runs used): a slow spell of the machine spoils a turn, not every call of
    one run."""
    times: dict[Any, list[float]] = {name: [] for name in runs}
    for _ in range(TURNS):
        for name, run in runs.items():
            run()
            times[name].extend(clocked(run, device) for _ in range(CALLS_PER_TURN))
    return times


def token_counts(profile: Profile, world_size: int, global_batch: int) -> list[int]:
    """The tokens a rank computes per microbatch in some layout of ``world_size``."""
    return sorted({layout.microbatch_size * profile.seq_len // layout.cp
                   for layout in layouts(world_size, profile, global_batch)})


def ulysses_sizes(profile: Profile, world_size: int, global_batch: int) -> dict[int, list[int]]:
    """Per cp size above 1 that a layout of ``world_size`` uses: the smallest and largest
    microbatch size it comes with (what ``_ulysses_times`` measures)."""
    sizes: dict[int, set[int]] = {}
    for layout in layouts(world_size, profile, global_batch):
        if layout.cp > 1:
            sizes.setdefault(layout.cp, set()).add(layout.microbatch_size)
    return {cp: sorted({min(found), max(found)}) for cp, found in sorted(sizes.items())}


def timed_layer(config: TrainConfig, device: torch.device) -> torch.nn.Module:
    """A transformer layer on ``device`` in the run's precision (``in_training_precision``;
    call it under ``forward_precision``)."""
    torch.manual_seed(config.seed)
    model = Transformer(sources.model_config(config), recompute=config.recompute)
    return in_training_precision(model.layers[0].to(device), config)


def priced_shape(config: TrainConfig, tokens: int) -> tuple[int, int]:
    """``(rows, length)`` of the input a layer over ``tokens`` tokens is priced at: rows of
    ``seq_len`` tokens, or one shorter row."""
    return max(1, tokens // config.seq_len), min(tokens, config.seq_len)


def layer_curve(config: TrainConfig, counts: list[int], device: torch.device | None = None
                ) -> tuple[tuple[float, float], ...]:
    """A transformer layer's forward and backward seconds per token, alone in this process,
    at each of ``counts`` tokens (``priced_shape``), on ``device`` (default: this rank's
    training device): the shape of the cost per token that one measured size cannot show.
    One thread, as the training processes run."""
    device = device_for_this_rank() if device is None else device
    layer = timed_layer(config, device)

    def step(tokens: int) -> Callable[[], None]:
        rows, length = priced_shape(config, tokens)
        hidden = hidden_states(config, (rows, length), device)
        return lambda: layer_step(layer, hidden, None, config, device)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = _seconds_in_turn({tokens: step(tokens) for tokens in counts}, device)
    finally:
        torch.set_num_threads(threads)
    # The fastest call: the least disturbed by other processes.
    return tuple((float(tokens), min(seconds[tokens]) / tokens) for tokens in counts)
