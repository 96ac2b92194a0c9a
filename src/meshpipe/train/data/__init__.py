"""Training data: the shipped corpus (``corpus``; its files lie beside it), the user's files
read row by row (``records``: .txt, .jsonl, Parquet, Arrow), what a row means and its tokens
(``samples``: text, chat with the assistant's tokens found, prompt/completion), tokenized
once into a memory-mapped cache (``cache``), tokenizers, and samplers that are pure
functions of the step (``sampling``, and ``mixture`` for weighted sources), so a resume
needs no data state. Nothing here holds a whole user corpus in memory or talks to other
ranks."""
