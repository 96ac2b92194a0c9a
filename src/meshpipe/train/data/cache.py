"""``--data`` tokenized once into a cache, then only memory-mapped (reading in ``records``,
the meaning of rows in ``samples``, tokenizers in ``tokenizers``, sampling in ``sampling``).

The rows become one flat int32 token array plus int64 document offsets (``TokenizedData``),
with, per document, its kind (a document or a chat/instruction sample) and row number, and,
where some tokens are not targets (``--loss-on assistant``), a uint8 mask over the tokens.
An entry is written once per (data files, tokenizer, reading options) under a content key
and then only memory-mapped, so every rank of a job shares one copy in the page cache. It is
built in a temporary directory and renamed into place: a killed tokenization never leaves a
half-written entry and, of concurrent writers, the first rename wins. Tokenizing streams:
resident memory stays bounded whatever the size of the data.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from pathlib import Path
from queue import Full, Queue
from typing import Any

import numpy as np
from tqdm import tqdm

from meshpipe.train.data.npy_stream import NpyStream
from meshpipe.train.data.images import DocumentImages, ImageColumns, ImageInputs
from meshpipe.train.data.records import data_files, read_rows, where
from meshpipe.train.data.samples import KIND_SAMPLE, encode_prepared, prepare_rows
from meshpipe.train.data.tokenizers import Tokenizer

# Bumped when the reading rules or the cache layout change, so old entries are not reused.
CACHE_FORMAT = 4
PROGRESS_MIN_BYTES = 4 << 20
TEMP_PREFIX = ".tmp-"
ONES_PER_WRITE = 1 << 24


@dataclass(frozen=True)
class ReadOptions:
    """How rows are read and which tokens are targets (part of the cache key)."""

    text_field: str = "text"
    loss_on: str = "assistant"


# ---------------------------------------------------------------------------------------------
# Tokenized data and its cache


@dataclass
class TokenizedData:
    """Documents as one flat token array: document ``d`` is
    ``tokens[offsets[d]:offsets[d + 1]]``, with ``offsets[0] == 0``.

    ``mask`` (uint8 per token, None: all ones) says which tokens are targets; ``kinds``
    (uint8 per document, None: all ``KIND_TEXT``) which documents are chat or
    prompt/completion samples; ``rows`` each document's row number in its file, and
    ``files`` each file with the index one past its last document (of the whole data, of
    which this holds documents from ``first_document`` on); ``images`` the documents'
    images (None: the data shows none)."""

    tokens: np.ndarray
    offsets: np.ndarray
    vocab_size: int
    mask: np.ndarray | None = None
    kinds: np.ndarray | None = None
    rows: np.ndarray | None = None
    files: tuple[tuple[str, int], ...] = ()
    first_document: int = 0
    images: DocumentImages | None = None

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @cached_property
    def max_token(self) -> int:
        """The largest token id present (-1 without tokens)."""
        return int(self.tokens.max()) if len(self.tokens) else -1

    @cached_property
    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    def samples_longer_than(self, seq_len: int) -> np.ndarray:
        """The chat and prompt/completion documents of more than ``seq_len`` tokens."""
        if self.kinds is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero((np.asarray(self.kinds) == KIND_SAMPLE) & (self.lengths > seq_len))

    def place(self, document: int) -> str:
        """Where document ``document`` comes from: file and line or row."""
        if self.rows is None or not self.files:
            return f"document {document}"
        whole = self.first_document + document
        ends = [end for _, end in self.files]
        file = self.files[int(np.searchsorted(ends, whole, side="right"))][0]
        return where(Path(file), int(self.rows[document]))

    def split(self, val_fraction: float = 0.05) -> tuple[TokenizedData, TokenizedData]:
        """(train, validation): the last documents are held out, or, for a single
        document, its last ``val_fraction`` of tokens."""
        if self.num_documents == 1:
            return self._split_tokens(int(self.num_tokens * (1.0 - val_fraction)))
        held = max(1, round(val_fraction * self.num_documents))
        if self.num_documents < 2 or held >= self.num_documents:
            raise ValueError(f"cannot hold out {val_fraction:.0%} of {self.num_documents} "
                             "documents for validation and still train on some: add "
                             "documents to --data")
        return self._slice(0, self.num_documents - held), self._slice(
            self.num_documents - held, self.num_documents)

    def _slice(self, first: int, last: int) -> TokenizedData:
        """Documents ``first .. last - 1``, sharing this token array."""
        start, end = int(self.offsets[first]), int(self.offsets[last])
        offsets = np.asarray(self.offsets[first:last + 1], dtype=np.int64) - start
        return self._part(start, end, offsets, slice(first, last), first)

    def _part(self, start: int, end: int, offsets: np.ndarray, documents: slice,
              first: int) -> TokenizedData:
        return TokenizedData(
            self.tokens[start:end], offsets, self.vocab_size,
            mask=None if self.mask is None else self.mask[start:end],
            kinds=None if self.kinds is None else self.kinds[documents],
            rows=None if self.rows is None else self.rows[documents], files=self.files,
            first_document=self.first_document + first,
            images=None if self.images is None else self.images.part(documents))

    def _split_tokens(self, cut: int) -> tuple[TokenizedData, TokenizedData]:
        if not 0 < cut < self.num_tokens:
            raise ValueError(f"--data is one document of {self.num_tokens} tokens, too short "
                             "to hold out a validation part: add text or documents")
        one = slice(0, 1)
        return (self._part(0, cut, np.array([0, cut], dtype=np.int64), one, 0),
                self._part(cut, self.num_tokens,
                           np.array([0, self.num_tokens - cut], dtype=np.int64), one, 0))


def tokenize_dataset(path: str, tokenizer: Tokenizer, cache_dir: str | Path, *,
                     progress: bool = True, options: ReadOptions = ReadOptions(),
                     flag: str = "--data", images: ImageInputs | None = None) -> TokenizedData:
    """``path``'s rows tokenized (their images processed by ``images``, a vision-language
    model's), from the cache when the files, the tokenizer, the image processor and the
    options are unchanged (same resolved paths, sizes and modification times)."""
    files = data_files(path, flag)
    cache_dir = Path(cache_dir)
    key = cache_key(files, tokenizer, options, images)
    entry = cache_dir / key
    if not _complete(entry):
        with _exclusive(cache_dir):
            if not _complete(entry):  # another process may have written it meanwhile
                _remove_dead_temporaries(cache_dir)
                _build_entry(path, files, tokenizer, cache_dir, key, progress, options, images)
    return _load_entry(entry, tokenizer)


@contextlib.contextmanager
def _exclusive(cache_dir: Path) -> Iterator[None]:
    """One tokenization at a time per cache directory on a host (a lock on the directory
    itself): the ranks of a torchrun job that all reach an uncached dataset wait for the
    first one and then read its cache instead of tokenizing it again."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(cache_dir, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def cache_key(files: list[Path], tokenizer: Tokenizer,
              options: ReadOptions = ReadOptions(), images: ImageInputs | None = None) -> str:
    """sha256 over the tokenizer's (and image processor's) identity, the reading options and
    each file's resolved path, size and mtime (an image changed in place is not seen: give
    it a new name)."""
    described = [_describe(file) for file in files]
    payload = json.dumps({"format": CACHE_FORMAT, "tokenizer": tokenizer.name,
                          "images": images.name if images else None,
                          "files": described, "options": vars(options)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _describe(file: Path) -> list:
    info = file.stat()
    return [str(file.resolve()), info.st_size, info.st_mtime_ns]


def _complete(entry: Path) -> bool:
    """An entry exists only after its rename, and meta.json is written before that."""
    return (entry / "meta.json").is_file()


def _load_entry(entry: Path, tokenizer: Tokenizer) -> TokenizedData:
    meta = json.loads((entry / "meta.json").read_text())
    mask = entry / "mask.npy"
    kinds = np.load(entry / "kinds.npy", mmap_mode="r")
    return TokenizedData(tokens=np.load(entry / "tokens.npy", mmap_mode="r"),
                         offsets=np.load(entry / "offsets.npy", mmap_mode="r"),
                         vocab_size=tokenizer.vocab_size,
                         mask=np.load(mask, mmap_mode="r") if mask.is_file() else None,
                         kinds=kinds if kinds.any() else None,
                         rows=np.load(entry / "rows.npy", mmap_mode="r"),
                         files=tuple((name, end) for name, end in meta["documents_of_files"]),
                         images=_load_images(entry, meta))


def _load_images(entry: Path, meta: dict) -> DocumentImages | None:
    if not meta.get("images"):
        return None
    pixels = np.load(entry / "pixels.npy", mmap_mode="r")
    return DocumentImages(pixels=pixels.reshape(-1, meta["patch_dim"]),
                          grids=np.load(entry / "grids.npy"),
                          image_offsets=np.load(entry / "image_offsets.npy"))


def _build_entry(path: str, files: list[Path], tokenizer: Tokenizer, cache_dir: Path,
                 key: str, progress: bool, options: ReadOptions,
                 images: ImageInputs | None = None) -> None:
    """Tokenize into a temporary directory and rename it to ``cache_dir / key``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    temporary = cache_dir / f"{TEMP_PREFIX}{key[:16]}-{socket.gethostname()}-{os.getpid()}-" \
                            f"{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    try:
        counts = _write_tokens(path, files, tokenizer, temporary, progress, options, images)
        meta = {"files": [_describe(file) for file in files], "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size, "options": vars(options), **counts}
        (temporary / "meta.json").write_text(json.dumps(meta, indent=1))
        _publish(temporary, cache_dir / key)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _publish(temporary: Path, entry: Path) -> None:
    """Rename into place; when another writer got there first, keep theirs."""
    try:
        os.rename(temporary, entry)
    except OSError:
        if not _complete(entry):
            raise
        shutil.rmtree(temporary, ignore_errors=True)


def _remove_dead_temporaries(cache_dir: Path) -> None:
    """Delete temporary directories left by killed tokenizations on this host (their
    names carry host and process id); a live writer's directory is left alone."""
    if not cache_dir.is_dir():
        return
    host = socket.gethostname()
    for temporary in cache_dir.glob(f"{TEMP_PREFIX}*"):
        parts = temporary.name[len(TEMP_PREFIX):].split("-")
        if len(parts) < 4 or "-".join(parts[1:-2]) != host or not parts[-2].isdigit():
            continue
        if not _alive(int(parts[-2])):
            shutil.rmtree(temporary, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    return True


def _write_tokens(path: str, files: list[Path], tokenizer: Tokenizer, directory: Path,
                  progress: bool, options: ReadOptions, images: ImageInputs | None) -> dict:
    """tokens.npy, mask.npy (only where some token is not a target), offsets.npy, kinds.npy,
    rows.npy of every non-empty document, and its images (``ImageColumns``); the documents'
    counts."""
    total_bytes = sum(file.stat().st_size for file in files)
    columns = _DocumentColumns()
    documents_of_files = []
    with NpyStream(directory / "tokens.npy", np.int32) as tokens, _TargetMask(
            directory / "mask.npy") as mask, ImageColumns(directory) as shown, tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc=f"tokenizing {path}",
            disable=not progress or total_bytes <= PROGRESS_MIN_BYTES) as bar:
        for file in files:
            done = 0
            prepared = ((batch, prepare_rows(batch, file, tokenizer, options.text_field, images))
                        for batch in read_rows(file, options.text_field))
            for batch, meaning in _in_background(prepared):
                rows = encode_prepared(meaning, tokenizer, options.loss_on, images, file)
                ids, lengths = _flatten(rows.ids, tokenizer, file)
                tokens.write(ids)
                mask.write(_flat_mask(rows.masks, lengths))
                shown.add(rows.images, lengths)
                columns.add(lengths, rows.kinds, rows.numbers)
                bar.update(batch.bytes_done - done)
                done = batch.bytes_done
            bar.update(file.stat().st_size - done)
            documents_of_files.append([str(file), columns.count])
    if not columns.count:
        raise ValueError(f"{path} holds no text: its {len(files)} file(s) have no non-blank "
                         "document or row")
    lengths = columns.save(directory)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(directory / "offsets.npy", offsets)
    return {"num_documents": columns.count, "num_tokens": int(offsets[-1]),
            "documents_of_files": documents_of_files, **shown.counts()}


def _in_background(items: Iterable, depth: int = 2) -> Iterator:
    """``items`` produced by a thread of their own, up to ``depth`` ahead: reading the rows
    and rendering the chats of the next batches (Python) runs while this thread tokenizes
    (Rust, which releases the GIL), so both cores stay busy on chat data too. An error of
    the producer is raised here; leaving early stops it after its current item."""
    queue: Queue = Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry: tuple[bool, Any]) -> None:
        while not stop.is_set():
            try:
                queue.put(entry, timeout=0.1)
                return
            except Full:
                continue

    def produce() -> None:
        try:
            for item in items:
                put((True, item))
                if stop.is_set():
                    return
            put((True, _END))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            put((False, err))

    thread = threading.Thread(target=produce, name="meshpipe-read-rows", daemon=True)
    thread.start()
    try:
        while True:
            produced, item = queue.get()
            if not produced:
                raise item
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        thread.join()


_END = object()


class _DocumentColumns:
    """Each non-empty document's length, kind and row number, gathered batch by batch
    (a few bytes per document: they are kept in memory)."""

    def __init__(self):
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.count = 0

    def add(self, lengths: np.ndarray, kinds: list[int], numbers: list[int]) -> None:
        kept = lengths > 0
        self.parts.append((lengths[kept], np.asarray(kinds, dtype=np.uint8)[kept],
                           np.asarray(numbers, dtype=np.int64)[kept]))
        self.count += int(kept.sum())

    def save(self, directory: Path) -> np.ndarray:
        """kinds.npy and rows.npy written; the lengths."""
        lengths, kinds, rows = (np.concatenate(column) for column in zip(*self.parts))
        np.save(directory / "kinds.npy", kinds)
        np.save(directory / "rows.npy", rows)
        return lengths


def _flat_mask(masks: list[np.ndarray | None], lengths: np.ndarray) -> np.ndarray:
    """The batch's per-token target mask as one array (ones where a row has none)."""
    return np.concatenate([np.ones(length, dtype=np.uint8) if mask is None else mask
                           for mask, length in zip(masks, lengths)] or
                          [np.zeros(0, dtype=np.uint8)])


def _flatten(encoded: list[list[int]], tokenizer: Tokenizer,
             file: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch's ids as a flat int32 array, and each document's length; checks every id
    is one the tokenizer can produce (a model's embedding has only that many rows)."""
    doc_lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(chain.from_iterable(encoded), dtype=np.int64, count=int(doc_lengths.sum()))
    if len(flat) and (flat.min() < 0 or flat.max() >= tokenizer.vocab_size):
        bad = int(flat.max()) if flat.max() >= tokenizer.vocab_size else int(flat.min())
        raise ValueError(f"tokenizer {tokenizer.name} produced id {bad} for {file}, outside "
                         f"its vocabulary of {tokenizer.vocab_size}: the tokenizer is broken")
    return flat.astype(np.int32), doc_lengths


class _TargetMask:
    """mask.npy, started once some token is not a target: until then only the count of
    tokens that all are (plain text never writes one)."""

    def __init__(self, path: Path):
        self.path = path
        self.stream: NpyStream | None = None
        self.all_targets = 0

    def write(self, targets: np.ndarray) -> None:
        if self.stream is None:
            if targets.all():
                self.all_targets += len(targets)
                return
            self.stream = NpyStream(self.path, np.uint8)
            for start in range(0, self.all_targets, ONES_PER_WRITE):
                self.stream.write(np.ones(min(ONES_PER_WRITE, self.all_targets - start),
                                          dtype=np.uint8))
        self.stream.write(targets)

    def __enter__(self) -> _TargetMask:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.stream is not None:
            self.stream.__exit__(*exc_info)
