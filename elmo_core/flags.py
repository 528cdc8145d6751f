"""A stage's options as command-line flags: one per field of its options model (``elmo_core.options``), the field's
description as help, and the values merged in one order (field defaults < ``--config FILE`` < flags). Apart from the
``elmo`` command (``cli``) because the rules of the mapping are one concern, and the commands' table another."""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from elmo_core.config import load_config_file
from elmo_core.errors import ConfigError
from elmo_core.options import Options, describe_validation_error


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``; (annotation, False) otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _scalar(kind: Any, nullable: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if nullable and text.lower() in ("none", "null"):
            return None
        return kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its errors
    return parse


def _structured(text: str) -> Any:
    """A nested model's value: inline JSON, or a YAML/JSON file."""
    return json.loads(text) if text.lstrip().startswith("{") else load_config_file(text)


_structured.__name__ = "JSON or file"


def add_fields(parser: argparse.ArgumentParser, model: type[BaseModel], positional: tuple[str, ...] = ()) -> None:
    """One argument per field of ``model``; values not given stay out of the namespace (the model's defaults hold)."""
    for name, field in model.model_fields.items():
        kind, nullable = _unwrap_optional(field.annotation)
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = str  # e.g. int | "auto": the text as given, validated by the model
        default = field.default if field.default is not PydanticUndefined else None
        help_text = field.description or ""
        if field.is_required():
            help_text += " (required)"
        elif default is not None and kind is not bool:
            help_text += f" (default: {default})"
        options: dict[str, Any] = {"help": help_text, "default": argparse.SUPPRESS}
        origin = typing.get_origin(kind)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
            options["help"] = help_text + (f" (default: {'on' if default else 'off'})" if default is not None else "")
        elif origin is Literal:
            options["choices"] = [str(v) for v in typing.get_args(kind)]
        elif origin is list:
            (item,) = typing.get_args(kind)
            if typing.get_origin(item) in (typing.Union, types.UnionType) and str in typing.get_args(item):
                item = str  # e.g. sources: str | Source; on the command line, strings
            options.update(nargs="+", type=_scalar(item, False), metavar=_METAVARS.get(item, "VALUE"))
        elif isinstance(kind, type) and issubclass(kind, BaseModel):
            options.update(type=_structured, metavar="JSON|FILE")
        else:
            options.update(type=_scalar(kind, nullable), metavar=_METAVARS.get(kind, "VALUE"))
        options["help"] = options["help"].replace("%", "%%")  # argparse formats help with %: "2%" must read "2%%"
        if name in positional:
            if field.is_required():
                options.pop("default")
            else:  # an optional positional (``elmo info [MODEL]``): absent, the model's default holds
                options["nargs"] = "?"
            parser.add_argument(name, **options)
        else:
            flags = [_flag(name), "-" + name] if len(name) == 1 else [_flag(name)]  # -k as well as --k
            parser.add_argument(*flags, dest=name, **options)


def parse_config(model: type[Options], args: argparse.Namespace) -> Options:
    """The command's options: field defaults < ``--config`` file < flags, validated in one go. An error names
    the flag it came from, or the config file and the key as written there (``bad.json: batch_size: …``)."""
    config_file = getattr(args, "config", None)
    from_file: dict[str, Any] = load_config_file(config_file) if config_file else {}
    from_flags = {name: value for name, value in vars(args).items() if name in model.model_fields}

    def name(where: str) -> str:
        top = where.split(".")[0]
        if top in from_flags:
            return _flag(top) + where[len(top) :]
        if top in from_file:
            return f"{config_file}: {where}"
        return _flag(where) if where in model.model_fields else (where or "options")

    try:
        return model.model_validate({**from_file, **from_flags})
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, name)) from None
