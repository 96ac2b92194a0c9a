"""``meshpipe plan``'s cost model against published training runs.

    python benchmarks/plan_validation.py [--no-search] [--only ID_PREFIX]

Each row of ``data/published_layouts.json`` (layouts and their measured figures as their
sources published them, each with its source and what was inferred) is predicted as its
source ran it: its layout, its microbatch size, its ZeRO-style optimizer, its
recomputation, its tensor-parallel communication overlap where it had one; FLOPs counted as
that source counts them (Megatron's 2024 formula: attention in full; its 2025 one and the
current model zoo: causal attention halved; the Llama 3 paper: PaLM's count, attention in
full), and rows that publish samples per second compared as such. Then, per case (model,
GPUs, sequence, batch), the whole search runs and the published layout's predicted step is
set against the plan's best (``--no-search`` skips this). Results in
``results/plan_validation.{md,json}``; a benchmark records, it never asserts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pathlib import Path

from harness import write_results
from meshpipe.schedules.cluster import cluster_named
from meshpipe.schedules.model_shape import ModelShape, reference_shape
from meshpipe.schedules.plan_space import PlanRequest
from meshpipe.schedules.planner import PlanError, plan, predict
from meshpipe.schedules.scale import MESHPIPE, Efficiency, Runtime, ScaleLayout

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "published_layouts.json"
RESULTS = HERE / "results"
SCHEDULE_NAMES = {"1f1b": "1f1b", "interleaved": "interleaved", "zb-1p": "zb-h1",
                  "zb-v": "zb-v"}
# How much of tensor parallelism's communication a source's overlap hides, where it had one
# (Megatron's --tp-comm-overlap pipelines the collectives with the products).
SOURCE_TP_OVERLAP = 0.8
# The sources' attention kernels (cuDNN's fused attention, FlashAttention 2/3) reach more of
# the peak than torch's SDPA that meshpipe's default efficiency measured: forward and
# backward together, from FlashAttention-3's and cuDNN's published H100 figures (about 600
# TFLOP/s forward, 450 backward at 4k-16k tokens).
FUSED_ATTENTION = Efficiency(attention=((2048, 0.40), (8192, 0.50), (32768, 0.55)))
# Which FLOP count each source's figures use: (attention counted "full" or "causal").
CONVENTIONS = {"megatron-readme-2024-h100": "full", "llama3-paper": "full",
               "moe-modelzoo-qwen3": "causal", "megatron-moe-readme-mixtral": "full",
               "moe-modelzoo-mixtral-8x22b": "causal"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-search", action="store_true",
                        help="predict the published layouts only, no whole-search comparison")
    parser.add_argument("--only", default="", help="rows whose id starts with this")
    parser.add_argument("--table-only", action="store_true",
                        help="write the markdown again from the recorded JSON, predicting nothing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def model_of(name: str, spec: dict) -> ModelShape:
    moe_layers = spec["layers"] if spec.get("experts") else 0
    return ModelShape(name, spec["layers"], spec["hidden"], spec["ffn_hidden"], spec["heads"],
                      spec["kv_heads"], spec["head_dim"], spec["vocab"] or 51200,
                      tied_embeddings=bool(spec.get("tied_embeddings")),
                      gated=spec.get("activation") == "swiglu",
                      experts=spec.get("experts") or 0, top_k=spec.get("top_k") or 0,
                      moe_ffn_hidden=spec.get("moe_ffn_hidden") or 0,
                      shared_ffn_hidden=spec.get("shared_expert_ffn") or 0,
                      moe_layers=moe_layers)


def layout_of(row: dict) -> ScaleLayout | None:
    """The row's layout as meshpipe names it; None for a schedule meshpipe has no
    counterpart of (ZB-2p)."""
    pp, vpp = row["pp"], row.get("vpp") or 1
    if pp == 1:
        schedule, vpp = "none", 1
    else:
        named = row.get("schedule") or ("interleaved" if vpp > 1 else "1f1b")
        schedule = SCHEDULE_NAMES.get(named)
        if schedule is None:
            return None
        if schedule == "zb-v":
            vpp = 2
        if schedule == "interleaved" and vpp == 1:
            vpp = 2  # interleaved without a stated count: two virtual stages
        if (row.get("extras") or {}).get("ep_a2a_overlap"):
            schedule = "combined-1f1b"  # the all-to-all hidden behind the other microbatch
    size = row.get("microbatch_size") or 1
    microbatches = row["global_batch"] // (row["dp"] * size)
    return ScaleLayout(tp=row["tp"], pp=pp, vpp=vpp, cp=row.get("cp") or 1, dp=row["dp"],
                       microbatch_size=size, microbatches=microbatches, schedule=schedule,
                       ep=row.get("ep") or 1, zero=1 if row.get("distributed_optimizer") else 0,
                       recompute=row.get("recompute") or "none")


def runtime_of(row: dict) -> Runtime:
    """How the row's source ran: Megatron's tensor-parallel overlap where it had one, its
    parameter gather behind the forward with the distributed optimizer, weight gradients
    accumulated inside the products (gradient-accumulation fusion), DeepEP's dispatch; its
    host's time per layer unknown (none counted)."""
    extras = row.get("extras") or {}
    return Runtime(tensor_overlap=SOURCE_TP_OVERLAP if row.get("tp_comm_overlap") else 0.0,
                   data_overlap=True,
                   weight_gather_overlap=1.0 if row.get("distributed_optimizer") else 0.0,
                   fused_gradient_accumulation=True,
                   node_dedup_dispatch=extras.get("moe_dispatcher") == "DeepEP")


