"""The default corpus: English prose that ships with every Python (the ``pydoc_data`` help topics).

Nothing is downloaded and no text is copied into the project: the corpus is written at run time from the
interpreter's own documentation, one paragraph per block, for ``ingest --split-sentences``.
"""

from __future__ import annotations

import re
from pathlib import Path

from elmo_core.fileio import write_text_atomic

_RULE = re.compile(r"^[\s*=\-~^#]+$")  # reST heading underlines


def _prose_paragraphs(topic: str) -> list[str]:
    paragraphs = []
    for block in re.split(r"\n\s*\n", topic):
        lines = [line.strip() for line in block.splitlines() if line.strip() and not _RULE.match(line)]
        text = " ".join(lines)
        letters = sum(c.isalpha() or c.isspace() for c in text)
        # prose only: mostly letters, several words, ends like a sentence (skips code, tables and headings)
        if len(text.split()) >= 6 and letters >= 0.85 * len(text) and text[-1:] in ".:;)?!":
            paragraphs.append(text)
    return paragraphs


def write_default_corpus(path: str | Path) -> tuple[Path, int]:
    """Write the pydoc topics' prose paragraphs to ``path``; returns (path, paragraphs)."""
    from pydoc_data.topics import topics

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    paragraphs = [p for name in sorted(topics) for p in _prose_paragraphs(topics[name])]
    text = "\n\n".join(paragraphs) + "\n"
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return path, len(paragraphs)  # unchanged: keep the file (and its mtime) so reruns see the same input
    write_text_atomic(path, text)
    return path, len(paragraphs)
