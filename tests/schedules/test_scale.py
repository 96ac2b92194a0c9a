"""The cost model at scale (``schedules.scale``), cluster descriptions and model shapes:
each communication term against values computed by hand."""

import math

import pytest

from meshpipe.schedules.cluster import CLUSTERS, GIB, ClusterError, cluster_from_toml, cluster_named
from meshpipe.schedules.model_shape import ModelShape, ModelShapeError, shape_from_hf_config
from meshpipe.schedules.ranking import Link
from meshpipe.schedules.scale import (Efficiency, Runtime, ScaleLayout, all_to_all_s,
                                      collective_s, context_parallel_s, expert_all_to_all_s,
                                      gradient_accumulation_s, gradient_sync_s, group_link,
                                      hierarchical_reduce_s,
                                      layer_costs, pipeline_message_s, tensor_parallel_s)

# A cluster with round numbers: 4 GPUs a node, NVLink 100 GB/s and 1 us, network 10 GB/s
# and 10 us, 100 TFLOP/s, 1 TB/s of memory bandwidth.
ROUND = CLUSTERS["h100"].__class__("round", 4, 100e12, 80 * GIB, 1e12, Link(1e-6, 100e9),
                                   Link(10e-6, 10e9), reserved_bytes=0)
LLAMA_8B = ModelShape("llama-8b", 32, 4096, 14336, 32, 8, 128, 128256)
MOE = ModelShape("moe", 4, 1024, 4096, 8, 8, 128, 1000, experts=8, top_k=2, moe_ffn_hidden=512,
                 moe_layers=4)


def layout(**sizes) -> ScaleLayout:
    base = dict(tp=1, pp=1, vpp=1, cp=1, dp=1, microbatch_size=1, microbatches=1,
                schedule="none")
    return ScaleLayout(**{**base, **sizes})


def test_ring_collectives_move_their_share_with_a_latency_per_step():
    link = Link(1e-6, 100e9)
    # all-gather of 800 MB over 8 ranks: 7 steps of 100 MB each
    assert collective_s(link, 800e6, 8) == pytest.approx(7e-6 + 7e-3)
    assert collective_s(link, 800e6, 8, passes=2) == pytest.approx(2 * (7e-6 + 7e-3))
    assert collective_s(link, 800e6, 1) == 0.0
    assert all_to_all_s(link, 800e6, 4) == pytest.approx(1e-6 + 6e-3)


def test_a_group_inside_a_node_talks_over_nvlink():
    assert group_link(ROUND, stride=2, ranks=2) is ROUND.nvlink
    assert group_link(ROUND, stride=2, ranks=4) is ROUND.network
    assert group_link(ROUND, stride=1, ranks=4) is ROUND.nvlink


def test_a_reduction_across_nodes_is_a_ring_in_each_node_then_the_share_between_nodes():
    size = 1e9
    # 16 ranks, stride 1: 4 members a node, 4 nodes
    inside = 2 * (3 * 1e-6 + 3 / 4 * size / 100e9)
    between = 2 * (2 * math.log2(4) * 10e-6 + 3 / 4 * (size / 4) / 10e9)
    assert hierarchical_reduce_s(ROUND, size, 16, 1) == pytest.approx(inside + between)
    # all four in one node: only NVLink
    assert hierarchical_reduce_s(ROUND, size, 4, 1) == pytest.approx(inside)
    # stride 4 (tp 4): one member a node, the whole reduction on the network
    assert hierarchical_reduce_s(ROUND, size, 4, 4) == pytest.approx(
        2 * (2 * math.log2(4) * 10e-6 + 3 / 4 * size / 10e9))


def test_tensor_parallelism_is_two_gathers_and_two_scatters_a_way():
    tokens = 4096
    size = tokens * 4096 * 2  # bf16 activations
    expected = 4 * (3 * 1e-6 + 3 / 4 * size / 100e9)
    assert tensor_parallel_s(LLAMA_8B, ROUND, layout(tp=4), tokens) == pytest.approx(expected)
    assert tensor_parallel_s(LLAMA_8B, ROUND, layout(tp=1), tokens) == 0.0


