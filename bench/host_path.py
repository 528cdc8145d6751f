"""The batch embedding job's host path: what ``elmo embed`` spends outside the biLM's LSTMs, and its own pace.

    .venv/bin/python bench/host_path.py [--shapes small,original] [--model noop,real]
        [--cases mix-float32,mix-float16,all-float32,mean-float32] [--tokens 50000] [--real-tokens 5000]
        [--input ingested|text] [--precision fp32] [--threads N] [--unit-tokens 40000] [--workers N]

Measures the real job (``vectors.embed.embed``: read, tokenize for text input, char ids, word cache and char CNN,
the LSTMs, mix, Arrow, Parquet) on the default corpus (Python's pydoc topics, ingested as the main job ingests them),
with random weights of each published shape, per case of layers, dtype and pool: tok/s from an unprofiled run, each
part's share of the job's wall time from a profiled one. ``noop`` replaces the biLM's LSTM stacks (both directions,
every layer), in this process only, by zeros of the shapes and dtypes they return: the job then runs at its host
path's own pace, the most that any faster LSTM or a GPU could give it. ``real`` is the same job with the model.
``--workers N``: the no-op job again in one process and in N (``elmo embed --workers``), how it scales with cores.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import itertools
import logging
import os
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from embed_job import make_model  # noqa: E402
from embed_throughput import describe_machine  # noqa: E402

from elmo_core import cpu  # noqa: E402
from elmo_core.bilm.inference import TokenCache, WordCache, shared_first  # noqa: E402
from elmo_core.bilm.lstm import ElmoLstm  # noqa: E402
from elmo_core.bilm.model import BiLM  # noqa: E402
from elmo_core.config import preset  # noqa: E402
from elmo_core.ingest import IngestConfig, ingest  # noqa: E402
from elmo_core.runtime.engine import Runtime  # noqa: E402
from elmo_core.runtime.output import Output  # noqa: E402
from elmo_core.text.corpus import write_default_corpus  # noqa: E402
from elmo_core.text.manylangs_chars import Bytes  # noqa: E402
from elmo_core.vectors.embed import EmbedConfig, Embedder, embed  # noqa: E402
from elmo_core.vectors.sources import TokenizeStage, work_dir  # noqa: E402

try:  # the pass's table: unit_file.pass_table, or (code before it) Embedder._table, so one bench measures both
    from elmo_core.vectors.unit_file import pass_table as PASS_TABLE  # noqa: E402
except ImportError:
    PASS_TABLE = Embedder._table

# isort: split
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)

CASES: dict[str, dict[str, str]] = {
    "mix-float32": {"layers": "mix", "dtype": "float32"},
    "mix-float16": {"layers": "mix", "dtype": "float16"},
    "all-float32": {"layers": "all", "dtype": "float32"},
    "mean-float32": {"layers": "mix", "dtype": "float32", "pool": "mean"},
}
PARTS = ("read", "tokenize", "char ids", "cache+CNN", "LSTM", "biLM other", "mix", "Arrow", "Parquet", "load", "rest")
LEGEND = [
    "read: ParquetFile + read_row_group + embed_unit's own time (pyarrow's Cython slice/filter/to_pylist, which "
    "cProfile does not see apart)",
    "tokenize: TokenizeStage.work, text input only (--input text; its Parquet writes in ingest's writer thread, "
    "waited for); ingested input has none",
    "char ids: Bytes.rows (the char ids of the words the word cache lacks) + TokenCache.pass_ids (each pass's ids)",
    "cache+CNN: WordCache.table (char CNN, highway and projection of the words not cached, the LRU, the chunk's "
    "token table) + shared_first, less the char ids in it",
    "LSTM: ElmoLstm.forward, layer 0's input product per distinct word (word_steps) and the residuals included; "
    "no-op: zeros",
    "biLM other: BiLM.forward less the LSTMs (<S>/</S> through the char CNN, packing, the gathers into token rows) "
    "+ Runtime.run's torch.stack of the layers",
    "mix: Output.apply; Arrow: the pass's table (unit_file.pass_table); Parquet: ParquetWriter open, "
    "write_table, close",
    "load: Embedder.__init__ (Runtime.open, warm-up), not profiled; rest: plan, claim, manifest, generators, "
    "the profiler's overhead outside the parts",
]
REAL_LSTM = ElmoLstm.forward
_JOBS = itertools.count()


_NOISE: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def noop_lstm(self: ElmoLstm, table: torch.Tensor, ids: torch.Tensor, packing: Any, state: Any, **_: Any) -> Any:
    """``ElmoLstm.forward``'s return without running it: packed outputs (2, N, P) of the table's dtype for every
    layer, and the state it was given (c in float32, as the cell keeps it): h (L, 2, B, P), c (L, 2, B, H). The
    outputs are views of one buffer of random values made once (nothing writes into them): random as real vectors
    are to a compressor (zeros would let zstd write layers 1 and up for nothing, and the layers of the real job's
    table do not compress so)."""
    n, p, layers = ids.shape[1], self.config.projection_dim, self.config.n_layers
    key = (p, table.dtype)
    if key not in _NOISE or _NOISE[key].shape[2] < n:
        _NOISE[key] = torch.randn(layers, 2, max(n, 16_384), p, generator=torch.Generator().manual_seed(0)).to(table)
    noise = _NOISE[key]
    return [noise[i % noise.shape[0], :, :n] for i in range(layers)], (state[0], state[1].float())


@contextlib.contextmanager
def lstms(model: str) -> Iterator[None]:
    """``noop``: every biLM's LSTM stacks replaced by ``noop_lstm`` in this process while the block runs."""
    ElmoLstm.forward = noop_lstm if model == "noop" else REAL_LSTM  # type: ignore[method-assign]
    try:
        yield
    finally:
        ElmoLstm.forward = REAL_LSTM  # type: ignore[method-assign]


