"""One executor runs every schedule; loss and gradients equal a single process.

Each case builds the same tiny transformer on every rank, keeps the stages the schedule
places there, runs one step and compares loss and every parameter gradient with one process
computing the whole batch (float32, assert_close defaults).
"""

import pytest
import torch

from meshpipe.testing import run_distributed
from pipeline_cases import MICROBATCH_SIZE, pipeline_step, reference_step, tiny_config

pytestmark = pytest.mark.distributed

# (schedule, pp, microbatches, stages_per_rank): microbatches = pp and, where the schedule
# allows it, a count not divisible by pp.
CASES = [
    ("gpipe", 2, 2, 1), ("gpipe", 2, 3, 1), ("gpipe", 4, 4, 1), ("gpipe", 4, 6, 1),
    ("1f1b", 2, 2, 1), ("1f1b", 2, 5, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 7, 1),
    ("interleaved", 2, 2, 2), ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2),
    ("interleaved", 4, 8, 2),
    ("zb-h1", 2, 2, 1), ("zb-h1", 2, 3, 1), ("zb-h1", 4, 4, 1), ("zb-h1", 4, 6, 1),
    ("zb-v", 2, 2, 2), ("zb-v", 2, 3, 2), ("zb-v", 4, 4, 2), ("zb-v", 4, 6, 2),
    ("dualpipe-v", 2, 4, 2), ("dualpipe-v", 2, 5, 2), ("dualpipe-v", 4, 8, 2),
    ("dualpipe-v", 4, 9, 2),
    ("combined-1f1b", 2, 2, 1), ("combined-1f1b", 2, 3, 1), ("combined-1f1b", 4, 4, 1),
    ("combined-1f1b", 2, 4, 2), ("combined-1f1b", 4, 8, 2),
]


def _assert_matches_reference(results, num_stages, num_sequences):
    loss, grads = reference_step(2 * num_stages, num_sequences)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses, "no rank reported a loss"
    torch.testing.assert_close(torch.tensor(sum(losses) / len(losses)), loss)
    seen = {}
    for r in results:
        for name, grad in r["grads"].items():
            seen.setdefault(name, grad)
            torch.testing.assert_close(grad, grads[name], msg=lambda m, n=name: f"{n}: {m}")
    assert seen.keys() == grads.keys()


@pytest.mark.parametrize("name,pp,microbatches,vpp", CASES,
                         ids=[f"{c[0]}-pp{c[1]}-m{c[2]}-v{c[3]}" for c in CASES])
def test_schedule_matches_single_process(name, pp, microbatches, vpp):
    results = run_distributed(pp, pipeline_step, name, pp, microbatches, stages_per_rank=vpp)
    _assert_matches_reference(results, pp * vpp, microbatches * MICROBATCH_SIZE)


# Batched transport: each run of SEND/RECV actions goes out in one batch_isend_irecv.
BATCHED_CASES = [("gpipe", 2, 3, 1), ("1f1b", 2, 5, 1), ("1f1b", 4, 7, 1),
                 ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("zb-h1", 4, 6, 1),
                 ("zb-v", 2, 3, 2), ("zb-v", 4, 6, 2), ("dualpipe-v", 2, 5, 2),
                 ("combined-1f1b", 2, 4, 2)]


@pytest.mark.parametrize("name,pp,microbatches,vpp", BATCHED_CASES,
                         ids=[f"{c[0]}-pp{c[1]}-m{c[2]}-v{c[3]}" for c in BATCHED_CASES])
def test_batched_transport_matches_single_process(name, pp, microbatches, vpp):
    results = run_distributed(pp, pipeline_step, name, pp, microbatches, stages_per_rank=vpp,
                              p2p_mode="batched")
    _assert_matches_reference(results, pp * vpp, microbatches * MICROBATCH_SIZE)


@pytest.mark.parametrize("name,pp,microbatches,vpp", [("1f1b", 2, 3, 1), ("interleaved", 2, 4, 2),
                                                      ("zb-v", 2, 4, 2)])
def test_data_parallel_averages_gradients(name, pp, microbatches, vpp):
    results = run_distributed(2 * pp, pipeline_step, name, pp, microbatches,
                              stages_per_rank=vpp, dp=2)
    _assert_matches_reference(results, pp * vpp, 2 * microbatches * MICROBATCH_SIZE)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_wraparound_placement_first_rank_holds_the_end_stage(name):
    results = run_distributed(3, pipeline_step, name, 3, 5, placement="wraparound")
    assert results[0]["loss"] is not None, "rank 0 holds the last stage and computes the loss"
    _assert_matches_reference(results, 4, 5 * MICROBATCH_SIZE)


