"""Training batches with bilm-tf's ``_get_batch`` semantics, streamed from the token-id Parquet files.

Each of ``batch_size`` rows keeps its own stream of ``<S> w1 … wn </S>`` sentences. To fill a row's
``unroll_steps`` slots it takes ``k = min(len(stream) - 1, free slots)`` tokens as inputs and the next ``k`` as
targets, then drops the ``k`` consumed ones, so a sentence's last token is only ever a target and the row goes on
with the next sentence's ``<S>``. The LSTM state is carried per row between batches, so rows are continuous text.
The backward LM reads reversed sentences (``</S> wn … w1 <S>``) from an independently shuffled stream.

Sentences come one Parquet row group at a time (memory stays flat as the corpus grows), in an order fixed by
(seed, epoch): row groups shuffled, then the rows of each group. A row group is held in columnar form (flat ids,
each distinct token's char row made once), so a sentence is two slices and one gather, not a Python list per token. Distributed rank r of w takes every w-th
sentence of that order, so ranks see disjoint sentences. ``state_dict()`` is a small JSON-able object (epoch,
row group, offset and the rows' unfinished sentences): after ``load_state_dict`` the batcher yields exactly the
batches it would have yielded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.chars import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, MAX_CHARS, raw_char_ids
from elmo_core.errors import InputError


class _CharTable:
    """token → raw char-id row, cached: every sentence needs them, OOV words included."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._rows: dict[str, np.ndarray] = {}

    def rows(self, tokens: list[str]) -> np.ndarray:
        out = np.empty((len(tokens), self.max_chars), dtype=np.int32)
        cache = self._rows
        for i, token in enumerate(tokens):
            row = cache.get(token)
            if row is None:
                row = cache[token] = np.asarray(raw_char_ids(token, self.max_chars), dtype=np.int32)
                if len(cache) > 2_000_000:
                    cache.clear()
            out[i] = row
        return out


class _Sentence:
    """One sentence with its boundaries, as the packer reads it: ids (L,) and char rows (L, C), in reading order;
    its token strings are made only for a checkpoint (``tokens``)."""

    __slots__ = ("ids", "chars", "_tokens")

    def __init__(self, ids: np.ndarray, chars: np.ndarray, tokens: Callable[[], list[str]]) -> None:
        self.ids, self.chars, self._tokens = ids, chars, tokens

    def tokens(self) -> list[str]:
        return self._tokens()

    @classmethod
    def of(cls, ids: list[int], tokens: list[str], chars: _CharTable) -> _Sentence:
        """From a checkpoint's ids and tokens (already with boundaries and in reading order)."""
        return cls(np.asarray(ids, dtype=np.int32), chars.rows(tokens), lambda: list(tokens))


@dataclass
class _Unit:
    path: str
    row_group: int


class _RowGroup:
    """One row group's sentences in columnar form, boundaries included: flat ids, each distinct token's char row once
    (and the boundaries'), flat indexes into those rows, and where each sentence starts."""

    def __init__(self, table: Any, chars: _CharTable) -> None:
        ids, tokens = table.column("ids").combine_chunks(), table.column("tokens").combine_chunks()
        lengths = np.diff(ids.offsets.to_numpy())
        encoded = pc.dictionary_encode(tokens.flatten())
        self.tokens = encoded.dictionary
        n_words = len(self.tokens)
        self.char_rows = chars.rows(self.tokens.to_pylist() + [BOS_TOKEN, EOS_TOKEN])  # (U + 2, C)
        # <S> w1 … wn </S> per sentence: each sentence's words moved right by the boundaries before them
        self.starts = np.concatenate([[0], np.cumsum(lengths + 2)])
        total = int(self.starts[-1])
        words = np.ones(total, dtype=bool)
        words[self.starts[:-1]] = words[self.starts[1:] - 1] = False
        self.ids = np.full(total, EOS_ID, dtype=np.int32)
        self.ids[self.starts[:-1]] = BOS_ID
        self.ids[words] = ids.flatten().to_numpy(zero_copy_only=False)
        self.index = np.full(total, n_words + 1, dtype=np.int64)
        self.index[self.starts[:-1]] = n_words
        self.index[words] = encoded.indices.to_numpy(zero_copy_only=False)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def sentence(self, row: int, reverse: bool) -> _Sentence:
        start, end = self.starts[row], self.starts[row + 1]
        ids, index = self.ids[start:end], self.index[start:end]
        if reverse:
            ids, index = ids[::-1], index[::-1]
        dictionary = self.tokens

        def tokens() -> list[str]:
            first, last = (EOS_TOKEN, BOS_TOKEN) if reverse else (BOS_TOKEN, EOS_TOKEN)
            return [first, *(dictionary[int(i)].as_py() for i in index[1:-1]), last]

        return _Sentence(ids, self.char_rows[index], tokens)


