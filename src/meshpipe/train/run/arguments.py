"""A TrainConfig from the command line: one ``--flag`` per field (its default and its help
from ``config.FIELD_HELP``), laid over the fields of a ``--config`` TOML file, over the
defaults."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from meshpipe.train.config import FIELD_HELP, TrainConfig, default_help, field_kind, flag_name
from meshpipe.train.run.toml_config import read_toml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config PATH`` and one ``--flag`` per TrainConfig field.

    The field flags default to ``argparse.SUPPRESS``: the parsed namespace holds only the
    flags given on the command line, so ``from_arguments`` knows which override the
    ``--config`` file (``--steps 30`` does even though 30 is the default)."""
    parser.add_argument("--config", metavar="PATH",
                        help="a TOML file of these fields (seq_len = 128 or seq-len = 128, at "
                        "the top level or under [train]); flags given here override it")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + flag_name(field.name)
        help_text = f"{FIELD_HELP[field.name]} (default: {default_help(field.name)})"
        kind = field_kind(field.name)
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif kind == "list":
            parser.add_argument(flag, action="append", default=argparse.SUPPRESS,
                                metavar=field.name.upper(), help=help_text)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[kind], default=argparse.SUPPRESS,
                                metavar=field.name.upper(), help=help_text)


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of ``args``: its fields, over those of its ``config`` TOML file (if
    any), over the defaults. A namespace built by hand may name every field or only some."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None) is not None:
        values = read_toml(args.config)
    for field in dataclasses.fields(TrainConfig):
        if hasattr(args, field.name):
            values[field.name] = getattr(args, field.name)
    return TrainConfig(**values)