def request_of(row: dict, model: ModelShape) -> PlanRequest:
    return PlanRequest(model, cluster_named(row["gpu"]), row["gpus"], row["seq_len"],
                       row["global_batch"], efficiency=FUSED_ATTENTION, runtime=runtime_of(row))


def compare_row(row: dict, models: dict) -> dict | None:
    layout = layout_of(row)
    if layout is None:
        return None
    model = model_of(row["model"], models[row["model"]])
    request = request_of(row, model)
    predicted = predict(request, layout)
    tokens = row["global_batch"] * row["seq_len"]
    published = row["published"]
    entry = {"id": row["id"], "source": row["source"], "model": row["model"],
             "gpus": row["gpus"], "layout": layout.describe(),
             "confidence": row.get("confidence"),
             "predicted_step_s": round(predicted.step_s, 4),
             "predicted_bubble": round(predicted.bubble, 4),
             "predicted_memory_gib": round(predicted.memory_bytes / 2**30, 1)}
    if published.get("samples_per_s") is not None:
        predicted_rate = row["global_batch"] / (predicted.step_s * row["gpus"])
        entry.update(metric="samples/s per GPU", published=published["samples_per_s"],
                     predicted=round(predicted_rate, 3))
    else:
        attention = CONVENTIONS.get(row["source"], "causal")
        flops = 3 * model.model_flops_per_token(row["seq_len"], attention) * tokens
        tflops = flops / (predicted.step_s * row["gpus"]) / 1e12
        if published.get("tflops_per_gpu") is not None:
            entry.update(metric="TFLOP/s per GPU", published=published["tflops_per_gpu"],
                         predicted=round(tflops, 1))
        else:
            peak = request.cluster.peak_flops / 1e12
            entry.update(metric="MFU", published=published["mfu"],
                         predicted=round(tflops / peak, 3))
    entry["error"] = round(entry["predicted"] / entry["published"] - 1, 3)
    if published.get("peak_memory_gb") is not None:
        entry["published_memory_gb"] = published["peak_memory_gb"]
    return entry


def search_case(row: dict, models: dict, entry: dict) -> None:
    """The whole search for the row's case: where its layout stands against the best."""
    model = model_of(row["model"], models[row["model"]])
    request = request_of(row, model)
    started = time.perf_counter()
    try:
        result = plan(request, top=10)
    except PlanError as error:
        entry["search"] = f"no plan: {error}"
        return
    best = result.predictions[0]
    ours = entry["predicted_step_s"]
    entry.update(search_seconds=round(time.perf_counter() - started, 1),
                 best_layout=best.layout.describe(), best_step_s=round(best.step_s, 4),
                 published_over_best=round(ours / best.step_s, 3),
                 layouts_searched=result.layouts, simulations=result.simulated)


# meshpipe's own steps on one H100 (docs/gpu.md, results/gpu_bench.md, 2026-11-27): the
# reference transformer of 740M parameters (dim 2048, 16 layers, 16 heads, 8 kv heads, a
# 256-token vocabulary), 8 sequences of 2,048 tokens a step, bf16, AdamW.
MEASURED_HERE = [("4 x 2, --compile", 4, 2, 0.1924), ("2 x 4, --compile", 2, 4, 0.1772),
                 ("4 x 2, eager", 4, 2, 0.2508)]


def measured_here() -> list[dict]:
    """The plan's prediction of each measured one-GPU step, meshpipe's efficiency and
    runtime as they are by default."""
    model = reference_shape(2048, 16, 16, 8, 256)
    entries = []
    for name, microbatches, size, seconds in MEASURED_HERE:
        layout = ScaleLayout(tp=1, pp=1, vpp=1, cp=1, dp=1, microbatch_size=size,
                             microbatches=microbatches, schedule="none")
        predicted = predict(PlanRequest(model, cluster_named("h100"), 1, 2048, 8), layout)
        entries.append({"step": name, "measured_s": seconds,
                        "predicted_s": round(predicted.step_s, 4),
                        "error": round(predicted.step_s / seconds - 1, 3)})
    return entries


