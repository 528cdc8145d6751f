"""Word-vocabulary files in bilm-tf's ``vocab.txt`` format: UTF-8, one token per line, id = line number."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from elmo_core.chars import BOS_TOKEN, EOS_TOKEN, UNK_TOKEN
from elmo_core.errors import ConfigError

MAX_TERM_ID = "!!!MAXTERMID"  # bilm-tf skips this marker line


def read_vocab_file(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: vocabulary file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 at byte {exc.start}") from None
    return [line for line in text.split("\n") if line and line != MAX_TERM_ID]


def write_vocab_file(tokens: Iterable[str], path: str | Path) -> None:
    """Write atomically (temp file, then rename), so a reader never sees half a vocabulary."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for token in tokens:
            if "\n" in token:
                raise ConfigError(f"token {token!r} contains a newline and cannot be written to {path}")
            f.write(token + "\n")
    os.replace(tmp, path)


def check_training_vocab(tokens: list[str], source: str) -> None:
    """bilm-tf training needs ``<S>``, ``</S>``, ``<UNK>`` first (the sampler assumes id order = frequency)."""
    if tokens[:3] != [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]:
        raise ConfigError(f"{source}: a training vocabulary must start with <S>, </S>, <UNK>; found {tokens[:3]}")
