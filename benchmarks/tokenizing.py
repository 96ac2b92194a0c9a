"""Tokenizing --data into the token cache: throughput and peak resident memory per input kind.

    .venv/bin/python benchmarks/tokenizing.py                  # 1 GiB per kind, ~15 min on 2 cores
    .venv/bin/python benchmarks/tokenizing.py --size-mb 64     # a quick look

Generates, under --work (default: a temporary directory), the same kind of English-like text
in three inputs of --size-mb each: ``text.jsonl`` (one {"text"} per row, the text reader's
input), ``chat.jsonl`` (conversations of one to three user/assistant turns, some with a
system turn, rendered with a ChatML template, the loss on the answers) and
``text.parquet`` (the text rows in row groups of 8192) and ``saved/`` (the same rows as an
Arrow stream, the shard format of ``save_to_disk`` folders). A byte-level BPE tokenizer of 8k
tokens is trained on the first 16 MB of the text. Each input is then tokenized by
``meshpipe.train.data.cache.tokenize_dataset`` in a child process of its own, which reports
its wall time, its CPU time (both cores busy: CPU / wall near 2) and its peak resident
memory (``ru_maxrss``). Results go to benchmarks/results/tokenizing.json and tokenizing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYLLABLES = ("ka ri to na me lo su pe an in on er es ti ra de ma co la ne se ta po mi ve "
             "re li no ca mo da sa pa le ro di ga fu").split()
VOCAB_SIZE = 8000
ROW_GROUP = 8192
CHILD = """
import json, resource, sys, time
sys.path.insert(0, {src!r})
from meshpipe.train.data.cache import ReadOptions, tokenize_dataset
from meshpipe.train.data.tokenizers import HFTokenizer
tokenizer = HFTokenizer({tokenizer!r})
start, cpu = time.perf_counter(), time.process_time()
data = tokenize_dataset({path!r}, tokenizer, {cache!r}, progress=False)
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"wall_s": wall, "cpu_s": cpu,
                   "peak_rss_mb": usage.ru_maxrss / 1024, "tokens": data.num_tokens,
                   "documents": data.num_documents,
                   "trained_fraction": None if data.mask is None else float(data.mask.mean())}}))
