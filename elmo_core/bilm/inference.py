"""Running a biLM over many sentences: what ``BiLM.embed_sentences``, embedding jobs and probes share.

* ``length_batches`` / ``consecutive_batches``: which sentences share a forward pass: sorted by length (each
  sentence from zero state), or in the given order (the stateful protocol, where row r continues row r).
* ``TokenCache``: layer 0 (char CNN, highway, projection) of a chunk of work's distinct words, as a table;
  sentences then enter the model as (B, T) ids into it.
* ``SharedRows``: the words more than one pass of a chunk reads, first in every pass's table, so that layer 0's
  input gates of them are computed once per chunk, not once per pass.
* ``WordCache``: layer 0 of the words a process has seen, kept across calls (a word's layer 0 depends on the word
  alone), least recently used dropped first: a chunk then pays the char CNN only for words it has not seen.
* ``StateCarry``: bilm-tf's and AllenNLP's stateful protocol over explicit state: row r's final LSTM state
  starts row r of the next call; rows beyond a smaller batch keep theirs, new rows start from zero.
* ``token_rows``: the one loop: per chunk a token table from the word cache, then each batch's token rows.
* ``embed_sentences``: one (L+1, n_tokens, 2P) array per sentence.

The biLM is passed in (a ``model.BiLM``, as ``Embeds`` says what of it is used); this module sits below the model
and never imports it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from elmo_core.defaults import DEFAULT_INFERENCE_PRECISION, WORD_CACHE_BYTES
from elmo_core.word_rows import WordRows

log = logging.getLogger(__name__)

# (h, c) of every layer and direction: h (L, 2, B, P), c (L, 2, B, H); direction 0 forward, 1 backward.
LstmState = tuple[Tensor, Tensor]


class Embeds(Protocol):
    """What running over sentences needs of a biLM (``model.BiLM`` is one)."""

    @property
    def device(self) -> torch.device: ...

    def token_embeddings(self, tokens: Sequence[str], batch_size: int = 1024) -> Tensor: ...

    def token_rows(
        self,
        inputs: Tensor,
        state: LstmState | None = None,
        token_table: Tensor | None = None,
        shared: SharedRows | None = None,
    ) -> tuple[list[Tensor], Tensor, LstmState]: ...

    def prepared(self, precision: str) -> contextlib.AbstractContextManager[Any]: ...


MAX_BATCH_TOKENS = 8192  # padded tokens per forward pass: large enough for efficient matmuls, bounded memory
CACHE_TOKENS = 65_536  # tokens whose distinct words share one token table
STATEFUL_BATCH_SIZE = 64  # rows per call of the stateful protocol, as AllenNLP's ElmoEmbedder


def length_batches(lengths: Sequence[int], max_tokens: int, max_rows: int | None = None) -> list[list[int]]:
    """Indices grouped into batches of similar length: sorted by length (stable), each batch at most
    ``max_rows`` sentences and ``max_tokens`` padded tokens (a longer sentence gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max(lengths[i], 1)  # ascending order: the newcomer is the longest
        if current and (longest * (len(current) + 1) > max_tokens or (max_rows and len(current) >= max_rows)):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def consecutive_batches(
    lengths: Sequence[int], max_tokens: int | None = None, max_rows: int | None = None
) -> list[list[int]]:
    """Indices in the given order, cut into batches of at most ``max_rows`` rows and ``max_tokens`` padded tokens."""
    batches: list[list[int]] = [[]]
    longest = 0
    for i, n in enumerate(lengths):
        grown = max(longest, n, 1)
        current = batches[-1]
        if current and (
            (max_rows and len(current) >= max_rows) or (max_tokens and grown * (len(current) + 1) > max_tokens)
        ):
            batches.append([])
            grown = max(n, 1)
        batches[-1].append(i)
        longest = grown
    return [b for b in batches if b]


class TokenCache:
    """Layer 0 of a fixed word list, computed once: ``table`` (V + 1, P) with row 0 the padding token."""

    def __init__(self, bilm: Embeds, words: Sequence[str], embeddings: Tensor | None = None) -> None:
        """``embeddings`` (V, P): the words' layer 0 where the caller holds it already (a server's word cache)."""
        self.words = list(words)
        if embeddings is None:
            embeddings = bilm.token_embeddings(self.words)
        self.table = torch.cat([embeddings.new_zeros(1, embeddings.shape[1]), embeddings])
        self.index = {word: i + 1 for i, word in enumerate(self.words)}

    def ids(self, sentences: Sequence[Sequence[str]]) -> Tensor:
        """(B, T) ids (cache row, 0 = padding) of sentences whose words are all in the cache."""
        longest = max((len(s) for s in sentences), default=0)
        ids = np.zeros((len(sentences), longest), dtype=np.int64)
        index = self.index
        for b, sentence in enumerate(sentences):
            try:
                ids[b, : len(sentence)] = [index[token] for token in sentence]
            except KeyError as exc:
                raise KeyError(f"token {exc.args[0]!r} (sentence {b}) is not in the token cache") from None
        return torch.from_numpy(ids)

    def pass_ids(self, sentences: Sequence[Sequence[str]], shared: int = 0) -> tuple[Tensor, Tensor]:
        """``ids`` into the rows of ``table`` that these sentences read, and those rows (R,): row 0 (the padding)
        and the ``shared`` rows after it first, whether read or not (``SharedRows``), then the pass's own. A pass is
        not given the rest of the chunk's words: the model runs layer 0's input product over every row of the table
        it gets that it did not keep, and a chunk's table holds the words of several passes (``CACHE_TOKENS``);
        given the whole table, each pass recomputed the products of them all (on bench/manylangs.py's 512 sentences
        in int8: 1.64 s of those products in a 6.4 s call, 0.58 s given its own)."""
        ids = self.ids(sentences).numpy()
        first = shared + 1
        rows, own = np.unique(np.concatenate([np.arange(first), ids.ravel()]), return_inverse=True)  # 0..shared stay
        return torch.from_numpy(own[first:].reshape(ids.shape)), torch.from_numpy(rows)


@dataclass
class SharedRows:
    """The first ``count`` rows of every pass's token table in a chunk of work: the padding row, then the words more
    than one of its passes reads (``shared_first``), the same words in the same order in each. Layer 0 computes
    their input gates with the chunk's first pass, keeps them in ``kept`` (by the weight they were computed with),
    and computes only each pass's own words after them, in room for ``capacity`` rows (the largest table of the
    chunk, boundaries included). Why: frequent words are in every pass, and their input product (2 x 4H wide) was
    recomputed in each: on bench/manylangs.py's 4,096 sentences in int8, 1.5x as many rows as the chunk has words,
    4.2 s of a 39 s job; 2.9 s computed once. Made per chunk by ``token_rows`` and dropped with it, so what is kept
    never outlives the chunk and no two calls share it."""

    count: int
    capacity: int
    kept: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # id(weight): (weight, its gates)


def shared_first(words_of_passes: Sequence[set[str]]) -> tuple[list[str], int, int]:
    """A chunk's words (each pass's distinct words given), the shared ones first, each part sorted; how many are
    shared, and the most words a pass reads of the rest. Shared: read by more than one pass, those read by the most
    first, and at most as many as the largest pass reads, so that a pass's table (shared rows and its own) stays
    within twice the largest it would have alone: words spread evenly over the passes (each read by two of them)
    would otherwise make every pass's table hold half the chunk."""
    seen = Counter(word for words in words_of_passes for word in words)
    largest = max((len(words) for words in words_of_passes), default=0)
    by_passes = sorted((word for word, passes in seen.items() if passes > 1), key=lambda word: (-seen[word], word))
    shared = set(by_passes[:largest])
    most_own = max((sum(word not in shared for word in words) for words in words_of_passes), default=0)
    return sorted(shared) + sorted(word for word in seen if word not in shared), len(shared), most_own


class WordCache:
    """Layer 0 of the words a process has seen, least recently used dropped first past ``max_bytes`` (but never a
    word the current chunk needs: ``word_rows.WordRows``). ``missed``: how many words the last ``table`` computed."""

    def __init__(self, bilm: Embeds, max_bytes: int = WORD_CACHE_BYTES) -> None:
        self.bilm, self.max_bytes = bilm, max_bytes
        self.rows: WordRows[Tensor] = WordRows()
        self.missed = 0

    @property
    def capacity(self) -> int:
        """How many words fit ``max_bytes``, by the size of a row as computed (float32 or bfloat16)."""
        row = self.rows.first()
        return self.max_bytes // max(1, row.numel() * row.element_size()) if row is not None else self.max_bytes

    def table(self, words: Sequence[str]) -> TokenCache:
        """A token cache of ``words`` (distinct), computing only the ones not kept."""
        missing = self.rows.missing(words)
        self.missed = len(missing)
        if missing:
            self.rows.add(missing, self.bilm.token_embeddings(missing))
        self.rows.keep(words, self.capacity)
        return TokenCache(self.bilm, words, torch.stack([self.rows[w] for w in words]) if words else None)


class StateCarry:
    """The LSTM state carried from call to call, per batch row (bilm-tf's ``Batcher`` / AllenNLP semantics)."""

    def __init__(self) -> None:
        self.state: LstmState | None = None

    def reset(self) -> None:
        self.state = None

    def take(self, batch: int) -> LstmState | None:
        """The starting state of a batch of ``batch`` rows: the carried rows, zeros for rows never seen."""
        if self.state is None:
            return None
        h, c = self.state
        if h.shape[2] >= batch:
            return h[:, :, :batch], c[:, :, :batch]
        grow = batch - h.shape[2]
        return (
            torch.cat([h, h.new_zeros(*h.shape[:2], grow, h.shape[3])], dim=2),
            torch.cat([c, c.new_zeros(*c.shape[:2], grow, c.shape[3])], dim=2),
        )

    def keep(self, new_state: LstmState) -> None:
        """Store a call's final state; rows beyond its batch keep what they had."""
        h, c = (s.detach().float() for s in new_state)
        if self.state is not None and self.state[0].shape[2] > h.shape[2]:
            batch = h.shape[2]
            h = torch.cat([h, self.state[0][:, :, batch:]], dim=2)
            c = torch.cat([c, self.state[1][:, :, batch:]], dim=2)
        self.state = (h, c)


@torch.no_grad()
def token_rows(
    bilm: Embeds,
    sentences: Sequence[Sequence[str]],
    batches: list[list[int]],
    carry: StateCarry | None = None,
    words: WordCache | None = None,
) -> Iterator[tuple[list[int], list[Tensor], Tensor]]:
    """Per batch (in order): its sentence indices, its L+1 layers as token rows (N, 2P) (the tokens of its first
    sentence, then the next, …) and each sentence's token count. Runs whatever the model was prepared with; the
    distinct words of each ``CACHE_TOKENS`` of work go through layer 0 once, or not at all where ``words`` (a
    process's word cache) holds them. On CUDA each batch's ids go from pinned memory without blocking: the host
    packs the next batch while the GPU still runs this one (the ids are tiny; the table is on the GPU already)."""
    words = words if words is not None else WordCache(bilm)
    pinned = bilm.device.type == "cuda"  # page-locked host memory: the copy runs without the host waiting for it
    for chunk in _chunks(batches, sentences):
        order, n_shared, most_own = shared_first([{token for i in batch for token in sentences[i]} for batch in chunk])
        cache = words.table(order)
        table = cache.table.to(bilm.device)
        shared = SharedRows(1 + n_shared, 1 + n_shared + most_own + 2)  # the padding row; <S> and </S> at the end
        for batch in chunk:
            ids, rows = cache.pass_ids([sentences[i] for i in batch], n_shared)
            ids, rows = ((t.pin_memory() if pinned else t).to(bilm.device, non_blocking=True) for t in (ids, rows))
            state = carry.take(len(batch)) if carry is not None else None
            token_table = table.index_select(0, rows)
            layers, counts, new_state = bilm.token_rows(ids, state=state, token_table=token_table, shared=shared)
            if carry is not None:
                carry.keep(new_state)
            yield batch, layers, counts


def embed_sentences(
    bilm: Embeds,
    sentences: Sequence[Sequence[str]],
    *,
    batch_size: int | None = None,
    stateful: bool = False,
    carry: StateCarry | None = None,
    precision: str = DEFAULT_INFERENCE_PRECISION,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
) -> list[np.ndarray]:
    """One float32 array (L+1, n_tokens, 2P) per sentence, boundaries removed.

    Stateless (default): sentences are sorted by length into batches of at most ``max_batch_tokens`` padded
    tokens (and ``batch_size`` rows, if given), each starting from zero state, so a sentence's vectors do not
    depend on the rest of the batch. ``stateful=True`` (or a ``carry``, which then persists across calls):
    batches of ``batch_size`` (default 64) in the given order, the state carried per row like AllenNLP's
    ``ElmoEmbedder``. ``precision`` "bf16" runs the matmuls in bfloat16 with the cell state in float32.
    """
    if stateful and carry is None:
        carry = StateCarry()
    in_order = carry is not None
    rows = batch_size or (STATEFUL_BATCH_SIZE if in_order else None)
    batches = plan_batches([len(s) for s in sentences], max_batch_tokens, rows, in_order)
    results: list[np.ndarray | None] = [None] * len(sentences)
    with bilm.prepared(precision):
        for batch, layers, counts in token_rows(bilm, sentences, batches, carry):
            for i, answer in zip(batch, sentence_major(torch.stack(layers), counts.tolist())):
                results[i] = answer
    return results  # type: ignore[return-value]


def plan_batches(
    lengths: Sequence[int], max_tokens: int, max_rows: int | None = None, in_order: bool = False
) -> list[list[int]]:
    """Which sentences share a forward pass: sorted by length under ``max_tokens`` padded tokens and ``max_rows``
    rows (each sentence from zero state), or ``in_order`` (the stateful protocol, where row r continues row r):
    ``max_rows`` rows a pass where given, else ``max_tokens`` padded tokens."""
    if in_order:
        return consecutive_batches(lengths, max_tokens=None if max_rows else max_tokens, max_rows=max_rows)
    return length_batches(lengths, max_tokens, max_rows)


def sentence_major(shaped: Tensor, lengths: Sequence[int], dtype: torch.dtype = torch.float32) -> list[np.ndarray]:
    """A pass's (K, R, D) rows (K layers, R rows: each sentence's ``lengths`` rows after the one before) as one array
    (K, n, D) per sentence, each a view of one host buffer laid out sentence after sentence: one gather on the
    device into that layout (and ``dtype``), one copy to the host where the device is not the CPU, none per sentence.
    Until the last answer is dropped the buffer stays, as NumPy's views keep it."""
    k, r, d = shaped.shape
    starts = np.cumsum([0, *lengths[:-1]])
    rows = [(np.arange(k)[:, None] * r + np.arange(a, a + n)[None, :]).ravel() for a, n in zip(starts, lengths)]
    index = torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64)).to(shaped.device)
    flat = shaped.reshape(k * r, d).index_select(0, index).to(dtype).cpu().numpy()
    answers, at = [], 0
    for n in lengths:
        answers.append(flat[at : at + k * n].reshape(k, n, d))
        at += k * n
    return answers


def sentence_slices(counts: Tensor) -> list[slice]:
    """Each sentence's token rows in a batch's (N, ·) rows, from its token ``counts`` (B,)."""
    ends = np.cumsum(counts.tolist())
    return [slice(int(end - n), int(end)) for end, n in zip(ends, counts.tolist())]


def _chunks(batches: list[list[int]], sentences: Sequence[Sequence[str]]) -> list[list[list[int]]]:
    """Consecutive batches grouped up to ``CACHE_TOKENS`` tokens: one token cache each, so memory stays bounded."""
    chunks: list[list[list[int]]] = [[]]
    tokens = 0
    for batch in batches:
        size = sum(len(sentences[i]) for i in batch)
        if chunks[-1] and tokens + size > CACHE_TOKENS:
            chunks.append([])
            tokens = 0
        chunks[-1].append(batch)
        tokens += size
    return [c for c in chunks if c]
