"""The whole embedding job (read Parquet → biLM → write Parquet) next to raw ``embed_sentences`` on the same
sentences in the same run, bytes written per token, and the job's peak memory at 10k vs 100k sentences.

    .venv/bin/python bench/embed_job.py [--shape small] [--sentences 2000] [--precisions fp32,bf16] [--repeats 3]
        [--memory-sizes 10000,100000] [--cluster-workers 1,2]
        [--cluster-sentences 10000]   (an empty --precisions or --memory-sizes skips that part)

Raw and job runs alternate, ``--repeats`` times each, and the medians are compared (a single run of each moved the
overhead by +-10 points on a shared VM). Targets: job overhead <= 10% over the raw model in each precision; peak
memory flat as the input grows (streamed units of work).

Last, the same job on a local Dask cluster (``run_on_dask``) with 1 and 2 worker processes against one process on
the same machine, each worker with its share of the cores as torch threads, and 2 workers each taking every core
(what the share avoids). Each run is a fresh process; the job's seconds (from the flow's start: model loads
included) and the run's whole wall time (Prefect server and cluster start too) are both printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("ELMO_ALLOW_EMULATED_BF16", "1")  # a bench times bf16 where it is emulated too (the slowdown)

from corpus_gen import peak_rss_mb_of, zipf_words  # noqa: E402

from elmo_core import BiLM  # noqa: E402
from elmo_core.bilm.initialization import init_bilm_tf  # noqa: E402
from elmo_core.config import preset  # noqa: E402
from elmo_core.ingest import IngestConfig, ingest  # noqa: E402
from elmo_core.vectors.embed import EmbedConfig, embed  # noqa: E402

# isort: split
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)

RUN_JOB = """
import sys
from elmo_core.vectors.embed import EmbedConfig, embed
print(embed(EmbedConfig.model_validate_json(sys.argv[1])).line())
"""

ONE_PROCESS = """
import json, sys, time
from elmo_core.vectors.embed import EmbedConfig, embed
start = time.perf_counter()
s = embed(EmbedConfig.model_validate_json(sys.argv[1]))
print(json.dumps({"tokens": s.tokens, "seconds": s.seconds, "wall": time.perf_counter() - start, "threads": []}))
"""

ON_DASK = """
import json, sys, time
from elmo_core.vectors.embed import EmbedConfig
from flows.embed import run_on_dask

if __name__ == "__main__":  # Dask's local workers re-run this script
    start = time.perf_counter()
    threads = int(sys.argv[3]) or None
    s = run_on_dask(EmbedConfig.model_validate_json(sys.argv[1]), n_workers=int(sys.argv[2]), torch_threads=threads)
    print(json.dumps({"tokens": s["tokens"], "seconds": s["seconds"], "wall": time.perf_counter() - start,
                      "threads": s["worker_threads"]}))
