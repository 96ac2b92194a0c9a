"""``meshpipe train``: a training run, from its flags to its checkpoints.

``config.py`` holds ``TrainConfig`` (every flag a field), which every part below reads. The
subpackages, each named for what it owns:

- ``run``: the command line and TOML files that make a config, and the run decided once in
  the launcher from it (``plan``: checks, devices, schedule, layer split, resume; ``sources``:
  what is trained, on what data, and the one-process reference of ``--check``);
- ``loop``: the trainer and the parts it composes (a rank's microbatches, gradients, the
  pipeline transport, ``--check``'s comparison, the learning rate);
- ``data``: the shipped corpus, the user's text, tokenizers and samplers;
- ``outputs``: what a run writes for people (metrics, plots, TensorBoard, the timeline);
- ``checkpoints``: writing and reading checkpoints, and what ``--resume`` continues from;
- ``supervisor``: starting the ranks, stopping them all on a failure and saying why, fault
  injection;
- ``tune``: ``meshpipe tune``, in its steps (profile, measure, calibrate, rank).

A rank must not re-decide what the plan decided; a rank's failure reaches the terminal as one
line, never a traceback.
"""
