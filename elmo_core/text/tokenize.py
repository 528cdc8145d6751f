"""Tokenizers and a sentence splitter for ingest (and for embedding raw text the same way)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import numpy as np

from elmo_core.errors import ConfigError

if TYPE_CHECKING:  # Arrow is imported where ingest splits a block: a torch-free server image has no Arrow
    import pyarrow as pa

TokenizerName = Literal["whitespace", "unicode", "chinese"]

# URLs and e-mails, numbers with inner separators (3.14, 1,000, 12:30), words with inner apostrophes or
# hyphens (don't, state-of-the-art), then any other single non-space character (punctuation, symbols).
_UNICODE_TOKEN = re.compile(
    r"""(?:https?://|www\.)\S+[^\s.,;:!?)\]}'"]"""  # URLs, without trailing punctuation
    r"""|[\w.+-]+@[\w-]+\.[\w.-]*\w"""  # e-mail addresses
    r"""|\d+(?:[.,:]\d+)*"""  # numbers
    r"""|[^\W\d_]+(?:['’\-][^\W\d_]+)*"""  # words
    r"""|\w+"""  # other word characters (e.g. 3rd, snake_case)
    r"""|\S""",  # punctuation and symbols, one each
    re.UNICODE,
)

# A sentence ends at . ! ? (or their CJK forms) followed by whitespace, a closing quote or the end.
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])[\"'”’)\]]*\s+|(?<=[。！？])")


def whitespace_tokens(text: str) -> list[str]:
    return text.split()


def split_whitespace(texts: pa.StringArray, source: bytes | None = None) -> pa.ListArray:
    """``str.split()`` of every text, with Arrow's C++ splitters (no Python per sentence).

    Arrow's Unicode splitter breaks on exactly ``str.split``'s characters; its ASCII one is faster and
    agrees with it unless a text holds one of the rarer separators, so it is used when none occurs.
    ``source``: bytes that hold all of the texts (the block they were cut from), checked for those
    separators instead of a copy of the texts. Texts must be trimmed: Arrow turns a leading separator into
    a first token ``""``, and a text with no token into ``[""]``.
    """
    import pyarrow.compute as pc

    if source is None:
        data = texts.buffers()[2]
        source = data.to_pybytes() if data is not None else b""
    if _only_ascii_separators(source):
        return pc.ascii_split_whitespace(texts)
    return pc.utf8_split_whitespace(texts)


_RARE_ASCII_SEPARATORS = (b"\x1c", b"\x1d", b"\x1e", b"\x1f")
_SEPARATOR_LEAD_BYTES = (b"\xc2", b"\xe1", b"\xe2", b"\xe3")


def _only_ascii_separators(data: bytes) -> bool:
    """True when UTF-8 ``data`` holds none of the separators outside space, \\t, \\n, \\v, \\f, \\r:
    U+001C..U+001F, U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000."""
    if any(byte in data for byte in _RARE_ASCII_SEPARATORS):
        return False
    if not any(byte in data for byte in _SEPARATOR_LEAD_BYTES):  # memchr scans: the common case stops here
        return True
    buf = np.frombuffer(data, np.uint8)
    at = np.flatnonzero((buf == 0xC2) | ((buf - np.uint8(0xE1)) < 3))
    lead, last = buf[at], len(buf) - 1
    b1, b2 = buf[np.minimum(at + 1, last)], buf[np.minimum(at + 2, last)]
    separator = (
        ((lead == 0xC2) & ((b1 == 0x85) | (b1 == 0xA0)))
        | ((lead == 0xE1) & (b1 == 0x9A) & (b2 == 0x80))
        | ((lead == 0xE2) & (b1 == 0x80) & ((b2 <= 0x8A) | (b2 == 0xA8) | (b2 == 0xA9) | (b2 == 0xAF)))
        | ((lead == 0xE2) & (b1 == 0x81) & (b2 == 0x9F))
        | ((lead == 0xE3) & (b1 == 0x80) & (b2 == 0x80))
    )
    return not separator.any()


def unicode_tokens(text: str) -> list[str]:
    return _UNICODE_TOKEN.findall(text)


def _chinese() -> Callable[[str], list[str]]:
    try:
        import jieba  # optional extra: pip install "elmo-pipeline[chinese]"
    except ImportError:
        raise ConfigError(
            "the 'chinese' tokenizer needs jieba: pip install jieba (or the project's [chinese] extra)"
        ) from None
    jieba.setLogLevel(60)

    def tokens(text: str) -> list[str]:
        return [t for t in jieba.lcut(text) if t.strip()]

    return tokens


def get_tokenizer(name: str) -> Callable[[str], list[str]]:
    if name == "whitespace":
        return whitespace_tokens
    if name == "unicode":
        return unicode_tokens
    if name == "chinese":
        return _chinese()
    raise ConfigError(f"unknown tokenizer {name!r}; expected whitespace, unicode or chinese")


def split_sentences(paragraph: str) -> list[str]:
    """Rule-based: split after sentence-final punctuation followed by space (or after CJK full stops)."""
    return [s.strip() for s in _SENTENCE_END.split(paragraph) if s and s.strip()]
