"""Turning what the ranks reported into one line: which rank failed first, where and why;
or, for a hang, who waits on whom and the rank, the death or the cycle at the end of it.

Pure functions over the launcher's control files (``error-<rank>.json`` written by a rank
that raised, ``status-<rank>.json`` rewritten every interval by each rank's activity
reporter, ``where-<rank>`` written by the rank at every move), so they are tested without
processes. A rank whose status stopped being rewritten (a stopped or frozen process) is
reported where it was last seen, and how long ago, never as if it were still there now.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from meshpipe.runtime.activity import (REPORT_INTERVAL_S, WHERE_FIELDS, describe, hang_line,
                                       read_where_record)

# A status not rewritten for this long comes from a process that no longer runs Python.
STALE_AFTER_S = 10 * REPORT_INTERVAL_S
# What a process state in /proc/<pid>/stat says of a rank that has stopped moving.
_PROCESS_STATES = {"T": "stopped (SIGSTOP or a debugger)",
                   "t": "stopped (SIGSTOP or a debugger)"}
_NOT_RESPONDING = "not responding (frozen, or holding Python's GIL)"


def read_statuses(control: Path, world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's last reported activity (ranks that never reported are missing), with
    its where-file's record (``where_file``: newer than the status when the rank moved,
    then froze, between two reports) and its process state (``process_state``, Linux)."""
    statuses = {}
    for rank in range(world_size):
        try:
            status = json.loads((control / f"status-{rank}.json").read_text())
        except (OSError, ValueError):
            continue
        status["where_file"] = read_where_record(control / f"where-{rank}")
        status["process_state"] = _process_state(status.get("pid"))
        statuses[rank] = status
    return statuses