"""


class Words:
    """English-like words: 1 to 4 syllables, Zipf-distributed so that BPE finds structure."""

    def __init__(self, rng: np.random.Generator, size: int = 20000):
        self.lexicon = np.array(["".join(rng.choice(SYLLABLES, rng.integers(1, 5)))
                                 for _ in range(size)])

    def sentences(self, rng: np.random.Generator, count: int) -> list[str]:
        ranks = np.minimum(rng.zipf(1.2, count * 20), len(self.lexicon)) - 1
        drawn = self.lexicon[ranks].tolist()
        lengths = rng.integers(4, 20, count)
        out, at = [], 0
        for length in lengths.tolist():
            sentence = " ".join(drawn[at:at + length])
            out.append(sentence[:1].upper() + sentence[1:] + ".")
            at += length
        return out


def generate(path: Path, size_mb: int, row, seed: int) -> None:
    """Rows of ``row(rng, sentences)`` as jsonl until ``size_mb`` MB are written."""
    rng = np.random.default_rng(seed)
    words = Words(np.random.default_rng(1234))
    limit = size_mb << 20
    with open(path, "w", encoding="utf-8") as out:
        written = 0
        while written < limit:
            pool = words.sentences(rng, 40000)
            block = "".join(json.dumps(row(rng, pool[start:start + 40])) + "\n"
                            for start in range(0, len(pool) - 40, 40))
            out.write(block)
            written += len(block.encode("utf-8"))


def text_row(rng: np.random.Generator, pool: list[str]) -> dict:
    return {"text": " ".join(pool[:int(rng.integers(5, 40))])}


def chat_row(rng: np.random.Generator, pool: list[str]) -> dict:
    turns = [{"role": "system", "content": pool[0]}] if rng.random() < 0.3 else []
    at = 1
    for _ in range(int(rng.integers(1, 4))):
        asked, answered = int(rng.integers(1, 4)), int(rng.integers(2, 10))
        turns.append({"role": "user", "content": " ".join(pool[at:at + asked])})
        turns.append({"role": "assistant", "content": " ".join(pool[at + asked:
                                                                     at + asked + answered])})
        at += asked + answered
    return {"messages": turns}


def to_parquet(jsonl: Path, parquet_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as parquet

    writer = None
    with open(jsonl, encoding="utf-8") as rows:
        batch = []
        for line in rows:
            batch.append(json.loads(line))
            if len(batch) == ROW_GROUP:
                table = pa.Table.from_pylist(batch)
                writer = writer or parquet.ParquetWriter(parquet_path, table.schema)
                writer.write_table(table)
                batch = []
        if batch:
            table = pa.Table.from_pylist(batch)
            writer = writer or parquet.ParquetWriter(parquet_path, table.schema)
            writer.write_table(table)
    writer.close()


def to_arrow_folder(parquet_path: Path, folder: Path) -> None:
    """The Parquet rows as an Arrow IPC stream in a folder, the format of the shards that
    ``datasets.Dataset.save_to_disk`` writes."""
    import pyarrow as pa
    import pyarrow.parquet as parquet

    folder.mkdir(parents=True)
    rows = parquet.ParquetFile(parquet_path, pre_buffer=False)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        writer = pa.ipc.new_stream(sink, rows.schema_arrow)
        for batch in rows.iter_batches(batch_size=1000):
            writer.write_batch(batch)
        writer.close()


def train_tokenizer(jsonl: Path, directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def sample():
        seen = 0
        with open(jsonl, encoding="utf-8") as rows:
            for line in rows:
                seen += len(line)
                if seen > 16 << 20:
                    return
                yield json.loads(line)["text"]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tokenizer.train_from_iterator(sample(), trainer=trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    saved = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                    additional_special_tokens=specials[2:])
    saved.chat_template = CHATML
    saved.save_pretrained(str(directory))
    return directory


def measure(path: Path, tokenizer: Path, cache: Path) -> dict:
    child = CHILD.format(src=str(ROOT / "src"), tokenizer=str(tokenizer), path=str(path),
                         cache=str(cache))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    size_mb = sum(file.stat().st_size for file in
                  ([path] if path.is_file() else path.iterdir())) / 1e6
    result.update(input=path.name, size_mb=round(size_mb, 1),
                  mb_per_s=round(size_mb / result["wall_s"], 2),
                  cores_busy=round(result["cpu_s"] / result["wall_s"], 2))
    return result


def markdown(rows: list[dict], machine: str) -> str:
    lines = [f"Tokenizing into the cache on {machine}, an 8k byte-level BPE tokenizer. The "
             "Parquet file (compressed) and the Arrow folder hold the rows of text.jsonl: "
             "compare inputs by tokens/s.", "",
             "| input | file (MB) | seconds | file MB/s | tokens/s | vs text.jsonl | cores busy "
             "| peak RSS (MB) | tokens | trained tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = rows[0]["tokens"] / rows[0]["wall_s"]
    for row in rows:
        rate = row["tokens"] / row["wall_s"]
        trained = ("all" if row["trained_fraction"] is None
                   else f"{row['trained_fraction']:.0%}")
        lines.append(f"| {row['input']} | {row['size_mb']:,.0f} | {row['wall_s']:.0f} | "
                     f"{row['mb_per_s']:.2f} | {rate:,.0f} | {rate / base:.2f}x | "
                     f"{row['cores_busy']:.2f} | {row['peak_rss_mb']:,.0f} | "
                     f"{row['tokens']:,} | {trained} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--work", default="")
    parser.add_argument("--no-save", action="store_true", help="print, do not write results")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="meshpipe-tokenize-"))
    work.mkdir(parents=True, exist_ok=True)
    inputs = {"text.jsonl": text_row, "chat.jsonl": chat_row}
    for index, (name, row) in enumerate(inputs.items()):
        if not (work / name).exists():
            generate(work / name, args.size_mb, row, seed=index)
    if not (work / "text.parquet").exists():
        to_parquet(work / "text.jsonl", work / "text.parquet")
    if not (work / "saved").exists():
        to_arrow_folder(work / "text.parquet", work / "saved")
    tokenizer = work / "tokenizer"
    if not tokenizer.exists():
        train_tokenizer(work / "text.jsonl", tokenizer)
    rows = []
    for name in ("text.jsonl", "chat.jsonl", "text.parquet", "saved"):
        start = time.perf_counter()
        rows.append(measure(work / name, tokenizer, work / f"cache-{time.time_ns()}"))
        print(f"{name}: {rows[-1]} ({time.perf_counter() - start:.0f} s)", flush=True)
    machine = f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}"
    table = markdown(rows, machine)
    print(table)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "tokenizing.json").write_text(json.dumps(
            {"machine": machine, "size_mb": args.size_mb, "rows": rows}, indent=1) + "\n")
        (RESULTS / "tokenizing.md").write_text(table)


if __name__ == "__main__":
    main()
