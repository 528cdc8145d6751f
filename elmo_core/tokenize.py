"""Tokenizers and a sentence splitter for ingest (and for embedding raw text the same way)."""

from __future__ import annotations

import re
from typing import Callable, Literal

from elmo_core.errors import ConfigError

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


def unicode_tokens(text: str) -> list[str]:
    return _UNICODE_TOKEN.findall(text)


def _chinese() -> Callable[[str], list[str]]:
    try:
        import jieba  # optional extra: pip install "elmo-pipeline[chinese]"
    except ImportError:
        raise ConfigError("the 'chinese' tokenizer needs jieba: pip install jieba (or the project's [chinese] extra)") from None
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
