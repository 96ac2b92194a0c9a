"""meshpipe.runtime: pipeline stages and the executor that runs a lowered schedule."""

from meshpipe.runtime.executor import Executor, ExecutorError, PeerFailedError, StepResult
from meshpipe.runtime.grad_sync import all_reduce_gradients
from meshpipe.runtime.hooks import OverlapHooks, StageHooks
from meshpipe.runtime.master_weights import MasterWeights
from meshpipe.runtime.precision import (AutocastChunk, DynamicLossScaler, autocast,
                                        low_precision_tolerance, weights_cast_once,
                                        weights_dtype)
from meshpipe.runtime.split_backward import SplitBackward
from meshpipe.runtime.stage import Stage, StageError
from meshpipe.runtime.substeps import Exchange, run_steps

__all__ = ["AutocastChunk", "DynamicLossScaler", "Exchange", "Executor", "ExecutorError",
           "MasterWeights", "OverlapHooks", "PeerFailedError", "SplitBackward", "Stage",
           "StageError", "StageHooks", "StepResult", "all_reduce_gradients", "autocast",
           "low_precision_tolerance", "run_steps", "weights_cast_once", "weights_dtype"]
