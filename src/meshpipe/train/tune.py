"""Moved: ``meshpipe tune``'s measurements and ranking are ``meshpipe.train.tuner`` (with
``tune_profile`` and ``tune_runs``); their names still import from here."""

from meshpipe.train.tune_profile import (CALLS_PER_TURN, TURNS, UNMEASURED_LINK, clocked,
                                         layer_curve, model_profile, priced_shape, timed_layer,
                                         token_counts, ulysses_sizes)
from meshpipe.train.tune_runs import (MEASURE_STEPS, Measurement, REPEATS, base_layout, config_for,
                                      measure, measured_phases, measured_sizes, run_configs,
                                      size_layout)
from meshpipe.train.tuner import TuneResult, calibrate, check_tunable, global_batch_of, tune

__all__ = [
    "CALLS_PER_TURN", "MEASURE_STEPS", "Measurement", "REPEATS", "TURNS", "TuneResult",
    "UNMEASURED_LINK", "base_layout", "calibrate", "check_tunable", "clocked", "config_for",
    "global_batch_of", "layer_curve", "measure", "measured_phases", "measured_sizes",
    "model_profile", "priced_shape", "run_configs", "size_layout", "timed_layer", "token_counts",
    "tune", "ulysses_sizes"
]
