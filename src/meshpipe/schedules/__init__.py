"""Pipeline schedules as plain data. Pure Python: nothing here imports torch."""

from meshpipe.schedules.actions import Action, Kind, Schedule

__all__ = ["Action", "Kind", "Schedule"]
