"""Reading ``--data``: the files of a path and, file by file, their rows in batches.

A path is a ``.txt`` file (documents separated by blank lines), a ``.jsonl`` file (one JSON
object per line), a ``.parquet`` file, an ``.arrow`` file of a folder written by
``datasets.Dataset.save_to_disk``, or a folder of them (read in sorted order). A row is a
string (a .txt document) or a dict of the columns a row may use (``ROW_COLUMNS`` and
``--text-field``): what the row means is ``samples``' business.

Nothing reads a whole file into memory: .txt and .jsonl are read line by line, Parquet in
row batches of the needed columns, Arrow record batches one at a time. Every batch says
how far into its file it reached (bytes), for the progress bar. Every mistake is a one-line
``ValueError`` naming the file and the line (text files, from 1) or row (Parquet and Arrow,
from 0, as ``dataset[i]`` counts).
"""

from __future__ import annotations

import codecs
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = (".txt", ".jsonl")
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = TEXT_SUFFIXES + COLUMNAR_SUFFIXES
# The columns a row may use besides the text field: a conversation, or a prompt and its
# completion; and the images a caption or a conversation shows.
ROW_COLUMNS = ("messages", "prompt", "completion", "images")
BATCH_ROWS = 1024
# Rows a Parquet batch holds when they have images (their encoded bytes come along).
IMAGE_BATCH_ROWS = 64
BATCH_BYTES = 1 << 20
KINDS_OF_FILES = ".txt, .jsonl, .parquet or .arrow (datasets' save_to_disk)"


@dataclass(frozen=True)
class RowBatch:
    """Rows of one file: each row's number (line or row, see ``where``) and value, and the
    bytes of the file read up to the end of the batch."""

    numbers: list[int]
    values: list[Any]
    bytes_done: int


def where(file: Path, number: int) -> str:
    """How an error names a row: ``line N`` of a text file, ``row N`` of a columnar one."""
    kind = "row" if Path(file).suffix.lower() in COLUMNAR_SUFFIXES else "line"
    return f"{file} {kind} {number}"


