"""Training data: the shipped public-domain corpus, a byte-level tokenizer, a seekable sampler.

The sampler is a pure function of (seed, step): batch ``k`` is the same on every rank and after
a resume, so no sampler state needs checkpointing and every rank of a pipeline or
context-parallel group sees identical data without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import torch

VOCAB_SIZE = 256
CORPORA = ("shakespeare",)


@lru_cache(maxsize=None)
def load_corpus(name: str = "shakespeare") -> bytes:
    """The raw bytes of a corpus shipped beside this module."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; shipped corpora: {', '.join(CORPORA)}")
    return resources.files("meshpipe.train.data").joinpath(f"{name}.txt").read_bytes()


def encode(text: str | bytes) -> torch.Tensor:
    """Byte-level tokens (int64), one per UTF-8 byte."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Batch:
    """``tokens`` [batch, seq] and ``targets`` [batch, seq]: the next token of each position."""

    tokens: torch.Tensor
    targets: torch.Tensor


class CorpusSampler:
    """Random windows of ``seq_len + 1`` tokens from one split of a corpus.

    The last ``val_fraction`` of the corpus is held out as the validation split.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, *, seed: int = 0,
                 split: str = "train", val_fraction: float = 0.05):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        cut = int(len(tokens) * (1.0 - val_fraction))
        self.tokens = tokens[:cut] if split == "train" else tokens[cut:]
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"the {split} split has {len(self.tokens)} tokens, too few for "
                             f"seq_len {seq_len}; use a shorter --seq-len")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed + (0 if split == "train" else 1_000_003)

    def batch(self, step: int) -> Batch:
        """Batch number ``step``: identical on every rank and across restarts."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,),
                               generator=generator, device="cpu")
        windows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])
        return Batch(tokens=windows[:, :-1].contiguous(), targets=windows[:, 1:].contiguous())
