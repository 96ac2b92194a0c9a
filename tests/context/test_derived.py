"""What attention reads from a microbatch's positions and document ids is derived once per
microbatch, not in every layer (on a GPU each read would wait for the device)."""

from __future__ import annotations

import gc

import pytest
import torch

from meshpipe.context import local
from meshpipe.context.derived import derived, held, keep_host_copy, on_host
from meshpipe.context.masks import is_plain_sequence, token_runs, window_applies
from meshpipe.models import Transformer, TransformerConfig


def test_a_value_is_kept_for_the_same_tensors_while_they_live_unchanged():
    positions, doc_ids = torch.arange(6), torch.tensor([0, 0, 0, 1, 1, 1])
    computed = []

    def compute():
        computed.append(1)
        return len(computed)

    before = held()
    assert derived("runs", (positions, doc_ids), compute) == 1
    assert derived("runs", (positions, doc_ids), compute) == 1
    assert derived("other name", (positions, doc_ids), compute) == 2
    assert derived("runs", (positions.clone(), doc_ids), compute) == 3  # another tensor
    assert derived("runs", (positions, None), compute) == 4
    positions.add_(0)  # modified in place: derived anew
    assert derived("runs", (positions, doc_ids), compute) == 5
    del positions, doc_ids
    gc.collect()
    assert held() == before  # every value went with its tensors


def test_layout_readers_read_a_host_copy_instead_of_the_device():
    """A layout kept with its host copy is read from it: these tensors are on the 'meta'
    device, which has no values to read (as a read of a CUDA tensor would wait), and the
    answers equal those of the host tensors. Modified in place, the copy is not used."""
    _, positions, doc_ids = _packed_batch()
    on_device = [keep_host_copy(t.to("meta"), t) for t in (positions, doc_ids)]
    assert token_runs(*on_device) == token_runs(positions, doc_ids)
    assert is_plain_sequence(*on_device) is False
    assert window_applies(4, on_device[0], 24) is True
    assert on_host(on_device[0], None) == (positions, None)
    on_device[0].add_(1)  # modified: its copy is no longer its values
    assert on_host(*on_device) == tuple(on_device)  # and the pair is read together
    with pytest.raises(Exception):
        token_runs(*on_device)  # no copy any more: the device would be read


@pytest.mark.parametrize("kernel", ["per document", "variable length"])
def test_a_packed_batch_reaches_attention_with_its_host_copies(monkeypatch, kernel):
    """``RankBatches`` moves a pack's positions and document ids with their host copies, so
    a 4-layer model on the device ('meta' here: nothing can be read back from it, as a read
    of a CUDA tensor would wait for it) derives the pack's runs from them, and runs, where
    reading the device raised before: document by document, or (bf16, as on CUDA) as one
    variable-length call a layer on the cumulative lengths, backward too."""
    from meshpipe.train.loop.batches import RankBatches
    from meshpipe.train.config import TrainConfig

    class Packed:
        tokens = torch.randint(0, 64, (2, 12))
        targets = torch.randint(0, 64, (2, 12))
        doc_lens = [[5, 7], [12]]

    varlen = kernel == "variable length"
    monkeypatch.setattr(local, "_per_document", lambda q: True)
    monkeypatch.setattr(local, "_varlen_takes", lambda q: varlen)
    calls = []
    packed = local.packed_flash_attention
    monkeypatch.setattr(local, "packed_flash_attention",
                        lambda *args: calls.append(1) or packed(*args))
    config = TrainConfig(seq_len=12, microbatches=2, microbatch_size=1)
    batches = RankBatches(config, 0, 0, torch.device("meta"))
    inputs = batches(type("Sampler", (), {"batch": lambda self, step: Packed()})(), 0).inputs
    model = Transformer(TransformerConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4,
                                          n_kv_heads=2, max_seq_len=64)).to("meta")
    if varlen:
        model.to(torch.bfloat16)
    for tokens, positions, doc_ids in inputs:
        out = model(tokens, positions=positions, doc_ids=doc_ids)
        assert out.device.type == "meta"
        if varlen:
            out.float().square().mean().backward()
    assert len(calls) == (4 if varlen else 0)  # the second row, one whole document, is plain
    with pytest.raises(Exception):
        model(inputs[0][0], positions=inputs[0][1].clone(), doc_ids=inputs[0][2].clone())


