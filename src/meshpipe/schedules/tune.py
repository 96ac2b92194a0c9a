"""Moved: ranking layouts is ``meshpipe.schedules.ranking``; its names still import from here."""

from meshpipe.schedules.ranking import (Layout, Link, MAX_VPP, MemoryBudgetError, NoLayoutError,
                                        Piece, Prediction, Profile, TABLE_HEADER, TuneError,
                                        all_reduce_s, buildable, curve_factor, format_bytes,
                                        layouts, parse_bytes, predict, rank_layouts, stage_costs,
                                        stage_sum, table)

__all__ = [
    "Layout", "Link", "MAX_VPP", "MemoryBudgetError", "NoLayoutError", "Piece", "Prediction",
    "Profile", "TABLE_HEADER", "TuneError", "all_reduce_s", "buildable", "curve_factor",
    "format_bytes", "layouts", "parse_bytes", "predict", "rank_layouts", "stage_costs",
    "stage_sum", "table"
]
