"""The user's text (``meshpipe train --data PATH [--tokenizer DIR] [--pack]``): reading, and
tokenizing once into a cache (tokenizers in ``tokenizers``, sampling in ``text_sampling``).

Reading: ``--data`` is a ``.txt`` file (documents separated by blank lines), a ``.jsonl``
file (one ``{"text": ...}`` object per line) or a folder of them. Every mistake in the input
is a one-line ``ValueError`` that names the file and, where it can, the line or byte offset.

Tokenizing: the documents become one flat int32 token array plus int64 document offsets
(``TokenizedData``), written once per (data files, tokenizer) under a content key and then
only memory-mapped, so every rank of a job shares one copy in the page cache. A cache entry
is built in a temporary directory and renamed into place: a killed tokenization never
leaves a half-written entry and, of concurrent writers, the first rename wins.
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

from meshpipe.train.data.tokenizers import Tokenizer

IGNORE_INDEX = -100

SUFFIXES = (".txt", ".jsonl")
# Bumped when the reading rules or the cache layout change, so old entries are not reused.
CACHE_FORMAT = 1
PROGRESS_MIN_BYTES = 4 << 20
ENCODE_BATCH_BYTES = 1 << 20
ENCODE_BATCH_DOCS = 1024
TEMP_PREFIX = ".tmp-"


# ---------------------------------------------------------------------------------------------
# Reading


def data_files(path: str) -> list[Path]:
    """The text files of ``--data``: the file itself, or every .txt/.jsonl under a folder."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"--data {path} does not exist: give a .txt or .jsonl file or a "
                         "folder of them")
    if root.is_dir():
        files = sorted(p for p in root.rglob("*")
                       if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise ValueError(f"--data {path} is a folder with no .txt or .jsonl file in it")
        return files
    if root.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--data {path} is neither .txt nor .jsonl: give documents as .txt "
                         "(separated by blank lines) or .jsonl (one {\"text\": ...} per line)")
    return [root]


def read_documents(file: Path) -> Iterator[str]:
    """The documents of one .txt or .jsonl file, in order."""
    file = Path(file)
    reader = _jsonl_documents if file.suffix.lower() == ".jsonl" else _txt_documents
    try:
        yield from reader(file)
    except UnicodeDecodeError:
        raise ValueError(_not_utf8(file)) from None


def _txt_documents(file: Path) -> Iterator[str]:
    """Runs of non-blank lines; a line of only whitespace counts as blank."""
    lines: list[str] = []
    with open(file, encoding="utf-8-sig") as handle:
        for line in handle:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).strip()
                lines = []
    if lines:
        yield "".join(lines).strip()


def _jsonl_documents(file: Path) -> Iterator[str]:
    """The "text" field of each non-empty line, verbatim (its whitespace may matter, as in
    code); whitespace-only texts are skipped."""
    with open(file, encoding="utf-8-sig") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            text = _jsonl_text(file, number, line)
            if text.strip():
                yield text


def _jsonl_text(file: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} line {number} is not valid JSON ({err.msg}, column "
                         f"{err.colno}): write one JSON object per line") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError(f"{file} line {number} has no string \"text\" field: write each "
                         "line as {\"text\": \"...\"}")
    return text


def _not_utf8(file: Path) -> str:
    offset, reason = _invalid_utf8(file)
    return f"{file} is not UTF-8 at byte offset {offset} ({reason}): convert it to UTF-8"


