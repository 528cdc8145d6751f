"""ELMoForManyLangs' character and word ids: their dictionaries and the only place their conventions live.

A released model spells tokens with two TSV dictionaries (``symbol<TAB>id`` a line, ``docs/elmo-format.md`` §9):

* ``char.dic``: whole Unicode code points (not UTF-8 bytes) seen in training, and six entries of their own:
  ``<bos>``, ``<eos>``, ``<oov>`` (any character not in it), ``<pad>``, ``<bow>``, ``<eow>``;
* ``word.dic``: ``<oov>``, ``<bos>``, ``<eos>``, ``<pad>``, then the training words.

Each line is read as their loader reads it: surrounding whitespace stripped, split at the tab, and a line left with
one field (its symbol was whitespace) is U+3000; a later line for the same symbol wins.

A token is cut to ``max_chars - 2`` characters (the cut token is also what the word dictionary is asked), then
framed as their batcher frames it, with the two marker ids swapped: the first position holds ``<eow>``'s id and the
end marker ``<bow>``'s; the rest is ``<pad>``. The tokens ``<bos>``/``<eos>`` (the sentence boundaries they add) are
``[<eow>, <bos>|<eos>, <bow>, <pad>...]``.

How the biLM reads them: one row of ``max_chars + 1`` ids per token, the character ids **+ 1** and then the word id
**+ 1**, so that, as in bilm-tf's inference scheme (``chars.py``), a row of zeros is a padding token. The char
table of a ManyLangs biLM has their rows after a zero row 0, and the word column indexes their word table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from elmo_core.errors import ConfigError, InputError
from elmo_core.fileio import atomic_write
from elmo_core.text.chars import (
    BOS_CHAR,
    BOS_TOKEN,
    BOW_CHAR,
    EOS_CHAR,
    EOS_TOKEN,
    EOW_CHAR,
    INFERENCE_OFFSET,
    PAD_ID,
    distinct_rows,
    tokens_to_char_array,
)

if TYPE_CHECKING:  # torch where a tensor is made
    import torch

CHAR_DIC = "char.dic"
WORD_DIC = "word.dic"
RELEASE_CONFIG = "config.json"  # their training command's arguments, in every released folder
RELEASE_FILES = (CHAR_DIC, WORD_DIC, "token_embedder.pkl", "encoder.pkl")

BOS, EOS, OOV, PAD, BOW, EOW = "<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>"
CHAR_SPECIALS = (BOS, EOS, OOV, PAD, BOW, EOW)  # the order their trainer appends them in
WORD_SPECIALS = (OOV, BOS, EOS, PAD)  # the first four words of every word.dic their trainer writes
BLANK = "\u3000"  # a line whose symbol their loader strips away stands for this
ROW_CACHE = 1 << 16  # rows kept per dictionary: hot tokens, bounded


def is_release(path: str | Path) -> bool:
    """Whether ``path`` is a released ELMoForManyLangs folder: their config.json and any of their files, and no
    ``options.json`` (a project model folder keeps their dictionaries beside one)."""
    path = Path(path)
    if not path.is_dir() or not (path / RELEASE_CONFIG).is_file() or (path / "options.json").exists():
        return False
    return any((path / name).exists() for name in RELEASE_FILES)


def read_dic(path: str | Path) -> dict[str, int]:
    """A ``char.dic`` / ``word.dic`` as their loader reads it (see the module docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: missing; a released ELMoForManyLangs model has char.dic and word.dic") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 at byte {exc.start}") from None
    found: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.strip().split("\t")
        if fields == [""]:
            continue
        if len(fields) == 1:
            fields.insert(0, BLANK)
        if len(fields) != 2 or not fields[1].isdigit():
            raise InputError(f"{path}:{number}: expected 'symbol<TAB>id', found {line[:60]!r}")
        found[fields[0]] = int(fields[1])
    if not found:
        raise InputError(f"{path}: empty; expected 'symbol<TAB>id' lines")
    return found


def write_dic(entries: dict[str, int], path: str | Path) -> None:
    """Write a dictionary (atomically) so that ``read_dic`` reads back the same entries, in id order."""
    with atomic_write(path) as f:
        for symbol, i in sorted(entries.items(), key=lambda item: item[1]):
            if "\t" in symbol or "\n" in symbol or "\r" in symbol:
                raise InputError(f"{path}: the symbol {symbol!r} holds a tab or a line break and cannot be written")
            f.write(f"{symbol}\t{i}\n")