class SentenceStream:
    """Sentences of one direction (``_Sentence``: ids and char rows, boundaries included) in a seeded order;
    position resumable."""

    def __init__(
        self,
        files: list[Path],
        seed: int,
        *,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        loop: bool = True,
        reverse: bool = False,
        chars: _CharTable | None = None,
    ) -> None:
        self.units = [_Unit(str(f), g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
        if not self.units:
            raise InputError("no token-id row groups to read (is the split empty?)")
        self.seed, self.rank, self.world = seed, rank, world
        self.shuffle, self.loop, self.reverse = shuffle, loop, reverse
        self.chars = chars or _CharTable(MAX_CHARS)
        self.epoch, self.unit, self.offset = 0, 0, 0  # the next sentence is #offset of this rank's share of unit

    def _order(self, epoch: int) -> list[int]:
        order = np.arange(len(self.units))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        return order.tolist()

    def _rows(self, epoch: int, position: int) -> tuple[_RowGroup, np.ndarray]:
        """The row group at ``position`` of ``epoch``'s order, and which of its rows are this rank's, in order."""
        unit = self.units[self._order(epoch)[position]]
        group = _RowGroup(
            pq.ParquetFile(unit.path).read_row_group(unit.row_group, columns=["ids", "tokens"]), self.chars
        )
        perm = np.arange(len(group))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch, position]).shuffle(perm)
        return group, perm[self.rank :: self.world]

    def __iter__(self) -> Iterator[_Sentence]:
        while True:
            while self.unit < len(self.units):
                group, mine = self._rows(self.epoch, self.unit)
                while self.offset < len(mine):
                    row = int(mine[self.offset])
                    self.offset += 1
                    yield group.sentence(row, self.reverse)
                self.unit, self.offset = self.unit + 1, 0
            if not self.loop:
                return
            self.epoch, self.unit, self.offset = self.epoch + 1, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "unit": self.unit, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.unit, self.offset = int(state["epoch"]), int(state["unit"]), int(state["offset"])


class _RowPacker:
    """bilm-tf ``_get_batch`` for one direction: fills (B, T) windows from per-row sentence streams. Each row holds
    its current sentence and how many of its tokens it has consumed."""

    def __init__(self, stream: SentenceStream, batch_size: int, unroll_steps: int) -> None:
        self.stream, self.batch_size, self.unroll_steps = stream, batch_size, unroll_steps
        self.rows: list[tuple[_Sentence, int] | None] = [None] * batch_size
        self._sentences = iter(stream)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        b, t = self.batch_size, self.unroll_steps
        inputs = np.zeros((b, t), np.int32)
        targets = np.zeros((b, t), np.int32)
        chars = np.zeros((b, t, self.stream.chars.max_chars), np.int32)
        rows = self.rows
        for i in range(b):
            pos = 0
            while pos < t:
                row = rows[i]
                if row is None or len(row[0].ids) - row[1] <= 1:
                    try:
                        row = (next(self._sentences), 0)
                    except StopIteration:  # out of data: the incomplete batch is dropped
                        return None
                sentence, start = row
                k = min(len(sentence.ids) - start - 1, t - pos)
                inputs[i, pos : pos + k] = sentence.ids[start : start + k]
                targets[i, pos : pos + k] = sentence.ids[start + 1 : start + k + 1]
                chars[i, pos : pos + k] = sentence.chars[start : start + k]
                rows[i] = (sentence, start + k)
                pos += k
        return inputs, targets, chars

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream.state_dict(),
            "rows": [None if r is None else [r[0].ids[r[1] :].tolist(), r[0].tokens()[r[1] :]] for r in self.rows],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        chars = self.stream.chars
        self.rows = [None if r is None else (_Sentence.of(r[0], r[1], chars), 0) for r in state["rows"]]
        self._sentences = iter(self.stream)


class LMBatcher:
    """Forward (and backward) LM batches: dicts of numpy int32 arrays ready for ``torch.from_numpy``.

    Keys as in bilm-tf: ``token_ids`` (B, T), ``tokens_characters`` (B, T, C) raw char ids (0..260),
    ``next_token_id`` (B, T), and the same with ``_reverse`` for the backward LM.
    """

    def __init__(
        self,
        token_id_dir: str | Path,
        batch_size: int,
        unroll_steps: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        bidirectional: bool = True,
        shuffle: bool = True,
        loop: bool = True,
        max_chars: int = MAX_CHARS,
    ) -> None:
        files = sorted(Path(token_id_dir).glob("part-*.parquet"))
        if not files:
            raise InputError(f"{token_id_dir}: no token-id files (part-*.parquet); run `elmo vocab` first")
        chars = _CharTable(max_chars)
        self.loop = loop
        self.forward = _RowPacker(
            SentenceStream(files, seed, rank=rank, world=world, shuffle=shuffle, loop=loop, chars=chars),
            batch_size,
            unroll_steps,
        )
        self.backward = (
            _RowPacker(
                SentenceStream(
                    files, seed + 7919, rank=rank, world=world, shuffle=shuffle, loop=loop, reverse=True, chars=chars
                ),
                batch_size,
                unroll_steps,
            )
            if bidirectional
            else None
        )

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch

    def next_batch(self) -> dict[str, np.ndarray] | None:
        state = None if self.loop else self.state_dict()  # only a finite pass can run out mid-batch
        fwd = self.forward.next_batch()
        bwd = self.backward.next_batch() if self.backward is not None else None
        if fwd is None or (self.backward is not None and bwd is None):
            if state is not None:
                self.load_state_dict(state)  # a batch that was not produced consumes nothing
            return None
        batch = {"token_ids": fwd[0], "next_token_id": fwd[1], "tokens_characters": fwd[2]}
        if bwd is not None:
            batch.update(
                {"token_ids_reverse": bwd[0], "next_token_id_reverse": bwd[1], "tokens_characters_reverse": bwd[2]}
            )
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"forward": self.forward.state_dict(), "backward": self.backward.state_dict() if self.backward else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.forward.load_state_dict(state["forward"])
        if self.backward is not None:
            self.backward.load_state_dict(state["backward"])
