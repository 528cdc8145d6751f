"""The vocab step (DuckDB counts, ranks, char ids, corpus stats) on a generated Zipfian corpus.

    .venv/bin/python bench/vocab_build.py [--tokens 100_000_000]

Target: under 2 minutes for 100M tokens on the 2-core machine. Prints the time and the peak memory of the
`elmo vocab` process, next to the time DuckDB takes just to scan every token of the same files in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from corpus_gen import peak_rss_mb_of, write_parquet_corpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--memory-limit", default="4GB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        start = time.perf_counter()
        n = write_parquet_corpus(corpus, args.tokens)
        print(
            f"corpus: {n:,} tokens in {len(list(corpus.glob('*.parquet')))} shards (generated in {time.perf_counter() - start:.0f} s)"
        )
        scan = (
            "import duckdb, sys; c = duckdb.connect(); "
            "print(c.execute(\"SELECT count(*) FROM (SELECT unnest(tokens) FROM read_parquet($p))\", {'p': sys.argv[1]}).fetchone()[0])"
        )
        scan_s, scan_mb, _ = peak_rss_mb_of(scan, str(corpus / "*.parquet"))
        cli = "import sys; from elmo_core.cli import main; main(sys.argv[1:])"
        vocab_s, vocab_mb, out = peak_rss_mb_of(
            cli,
            "vocab",
            "--corpus",
            str(corpus),
            "--db",
            str(Path(tmp) / "v" / "vocab.duckdb"),
            "--min-count",
            "1",
            "--memory-limit",
            args.memory_limit,
        )
        print(f"{'step':<44}{'seconds':>10}{'peak MB':>10}")
        print(f"{'DuckDB scan of every token (baseline)':<44}{scan_s:>10.1f}{scan_mb:>10.0f}")
        print(f"{'elmo vocab (counts, vocab, char ids, stats, ids)':<44}{vocab_s:>10.1f}{vocab_mb:>10.0f}")
        print(out.strip())


if __name__ == "__main__":
    main()
