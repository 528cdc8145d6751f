"""Training batches with bilm-tf's ``_get_batch`` semantics, streamed from the token-id Parquet files.

Each of ``batch_size`` rows keeps its own stream of ``<S> w1 … wn </S>`` sentences. To fill a row's
``unroll_steps`` slots it takes ``k = min(len(stream) - 1, free slots)`` tokens as inputs and the next ``k`` as
targets, then drops the ``k`` consumed ones, so a sentence's last token is only ever a target and the row goes on
with the next sentence's ``<S>``. The LSTM state is carried per row between batches, so rows are continuous text.
The backward LM reads reversed sentences (``</S> wn … w1 <S>``) from an independently shuffled stream.

Sentences come one Parquet row group at a time (memory stays flat as the corpus grows), in an order fixed by
(seed, epoch): row groups shuffled, then the rows of each group. A row group is held in columnar form (flat ids,
each distinct token's char row made once); filling a window notes which run of tokens each row takes, then gathers
ids, targets and char rows for the whole window at once. Distributed rank r of w takes every w-th
sentence of that order, so ranks see disjoint sentences. ``state_dict()`` is a small JSON-able object (epoch,
row group, offset and the rows' unfinished sentences): after ``load_state_dict`` the batcher yields exactly the
batches it would have yielded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.errors import InputError
from elmo_core.text.chars import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, MAX_CHARS, raw_char_ids


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


@dataclass
class _Unit:
    path: str
    row_group: int


class _RowGroup:
    """Sentences in columnar form, each with its boundaries and in reading order (reversed for the backward LM):
    flat ids, flat indexes into the char rows of each distinct token (made once), and where each sentence starts."""

    def __init__(
        self, ids: np.ndarray, index: np.ndarray, starts: np.ndarray, char_rows: np.ndarray, words: Any
    ) -> None:
        self.ids, self.index, self.char_rows, self.words = ids, index, char_rows, words  # words: index → token
        self.starts = starts.tolist()  # Python ints: the packer reads them one at a time

    @classmethod
    def from_table(cls, table: Any, chars: _CharTable, reverse: bool) -> _RowGroup:
        ids, tokens = table.column("ids").combine_chunks(), table.column("tokens").combine_chunks()
        lengths = np.diff(ids.offsets.to_numpy()) + 2
        encoded = pc.dictionary_encode(tokens.flatten())
        n_words = len(encoded.dictionary)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        total = int(starts[-1])
        inner = np.ones(total, dtype=bool)
        inner[starts[:-1]] = inner[starts[1:] - 1] = False
        flat_ids = np.full(total, EOS_ID, dtype=np.int32)
        flat_ids[starts[:-1]] = BOS_ID
        flat_ids[inner] = ids.flatten().to_numpy(zero_copy_only=False)
        index = np.full(total, n_words + 1, dtype=np.int64)
        index[starts[:-1]] = n_words
        index[inner] = encoded.indices.to_numpy(zero_copy_only=False)
        if reverse:  # each sentence back to front: </S> wn … w1 <S>
            order = np.repeat(2 * starts[:-1] + lengths - 1, lengths) - np.arange(total)
            flat_ids, index = flat_ids[order], index[order]
        words = encoded.dictionary.to_pylist() + [BOS_TOKEN, EOS_TOKEN]
        return cls(flat_ids, index, starts, chars.rows(words), words)

    @classmethod
    def from_sentences(cls, sentences: list[tuple[list[int], list[str]]], chars: _CharTable) -> _RowGroup:
        """A checkpoint's unfinished sentences (ids and tokens as read), one per row that had one."""
        lengths = [len(ids) for ids, _ in sentences]
        words = [token for _, tokens in sentences for token in tokens]
        flat_ids = np.asarray([i for ids, _ in sentences for i in ids], dtype=np.int32)
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        return cls(flat_ids, np.arange(len(words)), starts, chars.rows(words), words)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def unread(self, sentence: int, consumed: int) -> list[list[Any]]:
        """A sentence's ids and tokens after its first ``consumed`` (what a checkpoint keeps of a row)."""
        start, end = self.starts[sentence] + consumed, self.starts[sentence + 1]
        return [self.ids[start:end].tolist(), [self.words[i] for i in self.index[start:end].tolist()]]


class SentenceStream:
    """Sentences of one direction as (row group, sentence number) in a seeded order; position resumable."""

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

    def _rows(self, epoch: int, position: int) -> tuple[_RowGroup, list[int]]:
        """The row group at ``position`` of ``epoch``'s order, and which of its rows are this rank's, in order."""
        unit = self.units[self._order(epoch)[position]]
        table = pq.ParquetFile(unit.path).read_row_group(unit.row_group, columns=["ids", "tokens"])
        group = _RowGroup.from_table(table, self.chars, self.reverse)
        perm = np.arange(len(group))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch, position]).shuffle(perm)
        return group, perm[self.rank :: self.world].tolist()

    def __iter__(self) -> Iterator[tuple[_RowGroup, int]]:
        while True:
            while self.unit < len(self.units):
                group, mine = self._rows(self.epoch, self.unit)
                while self.offset < len(mine):
                    self.offset += 1
                    yield group, mine[self.offset - 1]
                self.unit, self.offset = self.unit + 1, 0
            if not self.loop:
                return
            self.epoch, self.unit, self.offset = self.epoch + 1, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "unit": self.unit, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.unit, self.offset = int(state["epoch"]), int(state["unit"]), int(state["offset"])


