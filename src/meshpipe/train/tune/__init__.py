"""``meshpipe tune``, in its steps: ``profile`` measures the model's pieces in this process,
``measure`` takes short training runs of a base layout, ``calibrate`` fits the profile to
what was measured, and ``tuner`` runs the steps in order and ranks the layouts
(``meshpipe.schedules.ranking`` does the ranking itself)."""
