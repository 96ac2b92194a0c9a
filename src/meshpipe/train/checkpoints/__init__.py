"""Checkpoints (``store``: written whole or not at all, read back in any layout) and what
``--resume`` continues from (``resume``: decided in the launcher by reading files only,
before any process starts)."""
