"""TrainConfig as a TOML file: ``meshpipe train --config run.toml``.

The file's keys are TrainConfig's field names (``seq_len`` or ``seq-len``), at the top level
or all under one ``[train]`` table. ``read_toml`` checks names and types and returns the
values; ``train.arguments.from_arguments`` lays the flags given on the command line over them.
``to_toml`` writes a config back, so a tuned run can be saved and replayed.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from pathlib import Path
from typing import Any

from meshpipe.train.config import TrainConfig, as_list_value, field_kind

TABLE = "train"
_EXPECTED = {"bool": "a boolean (true or false)", "int": "an integer", "float": "a number",
             "str": "a string", "list": "an array of strings (or one string)"}
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
               list: "an array", dict: "a table"}
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}


class TomlConfigError(ValueError):
    """A --config file that cannot be read, is not TOML, or does not describe a TrainConfig."""


def _field_types() -> dict[str, str]:
    """Each TrainConfig field's type name ('int', 'float', 'str' or 'bool'), in field order."""
    return {field.name: field_kind(field.name) for field in dataclasses.fields(TrainConfig)}


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TrainConfig field values a TOML file gives, keyed by field name.

    Only the keys in the file: the caller lays command-line flags over them and the
    dataclass defaults fill the rest, so the values are checked for name and type here and
    validated together by TrainConfig."""
    return _field_values(_table(_parse(path), path), path)


def load_toml(path: str | Path) -> TrainConfig:
    """The TrainConfig a TOML file describes (its fields over the defaults)."""
    return TrainConfig(**read_toml(path))


def to_toml(config: TrainConfig, *, only_changed: bool = True) -> str:
    """``config`` as TOML that ``read_toml`` reads back to an equal config: the fields that
    differ from their defaults (all of them with ``only_changed=False``), in field order."""
    what = "the fields that differ from the defaults" if only_changed else "every field"
    lines = [f"# meshpipe train --config FILE: TrainConfig, {what}"]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not only_changed or value != config.default_of(field.name):
            lines.append(f"{field.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _parse(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TomlConfigError(f"{path}: no such file; give --config the path of a TOML file "
                              "of TrainConfig fields") from None
    except UnicodeDecodeError:
        raise TomlConfigError(f"{path}: not UTF-8 text; a TOML file must be UTF-8") from None
    except OSError as error:
        raise TomlConfigError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        # The message ends with "(at line L, column C)".
        raise TomlConfigError(f"{path}: not valid TOML: {error}") from None


def _table(document: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The keys that configure training: the document's, or those of its [train] table."""
    if not isinstance(document.get(TABLE), dict):
        return document
    if len(document) > 1:
        others = ", ".join(repr(key) for key in document if key != TABLE)
        raise TomlConfigError(f"{path}: has both a [{TABLE}] table and top-level keys "
                              f"({others}); put every key in one of them")
    return document[TABLE]


def _field_values(table: dict[str, Any], path: str | Path) -> dict[str, Any]:
    types = _field_types()
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in types:
            raise TomlConfigError(f"{path}: {_unknown(key, types)}")
        if name in spelled:
            raise TomlConfigError(f"{path}: both '{spelled[name]}' and '{key}' set {name}; "
                                  "keep one")
        spelled[name] = key
        values[name] = _checked(key, value, types[name], path)
    return values


def _unknown(key: str, types: dict[str, str]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), types, n=1)
    if close:
        return f"unknown key '{key}' (did you mean '{close[0]}'?)"
    return (f"unknown key '{key}'; use a TrainConfig field name (a `meshpipe train --help` "
            "flag without its leading --)")


def _checked(key: str, value: Any, kind: str, path: str | Path) -> Any:
    """``value`` if it has the field's type; an int for a float field becomes a float.

    bool is a subclass of int in Python, so ``steps = true`` is refused explicitly."""
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == "list" and (isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(item, str) for item in value))):
        return as_list_value(value)
    if type(value) is {"bool": bool, "int": int, "float": float, "str": str}.get(kind):
        return value
    raise TomlConfigError(f"{path}: key '{key}' must be {_EXPECTED[kind]}, got "
                          f"{_shown(value)} ({_type_name(value)})")


def _shown(value: Any) -> str:
    return _toml_value(value) if type(value) in (bool, int, float, str) else repr(value)


def _type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), f"a {type(value).__name__}")


def _toml_value(value: bool | int | float | str | tuple[str, ...]) -> str:
    """A TOML literal. Python's repr of a float (0.0003, 1e-10, inf, nan) is valid TOML."""
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_string(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return _toml_string(value)


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    return '"' + "".join(_escaped(character) for character in text) + '"'


def _escaped(character: str) -> str:
    if character in _ESCAPES:
        return _ESCAPES[character]
    if ord(character) < 0x20 or ord(character) == 0x7F:
        return f"\\u{ord(character):04x}"
    return character
