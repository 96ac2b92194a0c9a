"""Small pieces every benchmark script shares (run as ``python benchmarks/NAME.py``, which
puts this directory on the import path)."""

from __future__ import annotations

import os


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (None where the OS has none): a
    benchmark records them before and after, since other processes skew its timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def paired_ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Round by round, one case's time over another's timed in the same round: load that
    drifts between rounds slows both sides of a ratio, where it would move the two cases'
    own medians apart."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]
