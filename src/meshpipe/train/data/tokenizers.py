"""Tokenizers for ``--data``: byte-level (vocabulary 256, no files) or a Hugging Face
tokenizer directory (``AutoTokenizer``, offline), behind the small ``Tokenizer`` protocol the
token cache and the samplers use. A tokenizer's ``name`` fingerprints its files (and a
``--chat-template`` file), so a cache entry is keyed by the exact tokenizer that wrote it.

Chat rows are rendered with the tokenizer's chat template (``render_chat``) and encoded with
each token's character span (``encode_with_offsets``), which is how ``samples`` finds the
assistant's tokens under any template. Byte-level has no chat template.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

from meshpipe.train.data.corpus import VOCAB_SIZE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Where a processor (a vision-language model's) saves a chat template of its own.
PROCESSOR_TEMPLATE = "chat_template.json"
# Files of a model directory that never change what its tokenizer produces; hashing them
# (gigabytes of weights) would make every start slow.
# Chat renders checked against transformers' own before the template is rendered directly.
CHECKED_RENDERS = 64
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack",
                   ".onnx")


class Tokenizer(Protocol):
    """What the trainer needs of a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int | None
    pad_id: int

    def encode_batch(self, texts: list[str], *, special_tokens: bool = True,
                     eos: bool = True) -> list[list[int]]: ...

    def encode_with_offsets(self, texts: list[str]
                            ) -> list[tuple[list[int], list[tuple[int, int]]]]: ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes: the ids of ``meshpipe.train.data.corpus.encode``, no end-of-document token."""

    name = "bytes"
    vocab_size = VOCAB_SIZE
    eos_id = None
    pad_id = 0

    def encode_batch(self, texts: list[str], *, special_tokens: bool = True,
                     eos: bool = True) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        raise ValueError("chat rows (messages) are rendered with a tokenizer's chat template, "
                         "and the byte-level tokenizer has none: give --tokenizer DIR (or a "
                         "--model directory with a tokenizer)")


class HFTokenizer:
    """A tokenizer directory that ``transformers.AutoTokenizer`` loads offline.

    Each document is encoded with the tokenizer's own special tokens (a Llama-style BOS
    included) and ends with EOS, so a model trained on packed documents learns where one
    ends.
    """

    def __init__(self, path: str | Path, chat_template: str | Path = ""):
        import transformers

        directory = Path(path).resolve()
        self._tokenizer = load_offline(transformers.AutoTokenizer, directory, "tokenizer")
        self.name = f"hf:{directory}:{_fingerprint(directory)}"
        processor_template = directory / PROCESSOR_TEMPLATE
        if not chat_template and not self._tokenizer.chat_template and \
                processor_template.is_file():
            # A vision-language model's processor may keep the template for both.
            self._tokenizer.chat_template = json.loads(
                processor_template.read_text(encoding="utf-8")).get("chat_template")
        if chat_template:
            text = _read_template(chat_template)
            self._tokenizer.chat_template = text
            self.name += f":template:{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        self.vocab_size = len(self._tokenizer)
        self.eos_id = self._tokenizer.eos_token_id
        self.pad_id = next((i for i in (self._tokenizer.pad_token_id, self.eos_id)
                            if i is not None), 0)
        self._checked_renders = 0
        self._direct = self._direct_renderer() if self.has_chat_template else None

    def encode_batch(self, texts: list[str], *, special_tokens: bool = True,
                     eos: bool = True) -> list[list[int]]:
        encoded = self._tokenizer(texts, add_special_tokens=special_tokens,
                                  return_attention_mask=False, return_token_type_ids=False,
                                  verbose=False)["input_ids"]
        if self.eos_id is None or not eos:
            return encoded
        return [ids if ids and ids[-1] == self.eos_id else ids + [self.eos_id]
                for ids in encoded]

    def encode_with_offsets(self, texts: list[str]
                            ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's ids (no special tokens added: a chat template writes its own) and,
        per token, the characters it covers (start, end); from the Rust tokenizer itself,
        whose ids transformers' call returns unchanged (its conversion of the offsets cost
        a tenth of chat data's tokenizing time)."""
        if not self._tokenizer.is_fast:
            raise ValueError(f"the tokenizer {self.name} has no fast (Rust) version, which "
                             "finding the assistant's tokens needs: save it with a "
                             "tokenizer.json")
        encodings = self._tokenizer.backend_tokenizer.encode_batch(texts,
                                                                   add_special_tokens=False)
        return [(encoding.ids, encoding.offsets) for encoding in encodings]

    def token_texts(self, ids: list[int]) -> list[str]:
        """The tokens ``ids`` as the tokenizer writes them (special tokens included)."""
        return self._tokenizer.convert_ids_to_tokens(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the chat template writes it: through transformers'
        ``apply_chat_template``, and once ``CHECKED_RENDERS`` renders agreed, through the
        compiled template directly (3-4x faster: the rendering is most of the time chat
        data takes to tokenize)."""
        if self._checked_renders >= CHECKED_RENDERS:
            return self._direct(messages, add_generation_prompt)
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer in {self.name.split(':')[1]} has no chat template "
                             "to render messages rows with: give one with --chat-template "
                             "FILE (a Jinja template)")
        exact = self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
        self._check_direct(messages, add_generation_prompt, exact)
        return exact

    def _check_direct(self, messages: list[dict], add_generation_prompt: bool,
                      exact: str) -> None:
        """Count a direct render that equals ``exact``; one that differs (or fails) keeps
        every later render on ``apply_chat_template``."""
        if self._direct is None:
            return
        try:
            agrees = self._direct(messages, add_generation_prompt) == exact
        except Exception:  # noqa: BLE001 - any failure means: do not render directly
            agrees = False
        if agrees:
            self._checked_renders += 1
        else:
            self._direct = None

    def _direct_renderer(self):
        """The chat template compiled by transformers, rendered with the tokenizer's special
        tokens (None where this transformers has no such compiler)."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self._tokenizer.chat_template)
        except Exception:  # noqa: BLE001 - an older or newer transformers: stay exact
            return None
        variables = dict(self._tokenizer.special_tokens_map)
        return lambda messages, add_generation_prompt: compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def load_offline(auto_class, directory: Path, what: str):
    """``auto_class.from_pretrained(directory)`` without the network; a one-line ValueError
    naming ``what`` when it cannot."""
    try:
        return auto_class.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises many types; the CLI wants one line
        raise ValueError(f"cannot load the {what} in {directory}: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _fingerprint(directory: Path) -> str:
    """sha256 over the names and contents of the directory's files other than weights: a
    tokenizer edited in place gets a new cache key."""
    digest = hashlib.sha256()
    for file in sorted(p for p in directory.iterdir()
                       if p.is_file() and p.suffix.lower() not in WEIGHT_SUFFIXES):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _read_template(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--chat-template {path} does not exist: give a Jinja chat template "
                         "file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read --chat-template {path}: {err}") from None


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds a saved tokenizer."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def resolve_tokenizer(model_dir: str, tokenizer_dir: str, chat_template: str = "") -> Tokenizer:
    """``--tokenizer`` when given, else the ``--model``'s own tokenizer, else byte-level
    (with ``--chat-template`` as the chat template of a Hugging Face one)."""
    if tokenizer_dir:
        if not Path(tokenizer_dir).exists():
            raise ValueError(f"--tokenizer {tokenizer_dir} does not exist: give a directory "
                             "written by a transformers tokenizer's save_pretrained")
        if not has_tokenizer(tokenizer_dir):
            raise ValueError(f"--tokenizer {tokenizer_dir} holds no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}): give a directory written by a "
                             "transformers tokenizer's save_pretrained")
        return HFTokenizer(tokenizer_dir, chat_template)
    if model_dir and has_tokenizer(model_dir):
        return HFTokenizer(model_dir, chat_template)
    if chat_template:
        raise ValueError("--chat-template renders chat rows for a tokenizer, and the byte-level "
                         "one cannot encode a template's special tokens: give --tokenizer DIR")
    return ByteTokenizer()


