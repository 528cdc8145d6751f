"""One input file ─► one Parquet shard: tokenized, hashed, split into train/heldout, deduplicated inline.

The shard is written to a hidden temporary file; ``manifest.commit_file`` renames it into place."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.ingest.readers import FileStats, line_array, line_blocks, read_records
from elmo_core.options import IngestConfig
from elmo_core.text.tokenize import get_tokenizer, split_sentences, split_whitespace

log = logging.getLogger(__name__)

SHARD_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("sentence_id", pa.string()),
        ("text", pa.string()),
        ("tokens", pa.list_(pa.string())),
        ("n_tokens", pa.int32()),
        ("source", pa.string()),
        ("split", pa.string()),
    ]
)

HASH_SENTENCES = "SELECT md5(s) AS h FROM normalized_sentences"
# a pool is where a sentence counts for deduplication: "corpus" (train and the hash split) or a fixed heldout/test
KNOWN_IN_POOL = "SELECT n.hash FROM new_hashes n SEMI JOIN seen s ON n.hash = s.hash AND s.pool = $pool"
KNOWN_IN_FIXED = "SELECT n.hash FROM new_hashes n SEMI JOIN seen s ON n.hash = s.hash AND s.pool <> 'corpus'"
KNOWN_IN_CORPUS = "SELECT n.hash FROM new_hashes n SEMI JOIN seen s ON n.hash = s.hash AND s.pool = 'corpus'"
FIXED_SPLITS = ("heldout", "test")


_HEX_VALUE = np.zeros(256, np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def sentence_hashes(con: duckdb.DuckDBPyConnection, normalized: pa.Array) -> np.ndarray:
    """Signed 64-bit keys: the last 8 bytes of each string's MD5 read little-endian, i.e. DuckDB's
    ``md5_number_lower`` (MD5 is a standard, so the keys are stable across versions and runs).

    The dedup key, and (other bits) the train/heldout draw. DuckDB computes the hex digests over the Arrow
    array (twice as fast as its ``md5_number_lower``); numpy turns them into integers.
    """
    con.register("normalized_sentences", pa.table({"s": normalized}))
    try:
        digests = con.sql(HASH_SENTENCES).to_arrow_table().column(0).combine_chunks()
    finally:
        con.unregister("normalized_sentences")
    hex_digits = np.frombuffer(digests.buffers()[2], np.uint8)[: 32 * len(digests)].reshape(-1, 32)
    nibbles = _HEX_VALUE[hex_digits[:, 16:]]
    return np.ascontiguousarray((nibbles[:, 0::2] << 4) | nibbles[:, 1::2]).view("<i8").ravel()


_SPLIT_NAMES = pa.array(["train", "heldout"], pa.string())


def _splits(hashes: np.ndarray, heldout_fraction: float) -> pa.Array:
    draw = (hashes.view(np.uint64) >> np.uint64(20)) & np.uint64(0xFFFFF)
    return _SPLIT_NAMES.take(pa.array((draw < heldout_fraction * 0x100000).astype(np.int8)))


def _ordinals_within_runs(keys: pa.StringArray) -> np.ndarray:
    """0, 1, 2, … along each run of equal consecutive ``keys`` (a record's sentences arrive together)."""
    n = len(keys)
    same = np.zeros(n, dtype=bool)
    if n > 1:
        same[1:] = pc.equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    position = np.arange(n)
    return position - np.maximum.accumulate(np.where(same, 0, position))


class _HashSet:
    """A set of int64 hashes as sorted numpy runs, merged like a binary counter (each run at least twice
    the next one's size): lookups are a few vectorized binary searches, memory is 8 bytes per hash, and an
    insert costs O(log n) amortized, so a file of 100M sentences is deduplicated without a Python object per
    sentence."""

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def contains(self, values: np.ndarray) -> np.ndarray:
        found = np.zeros(len(values), dtype=bool)
        for run in self._runs:
            at = np.minimum(np.searchsorted(run, values), len(run) - 1)
            found |= run[at] == values
        return found

    def add(self, values: np.ndarray) -> None:
        """Add hashes that are not in the set yet."""
        run = np.sort(values)
        while self._runs and len(self._runs[-1]) <= 2 * len(run):
            run = np.sort(np.concatenate([self._runs.pop(), run]), kind="stable")  # timsort: a linear merge
        if len(run):
            self._runs.append(run)

    def values(self) -> np.ndarray:
        return np.concatenate(self._runs) if self._runs else np.zeros(0, np.int64)


class _Dedup:
    """Inline deduplication of one file's sentences: against the file's earlier batches (hash sets per pool) and,
    with one DuckDB semi-join per batch, against the ``seen`` table of files already committed."""

    def __init__(self, con: duckdb.DuckDBPyConnection, stats: FileStats, drop_overlap: bool) -> None:
        self.con, self.stats, self.drop_overlap = con, stats, drop_overlap
        self._in_file: dict[str, _HashSet] = {}  # pool ─► hashes of the sentences kept from this file

    def unique(self, hashes: np.ndarray, pools: np.ndarray, texts: pa.Array) -> np.ndarray:
        """Which sentences are new in their pool (this file's earlier batches and the committed files); counts
        duplicates and train/heldout overlap."""
        keep = np.ones(len(hashes), dtype=bool)
        for pool in np.unique(pools):
            at = np.flatnonzero(pools == pool)
            keep[at] = self._first_seen(hashes[at], str(pool))
        self.stats.duplicates += int(len(keep) - keep.sum())
        self._overlap(hashes, pools, texts, keep)
        return keep

    def _first_seen(self, hashes: np.ndarray, pool: str) -> np.ndarray:
        """True for the first copy of each hash of ``pool`` in this file that no committed file holds in it."""
        candidates, first = np.unique(hashes, return_index=True)  # sorted, which makes the lookups cache-friendly
        known = self._known(candidates, KNOWN_IN_POOL, {"pool": pool})
        in_file = self._in_file.setdefault(pool, _HashSet())
        fresh = ~in_file.contains(candidates) & ~known
        in_file.add(candidates[fresh])
        keep = np.zeros(len(hashes), dtype=bool)
        keep[first[fresh]] = True
        return keep

    def _known(self, values: np.ndarray, query: str, parameters: dict | None = None) -> np.ndarray:
        """Which of ``values`` the committed files' ``seen`` table holds, by ``query``."""
        self.con.register("new_hashes", pa.table({"hash": values}))
        try:
            known = self.con.execute(query, parameters or {}).fetchnumpy()["hash"]
        finally:
            self.con.unregister("new_hashes")
        return np.isin(values, known) if len(known) else np.zeros(len(values), dtype=bool)

    def _overlap(self, hashes: np.ndarray, pools: np.ndarray, texts: pa.Array, keep: np.ndarray) -> None:
        """Count the kept sentences that are both in train and in a heldout/test source (committed, or earlier in
        this file), keep the first as an example, and with ``drop_overlap`` drop the train copies."""
        corpus, fixed = np.flatnonzero((pools == "corpus") & keep), np.flatnonzero((pools != "corpus") & keep)
        fixed_here = [s for p, s in self._in_file.items() if p != "corpus"]
        corpus_here = self._in_file.get("corpus")
        in_fixed = self._known(hashes[corpus], KNOWN_IN_FIXED) if len(corpus) else np.zeros(0, dtype=bool)
        for hash_set in fixed_here:
            in_fixed |= hash_set.contains(hashes[corpus])
        in_corpus = self._known(hashes[fixed], KNOWN_IN_CORPUS) if len(fixed) else np.zeros(0, dtype=bool)
        if corpus_here is not None:
            in_corpus |= corpus_here.contains(hashes[fixed])
        both = np.concatenate([corpus[in_fixed], fixed[in_corpus]])
        if not len(both):
            return
        self.stats.overlap += len(np.unique(hashes[both]))  # a shared sentence counts once, whichever side
        if self.stats.overlap_example is None:
            self.stats.overlap_example = str(texts[int(both[0])])
        if self.drop_overlap and in_fixed.any():
            keep[corpus[in_fixed]] = False
            self.stats.overlap_dropped += int(in_fixed.sum())

    def kept(self) -> dict[str, np.ndarray]:
        """The hashes of the kept sentences, by pool: what the manifest's ``seen`` table gets at commit."""
        return {pool: hash_set.values() for pool, hash_set in self._in_file.items()}


class _ShardWriter:
    """Collects (record, text) pairs; writes them tokenized and deduplicated to the shard's ``.tmp`` file.

    Dedup is inline (``_Dedup``): a batch's sentence hashes are checked against this file's earlier hashes and the
    files already committed.

    A record's sentences are numbered k = 0, 1, … (sentence splitting and over-long pieces both count), so
    ``sentence_id`` = ``<key>:<record>:<k>`` and ``doc_id`` = ``<key>:<record>``.
    """

    BATCH = 20_000

    def __init__(
        self,
        path: Path,
        key: str,
        *,
        config: IngestConfig,
        tmp: Path,
        con: duckdb.DuckDBPyConnection,
        stats: FileStats,
        split: str = "auto",
    ) -> None:
        self.key, self.config, self.stats, self.source, self.con = key, config, stats, str(path), con
        self.split = None if split == "auto" else split  # the whole file's split, else per record or by hash
        self.record_splits: dict[str, str] = {}  # record ─► the split its split field named
        self.tokenize = get_tokenizer(config.tokenizer)
        # zstd level 1 and no dictionary for the mostly-unique columns: writing is most of the cost of ingest
        # and min/max statistics only where a filter can use them (not on unique ids and texts)
        self.writer = pq.ParquetWriter(
            tmp,
            SHARD_SCHEMA,
            compression="zstd",
            compression_level=1,
            use_dictionary=["tokens.list.element", "source", "split"],
            write_statistics=["n_tokens", "source", "split"],
        )
        self.records: list[str] = []  # a label per text: "l<line>" or "r<row>" (JSONL lines, Parquet rows)
        self.texts: list[str] = []
        self.dedup = _Dedup(con, stats, config.drop_overlap)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parquet-writer")
        self._pending: Future | None = None

    def _wait_for_write(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises a write error here
            self._pending = None

    def add(self, record: str, text: str, split: str | None = None) -> None:
        if split is not None:
            self.record_splits[record] = split
        pieces = split_sentences(text) if self.config.split_sentences else [text]
        self.records.extend([record] * len(pieces))
        self.texts.extend(pieces)
        if len(self.texts) >= self.BATCH:  # only between records: a record never spans two batches
            self.flush()

    def add_lines(self, before: int, lines: pa.StringArray, block: bytes) -> None:
        """A block of one-sentence-per-line text (``block``: the bytes it was cut from), labelled without a
        Python loop per line."""
        self.flush()
        self.stats.records += len(lines)
        line_numbers = pc.cast(pa.array(np.arange(before + 1, before + len(lines) + 1)), pa.string())
        self._write(lines, pc.binary_join_element_wise("l", line_numbers, ""), one_per_record=True, source=block)

    def flush(self) -> None:
        if self.texts:
            texts, records = pa.array(self.texts, pa.string()), pa.array(self.records, pa.string())
            self.texts, self.records = [], []
            self._write(texts, records, one_per_record=not self.config.split_sentences)

    def _write(
        self, texts: pa.StringArray, records: pa.StringArray, one_per_record: bool, source: bytes | None = None
    ) -> None:
        """Tokenize a batch, drop empty texts, cut over-long ones, name, split and deduplicate the sentences, and
        queue the rows for writing."""
        if not len(texts):
            return
        texts, tokens, counts, records = self._tokenized(texts, records, source)
        if (counts > self.config.max_tokens).any():
            texts, tokens, records = self._split_long(texts, tokens, records, counts)
            counts = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
            one_per_record = False
        if not len(records):
            return
        doc_ids = pc.binary_join_element_wise(f"{self.key}:", records, "")
        ordinals = "0" if one_per_record else pc.cast(pa.array(_ordinals_within_runs(doc_ids)), pa.string())
        hashes = sentence_hashes(self.con, texts)
        splits = self._splits(records, hashes)
        table = pa.table(
            {
                "doc_id": doc_ids,
                "sentence_id": pc.binary_join_element_wise(doc_ids, ordinals, ":"),
                "text": texts,
                "tokens": tokens,
                "n_tokens": pa.array(counts.astype(np.int32)),
                "source": pa.repeat(pa.scalar(self.source, pa.string()), len(records)),
                "split": splits,
            },
            schema=SHARD_SCHEMA,
        )
        if self.config.dedup:
            keep = self.dedup.unique(hashes, self._pools(splits), texts)
            if not keep.all():
                table = table.filter(pa.array(keep))
        self._queue(table)

    def _tokenized(
        self, texts: pa.StringArray, records: pa.StringArray, source: bytes | None
    ) -> tuple[pa.StringArray, pa.ListArray, np.ndarray, pa.StringArray]:
        """(texts, tokens, token counts, records), texts trimmed and those without a token dropped (counted)."""
        texts = pc.utf8_trim_whitespace(texts)  # also drops the newline, and the \r of CRLF files
        if self.config.tokenizer == "whitespace":
            tokens = split_whitespace(texts, source)
        else:
            tokens = pa.array([self.tokenize(t) for t in texts.to_pylist()], pa.list_(pa.string()))
        counts = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
        # Arrow splits "" into [""]: a trimmed empty text has no tokens whatever the count says
        offsets = np.frombuffer(texts.buffers()[1], np.int32)[texts.offset : texts.offset + len(texts) + 1]
        empty = (counts == 0) | (offsets[1:] == offsets[:-1])
        if not empty.any():
            return texts, tokens, counts, records
        self.stats.empty_lines += int(empty.sum())  # blank lines, or text without a single token
        nonempty = np.flatnonzero(~empty)
        return texts.take(nonempty), tokens.take(nonempty), counts[nonempty], records.take(nonempty)

    def _queue(self, table: pa.Table) -> None:
        """Parquet encoding (Arrow, GIL released) overlaps with tokenizing the next block; one block in flight."""
        if table.num_rows:
            self._wait_for_write()
            self._pending = self._io.submit(self.writer.write_table, table, row_group_size=self.config.row_group_size)
        self.stats.sentences += table.num_rows

    def _splits(self, records: pa.StringArray, hashes: np.ndarray) -> pa.Array:
        """Each sentence's split: the file's, its record's split field, or the hash split by heldout_fraction."""
        if self.split is not None:
            return pa.array([self.split] * len(records), pa.string())
        if self.record_splits:
            return pa.array([self.record_splits[r] for r in records.to_pylist()], pa.string())
        return _splits(hashes, self.config.heldout_fraction)

    def _pools(self, splits: pa.Array) -> np.ndarray:
        """Dedup pools: a fixed heldout/test sentence (its file's or its record's split) is deduplicated only
        against its own split, so a benchmark's test file stays whole; every other sentence against the corpus."""
        names = np.asarray(splits.to_pylist(), dtype=object)
        if self.split is None and not self.record_splits:
            return np.full(len(names), "corpus", dtype=object)
        return np.where(np.isin(names, FIXED_SPLITS), names, "corpus")

    def _split_long(
        self, texts: pa.Array, tokens: pa.Array, records: pa.StringArray, counts: np.ndarray
    ) -> tuple[pa.Array, pa.Array, pa.StringArray]:
        """Split rows longer than ``max_tokens`` into pieces, each a sentence of its own (rare: plain Python)."""
        limit = self.config.max_tokens
        out_texts: list[str] = []
        out_tokens: list[list[str]] = []
        out_records: list[str] = []
        for text, toks, record, count in zip(texts.to_pylist(), tokens.to_pylist(), records.to_pylist(), counts):
            if count <= limit:
                out_texts.append(text)
                out_tokens.append(toks)
                out_records.append(record)
                continue
            self.stats.split_long += 1
            for start in range(0, count, limit):
                piece = toks[start : start + limit]
                out_texts.append(" ".join(piece))
                out_tokens.append(piece)
                out_records.append(record)
        return (
            pa.array(out_texts, pa.string()),
            pa.array(out_tokens, pa.list_(pa.string())),
            pa.array(out_records, pa.string()),
        )

    def close(self) -> dict[str, np.ndarray]:
        """Finish the ``.tmp`` file; returns the hashes of the kept sentences, by dedup pool."""
        try:
            self.flush()
            self._wait_for_write()
        finally:
            self._io.shutdown(wait=True)
            self.writer.close()
        return self.dedup.kept()


def write_shard(
    path: Path,
    key: str,
    *,
    fmt: str,
    config: IngestConfig,
    tmp: Path,
    con: duckdb.DuckDBPyConnection,
    stats: FileStats,
    split: str = "auto",
) -> dict[str, np.ndarray]:
    """Tokenize and dedup one file into ``tmp``; returns the kept sentences' hashes by dedup pool."""
    writer = _ShardWriter(path, key, config=config, tmp=tmp, con=con, stats=stats, split=split)
    try:
        if fmt == "text" and not config.split_sentences:
            for before, data, ends in line_blocks(path, stats):
                writer.add_lines(before, line_array(data, ends, path, before + 1, stats), data.obj)
        else:
            for record, text, record_split in read_records(path, fmt, config, stats):
                stats.records += 1
                writer.add(record, text, record_split)
    finally:
        hashes = writer.close()
    return hashes


def shard_paths(out: str | Path) -> list[Path]:
    """The committed-or-complete shards of a dataset (never temporary files)."""
    return sorted(Path(out).glob("part-*.parquet"))
