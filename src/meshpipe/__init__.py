"""meshpipe: pipeline- and context-parallel training for PyTorch.

Schedules are data (``meshpipe.schedules``): built, validated, simulated, drawn and then
executed by one generic executor (``meshpipe.runtime``).
"""

__version__ = "0.1.0"
