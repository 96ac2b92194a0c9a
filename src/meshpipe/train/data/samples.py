"""What a row of ``--data`` means, and its tokens.

- A ``.txt`` document, or a row with the text field (``--text-field``, default ``text``): a
  document, every token a target. A long document is cut into several sequences.
- A row with ``messages`` (``role`` and ``content``; an optional system turn, then user and
  assistant turns alternating, ending with the assistant's): rendered with the tokenizer's
  chat template. With ``--loss-on assistant`` only the assistant's tokens are targets. A
  content is a string or a list of parts (datasets' layout): text parts only are their text;
  a user's may show images.
- A row with ``prompt`` and ``completion``: the prompt (with the tokenizer's special
  tokens) then the completion and EOS; with ``--loss-on assistant`` only the completion's.

Chat and prompt/completion rows are samples (``KIND_SAMPLE``): one that is longer than
``--seq-len`` is cut to it (or refused), never spread over sequences, packed or not.

Finding the assistant's tokens works for any template, also those that do not mark the
generated spans (``{% generation %}``): the conversation is rendered whole and, for each
assistant turn, up to the turn with the generation prompt and through the turn. Both are
prefixes of the whole for every common template, and the text between them is the turn as
the model writes it (its end-of-turn marker included). A template that rewrites earlier
turns (and so breaks the prefixes) is served by finding the turn's content in the text.
A token is an answer's when it covers a character of the answer (so the first, which
often carries the space or newline before it, counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from meshpipe.models.hf_vision import VISION_MODEL_TYPES
from meshpipe.train.data.images import ImageInputs, image_sources
from meshpipe.train.data.records import RowBatch, where
from meshpipe.train.data.tokenizers import Tokenizer

KIND_TEXT = 0
KIND_SAMPLE = 1
ROLES = ("system", "user", "assistant")


@dataclass
class EncodedRows:
    """The non-empty rows of a batch: their numbers, token ids, kinds and target masks
    (None: every token is a target)."""

    numbers: list[int] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    masks: list[np.ndarray | None] = field(default_factory=list)
    images: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)


@dataclass
class PreparedRows:
    """A batch's rows read for their meaning, chats rendered: what is left is tokenizing.
    Each list holds (index in the batch, row number, content): a text, a (prompt,
    completion) pair, a rendered conversation and its assistant spans, or a caption (its
    images' placeholders, then its text); ``images``: the processed images (patches,
    grids) of the rows that show some, by index."""

    texts: list[tuple[int, int, str]] = field(default_factory=list)
    instructions: list[tuple[int, int, tuple[str, str]]] = field(default_factory=list)
    chats: list[tuple[int, int, tuple[str, list[tuple[int, int]]]]] = field(
        default_factory=list)
    captions: list[tuple[int, int, str]] = field(default_factory=list)
    images: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def encode_rows(batch: RowBatch, file: Path, tokenizer: Tokenizer, *, text_field: str = "text",
                loss_on: str = "assistant", images: ImageInputs | None = None) -> EncodedRows:
    """Every row of ``batch`` tokenized (whitespace-only texts are skipped)."""
    return encode_prepared(prepare_rows(batch, file, tokenizer, text_field, images), tokenizer,
                           loss_on, images, file)


def prepare_rows(batch: RowBatch, file: Path, tokenizer: Tokenizer,
                 text_field: str = "text", images: ImageInputs | None = None) -> PreparedRows:
    """Each row's meaning, a one-line error for a bad row, chats rendered and images
    processed (Python work, which ``cache`` runs beside the tokenizing of the batch
    before)."""
    prepared = PreparedRows()
    for index, (number, value) in enumerate(zip(batch.numbers, batch.values)):
        try:
            kind, content = _meaning(value, text_field)
            paths = _row_images(kind, content, value, file, images)
            if kind == "chats":
                content = assistant_spans(tokenizer, _without_paths(content))
            elif kind == "captions":
                content = images.marker * len(paths) + content
            if paths:
                prepared.images[index] = images.process(paths)
        except ValueError as err:
            raise ValueError(f"{where(file, number)}{err}") from None
        if kind != "texts" or content.strip():
            getattr(prepared, kind).append((index, number, content))
    return prepared


def encode_prepared(prepared: PreparedRows, tokenizer: Tokenizer,
                    loss_on: str = "assistant", images: ImageInputs | None = None,
                    file: Path | None = None) -> EncodedRows:
    """The prepared rows tokenized, in their order, with their target masks (each image's
    placeholder repeated for its tokens, which are never targets)."""
    encoded: dict[int, tuple[int, list[int], int, np.ndarray | None]] = {}
    if prepared.texts:
        for (index, number, _), ids in zip(prepared.texts, tokenizer.encode_batch(
                [text for _, _, text in prepared.texts])):
            encoded[index] = (number, ids, KIND_TEXT, None)
    if prepared.captions:
        for (index, number, _), ids in zip(prepared.captions, tokenizer.encode_batch(
                [text for _, _, text in prepared.captions])):
            encoded[index] = (number, ids, KIND_SAMPLE, None)
    for index, number, ids, mask in _instructions(prepared.instructions, tokenizer, loss_on):
        encoded[index] = (number, ids, KIND_SAMPLE, mask)
    for index, number, ids, mask in _chats(prepared.chats, tokenizer, loss_on):
        encoded[index] = (number, ids, KIND_SAMPLE, mask)
    rows = EncodedRows()
    for index in sorted(encoded):
        number, ids, kind, mask = encoded[index]
        shown = prepared.images.get(index)
        if shown is not None:
            try:
                ids, mask = images.expand(ids, mask, shown[1])
            except ValueError as err:
                raise ValueError(f"{where(file, number)}{err}") from None
        rows.numbers.append(number)
        rows.ids.append(ids)
        rows.kinds.append(kind)
        rows.masks.append(mask)
        rows.images.append(shown)
    return rows


def _row_images(kind: str, content: Any, value: Any, file: Path,
                images: ImageInputs | None) -> list[Path | bytes]:
    """The images a row shows (none for a plain text), files or bytes; a one-line error when
    the run's model takes no images. A chat's image part names its image, or takes the next
    of the row's ``images`` (datasets' layout: ``{"type": "image"}`` parts, the images in a
    column of their own)."""
    if kind == "captions":
        entries = _listed_images(value)
    elif kind == "chats":
        entries = _chat_images(content, value)
    else:
        return []
    if entries and images is None:
        raise ValueError(" shows images, which only a vision-language --model reads "
                         f"({', '.join(VISION_MODEL_TYPES)})")
    return image_sources(entries, file)


def _listed_images(value: Any) -> list:
    listed = value.get("images")
    if listed is None:
        return []
    if not isinstance(listed, list):
        raise ValueError(": \"images\" must be a list of images (file paths, or their bytes)")
    return listed


def _chat_images(turns: list[dict], value: Any) -> list:
    """The images of a chat's image parts in order, the row's ``images`` taken in turn by
    the parts that name none."""
    listed = _listed_images(value)
    parts = [part for turn in turns if isinstance(turn["content"], list)
             for part in turn["content"] if part["type"] == "image"]
    unnamed = sum(part.get("image") is None for part in parts)
    if unnamed != len(listed):
        raise ValueError(f": its messages show {unnamed} images that name no file and its "
                         f"\"images\" holds {len(listed)}: each of the row's images is shown "
                         "by one {\"type\": \"image\"} part, in order")
    taken = iter(listed)
    return [next(taken) if part.get("image") is None else part["image"] for part in parts]


def _without_paths(turns: list[dict]) -> list[dict]:
    """The turns as the chat template takes them: an image part without its image."""
    return [turn if isinstance(turn["content"], str) else
            {**turn, "content": [{"type": "image"} if part["type"] == "image" else part
                                 for part in turn["content"]]} for turn in turns]


def _meaning(value: Any, text_field: str) -> tuple[str, Any]:
    """("texts" | "chats" | "instructions" | "captions", the row's content), or a one-line
    error (to follow the row's place)."""
    if isinstance(value, str):
        return "texts", value
    if value.get("messages") is not None:
        return "chats", check_messages(value["messages"])
    if value.get("images") is not None:
        text = value.get(text_field)
        if not isinstance(text, str):
            raise ValueError(f" has \"images\" but no string \"{text_field}\" to caption "
                             "them with")
        return "captions", text
    if value.get("prompt") is not None or value.get("completion") is not None:
        pair = value.get("prompt"), value.get("completion")
        if not all(isinstance(part, str) for part in pair):
            raise ValueError(" needs both \"prompt\" and \"completion\" as strings")
        return "instructions", pair
    text = value.get(text_field)
    if not isinstance(text, str):
        raise ValueError(f" has neither a string \"{text_field}\" field nor \"messages\" (nor "
                         "\"prompt\" and \"completion\"): write "
                         f"{{\"{text_field}\": \"...\"}} or {{\"messages\": [{{\"role\": "
                         "\"user\", \"content\": \"...\"}, ...]}, or name the text field "
                         "with --text-field")
    return "texts", text


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as a list of {role, content}, or a one-line error (to follow the row's
    place): an optional system turn, then user and assistant turns alternating, the
    assistant's last."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(": \"messages\" must be a non-empty list of {\"role\", \"content\"}")
    turns = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        parts = _content_parts(content) if isinstance(content, list) else None
        shows_images = parts is not None and any(part["type"] == "image" for part in parts)
        if role not in ROLES or not (isinstance(content, str) or parts) or (
                shows_images and role != "user"):
            raise ValueError(f": message {index} must have a \"role\" of {', '.join(ROLES)} "
                             "and a string \"content\" or a list of {\"type\": \"text\", "
                             "\"text\"} parts (a user's also {\"type\": \"image\"} parts, "
                             f"with or without an \"image\"); got {_short(message)}")
        if parts is not None:  # a turn of text parts only is its text
            content = parts if shows_images else "".join(part["text"] for part in parts)
        turns.append({"role": role, "content": content})
    first = 1 if turns[0]["role"] == "system" else 0
    for index, turn in enumerate(turns):
        expected = "system" if index < first else ("user", "assistant")[(index - first) % 2]
        if turn["role"] != expected:
            raise ValueError(f": message {index} is a {turn['role']} turn where a {expected} "
                             f"turn belongs: {_ORDER}")
    if turns[-1]["role"] != "assistant":
        raise ValueError(f": the last message is a {turns[-1]['role']} turn with no answer: "
                         f"{_ORDER}")
    return turns


def _content_parts(content: list) -> list[dict] | None:
    """``content``'s text and image parts, keys without a value dropped (datasets gives
    every part of a column the keys of all), or None when it is not a list of them."""
    parts = [{key: item for key, item in part.items() if item is not None}
             for part in content if isinstance(part, dict)]
    valid = len(parts) == len(content) and all(
        (part.get("type") == "text" and isinstance(part.get("text"), str))
        or part.get("type") == "image" for part in parts)
    return parts if valid and parts else None


_ORDER = ("a conversation is an optional system turn, then user and assistant turns "
          "alternating, ending with the assistant's")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _instructions(rows, tokenizer: Tokenizer, loss_on: str):
    """(index, number, ids, mask) of each prompt/completion row."""
    if not rows:
        return []
    prompts = tokenizer.encode_batch([prompt for _, _, (prompt, _) in rows], eos=False)
    completions = tokenizer.encode_batch([completion for _, _, (_, completion) in rows],
                                         special_tokens=False)
    encoded = []
    for (index, number, _), prompt, completion in zip(rows, prompts, completions):
        ids = prompt + completion
        mask = None if loss_on == "all" else np.repeat(
            np.array([0, 1], dtype=np.uint8), [len(prompt), len(completion)])
        encoded.append((index, number, ids, mask))
    return encoded


def _chats(rows, tokenizer: Tokenizer, loss_on: str):
    """(index, number, ids, mask) of each rendered chat row."""
    if not rows:
        return []
    encoded = []
    for (index, number, (_, spans)), (ids, offsets) in zip(
            rows, tokenizer.encode_with_offsets([text for _, _, (text, _) in rows])):
        mask = None if loss_on == "all" else spans_mask(offsets, spans)
        encoded.append((index, number, ids, mask))
    return encoded


def assistant_spans(tokenizer: Tokenizer,
                    turns: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered, and the character span of each assistant turn in it."""
    text = _rendered(tokenizer, turns, False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for index, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = _rendered(tokenizer, turns[:index], True)
        through = (text if index == len(turns) - 1
                   else _rendered(tokenizer, turns[:index + 1], False))
        if (text.startswith(before) and text.startswith(through)
                and cursor <= len(before) < len(through)):
            span = (len(before), len(through))
        else:
            found = text.find(turn["content"], cursor) if turn["content"] else -1
            if found < 0:
                raise ValueError(f": the chat template does not write assistant message {index} "
                                 "as given, so its tokens cannot be told from the prompt's: use "
                                 "--loss-on all, or a template that writes each message's "
                                 "content (--chat-template FILE)")
            span = (found, found + len(turn["content"]))
        spans.append(span)
        cursor = span[1]
    return text, spans


def _rendered(tokenizer: Tokenizer, turns: list[dict[str, str]],
              add_generation_prompt: bool) -> str:
    """``render_chat``, a template's own refusal (``raise_exception``) as a one-line error."""
    try:
        return tokenizer.render_chat(turns, add_generation_prompt=add_generation_prompt)
    except ValueError as err:
        raise ValueError(f": {err}") from None
    except Exception as err:  # noqa: BLE001 - jinja2's TemplateError and what templates raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f": the chat template refuses this conversation ({reason}): fix the "
                         "row, or give a template that takes it with --chat-template FILE"
                         ) from None


def spans_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters (``offsets``: start and end) overlap a span."""
    flat = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    starts, ends = flat[0::2], flat[1::2]
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for begin, end in spans:
        mask |= ((starts < end) & (ends > begin)).astype(np.uint8)
    return mask
