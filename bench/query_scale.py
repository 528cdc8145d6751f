"""Nearest-neighbour queries over embedding tables at 10^6-10^7 rows: the exact DuckDB scan against the faiss index
(``elmo index``) and against usearch's HNSW, on the same tables in the same run.

    .venv/bin/python bench/query_scale.py [--sizes 1000000,10000000] [--dim 256] [--queries 100]
        [--exact-queries 100,10] [--usearch-max-rows 1000000] [--real-sentences 20000] [--work DIR] [--keep]
        [--no-build]

Tables: a synthetic one per size in our schema, written as a stream (part files of 500k rows, row groups of 8192):
Zipfian tokens over 50k types; every type has a vector near one of 256 topic centres, and every use of it is that
vector plus noise (so uses of a token cluster, as contextual embeddings do); sentences of long-tailed lengths.
And a real one: Python's documentation prose (the main job's corpus) embedded by `elmo embed` with the TF-trained
fixture model (32 wide).

Per table: build time and peak RSS of `elmo index` (a child process), index bytes against the table's vector bytes,
then ``--queries`` queries (rows drawn with a fixed seed) through ``EmbeddingStore``: p50/p95 latency indexed (right
after a scan of the table has filled the page cache with it, and again for other queries with the index's codes
cached, as in a process that has served for a while), and
exact for the first ``--exact-queries`` of them (an exact query at 10^7 rows takes seconds); recall@10 of the
indexed answer against the exact top 10 (computed for all queries in one streaming pass with numpy, checked against
DuckDB's answer where both ran); token-filtered queries (``like`` = the token) for tokens of several frequencies,
with their answer compared with the exact scan's. usearch (HNSW, int8, cosine) is built on the tables up to
``--usearch-max-rows`` and its search timed on the same query vectors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from elmo_core import cpu  # noqa: E402
from elmo_core.vectors.query import EmbeddingStore  # noqa: E402

PART_ROWS, ROW_GROUP, N_TYPES, N_TOPICS = 500_000, 8192, 50_000, 256


def schema(dim: int) -> pa.Schema:
    return pa.schema(
        [
            ("doc_id", pa.string()),
            ("sentence_id", pa.string()),
            ("token_index", pa.int32()),
            ("token", pa.string()),
            ("text", pa.string()),
            ("elmo", pa.list_(pa.float32(), dim)),
            ("model_id", pa.string()),
        ]
    )


def type_vectors(dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    topics = rng.standard_normal((N_TOPICS, dim)).astype(np.float32)
    return topics[rng.integers(0, N_TOPICS, N_TYPES)] + 0.8 * rng.standard_normal((N_TYPES, dim)).astype(np.float32)


def write_table(
    out: Path, rows: int, dim: int = 256, seed: int = 0, part_rows: int = PART_ROWS, first_part: int = 0
) -> Path:
    """A synthetic embedding table of ``rows`` token rows in ``elmo embed``'s schema, one part at a time
    (``first_part``: number the parts and their sentences after an existing table's, to add to it)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    types = type_vectors(dim, seed)
    weights = 1.0 / (np.arange(N_TYPES) + 2.7)  # Zipf-Mandelbrot
    weights /= weights.sum()
    sentence = first_part * part_rows  # sentences are shorter than a part: ids never collide
    for part, start in enumerate(range(0, rows, part_rows), start=first_part):
        n = min(part_rows, rows - start)
        lengths = np.clip(rng.lognormal(2.8, 0.6, n // 8 + 8).astype(int) + 1, 1, 200)
        lengths = lengths[: np.searchsorted(np.cumsum(lengths), n) + 1]
        lengths[-1] -= lengths.sum() - n
        tokens = rng.choice(N_TYPES, size=n, p=weights)
        words = np.array([f"w{t}" for t in range(N_TYPES)], dtype=object)[tokens]
        sid = np.repeat(np.arange(sentence, sentence + len(lengths)), lengths)
        starts = np.cumsum(lengths) - lengths
        texts = [" ".join(words[s : s + k]) for s, k in zip(starts, lengths)]
        index = np.arange(n) - np.repeat(starts, lengths)
        with pq.ParquetWriter(
            out / f"part-{part:05d}.parquet", schema(dim), compression="zstd", compression_level=1
        ) as w:
            for g in range(0, n, ROW_GROUP):
                m = min(ROW_GROUP, n - g)
                vectors = types[tokens[g : g + m]] + 0.6 * rng.standard_normal((m, dim)).astype(np.float32)
                ids = pa.array([f"s{i:09d}" for i in sid[g : g + m]])
                w.write_table(
                    pa.table(
                        {
                            "doc_id": ids,
                            "sentence_id": ids,
                            "token_index": pa.array(index[g : g + m].astype(np.int32)),
                            "token": pa.array(words[g : g + m].tolist()),
                            "text": pa.array([texts[i - sentence] for i in sid[g : g + m]]),
                            "elmo": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim),
                            "model_id": pa.repeat(pa.scalar("synthetic", pa.string()), m),
                        },
                        schema=schema(dim),
                    )
                )
        sentence += len(lengths)
    return out


def exact_top(table: Path, queries: list[dict], k: int) -> list[float]:
    """The exact k-th best cosine of every query (its own row left out), in one numpy pass over the table.

    Recall is then judged by similarity, not by row identity: real tables hold rows of equal vectors (a token in
    the same context twice), and which of a tie a scan returns is arbitrary.
    """
    q = np.stack([x["vector"] for x in queries]).astype(np.float64)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    best = np.full((len(queries), k), -np.inf)
    own = {(x["sentence_id"], x["token_index"]): j for j, x in enumerate(queries)}
    for path in sorted(table.glob("part-*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(
            batch_size=65536, columns=["elmo", "sentence_id", "token_index"]
        ):
            col = batch.column(0)
            v = col.flatten().to_numpy().reshape(len(col), -1).astype(np.float64)
            sims = (v @ q.T) / np.linalg.norm(v, axis=1)[:, None]
            for i, key in enumerate(zip(batch.column(1).to_pylist(), batch.column(2).to_pylist())):
                if key in own:
                    sims[i, own[key]] = -np.inf
            best = -np.sort(-np.concatenate([best, sims.T], axis=1), axis=1)[:, :k]
    return best[:, -1].tolist()


def recall(similarities: list[list[float]], kth: list[float], k: int, tolerance: float = 1e-5) -> float:
    """Share of the returned rows at least as similar as the exact k-th neighbour (ties count as found)."""
    return float(np.mean([sum(s >= t - tolerance for s in sims[:k]) / k for sims, t in zip(similarities, kth)]))


def pick_queries(table: Path, n: int, seed: int) -> list[dict]:
    """``n`` rows drawn uniformly (a fixed seed), each the first use of its token in its sentence (a query names a
    token and a sentence, which finds the first): token, sentence and vector, read from their row groups."""
    groups = [
        (path, g, pf.metadata.row_group(g).num_rows)
        for path in sorted(table.glob("part-*.parquet"))
        for pf in [pq.ParquetFile(path)]
        for g in range(pf.metadata.num_row_groups)
    ]
    starts = np.cumsum([0] + [m for _, _, m in groups])
    picked = []
    for row in np.random.default_rng(seed).permutation(int(starts[-1])):
        i = int(np.searchsorted(starts, row, side="right") - 1)
        path, g, _ = groups[i]
        t = pq.ParquetFile(path).read_row_group(g, columns=["token", "sentence_id", "token_index", "elmo"])
        offset = int(row - starts[i])
        r = t.slice(offset, 1).to_pylist()[0]
        before = t.slice(max(0, offset - r["token_index"]), min(offset, r["token_index"])).to_pylist()
        if r["token_index"] > offset or any(
            b["token"] == r["token"] and b["sentence_id"] == r["sentence_id"] for b in before
        ):
            continue  # an earlier use in the sentence (or the sentence starts in another row group)
        picked.append({**r, "vector": np.asarray(r.pop("elmo"), np.float32)})
        if len(picked) == n:
            break
    return picked


def build_faiss(table: Path, workers: int) -> tuple[float, float]:
    """``elmo index`` in a child process: (seconds, peak RSS in MiB)."""
    code = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run([sys.executable, '-m', 'elmo_core.cli', 'index', sys.argv[1], '--rebuild', '--workers', "
        "sys.argv[2]], check=True); "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(table), str(workers)], check=True, capture_output=True, text=True
    )
    seconds, peak = out.stdout.split()[-2:]
    return float(seconds), float(peak)


def percentiles(values: list[float]) -> str:
    return f"p50 {np.percentile(values, 50) * 1000:8.1f} ms  p95 {np.percentile(values, 95) * 1000:8.1f} ms"


def timed_queries(store: EmbeddingStore, queries: list[dict], k: int = 10) -> tuple[list[float], list[list[float]]]:
    """Seconds per query and the similarities each answer returned."""
    seconds, answers = [], []
    for x in queries:
        t = time.perf_counter()
        hits = store.nearest_tokens(x["token"], sentence_id=x["sentence_id"], k=k)
        seconds.append(time.perf_counter() - t)
        answers.append([h.similarity for h in hits])
    return seconds, answers


def usearch_figures(table: Path, queries: list[dict], kth: list[float], k: int) -> str:
    """HNSW over int8 cosine codes: build (child process: time, peak RSS), bytes, single-query search, recall."""
    code = f"""
import resource, sys, time, numpy as np, pyarrow.parquet as pq
from usearch.index import Index
t = time.perf_counter()
index, n = None, 0
for path in sorted(__import__("pathlib").Path(sys.argv[1]).glob("part-*.parquet")):
    for b in pq.ParquetFile(path).iter_batches(batch_size=65536, columns=["elmo"]):
        v = b.column(0).flatten().to_numpy().reshape(len(b), -1)
        index = index or Index(ndim=v.shape[1], metric="cos", dtype="i8")
        index.add(np.arange(n, n + len(v)), v, threads={cpu.usable_cores()})
        n += len(v)
index.save(sys.argv[2])
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
    path = table.parent / f"{table.name}.usearch"
    out = subprocess.run(
        [sys.executable, "-c", code, str(table), str(path)], check=True, capture_output=True, text=True
    )
    seconds, peak = (float(x) for x in out.stdout.split()[-2:])
    from usearch.index import Index

    index = Index.restore(str(path), view=True)
    vectors = _all_vectors(table)
    times, answers = [], []
    for x in queries:
        t = time.perf_counter()
        found = index.search(x["vector"], k + 1)
        times.append(time.perf_counter() - t)
        v = vectors[np.asarray(found.keys, dtype=np.int64)].astype(np.float64)
        sims = v @ x["vector"] / (np.linalg.norm(v, axis=1) * np.linalg.norm(x["vector"]))
        answers.append(sorted(sims.tolist(), reverse=True)[1:])  # the query's own row (cosine 1) first
    size = path.stat().st_size
    path.unlink()
    return (
        f"usearch HNSW i8: build {seconds:7.1f} s, peak RSS {peak:7.0f} MiB, {size / 2**20:8.1f} MiB on disk; "
        f"search only {percentiles(times)}; recall@{k} {recall(answers, kth, k):.3f}"
    )


def _all_vectors(table: Path) -> np.ndarray:
    """Every row's vector, in table order (usearch's keys are row numbers): to score its answers exactly."""
    chunks = []
    for path in sorted(table.glob("part-*.parquet")):
        col = pq.read_table(path, columns=["elmo"]).column(0).combine_chunks()
        chunks.append(col.flatten().to_numpy().reshape(len(col), -1))
    return np.concatenate(chunks)


def token_filtered(indexed: EmbeddingStore, exact: EmbeddingStore, table: Path, check: int) -> list[str]:
    """``like`` = one token, for tokens of decreasing frequency: latency (median of 5) and the exact scan's answer."""
    con = __import__("duckdb").connect()
    files = sorted(str(p) for p in table.glob("part-*.parquet"))
    counts = con.execute(
        "SELECT token, count(*) AS n, min(sentence_id) FROM read_parquet($f) GROUP BY token ORDER BY n DESC",
        {"f": files},
    ).fetchall()
    lines = []
    for rank in (0, 10, 100, 1000, 10000):
        if rank >= len(counts):
            break
        token, n, sid = counts[rank]
        times = []
        for _ in range(5):
            t = time.perf_counter()
            hits = indexed.nearest_tokens(token, sentence_id=sid, k=10, like=token)
            times.append(time.perf_counter() - t)
        same = "not checked"
        if rank >= check:
            want = exact.nearest_tokens(token, sentence_id=sid, k=10, like=token)
            same = (
                "= exact"
                if [(h.sentence_id, h.token_index) for h in hits] == [(h.sentence_id, h.token_index) for h in want]
                else "DIFFERS from exact"
            )
        lines.append(
            f"  --like {token!r} (frequency rank {rank}, {n:,} rows): median {np.median(times) * 1000:7.1f} ms, {same}"
        )
    return lines


def bench_table(name: str, table: Path, args: argparse.Namespace, n_exact: int, dim: int) -> None:
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in table.glob("part-*.parquet"))
    vector_bytes = rows * dim * 4
    print(
        f"\n== {name}: {rows:,} rows x {dim} (vectors {vector_bytes / 2**30:.2f} GiB, files {_size(table, 'part-*.parquet') / 2**30:.2f} GiB)"
    )
    if args.no_build and (table / "_index").exists():
        seconds, peak = float("nan"), float("nan")  # (the index of an earlier run, --no-build)
    else:
        seconds, peak = build_faiss(table, args.workers)
    index_bytes = _size(table / "_index")
    print(
        f"faiss IVF-SQ8 (elmo index): build {seconds:7.1f} s, peak RSS {peak:7.0f} MiB, "
        f"{index_bytes / 2**20:8.1f} MiB on disk ({index_bytes / vector_bytes:.0%} of the vectors; codes "
        f"{_size(table / '_index', '**/*.faiss') / vector_bytes:.0%}, exact vectors {_size(table / '_index', '**/*.vectors.npy') / vector_bytes:.0%})"
    )
    both = pick_queries(table, 2 * args.queries, seed=1)
    queries, later = both[::2], both[1::2]
    started = time.perf_counter()
    kth_both = exact_top(table, both, 10)
    kth, kth_later = kth_both[::2], kth_both[1::2]
    print(f"(exact top 10 of {len(both)} queries in one numpy pass: {time.perf_counter() - started:.1f} s)")
    indexed = EmbeddingStore(table)
    timed_queries(indexed, queries[:3])  # opens the shards: the first query of a process pays it
    times, answers = timed_queries(indexed, queries)
    print(
        f"indexed nearest_tokens, {len(queries)} queries, right after the scan of the table (cold page cache): "
        f"{percentiles(times)}; recall@10 {recall(answers, kth, 10):.3f} ({indexed.last_path})"
    )
    for codes in (table / "_index").glob("**/*.faiss"):  # as a process that has served a while: codes cached
        codes.read_bytes()
    warm_times, warm_answers = timed_queries(indexed, later)
    print(
        f"indexed nearest_tokens, {len(later)} other queries, the index's codes in the page cache: "
        f"{percentiles(warm_times)}; recall@10 {recall(warm_answers, kth_later, 10):.3f}"
    )
    exact = EmbeddingStore(table, exact=True)
    ex_times, ex_answers = timed_queries(exact, queries[:n_exact])
    print(
        f"exact (DuckDB scan) nearest_tokens, {n_exact} queries: {percentiles(ex_times)}; recall@10 of the scan "
        f"{recall(ex_answers, kth, 10):.3f} (1.000: the numpy pass agrees); indexed speedup "
        f"x{np.median(ex_times) / np.median(times):,.0f}"
    )
    for line in token_filtered(indexed, exact, table, check=0 if rows <= 2_000_000 else 100):
        print(line)
    if rows <= args.usearch_max_rows:
        print(usearch_figures(table, queries, kth, 10))


def _size(folder: Path, pattern: str = "**/*") -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern) if p.is_file())