def _invalid_utf8(file: Path, chunk_size: int = 1 << 20) -> tuple[int, str]:
    """The absolute byte offset of the first invalid UTF-8 sequence in ``file``, and why.

    Text-mode reading does not say where it failed, so the file is scanned again, in
    chunks, with an incremental decoder: its error positions count from the bytes it still
    held back from the previous chunk (a character cut by the chunk edge)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    position = 0
    with open(file, "rb") as handle:
        while True:
            chunk = handle.read(chunk_size)
            held = decoder.getstate()[0]
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                byte = err.object[err.start]
                return position - len(held) + err.start, f"byte 0x{byte:02x}: {err.reason}"
            if not chunk:
                return position, "undecodable"
            position += len(chunk)


# ---------------------------------------------------------------------------------------------
# Tokenized data and its cache


@dataclass
class TokenizedData:
    """Documents as one flat token array: document ``d`` is
    ``tokens[offsets[d]:offsets[d + 1]]``, with ``offsets[0] == 0``."""

    tokens: np.ndarray
    offsets: np.ndarray
    vocab_size: int

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
        return TokenizedData(self.tokens[start:end], offsets, self.vocab_size)

    def _split_tokens(self, cut: int) -> tuple[TokenizedData, TokenizedData]:
        if not 0 < cut < self.num_tokens:
            raise ValueError(f"--data is one document of {self.num_tokens} tokens, too short "
                             "to hold out a validation part: add text or documents")
        tokens = self.tokens[:self.num_tokens]
        return (TokenizedData(tokens[:cut], np.array([0, cut], dtype=np.int64), self.vocab_size),
                TokenizedData(tokens[cut:], np.array([0, self.num_tokens - cut], dtype=np.int64),
                              self.vocab_size))


def tokenize_dataset(path: str, tokenizer: Tokenizer, cache_dir: str | Path, *,
                     progress: bool = True) -> TokenizedData:
    """``path``'s documents tokenized, from the cache when the files and the tokenizer are
    unchanged (same resolved paths, sizes and modification times)."""
    files = data_files(path)
    cache_dir = Path(cache_dir)
    key = cache_key(files, tokenizer)
    entry = cache_dir / key
    if not _complete(entry):
        with _exclusive(cache_dir):
            if not _complete(entry):  # another process may have written it meanwhile
                _remove_dead_temporaries(cache_dir)
                _build_entry(path, files, tokenizer, cache_dir, key, progress)
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


def cache_key(files: list[Path], tokenizer: Tokenizer) -> str:
    """sha256 over the tokenizer's identity and each file's resolved path, size and mtime."""
    described = [_describe(file) for file in files]
    payload = json.dumps({"format": CACHE_FORMAT, "tokenizer": tokenizer.name,
                          "files": described}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _describe(file: Path) -> list:
    info = file.stat()
    return [str(file.resolve()), info.st_size, info.st_mtime_ns]


def _complete(entry: Path) -> bool:
    """An entry exists only after its rename, and meta.json is written before that."""
    return (entry / "meta.json").is_file()


def _load_entry(entry: Path, tokenizer: Tokenizer) -> TokenizedData:
    return TokenizedData(tokens=np.load(entry / "tokens.npy", mmap_mode="r"),
                         offsets=np.load(entry / "offsets.npy", mmap_mode="r"),
                         vocab_size=tokenizer.vocab_size)


def _build_entry(path: str, files: list[Path], tokenizer: Tokenizer, cache_dir: Path,
                 key: str, progress: bool) -> None:
    """Tokenize into a temporary directory and rename it to ``cache_dir / key``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    temporary = cache_dir / f"{TEMP_PREFIX}{key[:16]}-{socket.gethostname()}-{os.getpid()}-" \
                            f"{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    try:
        counts = _write_tokens(path, files, tokenizer, temporary, progress)
        meta = {"files": [_describe(file) for file in files], "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size, **counts}
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
                  progress: bool) -> dict[str, int]:
    """tokens.npy and offsets.npy of every document; the documents' counts."""
    total_bytes = sum(file.stat().st_size for file in files)
    lengths: list[np.ndarray] = []
    with _TokenFile(directory / "tokens.npy") as out, tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc="tokenizing --data",
            disable=not progress or total_bytes <= PROGRESS_MIN_BYTES) as bar:
        for file in files:
            left = file.stat().st_size  # the bar counts text bytes, then the file's rest
            for texts in _batches(read_documents(file)):
                ids, doc_lengths = _flatten(tokenizer.encode_batch(texts), tokenizer, file)
                out.write(ids)
                lengths.append(doc_lengths)
                step = min(sum(len(text.encode("utf-8")) for text in texts), left)
                bar.update(step)
                left -= step
            bar.update(left)
    doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    doc_lengths = doc_lengths[doc_lengths > 0]
    if not len(doc_lengths):
        raise ValueError(f"{path} holds no text: its {len(files)} .txt/.jsonl file(s) have no "
                         "non-blank document")
    offsets = np.concatenate([[0], np.cumsum(doc_lengths)]).astype(np.int64)
    np.save(directory / "offsets.npy", offsets)
    return {"num_documents": len(doc_lengths), "num_tokens": int(offsets[-1])}


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    """Documents grouped for batch encoding (the fast tokenizers encode a batch in
    parallel), bounded in count and bytes to bound memory."""
    batch: list[str] = []
    size = 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if len(batch) >= ENCODE_BATCH_DOCS or size >= ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


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


class _TokenFile:
    """int32 tokens streamed into a .npy file without holding them in memory.

    The header goes in last, when the count is known: numpy pads a .npy header so that its
    length does not depend on the array's length, so a header for zero tokens reserves
    exactly the space of the final one."""

    def __init__(self, path: Path):
        self._handle = open(path, "wb")
        self._header_size = len(self._header(0))
        self._handle.write(b"\0" * self._header_size)
        self._count = 0

    @staticmethod
    def _header(count: int) -> bytes:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.int32)),
                     "fortran_order": False, "shape": (count,)})
        return buffer.getvalue()

    def write(self, ids: np.ndarray) -> None:
        self._handle.write(np.ascontiguousarray(ids, dtype="<i4").tobytes())
        self._count += len(ids)

    def __enter__(self) -> _TokenFile:
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            header = self._header(self._count)
            if len(header) != self._header_size:
                raise RuntimeError("the .npy header changed size; cannot stream tokens")
            self._handle.seek(0)
            self._handle.write(header)
        finally:
            self._handle.close()
