"""Where a layer's attention runs under ``--compile``: a plain sequence's one SDPA call inside
the block's graph, everything that reads a layout or communicates at the graph break
(``meshpipe.context.routing``); and the loader gives a rank without context parallelism the
plain sequence as no positions."""

from __future__ import annotations

import pytest
import torch

from meshpipe.context import LocalAttention, routing
from meshpipe.context.tiles import CAUSAL_LEAF
from dispatched_ops import DispatchedOps

PACK = dict(positions=torch.tensor([0, 1, 2, 0, 1, 2]), doc_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
PLAIN = dict(positions=None, doc_ids=None)


@pytest.fixture
def eager_calls(monkeypatch):
    """The calls that went to the graph break, with their options."""
    calls = []
    eagerly = routing._attend_eagerly

    def spy(attention, q, k, v, **options):
        calls.append(options)
        return eagerly(attention, q, k, v, **options)

    monkeypatch.setattr(routing, "_attend_eagerly", spy)
    return calls


def _qkv(seq: int, device: str = "cpu", dtype=torch.float32):
    return (torch.randn(1, seq, heads, 8, device=device, dtype=dtype) for heads in (4, 2, 2))


@pytest.mark.parametrize("case, seq, options, in_graph", [
    ("plain", 6, dict(PLAIN), True),
    ("plain, a window as long as the sequence", 6, dict(PLAIN, window=6), True),
    ("plain, a window shorter than the sequence", 6, dict(PLAIN, window=5), False),
    ("plain, soft-capped", 6, dict(PLAIN, softcap=30.0), False),
    ("a pack", 6, PACK, False),
    ("positions given", 6, dict(positions=torch.arange(6), doc_ids=None), False),
    ("plain, the CPU's causal squares", CAUSAL_LEAF + 2, dict(PLAIN), False),
])
def test_only_a_plain_sequences_sdpa_call_runs_in_the_graph(eager_calls, case, seq, options,
                                                            in_graph):
    q, k, v = _qkv(seq)
    out = routing.attend(LocalAttention(), q, k, v, causal=True, **options)
    torch.testing.assert_close(out, LocalAttention()(q, k, v, causal=True, **options))
    assert (eager_calls == []) == in_graph, case


def test_off_the_cpu_a_long_plain_sequence_runs_in_the_graph():
    """The causal squares are the CPU kernel's: elsewhere (CUDA; meta tensors here) a plain
    sequence of any length is one SDPA call, in the graph."""
    q, _, _ = _qkv(CAUSAL_LEAF + 2, device="meta", dtype=torch.bfloat16)
    assert LocalAttention().runs_in_graph(q, None, None, None, None)
    cpu_q, _, _ = _qkv(CAUSAL_LEAF + 2)
    assert not LocalAttention().runs_in_graph(cpu_q, None, None, None, None)


def test_a_chunk_hands_its_blocks_a_pack_only_where_their_graphs_keep_it(monkeypatch):
    """``pack_for_graph``: a pack on ``LocalAttention`` in bf16/fp16 (the autocast dtype where
    autocast is on) on a device the variable-length kernel runs on, each document one run of
    positions, as the kernel's causal segments; anything else None, which keeps the pack at
    the graph break."""
    from meshpipe.context import RingAttention, local

    def pack(attention=LocalAttention(), dtype=torch.bfloat16, layout=PACK, device="cpu"):
        hidden = torch.zeros(2, 6, 16, dtype=dtype, device=device)
        return routing.pack_for_graph(attention, layout["positions"], layout["doc_ids"], hidden)

    assert pack() is None  # the CPU has no variable-length kernel
    assert pack(device="meta") is None  # nor has a model laid out on no device
    monkeypatch.setattr(local, "_varlen_runs_on", lambda device: True)
    given = pack()
    assert given.documents.cu_q.tolist() == [0, 3, 6, 9, 12]  # both rows, end to end
    assert (given.documents.longest_q, given.documents.causal) == (3, True)
    assert pack(dtype=torch.float16) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pack(dtype=torch.float32) is not None
    assert pack(dtype=torch.float32) is None
    assert pack(attention=RingAttention()) is None
    assert pack(layout=PLAIN) is None
    split_document = dict(positions=torch.tensor([0, 1, 0, 1, 2, 3]),
                          doc_ids=torch.tensor([0, 0, 1, 1, 0, 0]))
    assert pack(layout=split_document) is None


@pytest.mark.parametrize("case, dtype, head_dim, options, windows, takes", [
    ("bf16", torch.bfloat16, 8, {}, True, True),
    ("fp16, a window", torch.float16, 8, dict(window=3), True, True),
    ("a window this torch's kernel does not take", torch.bfloat16, 8, dict(window=3), False,
     False),
    ("soft-capped", torch.bfloat16, 8, dict(softcap=30.0), True, False),
    ("float32", torch.float32, 8, {}, True, False),
    ("a head size the kernel does not take", torch.bfloat16, 12, {}, True, False),
])
def test_a_compiled_block_keeps_only_the_calls_the_kernel_takes(case, dtype, head_dim, options,
                                                                windows, takes):
    """Inside a graph, ``_graph_takes`` reads only what tracing may: the call's options and
    the queries' dtype and head size, and the pack's note of whether windows are taken."""
    from meshpipe.context.varlen import Segments

    documents = Segments.of([3, 3], [3, 3], 1, torch.device("cpu"), True)
    q = torch.zeros(1, 6, 4, head_dim, dtype=dtype)
    assert routing._graph_takes(routing.GraphPack(documents, windows), q, options.get("window"),
                                options.get("softcap")) == takes, case


def test_another_attention_runs_eagerly_with_exactly_the_options_given(eager_calls):
    """A context-parallel or user attention communicates or reads the layout as it likes:
    always at the graph break, called with what the layer gave and nothing more."""
    seen = []

    def custom(q, k, v, *, positions=None, doc_ids=None, causal=True):
        seen.append((positions, doc_ids, causal))
        return q

    q, k, v = _qkv(6)
    assert routing.attend(custom, q, k, v, positions=None, doc_ids=None, causal=False) is q
    assert seen == [(None, None, False)]
    assert eager_calls == [dict(positions=None, doc_ids=None, causal=False)]


@pytest.mark.parametrize("cp, positions", [
    (dict(), None), (dict(cp_ring=2), [0, 1, 6, 7]), (dict(cp_ulysses=2), [0, 1, 2, 3])])
def test_the_loader_gives_no_positions_without_context_parallelism(cp, positions):
    from meshpipe.train.loop.batches import RankBatches
    from meshpipe.train.config import TrainConfig

    class Batch:
        tokens = torch.randint(0, 64, (2, 8))
        targets = torch.randint(0, 64, (2, 8))

    config = TrainConfig(seq_len=8, microbatches=2, microbatch_size=1, **cp)
    sampler = type("Sampler", (), {"batch": lambda self, step: Batch()})()
    batches = RankBatches(config, 0, 0, torch.device("cpu"))
    with DispatchedOps() as ops:
        inputs = batches(sampler, 0).inputs
    # The whole sequence is the batch's rows as they are: no index over every column.
    assert ("aten.index" in ops.called) == (positions is not None)
    for row, (tokens, given, doc_ids) in enumerate(inputs):
        assert doc_ids is None
        assert (given is None) if positions is None else given.tolist() == positions
        held = list(range(8)) if positions is None else positions
        assert torch.equal(tokens, Batch.tokens[row:row + 1, held])


@pytest.mark.parametrize("cp", [dict(), dict(cp_ring=2)])
def test_the_loader_hands_a_whole_pack_over_without_copying_it(cp):
    """Without context parallelism a pack's rows go to the (here CPU) device as views of the
    batch, with no index over every column; over a ring each rank's own columns."""
    from meshpipe.train.loop.batches import RankBatches
    from meshpipe.train.config import TrainConfig

    class Packed:
        tokens = torch.randint(0, 64, (2, 8))
        targets = torch.randint(0, 64, (2, 8))
        doc_lens = [[3, 5], [8]]

    config = TrainConfig(seq_len=8, microbatches=2, microbatch_size=1, **cp)
    sampler = type("Sampler", (), {"batch": lambda self, step: Packed()})()
    microbatches = RankBatches(config, 0, 0, torch.device("cpu"))(sampler, 0)
    for row, ((tokens, positions, _), targets) in enumerate(zip(microbatches.inputs,
                                                               microbatches.targets)):
        whole = not cp
        for given, batch in ((tokens, Packed.tokens), (targets, Packed.targets)):
            shares = given.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr()
            assert shares == whole
        held = list(range(8)) if whole else [[0, 1, 3, 4, 5], [0, 1, 2, 3]][row]
        assert torch.equal(tokens, Packed.tokens[row:row + 1, held])
