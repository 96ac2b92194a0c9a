"""The fault-injection catalogue as a table: how each fault ends, how fast, what is reported.

    .venv/bin/python benchmarks/faults.py                 # every case, ~4 min on 2 cores
    .venv/bin/python benchmarks/faults.py --only hang     # the cases whose name has "hang"

Each case runs ``meshpipe train`` (a tiny model, 2 or 4 local processes, --hang-timeout 5)
in a child process with one fault injected through ``MESHPIPE_FAULT`` (see
``meshpipe.train.supervisor.faults``), a signal sent to the launcher once training is
underway, or bad input. "seconds to stop" runs from the moment the fault fired (its rank
writes the time to its log) or the signal was sent to the launcher's exit; for bad input
and the resume cases it is the whole command. "processes left" counts processes of the
case still alive after the launcher exited (found by an environment tag). The cases are the ones
tests/train/test_faults.py asserts on (tests/fault_cases.py). Results go to
benchmarks/results/faults.json and faults.md; docs/when-something-goes-wrong.md
shows the table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fault_cases import CASES, as_json, describe, run_case  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def markdown(rows: list[dict]) -> str:
    lines = ["| case | exit status | seconds to stop | processes left | reported (last line) |",
             "|---|---|---|---|---|"]
    for row in rows:
        reported = row["reported"].replace("|", "\\|")
        if len(reported) > 220:
            reported = reported[:217] + "..."
        lines.append(f"| {row['case']} | {row['exit status']} | {row['seconds to stop']} | "
                     f"{row['processes left']} | `{reported}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="meshpipe-faults-") as workdir:
        for case in CASES:
            if args.only and args.only not in case.name:
                continue
            outcome = run_case(case, Path(workdir))
            outcome.last_line = outcome.last_line.replace(workdir, "$TMP")
            outcomes.append(outcome)
            row = describe(outcome)
            print(f"{row['case']:<42} exit {row['exit status']:>4}  "
                  f"{row['seconds to stop']:>5} s  left {row['processes left']}  "
                  f"{row['reported'][:110]}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    suffix = f"-{args.only}" if args.only else ""
    (RESULTS / f"faults{suffix}.json").write_text(as_json(outcomes) + "\n")
    (RESULTS / f"faults{suffix}.md").write_text(markdown([describe(o) for o in outcomes]))
    print(f"wrote {RESULTS / f'faults{suffix}.md'}")


if __name__ == "__main__":
    main()