"""


def make_corpus(folder: Path, n_sentences: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    words = zipf_words(50_000, seed)
    with open(folder / "text.txt", "w") as f:
        for i in range(n_sentences):
            ids = np.minimum(rng.zipf(1.2, size=rng.integers(10, 41)) - 1, len(words) - 1)
            f.write(" ".join(words[ids]) + f" s{i}\n")
    ingest(
        IngestConfig(
            sources=[str(folder / "text.txt")], out=str(folder / "ingest"), heldout_fraction=0.0, row_group_size=5000
        )
    )
    return folder / "ingest"


def make_model(folder: Path, shape: str) -> Path:
    torch.manual_seed(0)
    bilm = BiLM(preset(shape))
    init_bilm_tf(bilm)
    bilm.save_pretrained(str(folder / shape))
    return folder / shape


def main() -> None:
    from elmo_core import cpu

    print(cpu.describe())  # which CPU these figures come from (AVX-512, avx512_bf16, AMX)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small")
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--memory-shape", default="tiny")
    parser.add_argument("--memory-sizes", default="10000,100000")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; medians are printed")
    parser.add_argument("--cluster-workers", default="1,2", help="local Dask cluster sizes to time ('' skips)")
    parser.add_argument("--cluster-sentences", type=int, default=10000, help="the cluster runs' corpus")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "c").mkdir()
        corpus = make_corpus(root / "c", args.sentences)
        model = make_model(root, args.shape)
        import pyarrow.parquet as pq

        sentences = [
            s
            for shard in sorted(corpus.glob("part-*.parquet"))
            for s in pq.read_table(shard, columns=["tokens"]).column(0).to_pylist()
        ]
        tokens = sum(len(s) for s in sentences)
        bilm = BiLM.from_pretrained(str(model))
        print(f"{args.shape} shape, {len(sentences):,} sentences, {tokens:,} tokens")
        print(f"{'':<44}{'seconds':>9}{'tok/s':>10}")
        sizes = {}
        for precision in [p for p in args.precisions.split(",") if p]:
            bilm.embed_sentences(sentences[:64], precision=precision)  # warm-up
            for dtype in ("float32", "float16") if precision == "fp32" else ("float32",):
                raws, jobs = [], []
                for attempt in range(args.repeats if dtype == "float32" else 1):  # alternating: the same machine
                    start = time.perf_counter()
                    bilm.embed_sentences(sentences, precision=precision)
                    raws.append(time.perf_counter() - start)
                    out = root / f"out-{precision}-{dtype}-{attempt}"  # a fresh folder: the whole job each time
                    start = time.perf_counter()
                    embed(
                        EmbedConfig(model=str(model), input=str(corpus), out=str(out), dtype=dtype, precision=precision)
                    )
                    jobs.append(time.perf_counter() - start)
                    sizes[dtype] = sum(p.stat().st_size for p in out.glob("part-*.parquet"))
                raw, job = float(np.median(raws)), float(np.median(jobs))
                if dtype == "float32":
                    print(f"{'raw embed_sentences, ' + precision + ' (baseline)':<44}{raw:>9.1f}{tokens / raw:>10,.0f}")
                    print(
                        f"{'elmo embed job, ' + precision + ' (Parquet in/out)':<44}{job:>9.1f}{tokens / job:>10,.0f}"
                        f"   overhead {100 * (job - raw) / raw:+.1f}%"
                    )
        for dtype, size in sizes.items():
            width = preset(args.shape).lstm.projection_dim * 2
            print(f"bytes per token written ({dtype}, elmo column of {width}): {size / tokens:,.0f}")
        del bilm

        print(f"\npeak memory of the job ({args.memory_shape} shape), as the input grows:")
        small_model = make_model(root, args.memory_shape)
        for n in (int(x) for x in args.memory_sizes.split(",") if x):
            folder = root / f"m{n}"
            folder.mkdir()
            corpus_n = make_corpus(folder, n, seed=n)
            config = EmbedConfig(model=str(small_model), input=str(corpus_n), out=str(folder / "out"))
            seconds, peak, out = peak_rss_mb_of(RUN_JOB, config.model_dump_json())
            print(f"  {n:>8,} sentences: peak {peak:,.0f} MB, {seconds:.0f} s  ({out.strip().split(' -> ')[0]})")

        if args.cluster_workers:
            (root / "cluster").mkdir()
            big = make_corpus(root / "cluster", args.cluster_sentences, seed=1)
            cluster_runs(root, big, model, [int(n) for n in args.cluster_workers.split(",")], args.cluster_sentences)


def cluster_runs(root: Path, corpus: Path, model: Path, workers: list[int], sentences: int) -> None:
    """One process against a local Dask cluster of 1 and 2 workers, fp32, on the same corpus and model."""
    import json
    import subprocess

    from elmo_core import cpu

    script = root / "on_dask.py"
    script.write_text(ON_DASK)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    env.pop("PREFECT_API_URL", None)  # run_on_dask starts one temporary server for the flow and its workers
    cores = cpu.usable_cores()
    print(
        f"\nthe job on a local Dask cluster ({sentences:,} sentences, fp32, {cores} cores), each run a fresh process:"
    )
    print(f"{'':<52}{'job s':>8}{'tok/s':>9}{'wall s':>9}  torch threads per process")
    runs = [("one process (baseline)", None, 0)] + [(f"Dask, {n} worker(s), share of cores", n, 0) for n in workers]
    if max(workers) > 1 and cores > 1:
        runs.append((f"Dask, {max(workers)} workers, each taking all {cores} cores", max(workers), cores))
    baseline = None
    for i, (name, n, threads) in enumerate(runs):
        config = EmbedConfig(model=str(model), input=str(corpus), out=str(root / f"cluster-{i}"))
        command = (
            [sys.executable, "-c", ONE_PROCESS, config.model_dump_json()]
            if n is None
            else [sys.executable, str(script), config.model_dump_json(), str(n), str(threads)]
        )
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root)
        if done.returncode:
            print(f"{name:<52} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rate = r["tokens"] / r["seconds"]
        baseline = baseline or rate
        threads_text = ", ".join(map(str, r["threads"])) or str(cpu.threads_for(1))
        print(f"{name:<52}{r['seconds']:>8.1f}{rate:>9,.0f}{r['wall']:>9.1f}  {threads_text}   x{rate / baseline:.2f}")


if __name__ == "__main__":
    main()