def data_files(path: str, flag: str = "--data") -> list[Path]:
    """The files of ``path``: the file itself, or every readable file under a folder."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"{flag} {path} does not exist: give a {KINDS_OF_FILES} file or a "
                         "folder of them")
    if root.is_dir():
        files = sorted(p for p in root.rglob("*")
                       if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise ValueError(f"{flag} {path} is a folder with no {KINDS_OF_FILES} file in it")
        return files
    if root.suffix.lower() not in SUFFIXES:
        raise ValueError(f"{flag} {path} is not a {KINDS_OF_FILES} file: give documents as "
                         ".txt (separated by blank lines), rows as .jsonl or .parquet, or a "
                         "folder written by datasets' save_to_disk")
    return [root]


def read_rows(file: Path, text_field: str = "text") -> Iterator[RowBatch]:
    """The rows of one file in batches, in order."""
    file = Path(file)
    suffix = file.suffix.lower()
    if suffix == ".txt":
        reader = _txt_rows(file)
    elif suffix == ".jsonl":
        reader = _jsonl_rows(file)
    else:
        reader = _columnar_rows(file, text_field)
    try:
        yield from reader
    except UnicodeDecodeError:
        raise ValueError(_not_utf8(file)) from None


class _Batcher:
    """Rows collected into ``RowBatch``es bounded in count and bytes."""

    def __init__(self):
        self.numbers: list[int] = []
        self.values: list[Any] = []
        self.size = 0

    def add(self, number: int, value: Any, size: int) -> bool:
        """Add a row; whether the batch is full."""
        self.numbers.append(number)
        self.values.append(value)
        self.size += size
        return len(self.numbers) >= BATCH_ROWS or self.size >= BATCH_BYTES

    def take(self, bytes_done: int) -> RowBatch:
        batch = RowBatch(self.numbers, self.values, bytes_done)
        self.numbers, self.values, self.size = [], [], 0
        return batch


def _lines(file: Path) -> Iterator[tuple[int, str, int]]:
    """Each line of a UTF-8 file (a byte-order mark dropped): its number, its text and the
    bytes read up to its end."""
    done = 0
    with open(file, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            done += len(raw)
            line = raw.decode("utf-8")
            yield number, line.removeprefix("\ufeff") if number == 1 else line, done


def _txt_rows(file: Path) -> Iterator[RowBatch]:
    """Runs of non-blank lines (a line of only whitespace counts as blank), numbered by
    their first line."""
    batcher = _Batcher()
    lines: list[str] = []
    first = done = 0
    for number, line, done in _lines(file):
        if line.strip():
            first = first if lines else number
            lines.append(line)
            continue
        if lines:
            text = "".join(lines).strip()
            lines = []
            if batcher.add(first, text, len(text)):
                yield batcher.take(done)
    if lines:
        text = "".join(lines).strip()
        batcher.add(first, text, len(text))
    yield batcher.take(done)


def _jsonl_rows(file: Path) -> Iterator[RowBatch]:
    """Each non-empty line as an object."""
    batcher = _Batcher()
    done = 0
    for number, line, done in _lines(file):
        if line.strip() and batcher.add(number, _json_row(file, number, line), len(line)):
            yield batcher.take(done)
    yield batcher.take(done)


def _json_row(file: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} line {number} is not valid JSON ({err.msg}, column "
                         f"{err.colno}): write one JSON object per line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{file} line {number} is a JSON {type(record).__name__}, not an "
                         "object: write each line as {\"text\": \"...\"} or "
                         "{\"messages\": [...]}")
    return record


def _columnar_rows(file: Path, text_field: str) -> Iterator[RowBatch]:
    """Record batches of the columns a row may use, as dicts (Parquet and Arrow)."""
    if importlib.util.find_spec("pyarrow") is None:
        raise ValueError(f"{file}: reading {file.suffix} files needs pyarrow: pip install "
                         "'meshpipe[data]'")
    batches, total_bytes = (_parquet_batches(file, text_field) if file.suffix.lower() ==
                            ".parquet" else _arrow_batches(file, text_field))
    number = 0
    for batch, bytes_done in batches:
        rows = batch.to_pylist()
        yield RowBatch(list(range(number, number + len(rows))), rows, min(bytes_done,
                                                                          total_bytes))
        number += len(rows)


def _columns(file: Path, names: list[str], text_field: str) -> list[str]:
    """The columns of ``names`` a row may use; a one-line error when there are none."""
    wanted = [text_field, *ROW_COLUMNS]
    present = [name for name in wanted if name in names]
    if not set(present) - {"images"}:
        raise ValueError(f"{file} has no column \"{text_field}\" nor \"messages\" (nor "
                         f"\"prompt\" and \"completion\"); its columns are "
                         f"{', '.join(names) or 'none'}: name the text column with "
                         "--text-field NAME")
    return present


def _parquet_batches(file: Path, text_field: str):
    import pyarrow.parquet as parquet

    try:
        # Without pre_buffer=False pyarrow keeps every column chunk it read: a 418 MB file
        # held 400 MB at its end, against 130 MB without.
        handle = parquet.ParquetFile(file, pre_buffer=False)
    except Exception as err:  # pyarrow's ArrowInvalid and friends
        raise ValueError(f"{file} is not a readable Parquet file: {_first_line(err)}") from None
    columns = _columns(file, handle.schema_arrow.names, text_field)
    size = file.stat().st_size
    rows = max(handle.metadata.num_rows, 1)

    def batches():
        done = 0
        rows_a_batch = IMAGE_BATCH_ROWS if "images" in columns else BATCH_ROWS
        for batch in handle.iter_batches(batch_size=rows_a_batch, columns=columns):
            done += batch.num_rows
            yield batch, size * done // rows

    return batches(), size


def _arrow_batches(file: Path, text_field: str):
    """An Arrow IPC stream (what ``save_to_disk`` writes) or file, read batch by batch (not
    memory-mapped: the pages of a map count as resident, 1.1 GB at the end of a 1 GB file,
    against the size of a batch read)."""
    import pyarrow as pa

    source = pa.OSFile(str(file))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as err:
            raise ValueError(f"{file} is not an Arrow stream or file: "
                             f"{_first_line(err)}") from None
        return _arrow_file_batches(file, reader, source, text_field), source.size()
    columns = _columns(file, reader.schema.names, text_field)

    def batches():
        for batch in reader:
            yield batch.select(columns), source.tell()

    return batches(), source.size()


def _arrow_file_batches(file: Path, reader, source, text_field: str):
    columns = _columns(file, reader.schema.names, text_field)
    for index in range(reader.num_record_batches):
        yield reader.get_batch(index).select(columns), source.size() * (index + 1) // max(
            reader.num_record_batches, 1)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _not_utf8(file: Path) -> str:
    offset, reason = _invalid_utf8(file)
    return f"{file} is not UTF-8 at byte offset {offset} ({reason}): convert it to UTF-8"


def _invalid_utf8(file: Path, chunk_size: int = 1 << 20) -> tuple[int, str]:
    """The absolute byte offset of the first invalid UTF-8 sequence in ``file``, and why.

    Decoding line by line does not say where in the file it failed, so the file is scanned
    again, in chunks, with an incremental decoder: its error positions count from the bytes
    it still held back from the previous chunk (a character cut by the chunk edge)."""
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
