"""Training data: the shipped corpus (``corpus``; its files lie beside it), the user's
.txt/.jsonl text tokenized once into a memory-mapped cache (``text``), tokenizers, and
samplers that are pure functions of the step (``sampling``), so a resume needs no data
state. Nothing here holds a whole user corpus in memory or talks to other ranks."""
