"""WordNet 3.0's example sentences as sense-annotated data for the word-sense probe, read from its database files.

Install the files once: ``sudo apt-get install wordnet-base`` (Debian/Ubuntu; they land in /usr/share/wordnet);
any folder holding WordNet 3.0's ``index.{noun,verb,adj,adv}``, ``data.*`` and ``*.exc`` files works.

* ``index.POS`` lists each lemma's synsets in WordNet's sense order (sense 1 is the most frequent in SemCor);
* ``data.POS`` holds each synset's gloss, where example sentences are the double-quoted parts;
* an example of a synset counts for one of its lemmas when the lemma, or an inflected form of it, is a token of the
  example: WordNet's exception lists (``noun.exc`` …) and its detachment rules (morphy: "ies" → "y", "ing" → "" …);
* the label is the synset (``<offset>-<pos>``), the lemma key ``<lemma>.<pos>``; only lemmas with two or more senses
  that have such examples are kept (a lemma with one sense has nothing to disambiguate). Multi-word lemmas
  ("bank_building") are left out: the probe targets one token.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from elmo_core.errors import InputError
from elmo_core.text.tokenize import unicode_tokens

POS_NAMES = {"n": "noun", "v": "verb", "a": "adj", "r": "adv"}
INSTALL_HINT = (
    "install WordNet 3.0 with `sudo apt-get install wordnet-base` (files in /usr/share/wordnet) or pass --data"
)
DEFAULT_DIR = Path("/usr/share/wordnet")

# morphy's detachment rules: (suffix, replacement) per part of speech
DETACHMENT = {
    "n": [
        ("s", ""),
        ("ses", "s"),
        ("xes", "x"),
        ("zes", "z"),
        ("ches", "ch"),
        ("shes", "sh"),
        ("men", "man"),
        ("ies", "y"),
    ],
    "v": [("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", "")],
    "a": [("er", ""), ("est", ""), ("er", "e"), ("est", "e")],
    "r": [],
}
_QUOTED = re.compile(r'"([^"]+)"')


@dataclass(frozen=True)
class SenseExample:
    """One occurrence of a lemma in a sentence, labelled with its sense."""

    tokens: tuple[str, ...]
    index: int  # the target token
    sense: str
    lemma: str
    sense_number: int = 0  # the sense's rank for its lemma (1 = most frequent); 0 when unknown
    split: str | None = None


def is_wordnet_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and all(
        (path / f"{kind}.{name}").exists() for kind in ("index", "data") for name in POS_NAMES.values()
    )


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise InputError(f"{path}: missing; {INSTALL_HINT}") from None
    return [line for line in text.splitlines() if line and not line.startswith("  ")]  # the licence header is indented


def _index(path: Path) -> dict[str, list[str]]:
    """lemma → synset offsets in sense order (``index.POS``)."""
    senses = {}
    for number, line in enumerate(_lines(path), 1):
        fields = line.split()
        try:
            synset_cnt, p_cnt = int(fields[2]), int(fields[3])
            senses[fields[0]] = fields[4 + p_cnt + 2 :][:synset_cnt]
        except (IndexError, ValueError):
            raise InputError(f"{path}:{number}: not a WordNet index line ({line[:60]!r})") from None
    return senses


def _examples(path: Path) -> dict[str, list[str]]:
    """synset offset → its example sentences (the quoted parts of the gloss in ``data.POS``)."""
    out = {}
    for line in _lines(path):
        head, _, gloss = line.partition(" | ")
        examples = _QUOTED.findall(gloss)
        if examples:
            out[head.split(" ", 1)[0]] = examples
    return out


def _exceptions(path: Path) -> dict[str, list[str]]:
    """inflected form → base forms (``POS.exc``)."""
    out: dict[str, list[str]] = defaultdict(list)
    if path.exists():
        for line in _lines(path):
            inflected, *bases = line.split()
            out[inflected] += bases
    return out


def base_forms(token: str, pos: str, exceptions: dict[str, list[str]]) -> set[str]:
    """What ``token`` may be an inflection of, by WordNet's exception list and detachment rules (and itself)."""
    forms = {token, *exceptions.get(token, ())}
    forms |= {
        token[: -len(suffix)] + ending
        for suffix, ending in DETACHMENT[pos]
        if token.endswith(suffix) and len(token) > len(suffix)
    }
    return forms


def read_wordnet(directory: str | Path = DEFAULT_DIR) -> list[SenseExample]:
    """Every example sentence in which a lemma with ≥ 2 exemplified senses occurs, labelled with that sense."""
    directory = Path(directory)
    if not is_wordnet_dir(directory):
        raise InputError(f"{directory}: not a WordNet 3.0 database folder (index.noun, data.noun, …); {INSTALL_HINT}")
    records: list[SenseExample] = []
    for pos, name in POS_NAMES.items():
        index = _index(directory / f"index.{name}")
        examples = _examples(directory / f"data.{name}")
        exceptions = _exceptions(directory / f"{name}.exc")
        tokenized: dict[str, list[list[str]]] = {}
        for lemma, offsets in index.items():
            if "_" in lemma:
                continue
            found = []
            for number, offset in enumerate(offsets, 1):
                for example in examples.get(offset, ()):
                    tokens = tokenized.setdefault(example, unicode_tokens(example))
                    at = next(
                        (i for i, t in enumerate(tokens) if lemma in base_forms(t.lower(), pos, exceptions)), None
                    )
                    if at is not None:
                        found.append(SenseExample(tuple(tokens), at, f"{offset}-{pos}", f"{lemma}.{pos}", number))
            if len({r.sense for r in found}) >= 2:
                records += found
    if not records:
        raise InputError(f"{directory}: no example sentence names a lemma with two senses; is it WordNet 3.0?")
    return records


def write_definitions(directory: str | Path, path: str | Path) -> int:
    """WordNet's definitions without their quoted examples, one per line: ~2M tokens of general English that
    share no sentence with the word-sense probe's examples (a corpus to train a model to probe). Returns lines."""
    directory = Path(directory)
    if not is_wordnet_dir(directory):
        raise InputError(f"{directory}: not a WordNet 3.0 database folder; {INSTALL_HINT}")
    lines = []
    for name in POS_NAMES.values():
        for line in _lines(directory / f"data.{name}"):
            gloss = _QUOTED.sub("", line.partition(" | ")[2])
            text = " ".join(part.strip() for part in gloss.split(";") if part.strip())
            if text:
                lines.append(" ".join(unicode_tokens(text)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)
