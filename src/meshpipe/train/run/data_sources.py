"""A run's data: the shipped corpus, or the user's ``--data`` sources (one, or a weighted
mixture) with their tokenizer, their validation part (held out, or ``--val-data``) and the
samplers every rank draws its batches from.

The launcher calls ``check_data`` before any process starts: it tokenizes every source into
the cache (so the ranks only map the token files) and says in one line how many samples are
longer than ``--seq-len`` (cut to it), or refuses the first under ``--no-truncate``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from meshpipe.train.config import TrainConfig
from meshpipe.train.data import tokenizers
from meshpipe.train.data.cache import ReadOptions, TokenizedData, tokenize_dataset
from meshpipe.train.data.images import ImageInputs
from meshpipe.train.data.corpus import CorpusSampler, encode, load_corpus
from meshpipe.train.data.mixture import MixtureSampler, parse_source, source_names
from meshpipe.train.data.sampling import IGNORE_INDEX, TextSampler

VAL_FRACTION = 0.05
# Seeds of a mixture's sources after the first, and of the validation samplers.
SOURCE_SEED_STRIDE = 104_729
VAL_SEED_OFFSET = 1_000_003


@lru_cache(maxsize=None)
def _tokenizer(model_dir: str, tokenizer_dir: str, chat_template: str):
    return tokenizers.resolve_tokenizer(model_dir, tokenizer_dir, chat_template)


def tokenizer(config: TrainConfig):
    """The tokenizer of ``--data``: ``--tokenizer``, the model's own, or byte-level."""
    return _tokenizer(config.model, config.tokenizer, config.chat_template)


def data_cache(config: TrainConfig) -> Path:
    return Path(config.data_cache or Path(config.out_dir) / "tokens")


def sources(config: TrainConfig) -> list[tuple[str, float]]:
    """Each ``--data`` source's path and weight."""
    return [parse_source(text) for text in config.data]


def names(config: TrainConfig) -> list[str]:
    """Each source's name in the metrics."""
    return source_names([path for path, _ in sources(config)])


@lru_cache(maxsize=None)
def _image_inputs(model_dir: str, tokenizer_dir: str, chat_template: str) -> ImageInputs | None:
    """A vision-language model's image processor and placeholders (None for a decoder)."""
    if not model_dir:
        return None
    from meshpipe.models import hf

    vision = hf.inspect_model(model_dir).vision
    if vision is None:
        return None
    return ImageInputs(model_dir, vision, _tokenizer(model_dir, tokenizer_dir, chat_template))


def image_inputs(config: TrainConfig) -> ImageInputs | None:
    return _image_inputs(config.model, config.tokenizer, config.chat_template)


@lru_cache(maxsize=None)
def _tokenized(path: str, flag: str, model_dir: str, tokenizer_dir: str, chat_template: str,
               cache: str, progress: bool, options: ReadOptions) -> TokenizedData:
    return tokenize_dataset(path, _tokenizer(model_dir, tokenizer_dir, chat_template), cache,
                            progress=progress, options=options, flag=flag,
                            images=_image_inputs(model_dir, tokenizer_dir, chat_template))


def tokenized(config: TrainConfig, path: str, flag: str = "--data",
              progress: bool = False) -> TokenizedData:
    """``path`` read as ``config`` says and tokenized (from the cache when it is there)."""
    return _tokenized(path, flag, config.model, config.tokenizer, config.chat_template,
                      str(data_cache(config)), progress,
                      ReadOptions(config.text_field, config.loss_on))


def splits(config: TrainConfig) -> list[tuple[TokenizedData, TokenizedData | None]]:
    """Each source's (training, validation) parts: the last documents held out, or the whole
    source and no validation part with ``--val-data``."""
    whole = [tokenized(config, path) for path, _ in sources(config)]
    if config.val_data:
        return [(data, None) for data in whole]
    return [data.split(VAL_FRACTION) for data in whole]


