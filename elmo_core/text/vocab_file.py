"""bilm-tf's ``vocab.txt``: one token a line, most frequent first; a file of its own so that loading a model
(``weights.py``) needs neither DuckDB nor pyarrow."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from elmo_core.errors import ConfigError, InputError
from elmo_core.fileio import atomic_write
from elmo_core.text.chars import SPECIAL_TOKENS

MAX_TERM_ID = "!!!MAXTERMID"  # bilm-tf skips this marker line


def read_vocab_file(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: vocabulary file not found") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 at byte {exc.start}") from None
    return [line for line in text.split("\n") if line and line != MAX_TERM_ID]


def write_vocab_file(tokens: Iterable[str], path: str | Path) -> None:
    """Write atomically (temp file, then rename), so a reader never sees half a vocabulary."""
    with atomic_write(path) as f:
        for token in tokens:
            if "\n" in token:
                raise InputError(f"token {token!r} contains a newline and cannot be written to {path}")
            f.write(token + "\n")


def check_training_vocab(tokens: list[str], source: str) -> None:
    """bilm-tf training needs ``<S>``, ``</S>``, ``<UNK>`` first (the sampler assumes id order = frequency)."""
    if tuple(tokens[:3]) != SPECIAL_TOKENS:
        raise ConfigError(f"{source}: a training vocabulary must start with <S>, </S>, <UNK>; found {tokens[:3]}")
