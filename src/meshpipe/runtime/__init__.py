"""meshpipe.runtime: pipeline stages and the executor that runs a lowered schedule."""

from meshpipe.runtime.split_backward import SplitBackward
from meshpipe.runtime.stage import Stage, StageError

__all__ = ["SplitBackward", "Stage", "StageError"]
