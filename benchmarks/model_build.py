"""What a rank spends building its part of the reference model, by layout: peak host memory
and seconds, in fresh CPU processes.

    python benchmarks/model_build.py [--rounds 2] [--cases whole pp4 tp2 ...]

Each case starts fresh ranks on one thread each (what the launcher and torchrun give a
rank beside others), builds the model its layout gives them (``Transformer`` with the held
stages of ``held_by_stages``, the tensor- or expert-parallel group of every rank) and
reports per rank: the peak resident memory the build added (``ru_maxrss`` after it, less
before), its seconds and the bytes of the parameters it ended with. Rounds alternate the
order of the cases. Results in ``results/model_build.{md,json}``; a benchmark records
figures, it never asserts them.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from harness import join_ranks, load_average, publish, report, spawn_ranks

RESULTS = Path(__file__).resolve().parent / "results"
DENSE = dict(vocab_size=256, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8)  # 740M
MOE = dict(vocab_size=256, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, moe_experts=16,
           moe_top_k=4)  # 554M, 135M of them each layer's experts


@dataclass(frozen=True)
class Case:
    name: str
    model: dict
    ranks: int = 1
    group: str | None = None  # "tp" or "ep": every rank
    stage_of: tuple[int, int] | None = None  # (stage, stages): the rank holds that stage


CASES = (
    Case("whole", DENSE),
    Case("pp4", DENSE, stage_of=(1, 4)),
    Case("tp2", DENSE, ranks=2, group="tp"),
    Case("pp4-tp2", DENSE, ranks=2, group="tp", stage_of=(1, 4)),
    Case("moe-whole", MOE),
    Case("moe-ep2", MOE, ranks=2, group="ep"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", nargs="+", choices=[case.name for case in CASES],
                        default=[case.name for case in CASES])
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(case: Case):
    import torch.distributed as dist

    from meshpipe.models import Transformer, TransformerConfig
    from meshpipe.models.split import held_by_stages

    config = TransformerConfig(**case.model)
    held = None
    if case.stage_of is not None:
        stage, stages = case.stage_of
        held = held_by_stages([config.n_layers // stages] * stages, [stage],
                              config.tie_embeddings)
    groups = {f"{case.group}_group": dist.group.WORLD} if case.group else {}
    return Transformer(config, held=held, **groups)


def _worker(rank: int, world_size: int, init_file: str, result_file: str, case: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    join_ranks(rank, world_size, init_file)
    torch.zeros(1).normal_()
    before, start = _peak_rss_bytes(), time.perf_counter()
    model = _build(Case(**case))
    seconds = time.perf_counter() - start
    measured = {"peak added GiB": round((_peak_rss_bytes() - before) / 2**30, 2),
                "seconds": round(seconds, 2),
                "parameters GiB": round(sum(p.numel() * p.element_size()
                                            for p in model.parameters() if not p.is_meta)
                                        / 2**30, 2)}
    every_rank: list = [None] * world_size
    dist.all_gather_object(every_rank, measured)
    if rank == 0:
        report(result_file, every_rank)
    dist.destroy_process_group()


def _table(result: dict) -> str:
    lines = ["# Building a rank's part of the reference model", "",
             "Fresh CPU processes of one thread each; per rank, the peak resident memory the "
             "build added, its seconds and the parameters it ended with (GiB). torch "
             f"{result['torch']}, load average before {result['load before']}, after "
             f"{result['load after']}.", "",
             "| case | ranks | model | round | peak added (GiB) | seconds | parameters (GiB) |",
             "|---|---:|---|---:|---|---|---|"]
    for row in result["rows"]:
        cells = [", ".join(str(rank[key]) for rank in row["ranks"])
                 for key in ("peak added GiB", "seconds", "parameters GiB")]
        lines.append(f"| {row['case']} | {len(row['ranks'])} | {row['model']} | "
                     f"{row['round']} | {' | '.join(cells)} |")
    lines += ["", "Cases: " + "; ".join(
        f"{case['name']}: {_describe(case)}" for case in result["cases"]) + ".", ""]
    return "\n".join(lines)


def _describe(case: dict) -> str:
    parts = [f"{case['ranks']} rank(s)"]
    if case["stage_of"]:
        parts.append(f"stage {case['stage_of'][0]} of {case['stage_of'][1]}")
    if case["group"]:
        parts.append(f"{case['group']} {case['ranks']}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [case for case in CASES if case.name in args.cases]
    result = {"torch": torch.__version__, "load before": load_average(),
              "cases": [asdict(case) for case in cases], "rows": []}
    for number in range(1, args.rounds + 1):
        for case in cases if number % 2 else reversed(cases):
            ranks = spawn_ranks(_worker, case.ranks, asdict(case))
            model = "740M" if case.model is DENSE else "MoE 554M"
            result["rows"].append({"case": case.name, "model": model, "round": number,
                                   "ranks": ranks})
            print(f"round {number} {case.name}: {ranks}", flush=True)
    result["load after"] = load_average()
    publish("model_build", result, _table(result), args.out, rehearsal=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