def check_data(config: TrainConfig) -> list[str]:
    """Every source (and ``--val-data``) tokenized into the cache, with a progress bar on
    large inputs; a one-line ValueError for data the run cannot use; the notes to show."""
    data = [tokenized(config, path, progress=config.progress) for path, _ in sources(config)]
    if config.val_data:
        data.append(tokenized(config, config.val_data, "--val-data", config.progress))
    for part in data:
        if part.images is not None:
            _check_images_fit(part, config.seq_len, image_inputs(config).image_token_id)
    long = [(part, part.samples_longer_than(config.seq_len)) for part in data]
    count = sum(len(documents) for _, documents in long)
    if not count:
        return []
    part, documents = next((part, documents) for part, documents in long if len(documents))
    if not config.truncate:
        more = f" (and {count - 1} more)" if count > 1 else ""
        raise ValueError(f"--no-truncate: {part.place(int(documents[0]))} is a sample of "
                         f"{int(part.lengths[documents[0]])} tokens, longer than --seq-len "
                         f"{config.seq_len}{more}: give a larger --seq-len, or drop "
                         "--no-truncate to cut such samples to it")
    samples = sum(len(part.samples_longer_than(0)) for part in data)
    return [f"{count} of {samples} chat or prompt/completion samples are longer than "
            f"--seq-len {config.seq_len} tokens and are cut to it (the first: "
            f"{part.place(int(documents[0]))}); --no-truncate refuses them instead"]


def _check_images_fit(data: TokenizedData, seq_len: int, image_token_id: int) -> None:
    """A sample cut to ``seq_len`` may lose text, never an image's tokens: a one-line
    ValueError naming the first sample whose images end past it."""
    offsets = data.images.image_offsets
    for document in data.samples_longer_than(seq_len):
        if offsets[document + 1] == offsets[document]:
            continue
        tokens = np.asarray(data.tokens[int(data.offsets[document]):
                                        int(data.offsets[document + 1])])
        last = int(np.flatnonzero(tokens == image_token_id)[-1]) + 1
        if last > seq_len:
            raise ValueError(f"{data.place(int(document))} is a sample whose images end at "
                             f"token {last}, past --seq-len {seq_len}: give a --seq-len of "
                             f"{last} or more, or smaller or fewer images")


def samplers(config: TrainConfig, dp_rank: int) -> tuple[Any, Any]:
    """Data-parallel replica ``dp_rank``'s (train, validation) samplers: each batch holds
    microbatches x microbatch_size sequences and is a pure function of the step."""
    batch = config.microbatches * config.microbatch_size
    seed = config.seed * 7919 + dp_rank
    if not config.data:
        tokens = encode(load_corpus())
        return tuple(CorpusSampler(tokens, config.seq_len, batch, seed=seed, split=name)
                     for name in ("train", "val"))
    pad = tokenizer(config).pad_id
    parts = splits(config)
    patch_dim = max((data.images.patch_dim for data, _ in parts if data.images is not None),
                    default=0)

    def sampler(data: TokenizedData, sampler_seed: int) -> TextSampler:
        return TextSampler(data, config.seq_len, batch, seed=sampler_seed, pack=config.pack,
                           pad_id=pad, patch_dim=patch_dim if len(parts) > 1 else 0)

    weights = [weight for _, weight in sources(config)]
    seeds = [seed + index * SOURCE_SEED_STRIDE for index in range(len(parts))]
    train = [sampler(data, source_seed) for (data, _), source_seed in zip(parts, seeds)]
    if config.val_data:
        val = sampler(tokenized(config, config.val_data, "--val-data"), seed + VAL_SEED_OFFSET)
    else:
        val = _mixed([sampler(held, source_seed + VAL_SEED_OFFSET)
                      for (_, held), source_seed in zip(parts, seeds)], weights, batch, seed)
    return _mixed(train, weights, batch, seed), val


def _mixed(samplers_of_sources: list[TextSampler], weights: list[float], batch: int,
           seed: int) -> Any:
    if len(samplers_of_sources) == 1:
        return samplers_of_sources[0]
    return MixtureSampler(samplers_of_sources, weights, batch, seed=seed)


def counted_targets(targets) -> int:
    """Targets that count in the loss (not padding, not a document's last token, not a
    token the data leaves out of the loss)."""
    return int((targets != IGNORE_INDEX).sum())
