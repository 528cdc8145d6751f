"""Rows kept by word, the least recently used dropped first: the rule both of a process's word caches follow (the
runtime's ``bilm.inference.WordCache`` of torch rows, the torch-free server's ``serve.onnx_compute.OnnxWords`` of
NumPy rows), kept here once and torch-free, so that the ONNX model process shares it without importing torch."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

Row = TypeVar("Row")


class WordRows(Generic[Row]):
    """A word's row (its layer 0), looked up by word, in order of last use."""

    def __init__(self) -> None:
        self.rows: OrderedDict[str, Row] = OrderedDict()

    def __getitem__(self, word: str) -> Row:
        return self.rows[word]

    def first(self) -> Row | None:
        """Any row (to learn a row's size from), or None while empty."""
        return next(iter(self.rows.values()), None)

    def missing(self, words: Iterable[str]) -> list[str]:
        """Those of ``words`` not kept, in their order."""
        return [word for word in words if word not in self.rows]

    def add(self, words: Sequence[str], rows: Iterable[Row]) -> None:
        self.rows.update(zip(words, rows))

    def keep(self, words: Sequence[str], capacity: int) -> None:
        """``words`` (the batch at hand, distinct, all kept) become the most recently used; then the least recently
        used go until ``capacity`` rows are left, though never one of ``words`` (a batch larger than the capacity
        keeps all of its own)."""
        for word in words:
            self.rows.move_to_end(word)
        while len(self.rows) > max(capacity, len(words)):
            self.rows.popitem(last=False)