def test_ring_attention_hides_each_exchange_behind_a_tile_and_ulysses_does_not():
    tokens, attention = 2048, 1e-3
    kv = 2 * tokens * 8 * 128 * 2  # K and V of 8 kv heads, bf16
    step = 1e-6 + kv / 100e9
    forward, backward = context_parallel_s(LLAMA_8B, ROUND, layout(cp=4), tokens, attention,
                                           2.5 * attention)
    # each of the 3 exchanges (8.4 us) is shorter than a tile (250 us): only a latency shows
    assert step < attention / 4
    assert (forward, backward) == (pytest.approx(1e-6), pytest.approx(1e-6))
    slow_tile = 1e-6
    forward, _ = context_parallel_s(LLAMA_8B, ROUND, layout(cp=4), tokens, slow_tile, slow_tile)
    assert forward == pytest.approx(3 * (step - slow_tile / 4) + 1e-6)
    width = 2 * 4096 + 2 * 1024  # q and the output, k and v
    ulysses, _ = context_parallel_s(LLAMA_8B, ROUND, layout(cp=4, cp_kind="ulysses"), tokens,
                                    attention, attention)
    assert ulysses == pytest.approx(1e-6 + 3 / 4 * tokens * width * 2 / 100e9)


def test_experts_dispatch_and_combine_their_routed_tokens():
    tokens = 1024
    size = tokens / 2 * 2 * 1024 * 2  # tp 2's share, top 2 copies, bf16
    # tp 2 x ep 4 = 8 GPUs: more than a node of 4, over the network
    expected = 2 * (10e-6 + 3 / 4 * size / 10e9)
    split_tokens = Runtime()  # Megatron-Core's expert tensor-parallel size 1
    assert expert_all_to_all_s(MOE, ROUND, layout(tp=2, ep=4), tokens,
                               split_tokens) == pytest.approx(expected)
    # meshpipe's tp ranks route every token (each keeps a slice of every expert's width)
    whole = 2 * (10e-6 + 3 / 4 * 2 * size / 10e9)
    assert expert_all_to_all_s(MOE, ROUND, layout(tp=2, ep=4), tokens) == pytest.approx(whole)


def test_experts_split_over_tp_cost_a_rows_all_reduce_and_keep_the_rows_whole():
    """At tp 2 meshpipe's MoE layer trades one of the four sequence collectives for an
    all-reduce of its routed rows each way, and keeps those rows whole for backward; the
    products are the same FLOPs either way."""
    sizes = layout(tp=2, ep=2, dp=2)
    meshpipe = Runtime(experts_split_over_tp=True, recompute_keeps_routed_rows=True)
    split, whole = (layer_costs(MOE, ROUND, sizes, 4096, Efficiency(), runtime, moe=True,
                                split=False) for runtime in (Runtime(), meshpipe))
    tokens, rows = 4096, 4096 * 2 * 1024 * 2  # top 2 copies, bf16
    one_way = tensor_parallel_s(MOE, ROUND, sizes, tokens)
    rows_reduce = collective_s(ROUND.nvlink, rows, 2, passes=2)
    assert whole.exposed_comm - split.exposed_comm == pytest.approx(
        2 * (rows_reduce - one_way / 4))
    kept_rows = 4096 * 2 * 2 * 1024 * 2  # to the experts and back, top 2, bf16
    assert whole.activation_bytes - split.activation_bytes == pytest.approx(kept_rows / 2)
    full = [layer_costs(MOE, ROUND, layout(tp=2, ep=2, dp=2, recompute="full"), 4096,
                        Efficiency(), runtime, moe=True, split=False).activation_bytes
            for runtime in (Runtime(), meshpipe)]
    assert full[1] - full[0] == pytest.approx(kept_rows)