def _process_state(pid: int | None) -> str | None:
    """The state letter of process ``pid`` (R, S, T...); None without /proc or process."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name in (...) may hold spaces
    return fields[0] if fields else None


def as_of(status: dict[str, Any], now: float) -> dict[str, Any]:
    """The status to report at ``now``: as written while the rank's reporter runs. For a
    rank that stopped (/proc) or whose status is older than ``STALE_AFTER_S``: why
    (``frozen``), its freshest place (the where-file's when newer), and when it was last
    seen (``seen``); it waits on nobody, since it runs nothing."""
    why = _PROCESS_STATES.get(status.get("process_state"))
    reported = status.get("reported_at", status["since"])
    if why is None and "reported_at" in status and now - reported > STALE_AFTER_S:
        why = _NOT_RESPONDING
    if why is None:
        return status
    where = status.get("where_file")
    if where is not None and where["written_at"] > status["since"]:
        # A record without step or action was written as the rank left its last step.
        place = {"what": "outside any step", **where, "since": where["written_at"]}
    else:
        place = status
    return {**{key: place[key] for key in (*WHERE_FIELDS, "what") if key in place},
            "since": place["since"], "limit": status.get("limit"), "waiting": False,
            "frozen": why, "seen": max(reported, place["since"])}


def failure_report(records: list[dict], unrecorded: dict[int, dict], world_size: int,
                   log_dir: Path | None = None) -> tuple[str, int, str]:
    """(one line, the rank that failed first, the details) of a failed job.

    ``records`` are the errors ranks recorded; ``unrecorded`` the ranks that ended without
    one (killed, os._exit), with their exit code and last status; ``log_dir`` holds each
    rank's log (named in the line). A recorded error that only
    reports another rank's failure (a stop notice, a closed connection) is a consequence:
    the first real error wins, then a rank that died, then the first consequence.
    """
    causes = sorted((r for r in records if not r["consequence"]), key=lambda r: r["time"])
    consequences = sorted((r for r in records if r["consequence"]), key=lambda r: r["time"])
    details = "\n".join(f"--- rank {r['rank']} ---\n{r['traceback']}"
                        for r in causes + consequences)
    if causes:
        first = causes[0]
        line = _failed(first)
        rank = first["rank"]
        line += _also(first, causes[1:])
    elif unrecorded:
        rank = min(unrecorded, key=lambda r: unrecorded[r]["time"])
        death = unrecorded[rank]
        status = death["status"]
        place = death.get("where") or (describe(status) if status else None)
        where = f"at {place}" if place else "before it reported any activity"
        line = f"rank {rank} {_how_it_ended(death['exit_code'])} {where}"
        if log_dir is not None:
            line += f" (its output is in {Path(log_dir) / f'rank-{rank}.log'})"
        return line, rank, details
    elif consequences:
        first = consequences[0]
        rank = first["rank"]
        line = _failed(first)
    else:
        return f"the job failed on {world_size} ranks without a report", 0, details
    log = next((r["log"] for r in causes + consequences if r["rank"] == rank and r["log"]), None)
    if log:
        line += f" (traceback in {log})"
    return line, rank, details


def _failed(record: dict) -> str:
    """"rank R failed at <where>: <cause>", and who reported it when another rank did (a
    stop notice names the rank that failed first)."""
    where = f" at {record['where']}" if record.get("where") else ""
    line = f"rank {record['rank']} failed{where}: {record['cause']}"
    reporter = record.get("reported_by", record["rank"])
    return line if reporter == record["rank"] else f"{line} (reported by rank {reporter})"


def _also(first: dict, others: list[dict]) -> str:
    """The other ranks that failed on their own, in a few words."""
    others = [r for r in others if r["rank"] != first["rank"]]
    same = sorted({r["rank"] for r in others if r["cause"] == first["cause"]})
    different = [r for r in others if r["cause"] != first["cause"]]
    notes = []
    if same:
        notes.append(f"{_ranks_word(same)} {_join(same)} failed the same way")
    if different:
        notes.append(f"{_ranks_word(different)} {_join([r['rank'] for r in different])} also "
                     f"failed ({different[0]['cause'][:80]})")
    return f"; {'; '.join(notes)}" if notes else ""


def _how_it_ended(exit_code: int) -> str:
    if exit_code < 0:
        name = signal.Signals(-exit_code).name
        hint = " (out of memory, or killed from outside)" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {exit_code} without reporting an error"


def hang_report(statuses: dict[int, dict], now: float, hang_timeout: float,
                exit_codes: list[int | None], *, always: bool = False
                ) -> tuple[str, str, int] | None:
    """(picture, one line, the rank to blame) when some rank's activity has outlived its
    limit (``hang_timeout`` unless the activity set a longer one); None otherwise. With
    ``always`` the picture is drawn anyway (an on-demand dump)."""
    world_size = len(exit_codes)
    statuses = {rank: as_of(status, now) for rank, status in statuses.items()}
    ages = {rank: now - status["since"] for rank, status in statuses.items()}
    running = [rank for rank in range(world_size) if exit_codes[rank] is None]
    overdue = [rank for rank in running if rank in statuses
               and ages[rank] > (statuses[rank].get("limit") or hang_timeout)]
    if not overdue and not always:
        return None
    blocked_by = {rank: _blocker(rank, statuses) for rank in running if rank in statuses}
    ends = {rank: _chain_end(rank, blocked_by) for rank in overdue}
    lines = [f"meshpipe: {'hang' if overdue else 'status'}: {len(overdue)} of {world_size} ranks "
             f"have not moved for longer than their limit (--hang-timeout "
             f"{hang_timeout:g} s); who waits on whom:"]
    for rank in range(world_size):
        lines.append(f"  rank {rank}: "
                     f"{_state(rank, statuses, ages, exit_codes, blocked_by, now)}")
    if not overdue:
        return "\n".join(lines), "", -1
    culprit, cycle = max(ends.values(), key=lambda end: sum(e == end for e in ends.values()))
    # Every rank whose waits lead to the culprit, overdue or not: a waiting rank is given
    # longer than the rank it waits on, so it is often not overdue yet.
    waiters = sorted(rank for rank in blocked_by
                     if rank != culprit and _chain_end(rank, blocked_by)[0] == culprit)
    waiting = (f"; {_ranks_word(waiters)} {_join(waiters)} wait{'s' if len(waiters) == 1 else ''}"
               " on it" if waiters else "")
    if cycle:
        line = (f"ranks {' -> '.join(str(r) for r in cycle)} wait on each other (a deadlock): "
                f"rank {culprit} {hang_line(statuses[culprit], ages[culprit])}")
    elif culprit not in statuses:
        line = f"rank {culprit} never reported what it does (stuck while starting?){waiting}"
    elif exit_codes[culprit] is not None:
        ended = ("finished" if exit_codes[culprit] == 0
                 else _how_it_ended(exit_codes[culprit]))
        line = f"rank {culprit} {ended} while other ranks still wait for it{waiting}"
    else:
        verb = "is" if "frozen" in statuses[culprit] else "hangs:"
        line = (f"rank {culprit} {verb} {_activity(statuses[culprit], ages[culprit], now)}"
                f"{waiting}")
    return "\n".join(lines), line, culprit


def _blocker(rank: int, statuses: dict[int, dict]) -> int | None:
    """The rank that ``rank`` waits on: its peer, or for a collective the first member not
    waiting in the same collective; None when it is not waiting."""
    status = statuses[rank]
    if not status.get("waiting"):
        return None
    if "peer" in status:
        return status["peer"]
    for peer in status.get("peers", []):
        other = statuses.get(peer)
        in_same = other is not None and other.get("waiting") and (
            other.get("what"), other.get("peers")) == (status.get("what"), status.get("peers"))
        if peer != rank and not in_same:
            return peer
    return None


def _chain_end(rank: int, blocked_by: dict[int, int | None]) -> tuple[int, tuple[int, ...]]:
    """Follow who waits on whom from ``rank``: the rank at the end, and the cycle if the
    chain closes on itself (empty otherwise)."""
    path = [rank]
    while True:
        nxt = blocked_by.get(path[-1])
        if nxt is None:
            return path[-1], ()
        if nxt in path:
            cycle = path[path.index(nxt):] + [nxt]
            return min(cycle), tuple(cycle)
        path.append(nxt)


def _state(rank: int, statuses: dict, ages: dict, exit_codes: list, blocked_by: dict,
           now: float) -> str:
    code = exit_codes[rank]
    if code is not None:
        return "finished" if code == 0 else _how_it_ended(code)
    if rank not in statuses:
        return "has not reported yet"
    text = _activity(statuses[rank], ages[rank], now)
    blocker = blocked_by.get(rank)
    return text + (f" -> rank {blocker}" if blocker is not None else "")


def _activity(status: dict, age: float, now: float) -> str:
    """What a rank runs or waits for; for a frozen one, why, and where it was last seen."""
    if "frozen" not in status:
        return hang_line(status, age)
    return (f"{status['frozen']}; last seen {now - status['seen']:.0f} s ago at "
            f"{describe(status)}")


def _ranks_word(ranks: list) -> str:
    return "rank" if len(ranks) == 1 else "ranks"


def _join(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
