"""Ingest MB/s on a generated corpus next to plain line-by-line reading of the same file, in one run.

    .venv/bin/python bench/ingest_throughput.py [--mb 200]

Target: >= 20 MB/s per core with the whitespace tokenizer (ingest runs on one core).
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus_gen import write_text_corpus  # noqa: E402

from elmo_core.ingest import IngestConfig, IngestSummary, ingest  # noqa: E402


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads): MB per CPU second is the per-core rate."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        start = time.perf_counter()
        tokens = write_text_corpus(corpus, args.mb * 1_000_000)
        size = corpus.stat().st_size / 1e6
        print(f"corpus: {size:.0f} MB, {tokens:,} tokens (generated in {time.perf_counter() - start:.1f} s)")

        start = time.perf_counter()
        lines = 0
        with open(corpus, encoding="utf-8") as f:
            for _ in f:
                lines += 1
        raw = time.perf_counter() - start

        def timed_ingest(source: Path, out: str) -> tuple[float, float, IngestSummary]:
            cpu_before, start = _cpu_seconds(), time.perf_counter()
            summary = ingest(IngestConfig(sources=[str(source)], out=str(Path(tmp) / out)))
            return time.perf_counter() - start, _cpu_seconds() - cpu_before, summary

        took, cpu, summary = timed_ingest(corpus, "out")
        # the same lines, each ending in a no-break space: Arrow's Unicode splitter runs instead of the ASCII one
        unicode_corpus = Path(tmp) / "corpus-nbsp.txt"
        unicode_corpus.write_bytes(corpus.read_bytes().replace(b"\n", b"\xc2\xa0\n"))
        corpus.unlink()
        unicode_size = unicode_corpus.stat().st_size / 1e6
        u_took, u_cpu, _ = timed_ingest(unicode_corpus, "out-nbsp")

        print(f"{'step':<42}{'seconds':>10}{'MB/s':>10}{'CPU s':>8}{'MB per CPU s':>14}")
        print(f"{'read lines (baseline)':<42}{raw:>10.1f}{size / raw:>10.1f}")
        print(f"{'elmo ingest (whitespace, dedup)':<42}{took:>10.1f}{size / took:>10.1f}{cpu:>8.1f}{size / cpu:>14.1f}")
        print(
            f"{'  same, Unicode separators in every block':<42}{u_took:>10.1f}{unicode_size / u_took:>10.1f}{u_cpu:>8.1f}{unicode_size / u_cpu:>14.1f}"
        )
        print(
            f"ingest kept {summary.sentences:,} of {lines:,} lines ({summary.duplicates:,} duplicates), {summary.tokens:,} tokens"
        )
        verdict = "meets" if size / cpu >= 20 else "misses"
        print(
            f"per core: {size / cpu:.1f} MB per CPU second, {verdict} the target of 20 (ingest CPU time counts every thread)"
        )


if __name__ == "__main__":
    main()
