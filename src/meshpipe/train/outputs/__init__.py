"""What a run writes for people to read: ``metrics.jsonl`` and ``metrics.json``, the
progress line, the measured timeline of a step, ``loss.png``, TensorBoard scalars and each
rank's memory. It reads what the loop measured; it must not change what the loop does."""