def _measured_table(entries: list[dict]) -> str:
    lines = ["", "## meshpipe's own one-GPU steps (H100, 740M reference model)", "",
             "Predicted with the default efficiency (matrix products and torch's SDPA "
             "attention as measured on an H100) and meshpipe's runtime.", "",
             "| step (microbatches x sequences) | measured s | predicted s | error |",
             "|---|---:|---:|---:|"]
    lines += [f"| {e['step']} | {e['measured_s']} | {e['predicted_s']} | "
              f"{100 * e['error']:+.1f}% |" for e in entries]
    return "\n".join(lines) + "\n"


ZB_SCHEDULES = ("1f1b", "interleaved", "zb-1p", "zb-2p", "zb-v")


def _schedule_deltas(entries: list[dict]) -> str:
    """The zero-bubble paper's rows as each schedule's throughput over 1F1B's at the same
    model and microbatch count, published against predicted."""
    groups: dict[str, dict[str, dict]] = {}
    for e in entries:
        if e["source"].startswith("zero-bubble") and e["metric"] == "samples/s per GPU":
            schedule = next(name for name in ZB_SCHEDULES if e["id"].endswith("-" + name))
            groups.setdefault(e["id"][:-len(schedule) - 1], {})[schedule] = e
    lines = ["", "## The schedules' deltas (zero-bubble paper, A100)", "",
             "Each schedule's samples/s over 1F1B's at the same model and microbatch count "
             "(ZB-1p run as meshpipe's ZB-H1; ZB-2p has no counterpart).", "",
             "| case | schedule | published | predicted |", "|---|---|---:|---:|"]
    for case, rows in groups.items():
        base = rows.get("1f1b")
        if base is None:
            continue
        for schedule, e in rows.items():
            if schedule != "1f1b":
                lines.append(f"| {case} | {schedule} | {e['published'] / base['published']:.3f} | "
                             f"{e['predicted'] / base['predicted']:.3f} |")
    return "\n".join(lines) + "\n"


def _table(entries: list[dict]) -> str:
    lines = ["# `meshpipe plan` against published runs", "",
             "Each row's layout predicted as its source ran it; `error` = predicted / published "
             "- 1. `published / best`: the published layout's predicted step over the best "
             "step the whole search predicts for the same case (1.00: the published layout is "
             "the plan's pick).", "",
             "| row | GPUs | layout | metric | published | predicted | error | "
             "published / best | plan's best |",
             "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for e in entries:
        best = e.get("published_over_best")
        lines.append(f"| {e['id']} | {e['gpus']} | {e['layout']} | {e['metric']} | "
                     f"{e['published']} | {e['predicted']} | {100 * e['error']:+.1f}% | "
                     f"{'' if best is None else f'{best:.2f}'} | {e.get('best_layout', '')} |")
    within = [e for e in entries if abs(e["error"]) <= 0.15]
    lines += ["", f"{len(within)} of {len(entries)} predictions within 15 % of the published "
              "figure.", ""]
    return "\n".join(lines)


def _report(entries: list[dict], here: list[dict]) -> str:
    return _table(entries) + _schedule_deltas(entries) + _measured_table(here)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_only:
        recorded = json.loads((args.out / "plan_validation.json").read_text())
        (args.out / "plan_validation.md").write_text(_report(recorded["rows"],
                                                             recorded["measured here"]))
        return 0
    document = json.loads(DATA.read_text())
    entries = []
    searched: dict[tuple, dict] = {}
    for row in document["rows"]:
        if not row["id"].startswith(args.only) or row.get("dtype") == "fp8":
            continue
        entry = compare_row(row, document["models"])
        if entry is None:
            continue
        case = (row["model"], row["gpus"], row["seq_len"], row["global_batch"], row["gpu"])
        if not args.no_search and row["published"].get("samples_per_s") is None:
            if case not in searched:
                search_case(row, document["models"], entry)
                searched[case] = entry
            else:
                first = searched[case]
                entry.update({k: first[k] for k in ("best_layout", "best_step_s") if k in first})
                if "best_step_s" in first:
                    entry["published_over_best"] = round(entry["predicted_step_s"]
                                                         / first["best_step_s"], 3)
        entries.append(entry)
        print(f"{entry['id']}: {entry['metric']} published {entry['published']}, predicted "
              f"{entry['predicted']} ({100 * entry['error']:+.1f}%)"
              + (f"; published / best {entry['published_over_best']:.2f}"
                 if "published_over_best" in entry else ""), flush=True)
    here = measured_here()
    for entry in here:
        print(f"{entry['step']}: measured {entry['measured_s']} s, predicted "
              f"{entry['predicted_s']} s ({100 * entry['error']:+.1f}%)")
    result = {"measured here": here, "defaults": {"meshpipe runtime": MESHPIPE.__dict__,
                           "source tp overlap": SOURCE_TP_OVERLAP,
                           "source attention": FUSED_ATTENTION.attention},
              "rows": entries}
    json_path, md_path = write_results(args.out, "plan_validation", result,
                                       _report(entries, here))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