@pytest.mark.parametrize("name,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_forward_only_returns_the_model_outputs(name, vpp):
    from meshpipe.models import Transformer
    from pipeline_cases import batch

    results = run_distributed(2, pipeline_step, name, 2, 4, stages_per_rank=vpp,
                              forward_only=True)
    outputs = [o for r in results for o in r["outputs"]]
    assert len(outputs) == 4
    tokens, _ = batch(4 * MICROBATCH_SIZE)
    with torch.no_grad():
        logits = Transformer(tiny_config(2 * 2 * vpp))(tokens)
    torch.testing.assert_close(torch.cat(outputs), logits)
    assert all(not r["grads"] for r in results)


@pytest.mark.parametrize("name,pp,microbatches,vpp", [("1f1b", 4, 8, 1), ("gpipe", 2, 4, 1),
                                                      ("interleaved", 2, 4, 2),
                                                      ("zb-h1", 4, 8, 1), ("zb-v", 2, 6, 2)])
def test_live_activations_never_exceed_the_simulated_peak(name, pp, microbatches, vpp):
    results = run_distributed(pp, pipeline_step, name, pp, microbatches, stages_per_rank=vpp)
    for rank, r in enumerate(results):
        assert 0 < r["peak"] <= r["simulated_peak"], (rank, r["peak"], r["simulated_peak"])


def _two_steps_transport_stats(rank, world_size, name, microbatches, vpp, mode="async"):
    from meshpipe.comm.p2p import P2PTransport
    from meshpipe.models import Transformer, causal_lm_loss, split
    from meshpipe.runtime import Executor, Stage
    from meshpipe.schedules import build
    from pipeline_cases import batch

    schedule = build(name, world_size, microbatches, stages_per_rank=vpp)
    chunks = split(Transformer(tiny_config(2 * schedule.num_stages)), schedule.num_stages)
    last = schedule.num_stages - 1
    stages = {s: Stage(chunks[s], s, schedule.num_stages,
                       loss_fn=causal_lm_loss if s == last else None)
              for s in schedule.stages_of(rank)}
    transport = P2PTransport(mode=mode)
    executor = Executor(schedule, stages, pp_rank=rank, pipeline_ranks=list(range(world_size)),
                        transport=transport)
    comm_runs = sum(1 for i, action in enumerate(executor.actions) if action.kind.is_comm
                    and (i == 0 or not executor.actions[i - 1].kind.is_comm))
    tokens, targets = batch(microbatches * MICROBATCH_SIZE)
    positions = torch.arange(tokens.shape[1])  # forward messages carry it, gradients do not
    inputs = [(t, positions, None) for t in tokens.split(MICROBATCH_SIZE)]
    executor.step(inputs, list(targets.split(MICROBATCH_SIZE)))
    transport.stats.reset()
    executor.step(inputs, list(targets.split(MICROBATCH_SIZE)))
    stats = transport.stats
    return (stats.messages_sent, stats.sends_posted, stats.recvs_posted,
            stats.layout_changes_sent, stats.metadata_sent, stats.recvs_deferred,
            stats.batches_posted, stats.ops_batched, comm_runs)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("interleaved", 2)])
def test_a_steady_step_moves_each_message_in_one_operation(name, vpp):
    """Each (direction, stage) stream keeps its layout, so after the first step no metadata
    or layout notice travels and every message is one send and one receive. Interleaved
    sends activations and gradients (different layouts) between the same pair of ranks."""
    for messages, sends, receives, changes, metadata, _, batches, _, _ in run_distributed(
            2, _two_steps_transport_stats, name, 4, vpp):
        assert messages > 0
        assert sends == receives == messages
        assert changes == metadata == 0
        assert batches == 0  # async mode posts every operation by itself


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("interleaved", 2), ("zb-v", 2)])
def test_a_batched_step_posts_each_run_of_comm_actions_in_one_batch(name, vpp):
    """In batched mode the executor flushes once per run of SEND/RECV actions: at most one
    batch_isend_irecv per run (one group here), carrying every steady operation except the
    receives deferred behind an unresolved one of their channel (posted when it resolves)."""
    results = run_distributed(2, _two_steps_transport_stats, name, 4, vpp, "batched")
    for (messages, sends, receives, changes, metadata, deferred, batches, batched,
         comm_runs) in results:
        assert sends == receives == messages > 0
        assert changes == metadata == 0
        assert batched == sends + receives - deferred
        assert 0 < batches <= comm_runs
    # lowering puts most comm actions next to their compute, but some runs hold several
    assert any(batches < batched for *_, batches, batched, _ in results)