def test_a_pipeline_message_crosses_nodes_unless_the_whole_pipeline_fits_in_one():
    sizes = dict(pp=2, microbatch_size=2)
    message = 2 * 1024 * 4096 * 2 / 2  # 2 sequences of 1024, sharded over tp 2
    assert pipeline_message_s(LLAMA_8B, ROUND, layout(tp=2, **sizes), 1024) == pytest.approx(
        1e-6 + message / 100e9)
    assert pipeline_message_s(LLAMA_8B, ROUND, layout(tp=2, dp=2, **sizes), 1024) == \
        pytest.approx(10e-6 + message / 10e9)
    assert pipeline_message_s(LLAMA_8B, ROUND, layout(), 1024) == 0.0


def test_the_gradient_reduction_hides_behind_the_last_backward_but_its_last_bucket():
    sizes = layout(dp=4)
    reduce = hierarchical_reduce_s(ROUND, 4 * 1e9, 4, 1)
    exposed, optimizer = gradient_sync_s(ROUND, sizes, 1e9, 0.0, backward_window=10.0,
                                         runtime=Runtime())
    assert exposed == pytest.approx(reduce * 32 * 2**20 / 4e9)
    assert optimizer == pytest.approx(1e9 * 30 / (1e12 * Efficiency().memory))
    exposed, _ = gradient_sync_s(ROUND, sizes, 1e9, 0.0, 10.0, Runtime(data_overlap=False))
    assert exposed == pytest.approx(reduce)
    # zero 1: half the reduction, then the bf16 weights gathered; a quarter updated
    exposed, optimizer = gradient_sync_s(ROUND, layout(dp=4, zero=1), 1e9, 0.0, 0.0, Runtime(),
                                         Efficiency(memory=1.0))
    scatter = hierarchical_reduce_s(ROUND, 4e9, 4, 1, passes=1)
    gather = hierarchical_reduce_s(ROUND, 2e9, 4, 1, passes=1)
    assert exposed == pytest.approx(scatter + gather)
    assert optimizer == pytest.approx(1e9 / 4 * 30 / 1e12)


def test_matrix_efficiency_falls_for_small_matrices():
    efficiency = Efficiency(matmul=0.8, matmul_half_size=100)
    big = efficiency.matmul_s(1e12, 1e6, 1e6, 1e6, 100e12)
    assert big == pytest.approx(1e12 / (100e12 * 0.8), rel=1e-3)
    small = efficiency.matmul_s(1e12, 100, 1e6, 1e6, 100e12)
    assert small == pytest.approx(2 * big, rel=1e-3)


def test_a_layer_takes_at_least_the_hosts_time_to_launch_it():
    tiny = ModelShape("tiny", 2, 64, 256, 4, 4, 16, 100)
    bound, free = (layer_costs(tiny, ROUND, layout(), 128, Efficiency(), Runtime(host_layer_s=host),
                               False, split=True) for host in ((1e-3, 3e-3), (0.0, 0.0)))
    assert free.forward < 1e-3 and bound.forward == 1e-3
    assert bound.backward_input + bound.backward_weight == pytest.approx(3e-3)
    assert bound.backward_input / bound.backward_weight == pytest.approx(
        free.backward_input / free.backward_weight)


def test_weight_gradients_are_added_into_float32_unless_the_products_do_it():
    assert gradient_accumulation_s(ROUND, 1e9, Runtime(), Efficiency(memory=1.0)) == \
        pytest.approx(1e9 * 10 / 1e12)
    assert gradient_accumulation_s(ROUND, 1e9, Runtime(fused_gradient_accumulation=True)) == 0


def test_a_node_deduplicating_dispatch_sends_a_token_once_to_each_node():
    tokens, sizes = 1024, layout(tp=1, ep=8)  # 8 GPUs: two nodes of 4
    plain = expert_all_to_all_s(MOE, ROUND, sizes, tokens)
    once = expert_all_to_all_s(MOE, ROUND, sizes, tokens, Runtime(node_dedup_dispatch=True))
    copies = 2 * (1 - (1 - 1 / 2) ** 2)  # top 2 over 2 nodes: 1.5 node copies a token
    assert (once - 2 * 10e-6) / (plain - 2 * 10e-6) == pytest.approx(copies / 2)