@contextlib.contextmanager
def instrumented(profiler: cProfile.Profile | None) -> Iterator[dict[str, float]]:
    """Times the model's load (``Embedder.__init__``) and text input's tokenizing (``TokenizeStage.work``), and
    (``profiler``) profiles each unit (``Embedder.embed_unit``) only, while the block runs."""
    timers = {"load": 0.0, "tokenize": 0.0}

    def timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter() - start

        return wrapper

    def profiled(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if profiler is None:
                return fn(*args, **kwargs)
            profiler.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                profiler.disable()

        return wrapper

    patches = [
        (Embedder, "__init__", timed(Embedder.__init__, "load")),
        (TokenizeStage, "work", timed(TokenizeStage.work, "tokenize")),
        (Embedder, "embed_unit", profiled(Embedder.embed_unit)),
    ]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, fn in patches:
        setattr(owner, name, fn)
    try:
        yield timers
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def _key(fn: Callable[..., Any]) -> tuple[str, int, str]:
    code = fn.__code__
    return code.co_filename, code.co_firstlineno, code.co_name


def _cum(stats: dict, *fns: Callable[..., Any]) -> float:
    """The cumulative seconds of these Python functions in the profile."""
    return sum(stats[_key(fn)][3] for fn in fns if _key(fn) in stats)


def _stack_in_run(stats: dict) -> float:
    """The seconds of ``torch.stack`` called by ``Runtime.run`` (a builtin: found by name, then by its caller)."""
    run = _key(Runtime.run)
    return sum(
        entry[4][run][3]
        for (_, _, name), entry in stats.items()
        if name.startswith("<built-in") and "stack" in name and run in entry[4]
    )


def shares(profiler: cProfile.Profile, timers: dict[str, float], wall: float, lstm: Callable[..., Any]) -> dict:
    """Each part's seconds (``LEGEND``) in a profiled job of ``wall`` seconds."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    unit = stats.get(_key(Embedder.embed_unit), (0, 0, 0.0, 0.0, {}))
    char_ids = _cum(stats, Bytes.rows)
    lstm_seconds = _cum(stats, lstm)
    parts = {
        "read": _cum(stats, pq.ParquetFile.__init__, pq.ParquetFile.read_row_group) + unit[2],
        "tokenize": timers["tokenize"],
        "char ids": char_ids + _cum(stats, TokenCache.pass_ids),
        "cache+CNN": _cum(stats, WordCache.table, shared_first) - char_ids,
        "LSTM": lstm_seconds,
        "biLM other": _cum(stats, BiLM.forward) - lstm_seconds + _stack_in_run(stats),
        "mix": _cum(stats, Output.apply),
        "Arrow": _cum(stats, PASS_TABLE),
        "Parquet": _cum(stats, pq.ParquetWriter.__init__, pq.ParquetWriter.write_table, pq.ParquetWriter.close),
        "load": timers["load"],
    }
    parts["rest"] = wall - sum(parts.values())
    return parts


def run_job(
    model: Path, corpus: Path, case: str, root: Path, args: argparse.Namespace, profile: bool, workers: int = 1
) -> dict:
    """One ``elmo embed`` job into a fresh folder (removed after, with its work folder): tokens, wall seconds, the
    units' seconds, and (``profile``) each part's seconds."""
    out = root / f"out-{next(_JOBS)}"
    config = EmbedConfig(
        model=str(model),
        input=str(corpus),
        out=str(out),
        device="cpu",
        precision=args.precision,
        tokenizer="unicode",
        unit_tokens=args.unit_tokens,
        **({"workers": workers} if workers > 1 else {}),
        **CASES[case],  # type: ignore[arg-type]
    )
    profiler = cProfile.Profile() if profile else None
    with instrumented(profiler) as timers:
        start = time.perf_counter()
        summary = embed(config)
        wall = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work_dir(out), ignore_errors=True)
    result = {"tokens": summary.tokens, "wall": wall, "units": sum(summary.unit_seconds)}
    if profiler is not None:
        lstm = noop_lstm if ElmoLstm.forward is noop_lstm else REAL_LSTM
        result["parts"] = shares(profiler, timers, wall, lstm)
    return result


def default_corpus(root: Path) -> Path:
    """Python's pydoc topics (the main job's default corpus), ingested as the main job does: sentences, unicode
    tokens, all of them train."""
    text, _ = write_default_corpus(root / "pydoc.txt")
    out = root / "pydoc"
    ingest(
        IngestConfig(sources=[str(text)], out=str(out), tokenizer="unicode", split_sentences=True, heldout_fraction=0.0)
    )
    return out


def corpus_line(full: Path, sizes: dict[str, int]) -> str:
    """What the corpus holds (the char CNN's work is per distinct word, once per job), and what each job takes."""
    tokens = pa.concat_tables(pq.read_table(p, columns=["tokens"]) for p in sorted(full.glob("part-*.parquet")))
    sentences = tokens.column(0).to_pylist()
    n = sum(len(s) for s in sentences)
    distinct = len({t for s in sentences for t in s})
    return (
        f"corpus: Python's pydoc topics, {len(sentences):,} sentences, {n:,} tokens, {distinct:,} distinct words "
        f"(unicode tokens, as the main job ingests them); no-op jobs take {sizes['noop']:,} tokens, the real "
        f"model's {sizes['real']:,} (the corpus again under new ids past its end: its words then cached)"
    )


def capped(full: Path, n_tokens: int, folder: Path, as_text: bool) -> Path:
    """The sentences of ``full`` up to ``n_tokens`` tokens (again under new ids past its end) as an ingested
    dataset, or (``as_text``) as a text file, a sentence a line, for the job to tokenize."""
    table = pa.concat_tables(pq.read_table(p) for p in sorted(full.glob("part-*.parquet")))
    rows, picked, total = table.to_pylist(), [], 0
    for copy in itertools.count():
        for row in rows:
            if total >= n_tokens:
                break
            ids = {"doc_id": f"{row['doc_id']}#{copy}", "sentence_id": f"{row['sentence_id']}#{copy}"}
            picked.append({**row, **ids})
            total += row["n_tokens"]
        if total >= n_tokens or not total:
            break
    folder.mkdir(parents=True)
    if as_text:
        path = folder / "text.txt"
        path.write_text("".join(row["text"].replace("\n", " ") + "\n" for row in picked), encoding="utf-8")
        return path
    shard = pa.Table.from_pylist(picked, schema=table.schema)
    pq.write_table(shard, folder / "part-00000.parquet", compression="zstd", row_group_size=50_000)
    return folder


def measure(model: Path, corpora: dict[str, Path], kind: str, root: Path, args: argparse.Namespace) -> list[dict]:
    """Every case of one shape's ``kind`` (noop or real): a warm-up job, then each case unprofiled and profiled."""
    rows = []
    with lstms(kind):
        run_job(model, corpora["warm-up"], args.cases[0], root, args, profile=False)  # torch's first-call costs
        for case in args.cases:
            plain = run_job(model, corpora[kind], case, root, args, profile=False)
            profiled = run_job(model, corpora[kind], case, root, args, profile=True)
            rows.append({"case": case, "model": kind, **plain, "profiled": profiled["wall"], **profiled["parts"]})
            print(f"  ... {case} {kind}: {plain['tokens'] / plain['units']:,.0f} tok/s", file=sys.stderr, flush=True)
    return rows


# the no-op in the job's worker processes too: they are spawned, so it comes with Python's start (``sitecustomize``)
SITE = """import os, sys
if os.environ.get("ELMO_BENCH_NOOP_LSTM"):
    sys.path.insert(0, os.environ["ELMO_BENCH_NOOP_LSTM"])
    import host_path
    host_path.ElmoLstm.forward = host_path.noop_lstm
"""


def scaling(model: Path, corpus: Path, root: Path, args: argparse.Namespace) -> None:
    """The no-op job (mix float32) in one process and in ``--workers`` processes over its units (``elmo embed
    --workers``), each with its share of the cores; tok/s over the job's wall time (each process loads the model)."""
    site = root / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    rates = {}
    with lstms("noop"), cpu.environment({"ELMO_BENCH_NOOP_LSTM": str(HERE), "PYTHONPATH": path}):
        for workers in (1, args.workers):
            result = run_job(model, corpus, "mix-float32", root, args, profile=False, workers=workers)
            rates[workers] = result["tokens"] / result["wall"]
    print(
        f"  workers: no-op mix-float32 over {result['tokens']:,} tokens, tok/s over the job's wall time: 1 process "
        f"{rates[1]:,.0f}, {args.workers} processes {rates[args.workers]:,.0f} ({rates[args.workers] / rates[1]:.2f}x)"
    )


def print_table(shape: str, rows: list[dict], args: argparse.Namespace) -> None:
    lstm = preset(shape).lstm
    print(
        f"\n{shape} shape ({lstm.n_layers}x{lstm.dim}_{lstm.projection_dim}), precision {args.precision}, input "
        f"{args.input}: tok/s over the units (unprofiled; load and warm-up left out), each part's share of the "
        "profiled job's wall time"
    )
    widths = [max(len(p) + 2, 7) for p in PARTS]
    header = f"{'case':<14}{'model':<6}{'tokens':>8}{'job s':>8}{'tok/s':>9}{'x real':>8}{'prof s':>8}  "
    header += "".join(f"{p:>{w}}" for p, w in zip(PARTS, widths))
    print(header)
    print("-" * len(header))
    real = {r["case"]: r["tokens"] / r["units"] for r in rows if r["model"] == "real"}
    for r in sorted(rows, key=lambda r: (args.cases.index(r["case"]), r["model"] != "noop")):
        rate = r["tokens"] / r["units"]
        ratio = f"{rate / real[r['case']]:.1f}x" if r["model"] == "noop" and r["case"] in real else ""
        line = f"{r['case']:<14}{r['model']:<6}{r['tokens']:>8,}{r['wall']:>8.1f}{rate:>9,.0f}{ratio:>8}"
        line += f"{r['profiled']:>8.1f}  "
        line += "".join(f"{100 * r[p] / r['profiled']:>{w - 1}.1f}%" for p, w in zip(PARTS, widths))
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="small,original")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--model", default="noop,real", help="noop (LSTMs replaced by zeros), real, or both")
    parser.add_argument("--tokens", type=int, default=50_000, help="the no-op jobs' corpus (the whole has 53k)")
    parser.add_argument("--real-tokens", type=int, default=5_000, help="the real model's corpus (slow on a CPU)")
    parser.add_argument("--input", choices=("ingested", "text"), default="ingested", help="text: the job tokenizes")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the runtime's)")
    parser.add_argument("--unit-tokens", type=int, default=40_000, help="tokens per unit (the job's default)")
    parser.add_argument("--workers", type=int, default=0, help="also: the no-op job in 1 and in N processes")
    args = parser.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; expected some of {list(CASES)}")
    kinds = [k for k in ("noop", "real") if k in args.model.split(",")]
    if args.threads:
        os.environ[cpu.THREADS] = str(args.threads)  # what the runtime's take_threads applies
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    print(describe_machine())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full = default_corpus(root)
        sizes = {"warm-up": 2_000, "noop": args.tokens, "real": args.real_tokens}
        print(corpus_line(full, sizes))
        corpora = {k: capped(full, n, root / f"corpus-{k}", args.input == "text") for k, n in sizes.items()}
        for shape in args.shapes.split(","):
            model = make_model(root, shape)
            rows = [row for kind in kinds for row in measure(model, corpora, kind, root, args)]
            print_table(shape, rows, args)
            if args.workers > 1:
                scaling(model, corpora["noop"], root, args)
            shutil.rmtree(model)
    print("\nparts:")
    for line in LEGEND:
        print(f"  {line}")


if __name__ == "__main__":
    main()
