"""Corpora for the benchmarks: synthetic Zipfian ones (made-up words; nothing downloaded) and real text that a
package installs (the Linux kernel's documentation), ingested as the main job ingests."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np


def zipf_words(n_types: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = np.clip(rng.poisson(5, size=n_types) + 1, 1, 20)
    return np.array(["".join(rng.choice(letters, size=k)) + str(i % 10) for i, k in enumerate(lengths)], dtype=object)


def write_text_corpus(path: Path, target_bytes: int, n_types: int = 200_000, seed: int = 0) -> int:
    """Lines of 5–40 Zipf-distributed tokens until ``target_bytes``; returns the token count."""
    rng = np.random.default_rng(seed)
    words = zipf_words(n_types, seed)
    written = tokens = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            lengths = rng.integers(5, 41, size=10_000)
            ids = np.minimum(rng.zipf(1.2, size=int(lengths.sum())) - 1, n_types - 1)
            flat = words[ids]
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            block = "".join(" ".join(flat[s : s + k]) + "\n" for s, k in zip(starts, lengths))
            f.write(block)
            written += len(block.encode())
            tokens += int(lengths.sum())
    return tokens


def _zipf_shards(n_tokens: int, n_types: int, seed: int, shard_tokens: int):
    """(shard number, sentence lengths, token offsets, token strings) of Zipfian sentences, shard by shard."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    vocabulary = pa.array(zipf_words(n_types, seed).tolist(), pa.string())
    written, shard = 0, 0
    while written < n_tokens:
        want = min(shard_tokens, n_tokens - written)
        lengths = rng.integers(5, 41, size=want // 22 + 1)
        lengths = lengths[: np.searchsorted(np.cumsum(lengths), want) + 1]
        ids = np.minimum(rng.zipf(1.2, size=int(lengths.sum())) - 1, n_types - 1)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        yield shard, lengths, offsets, ids, pa.ListArray.from_arrays(offsets, vocabulary.take(pa.array(ids)))
        written += int(lengths.sum())
        shard += 1


def write_parquet_corpus(
    out: Path, n_tokens: int, n_types: int = 500_000, seed: int = 0, shard_tokens: int = 10_000_000
) -> int:
    """An ingest-format dataset (part-*.parquet) of Zipfian sentences, built with Arrow (no Python per token)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elmo_core.ingest import SHARD_SCHEMA

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    written = 0
    for shard, lengths, _, _, tokens in _zipf_shards(n_tokens, n_types, seed, shard_tokens):
        n = len(lengths)
        names = [f"{shard}:{i}" for i in range(n)]
        split = np.where(rng.random(n) < 0.01, "heldout", "train")
        table = pa.table(
            {
                "doc_id": names,
                "sentence_id": names,
                "text": pa.nulls(n, pa.string()),
                "tokens": tokens,
                "n_tokens": pa.array(lengths.astype(np.int32)),
                "source": pa.array(["generated"] * n),
                "split": pa.array(split),
            },
            schema=SHARD_SCHEMA,
        )
        pq.write_table(table, out / f"part-{shard:05d}.parquet", compression="zstd", row_group_size=50_000)
        written += int(lengths.sum())
    return written


# VmHWM, not ru_maxrss: ru_maxrss survives exec, so a child of a big parent would report the parent's peak
PEAK_REPORTER = (
    "import atexit, json, re\n"
    "def _peak():\n"
    "    status = open('/proc/self/status').read()\n"
    "    print(json.dumps({'peak_mb': int(re.search(r'VmHWM:\\s+(\\d+)', status).group(1)) / 1024}))\n"
    "atexit.register(_peak)"
)


def peak_rss_mb_of(code: str, *args: str) -> tuple[float, float, str]:
    """Run Python ``code`` in a fresh interpreter; return (seconds, its own peak RSS in MB, its stdout)."""
    import json
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", PEAK_REPORTER + "\n" + code, *args], capture_output=True, text=True, check=True
    )
    seconds = time.perf_counter() - start
    lines = result.stdout.strip().splitlines()
    return seconds, json.loads(lines[-1])["peak_mb"], "\n".join(lines[:-1])


def write_token_id_corpus(
    out: Path, n_tokens: int, n_types: int = 500_000, seed: int = 0, shard_tokens: int = 10_000_000
) -> int:
    """A token-id dataset (what `elmo vocab` writes under token_ids/train) of Zipfian sentences."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elmo_core.data.vocab import TOKEN_IDS_SCHEMA

    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for shard, lengths, offsets, ids, tokens in _zipf_shards(n_tokens, n_types, seed, shard_tokens):
        table = pa.table(
            {
                "sentence_id": [f"{shard}:{i}" for i in range(len(lengths))],
                "tokens": tokens,
                "ids": pa.ListArray.from_arrays(offsets, pa.array((ids + 3).astype(np.int32))),
            },
            schema=TOKEN_IDS_SCHEMA,
        )
        pq.write_table(table, out / f"part-{shard:05d}.parquet", compression="zstd", row_group_size=50_000)
        written += int(lengths.sum())
    return written


def ingest_like_the_main_job(text: Path, root: Path, split_sentences: bool = True) -> Path:
    """Ingest and count a text file as the main job does (unicode tokens, 5% heldout by hash, min count 2) under
    ``root``; returns the vocab folder (vocab.txt, token_ids/)."""
    from elmo_core.data.vocab import build_vocab
    from elmo_core.ingest import ingest
    from elmo_core.options import IngestConfig, VocabConfig

    ingest(
        IngestConfig(
            sources=[str(text)],
            out=str(root / "ingest"),
            tokenizer="unicode",
            split_sentences=split_sentences,
            heldout_fraction=0.05,
        )
    )
    build_vocab(VocabConfig(corpus=str(root / "ingest"), db=str(root / "vocab" / "vocab.duckdb"), min_count=2))
    return root / "vocab"


def main_job_data(root: Path) -> Path:
    """The main job's corpus (Python's pydoc topics), ingested and counted as the main job does."""
    from elmo_core.text.corpus import write_default_corpus

    text, _ = write_default_corpus(root / "pydoc.txt")
    return ingest_like_the_main_job(text, root)


KERNEL_DOCS = Path("/usr/share/doc/linux-doc-6.1/Documentation")  # `apt-get install linux-doc-6.1` (Debian 12)
_RST_RULE = re.compile(r"^\s*([=\-~^\"'`#*+:.]){3,}\s*$")  # a title's underline, a table's border


def write_kernel_docs(directory: Path, path: Path) -> int:
    """The Linux kernel's English documentation (reStructuredText and plain text, gzipped as Debian ships it; the
    translations left out), one paragraph per line: ~7M tokens of technical prose, code and tables with a long
    tail of lengths. Markup lines (underlines, ``..`` directives) are dropped. Returns the paragraphs written."""
    if not directory.is_dir():
        raise SystemExit(f"{directory}: missing; install it with `apt-get install linux-doc-6.1` (Debian 12)")
    paragraphs = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for source in sorted(directory.rglob("*.gz")):
            if "translations" in source.relative_to(directory).parts:
                continue
            text = gzip.open(source, "rt", encoding="utf-8", errors="replace").read()
            if "\x00" in text:  # a binary file among the documents (a firmware blob, an image)
                continue
            lines: list[str] = []
            for line in text.splitlines() + [""]:
                if line.strip() and not _RST_RULE.match(line) and not line.lstrip().startswith(".."):
                    lines.append(line.strip())
                elif lines:
                    out.write(" ".join(lines) + "\n")
                    paragraphs, lines = paragraphs + 1, []
    return paragraphs