class _RowPacker:
    """bilm-tf ``_get_batch`` for one direction: fills (B, T) windows from per-row sentence streams.

    Each row holds its sentence (row group, number) and how many of its tokens it consumed. Filling a window only
    notes which run of tokens each piece takes; the ids, targets and char rows are then gathered for the whole
    window at once (one gather per row group it reads)."""

    def __init__(self, stream: SentenceStream, batch_size: int, unroll_steps: int) -> None:
        self.stream, self.batch_size, self.unroll_steps = stream, batch_size, unroll_steps
        self.rows: list[tuple[_RowGroup, int, int] | None] = [None] * batch_size
        self._sentences = iter(stream)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        b, t = self.batch_size, self.unroll_steps
        groups: list[_RowGroup] = []
        piece_group, piece_start, piece_length = [], [], []
        rows = self.rows
        for i in range(b):
            pos = 0
            while pos < t:
                row = rows[i]
                if row is None or row[0].starts[row[1] + 1] - row[0].starts[row[1]] - row[2] <= 1:
                    try:
                        group, sentence = next(self._sentences)
                    except StopIteration:  # out of data: the incomplete batch is dropped
                        return None
                    row = (group, sentence, 0)
                group, sentence, consumed = row
                start = group.starts[sentence] + consumed
                k = min(group.starts[sentence + 1] - start - 1, t - pos)
                if not groups or groups[-1] is not group:
                    groups.append(group)
                piece_group.append(len(groups) - 1)
                piece_start.append(start)
                piece_length.append(k)
                rows[i] = (group, sentence, consumed + k)
                pos += k
        lengths = np.asarray(piece_length)
        ends = np.cumsum(lengths)
        positions = np.repeat(np.asarray(piece_start) - (ends - lengths), lengths) + np.arange(b * t)
        inputs, targets = np.empty(b * t, np.int32), np.empty(b * t, np.int32)
        chars = np.empty((b * t, self.stream.chars.max_chars), np.int32)
        which = np.repeat(np.asarray(piece_group), lengths) if len(groups) > 1 else None
        for g, group in enumerate(groups):
            at = slice(None) if which is None else which == g
            p = positions[at]
            inputs[at], targets[at], chars[at] = group.ids[p], group.ids[p + 1], group.char_rows[group.index[p]]
        return inputs.reshape(b, t), targets.reshape(b, t), chars.reshape(b, t, -1)

    def snapshot(self) -> tuple[dict[str, int], list[tuple[_RowGroup, int, int] | None]]:
        """The position, cheaply (row groups are never changed, so the rows' references are enough)."""
        return self.stream.state_dict(), list(self.rows)

    def restore(self, snapshot: tuple[dict[str, int], list[tuple[_RowGroup, int, int] | None]]) -> None:
        self.stream.load_state_dict(snapshot[0])
        self.rows = list(snapshot[1])
        self._sentences = iter(self.stream)

    @staticmethod
    def state_of(snapshot: tuple[dict[str, int], list[tuple[_RowGroup, int, int] | None]]) -> dict[str, Any]:
        """A snapshot as the JSON-able state a checkpoint keeps (each row's unfinished sentence spelled out)."""
        stream, rows = snapshot
        return {"stream": dict(stream), "rows": [None if r is None else r[0].unread(r[1], r[2]) for r in rows]}

    def state_dict(self) -> dict[str, Any]:
        return self.state_of(self.snapshot())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        kept = [(r[0], r[1]) for r in state["rows"] if r is not None]
        carried = _RowGroup.from_sentences(kept, self.stream.chars) if kept else None
        numbers = iter(range(len(kept)))
        self.rows = [None if r is None else (carried, next(numbers), 0) for r in state["rows"]]  # type: ignore[misc]
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
        before = None if self.loop else self.snapshot()  # only a finite pass can run out mid-batch
        fwd = self.forward.next_batch()
        bwd = self.backward.next_batch() if self.backward is not None else None
        if fwd is None or (self.backward is not None and bwd is None):
            if before is not None:
                self.restore(before)  # a batch that was not produced consumes nothing
            return None
        batch = {"token_ids": fwd[0], "next_token_id": fwd[1], "tokens_characters": fwd[2]}
        if bwd is not None:
            batch.update(
                {"token_ids_reverse": bwd[0], "next_token_id_reverse": bwd[1], "tokens_characters_reverse": bwd[2]}
            )
        return batch

    def snapshot(self) -> Any:
        """The batcher's position, in microseconds (``state_of`` makes it a checkpoint's JSON state)."""
        return self.forward.snapshot(), self.backward.snapshot() if self.backward else None

    def restore(self, snapshot: Any) -> None:
        self.forward.restore(snapshot[0])
        if self.backward is not None:
            self.backward.restore(snapshot[1])

    def state_of(self, snapshot: Any) -> dict[str, Any]:
        forward, backward = snapshot
        return {
            "forward": self.forward.state_of(forward),
            "backward": self.backward.state_of(backward) if self.backward else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state_of(self.snapshot())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.forward.load_state_dict(state["forward"])
        if self.backward is not None:
            self.backward.load_state_dict(state["backward"])