def _require(entries: dict[str, int], names: Sequence[str], source: str) -> None:
    missing = [name for name in names if name not in entries]
    if missing:
        raise InputError(f"{source}: no {', '.join(missing)} entry; their loader needs {', '.join(names)}")


ONNX_METADATA_KEY = "elmo.manylangs"  # where an ONNX file of a ManyLangs model keeps ``Dictionaries.state()`` as JSON


@dataclass
class Dictionaries:
    """A model's character and word dictionaries (``words`` None: a model without a word embedding), and the rows
    (their ids + 1, see the module docstring) the biLM reads for tokens."""

    chars: dict[str, int]
    words: dict[str, int] | None
    max_chars: int
    source: str = field(default="dictionaries", compare=False)  # where they were read: for messages
    _rows: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require(self.chars, CHAR_SPECIALS, f"{self.source}/{CHAR_DIC}")
        if self.words is not None:
            _require(self.words, (OOV, PAD), f"{self.source}/{WORD_DIC}")

    @classmethod
    def read(cls, folder: str | Path, max_chars: int, words: bool = True) -> Dictionaries:
        folder = Path(folder)
        word_dic = read_dic(folder / WORD_DIC) if words else None
        return cls(read_dic(folder / CHAR_DIC), word_dic, max_chars, str(folder))

    def write(self, folder: str | Path) -> None:
        write_dic(self.chars, Path(folder) / CHAR_DIC)
        if self.words is not None:
            write_dic(self.words, Path(folder) / WORD_DIC)

    @property
    def width(self) -> int:
        """Ids a row holds: ``max_chars`` characters and the word."""
        return self.max_chars + 1

    @property
    def pad_id(self) -> int:
        """The in-word padding as the biLM reads it (``<pad>``'s id + 1)."""
        return self.chars[PAD] + INFERENCE_OFFSET

    def cut(self, token: str) -> str:
        """The token as their reader keeps it: at most ``max_chars - 2`` characters."""
        return token if len(token) + 2 <= self.max_chars else token[: self.max_chars - 2]

    def row(self, token: str) -> tuple[int, ...]:
        """One token's ids as the biLM reads them (characters, then the word), each their id + 1."""
        found = self._rows.get(token)
        if found is not None:
            return found
        chars, cut = self.chars, self.cut(token)
        ids = [chars[PAD]] * self.max_chars
        ids[0] = chars[EOW]  # their batcher's swap: <eow>'s id opens the word ...
        if cut in (BOS, EOS):
            ids[1], ids[2] = chars[cut], chars[BOW]  # ... and <bow>'s id closes it
        else:
            oov = chars[OOV]
            ids[1 : 1 + len(cut)] = [chars.get(c, oov) for c in cut]
            ids[1 + len(cut)] = chars[BOW]
        word = self.words.get(cut, self.words[OOV]) + INFERENCE_OFFSET if self.words is not None else 0
        found = (*(i + INFERENCE_OFFSET for i in ids), word)
        if len(self._rows) >= ROW_CACHE:
            self._rows.clear()
        self._rows[token] = found
        return found

    def rows(self, tokens: Sequence[str]) -> np.ndarray:
        """(N, max_chars + 1) int64 rows of ``tokens``."""
        out = np.empty((len(tokens), self.width), dtype=np.int64)
        for i, token in enumerate(tokens):
            out[i] = self.row(token)
        return out

    def boundary_rows(self) -> np.ndarray:
        """The rows of the sentence boundaries they add around every sentence, ``<bos>`` and ``<eos>``."""
        return self.rows([BOS, EOS])

    def from_bytes(self, byte_rows: np.ndarray) -> np.ndarray:
        """bilm-tf inference char ids (N, C) (``chars.batch_to_ids``, training batches) ─► this dictionary's rows:
        each row's UTF-8 bytes decoded back to the token (a cut that split a character loses that character), the
        boundary patterns ``<S>``/``</S>`` to ``<bos>``/``<eos>``, a row of zeros (padding) to zeros."""
        out = np.zeros((len(byte_rows), self.width), dtype=np.int64)
        raw = np.asarray(byte_rows, dtype=np.int64) - INFERENCE_OFFSET
        for i, ids in enumerate(raw):
            if ids[0] != BOW_CHAR:  # a padding token
                continue
            if ids[1] in (BOS_CHAR, EOS_CHAR) and ids[2] == EOW_CHAR:
                out[i] = self.row(BOS if ids[1] == BOS_CHAR else EOS)
                continue
            end = int(np.argmax(ids == EOW_CHAR)) if (ids == EOW_CHAR).any() else len(ids)
            out[i] = self.row(bytes(ids[1:end].astype(np.uint8)).decode("utf-8", "ignore"))
        return out

    def own(self, char_ids: torch.Tensor) -> torch.Tensor:
        """(..., C) bilm-tf char ids as these rows (``from_bytes``, each distinct row once); rows already these
        dictionaries' (``width`` ids) as they are."""
        import torch

        if char_ids.shape[-1] == self.width:
            return char_ids
        unique, inverse = distinct_rows(char_ids.reshape(-1, char_ids.shape[-1]))
        rows = torch.from_numpy(self.from_bytes(unique.cpu().numpy())).to(char_ids.device)
        return rows[inverse].view(*char_ids.shape[:-1], self.width)

    def distinct(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.unique(rows, dim=0, return_inverse=True)``: the ids pass ``chars.distinct_rows``' 9 bits."""
        import torch

        return torch.unique(rows, dim=0, return_inverse=True)

    def with_words(self, words: Iterable[str]) -> tuple[Dictionaries, int, int]:
        """These dictionaries with ``words`` (cut as their reader cuts them) and their characters added after the
        entries they hold, new ids counting on from the largest; (the new dictionaries, words added, chars added)."""
        chars, known = dict(self.chars), dict(self.words) if self.words is not None else None
        next_char, next_word = self.n_chars, self.n_words
        for word in words:
            cut = self.cut(word)
            for c in cut:
                if c not in chars:
                    chars[c], next_char = next_char, next_char + 1
            if known is not None and cut not in known:
                known[cut], next_word = next_word, next_word + 1
        grown = Dictionaries(chars, known, self.max_chars, self.source)
        return grown, next_word - self.n_words, next_char - self.n_chars

    def state(self) -> dict[str, Any]:
        """What a training checkpoint keeps of them, so that its export needs no release folder: plain dicts that
        ``torch.load(weights_only=True)`` reads back (``from_state``)."""
        words = None if self.words is None else dict(self.words)
        return {"chars": dict(self.chars), "words": words, "max_chars": self.max_chars}

    @classmethod
    def from_state(cls, state: dict[str, Any], source: str) -> Dictionaries:
        words = state["words"]
        return cls(dict(state["chars"]), None if words is None else dict(words), int(state["max_chars"]), source)

    @property
    def n_chars(self) -> int:
        """Rows of their char table the ids reach (the largest id + 1)."""
        return max(self.chars.values()) + 1

    @property
    def n_words(self) -> int:
        return max(self.words.values()) + 1 if self.words is not None else 0


class Bytes:
    """bilm-tf's spelling (``chars.py``: UTF-8 bytes) behind the calls the biLM makes of a ManyLangs model's
    ``Dictionaries``, so the model asks one object however its tokens are spelled."""

    pad_id = PAD_ID

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars

    def rows(self, tokens: Sequence[str]) -> np.ndarray:
        return tokens_to_char_array(tokens, self.max_chars)

    def boundary_rows(self) -> np.ndarray:
        return tokens_to_char_array([BOS_TOKEN, EOS_TOKEN], self.max_chars).astype(np.int64)

    def own(self, char_ids: torch.Tensor) -> torch.Tensor:
        return char_ids

    def distinct(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return distinct_rows(rows)


def spelling(max_chars: int, manylangs: bool, dictionaries: Dictionaries | None) -> Dictionaries | Bytes:
    """How a biLM spells its tokens: a ManyLangs model (``manylangs``) by its dictionaries, any other by bytes."""
    if manylangs != (dictionaries is not None):
        raise ConfigError("an ELMoForManyLangs model (config.manylangs) is built with its dictionaries, and only it")
    return dictionaries if dictionaries is not None else Bytes(max_chars)
