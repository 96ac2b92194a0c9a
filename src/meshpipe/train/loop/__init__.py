"""The training loop on one rank (``trainer``) and the parts it composes: the rank's
microbatches, its gradients (reduced, measured, clipped), the pipeline transport of the
layout, ``--check``'s comparison with one process, the learning-rate schedule, a non-finite
step's handling, a mixture's per-source losses. It follows the plan it is given and must not
re-decide any of it."""