def _packed_batch(seq: int = 24):
    lengths = torch.tensor([5, 11, 8])
    doc_ids = torch.repeat_interleave(torch.arange(3), lengths)
    positions = torch.arange(seq) - (torch.cumsum(lengths, 0) - lengths)[doc_ids]
    return torch.randint(0, 64, (2, seq)), positions, doc_ids


@pytest.mark.parametrize("one_call", [False, True], ids=["per document", "one masked call"])
def test_every_layer_of_a_microbatch_shares_what_its_layout_gives(monkeypatch, one_call):
    """A 4-layer model on a pack: the plain-sequence test, the document runs or the mask are
    made once for the microbatch (and once more for the next), and the output equals the
    one made with every layer deriving its own."""
    counts = {"is_plain_sequence": 0, "token_runs": 0, "attention_mask": 0}
    for name in counts:
        def counted(*args, _name=name, _original=getattr(local, name)):
            counts[_name] += 1
            return _original(*args)
        monkeypatch.setattr(local, name, counted)
    monkeypatch.setattr(local, "_per_document", lambda q: not one_call)
    model = Transformer(TransformerConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4,
                                          n_kv_heads=2, max_seq_len=64))
    tokens, positions, doc_ids = _packed_batch()
    logits = model(tokens, positions=positions, doc_ids=doc_ids)
    derived_once = {"is_plain_sequence": 1, "token_runs": 0 if one_call else 1,
                    "attention_mask": 1 if one_call else 0}
    assert counts == derived_once
    model(tokens, positions=positions.clone(), doc_ids=doc_ids.clone())
    assert counts == {name: 2 * count for name, count in derived_once.items()}

    monkeypatch.setattr(local, "derived", lambda name, tensors, compute: compute())
    torch.testing.assert_close(logits, model(tokens, positions=positions, doc_ids=doc_ids))
    assert counts["is_plain_sequence"] == 2 + 4


def _layers_on_one_layout(rank: int, world: int) -> dict[str, int]:
    """Three 'layers' of ring and of Ulysses attention on one microbatch's positions and
    document ids, then one on the next microbatch's: how often each rank gathered the
    group's layout and planned its ring tiles."""
    from meshpipe.context import RingAttention, UlyssesAttention, layout, ring
    from meshpipe.context.shards import ShardLayout

    torch.set_num_threads(1)
    counts = {"gather_layout": 0, "_plan_ring": 0}
    originals = {"gather_layout": layout.gather_layout, "_plan_ring": ring._plan_ring}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call
    layout.gather_layout = counted("gather_layout")
    ring._plan_ring = counted("_plan_ring")
    try:
        lengths = [10, 6]
        shards = ShardLayout.packed(lengths, world)
        q, k, v = (torch.randn(1, shards.local_size(rank), heads, 8) for heads in (4, 2, 2))

        def microbatch():
            held = shards.positions(rank)
            doc_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))[held]
            starts = torch.tensor([0, lengths[0]])
            return held - starts[doc_ids], doc_ids
        for attention in (RingAttention(), UlyssesAttention()):
            positions, doc_ids = microbatch()
            first = [attention(q, k, v, positions=positions, doc_ids=doc_ids) for _ in range(3)]
            torch.testing.assert_close(first[0], first[2])
            attention(q, k, v, **dict(zip(("positions", "doc_ids"), microbatch())))
    finally:
        layout.gather_layout, ring._plan_ring = originals.values()
    return counts


@pytest.mark.distributed
def test_context_parallel_layers_gather_the_layout_once_per_microbatch():
    """Ring and Ulysses attention gather the group's layout (an exchange and a host
    synchronisation) and plan the ring's tiles at a microbatch's first layer only."""
    from meshpipe.testing import run_distributed

    for counts in run_distributed(2, _layers_on_one_layout):
        assert counts == {"gather_layout": 4, "_plan_ring": 2}, counts