def real_table(work: Path, sentences: int) -> Path:
    """Python's documentation prose (the main job's corpus) embedded with the TF-trained fixture model."""
    from corpus_gen import ingest_like_the_main_job

    from elmo_core.text.corpus import write_default_corpus
    from elmo_core.vectors.embed import EmbedConfig, embed

    text, _ = write_default_corpus(work / "pydoc.txt")
    lines = text.read_text(encoding="utf-8").splitlines()[:sentences]
    (work / "real.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    ingest_like_the_main_job(work / "real.txt", work / "real_corpus")
    model = HERE.parent / "tests" / "fixtures" / "allennlp_elmo"
    out = work / "real"
    embed(EmbedConfig(model=str(model), input=str(work / "real_corpus" / "ingest"), out=str(out)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--exact-queries", default="100,10", help="exact queries timed per size (in --sizes order)")
    parser.add_argument("--usearch-max-rows", type=int, default=1_000_000)
    parser.add_argument("--real-sentences", type=int, default=20_000, help="0: no real table")
    parser.add_argument("--workers", type=int, default=1, help="elmo index --workers")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the tables (in --work)")
    parser.add_argument("--no-build", action="store_true", help="use the index a --keep run left (no build figures)")
    args = parser.parse_args()
    print(cpu.describe())
    work = args.work or Path(tempfile.mkdtemp(prefix="query_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.real_sentences:
            table = real_table(work, args.real_sentences)
            bench_table("real: pydoc prose, fixture model, layer mix", table, args, args.queries, 32)
        exact_counts = [int(x) for x in args.exact_queries.split(",")]
        for i, size in enumerate(int(s) for s in args.sizes.split(",")):
            table = work / f"synthetic-{size}"
            if not (table / "part-00000.parquet").exists():
                started = time.perf_counter()
                write_table(table, size, args.dim)
                print(f"\n(wrote {table}: {time.perf_counter() - started:.0f} s)")
            bench_table(f"synthetic {size:,}", table, args, exact_counts[min(i, len(exact_counts) - 1)], args.dim)
            if not args.keep:
                shutil.rmtree(table)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"cpu": cpu.describe(), "threads": os.cpu_count()}))


if __name__ == "__main__":
    main()