def test_recomputation_adds_the_forward_to_the_backward():
    plain, full, selective = (layer_costs(LLAMA_8B, ROUND, layout(recompute=mode), 4096,
                                          Efficiency(), Runtime(), False, split=True)
                              for mode in ("none", "full", "selective"))
    assert full.backward_input == pytest.approx(plain.backward_input + plain.forward)
    assert full.backward_weight == pytest.approx(plain.backward_weight + plain.forward)
    assert plain.backward_input < selective.backward_input < full.backward_input
    assert full.activation_bytes < selective.activation_bytes < plain.activation_bytes


def test_hf_configs_give_their_models_sizes():
    llama = shape_from_hf_config({"hidden_size": 8192, "intermediate_size": 28672,
                                  "num_hidden_layers": 80, "num_attention_heads": 64,
                                  "num_key_value_heads": 8, "vocab_size": 128256})
    assert llama.parameters() == pytest.approx(70.55e9, rel=1e-3)
    qwen3_moe = shape_from_hf_config({
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536, "decoder_sparse_step": 1, "mlp_only_layers": []})
    assert qwen3_moe.parameters() == pytest.approx(235.1e9, rel=1e-3)
    assert qwen3_moe.active_parameters() == pytest.approx(22.2e9, rel=1e-2)
    deepseek_like = shape_from_hf_config({
        "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 100,
        "n_routed_experts": 8, "first_k_dense_replace": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 2})
    assert (deepseek_like.moe_layers, deepseek_like.shared_ffn_hidden) == (4, 64)
    with pytest.raises(ModelShapeError, match="lacks 'vocab_size'"):
        shape_from_hf_config({"hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4}, "tiny")


def test_causal_attention_counts_half_the_score_products():
    full = LLAMA_8B.model_flops_per_token(8192, "full")
    causal = LLAMA_8B.model_flops_per_token(8192, "causal")
    assert full - causal == pytest.approx(32 * 2 * 4096 * 8192)


def test_a_cluster_file_starts_from_a_built_in_one(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[cluster]\nbase = "h100"\nnetwork_gb_per_s = 90\nmemory_gib = 94\n')
    cluster = cluster_from_toml(path)
    assert cluster.network.bytes_per_s == 90e9 and cluster.memory_bytes == 94 * GIB
    assert cluster.nvlink == CLUSTERS["h100"].nvlink and cluster.name == "mine"
    assert cluster_named(str(path)) == cluster


@pytest.mark.parametrize("text, message", [
    ("[cluster]\nbase = \"h100\"\npeak_tflops = -3\n", "peak_tflops = -3 must be a positive"),
    ("[cluster]\nbase = \"h100\"\nnvlink_gbps = 3\n", "unknown key\\(s\\) nvlink_gbps"),
    ("[cluster]\ngpus_per_node = 8\n", "lacks peak_tflops"),
    ("[cluster]\nbase = \"v100\"\n", "base = 'v100' is no built-in"),
    ("[nodes]\n", "no \\[cluster\\] table"),
    ("[cluster\n", "cannot read it as TOML"),
    ("[cluster]\nbase = \"h100\"\nreserved_gib = 100\n", "leaves no memory"),
    ("[cluster]\nbase = \"h100\"\ngpus_per_node = 4.5\n", "must be a whole number"),
])
def test_a_bad_cluster_file_is_one_line_naming_what_to_change(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ClusterError, match=message) as raised:
        cluster_named(str(path))
    assert "\n" not in str(raised.value)


def test_an_unknown_cluster_name_lists_the_built_in_ones():
    with pytest.raises(ClusterError, match="unknown cluster 'tpu'.*h100, h200, a100"):
        cluster_named("tpu")
