"""Training batches with bilm-tf's ``_get_batch`` semantics, streamed from the token-id Parquet files.

Each of ``batch_size`` rows keeps its own stream of ``<S> w1 … wn </S>`` sentences. To fill a row's
``unroll_steps`` slots it takes ``k = min(len(stream) - 1, free slots)`` tokens as inputs and the next ``k`` as
targets, then drops the ``k`` consumed ones, so a sentence's last token is only ever a target and the row goes on
with the next sentence's ``<S>``. The LSTM state is carried per row between batches, so rows are continuous text.
The backward LM reads reversed sentences (``</S> wn … w1 <S>``) from an independently shuffled stream.

Sentences come one Parquet row group at a time (memory stays flat as the corpus grows), in an order fixed by
(seed, epoch): row groups shuffled, then the rows of each group. Distributed rank r of w takes every w-th
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


@dataclass
class _Unit:
    path: str
    row_group: int


class SentenceStream:
    """Sentences of one direction as (ids, tokens) with boundaries, in a seeded order; position resumable."""

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
    ) -> None:
        self.units = [_Unit(str(f), g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
        if not self.units:
            raise InputError("no token-id row groups to read (is the split empty?)")
        self.seed, self.rank, self.world = seed, rank, world
        self.shuffle, self.loop, self.reverse = shuffle, loop, reverse
        self.epoch, self.unit, self.offset = 0, 0, 0  # the next sentence is #offset of this rank's share of unit

    def _order(self, epoch: int) -> list[int]:
        order = np.arange(len(self.units))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        return order.tolist()

    def _rows(self, epoch: int, position: int) -> tuple[list[list[int]], list[list[str]]]:
        unit = self.units[self._order(epoch)[position]]
        table = pq.ParquetFile(unit.path).read_row_group(unit.row_group, columns=["ids", "tokens"])
        ids, tokens = table.column("ids").to_pylist(), table.column("tokens").to_pylist()
        perm = np.arange(len(ids))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch, position]).shuffle(perm)
        mine = perm[self.rank :: self.world]
        return [ids[i] for i in mine], [tokens[i] for i in mine]

    def __iter__(self) -> Iterator[tuple[list[int], list[str]]]:
        while True:
            while self.unit < len(self.units):
                ids, tokens = self._rows(self.epoch, self.unit)
                while self.offset < len(ids):
                    sentence_ids, sentence_tokens = ids[self.offset], tokens[self.offset]
                    self.offset += 1
                    full_ids = [BOS_ID, *sentence_ids, EOS_ID]
                    full_tokens = [BOS_TOKEN, *sentence_tokens, EOS_TOKEN]
                    if self.reverse:
                        full_ids.reverse()
                        full_tokens.reverse()
                    yield full_ids, full_tokens
                self.unit, self.offset = self.unit + 1, 0
            if not self.loop:
                return
            self.epoch, self.unit, self.offset = self.epoch + 1, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "unit": self.unit, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.unit, self.offset = int(state["epoch"]), int(state["unit"]), int(state["offset"])


class _RowPacker:
    """bilm-tf ``_get_batch`` for one direction: fills (B, T) windows from per-row sentence streams."""

    def __init__(self, stream: SentenceStream, batch_size: int, unroll_steps: int, chars: _CharTable) -> None:
        self.stream, self.batch_size, self.unroll_steps, self.chars = stream, batch_size, unroll_steps, chars
        self.rows: list[tuple[list[int], list[str]] | None] = [None] * batch_size
        self._sentences = iter(stream)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        b, t = self.batch_size, self.unroll_steps
        inputs = np.zeros((b, t), np.int32)
        targets = np.zeros((b, t), np.int32)
        chars = np.zeros((b, t, self.chars.max_chars), np.int32)
        for i in range(b):
            pos = 0
            while pos < t:
                row = self.rows[i]
                if row is None or len(row[0]) <= 1:
                    try:
                        row = self.rows[i] = next(self._sentences)
                    except StopIteration:  # out of data: the incomplete batch is dropped
                        return None
                ids, tokens = row
                k = min(len(ids) - 1, t - pos)
                inputs[i, pos : pos + k] = ids[:k]
                targets[i, pos : pos + k] = ids[1 : k + 1]
                chars[i, pos : pos + k] = self.chars.rows(tokens[:k])
                self.rows[i] = (ids[k:], tokens[k:])
                pos += k
        return inputs, targets, chars

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream.state_dict(),
            "rows": [None if r is None else [list(r[0]), list(r[1])] for r in self.rows],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.rows = [None if r is None else (list(r[0]), list(r[1])) for r in state["rows"]]
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
            SentenceStream(files, seed, rank=rank, world=world, shuffle=shuffle, loop=loop),
            batch_size,
            unroll_steps,
            chars,
        )
        self.backward = (
            _RowPacker(
                SentenceStream(files, seed + 7919, rank=rank, world=world, shuffle=shuffle, loop=loop, reverse=True),
                batch_size,
                unroll_steps,
                chars,
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
