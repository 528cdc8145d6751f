"""The ``embed`` flow: a corpus into contextual vectors, one Prefect task per unit of work (about
``unit_tokens`` tokens of one input row group).

    prefect deployment run embed/embed --params '{"config": {"model": "models:/elmo/latest",
                                                            "input": "data/ingest", "out": "data/embed"}}'

Units are independent; with ``run_on_dask`` (prefect-dask) they spread over a Dask cluster's workers. The flow's
progress artifact counts the tokens of finished units. With ``index: true`` the table's nearest-neighbour index
(``elmo_core.ann``) is built after it, one task per shard; the ``index`` flow builds it alone:

    prefect deployment run index/index --params '{"config": {"table": "data/embed"}}'
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.futures import as_completed
from prefect.settings import PREFECT_API_URL
from prefect.task_runners import ThreadPoolTaskRunner

import flows.common  # noqa: F401  (environment defaults before Prefect loads)
from elmo_core import ann, cpu
from elmo_core.embed import EmbedConfig, Embedder, Job, Unit, UnitResult, finish, job_lock, prepare
from elmo_core.options import IndexConfig
from flows.common import RETRIED, progress_over, run_main, stage

_EMBEDDERS: dict[str, Embedder] = {}  # one loaded model per worker process
WORKER_KEYS = ("pid", "threads")  # what a unit's result says of the process that ran it


@task(**RETRIED)
@stage
def prepare_embedding(config: EmbedConfig) -> dict[str, Any]:
    """Check the output folder, resolve the model (MLflow URIs too), tokenize text input, and plan the units."""
    return prepare(config).to_record()


@task(**RETRIED, tags=["elmo-embed-unit"])
def embed_unit(config: EmbedConfig, model_dir: str, model_id: str, target: str, unit: dict[str, Any]) -> dict[str, Any]:
    """One unit in, one Parquet file out (skipped if already written)."""
    key = config.model_dump_json() + model_id
    if key not in _EMBEDDERS:
        share = cpu.apply_thread_share()  # a local cluster's worker: its share of the cores, not all of them
        if share:
            get_run_logger().info(share)
        _EMBEDDERS[key] = Embedder(config, Path(model_dir), model_id)
    result = asdict(_EMBEDDERS[key].embed_unit(Unit(**unit), Path(target)))
    return {**result, "pid": os.getpid(), "threads": torch.get_num_threads()}


@task(**RETRIED)
@stage
def finish_embedding(
    config: EmbedConfig, prepared: dict[str, Any], results: list[dict[str, Any]], seconds: float
) -> dict[str, Any]:
    job = Job.from_record(config, prepared)
    units = [UnitResult(**{k: v for k, v in r.items() if k not in WORKER_KEYS}) for r in results]
    summary = finish(job, units, seconds)
    out = Path(config.out).resolve()
    column = "elmo" if config.layers == "mix" else "layer_1"
    query = (
        (
            f"CREATE VIEW emb AS SELECT * FROM read_parquet('{out}/*.parquet');\n"
            f"SELECT token, text, list_cosine_similarity({column}, (SELECT {column} FROM emb LIMIT 1)) AS similarity\n"
            f"FROM emb ORDER BY similarity DESC LIMIT 5;"
        )
        if config.pool == "none"
        else f"SELECT sentence_id, text FROM read_parquet('{out}/*.parquet') LIMIT 5;"
    )
    create_markdown_artifact(
        key="embedding-table",
        markdown=f"## Embedding table\n\n`{out}`: {summary.rows:,} rows in {summary.units} files "
        f"({summary.units_done_before} done by an earlier run).\n\n{summary.line()}\n\n"
        f"Read it with pandas/pyarrow (`pd.read_parquet('{out}')`) or in the `duckdb` shell:\n\n```sql\n{query}\n```\n",
        description="Where the vectors are, and a DuckDB query to try",
    )
    return {
        "out": str(out),
        "rows": summary.rows,
        "files": summary.units,
        "query": query,
        "line": summary.line(),
        "tokens": summary.tokens,
        "seconds": summary.seconds,
        "worker_processes": len({r["pid"] for r in results}),
        "worker_threads": sorted({r["threads"] for r in results}),  # torch threads per worker process
    }


@task(**RETRIED)
@stage
def plan_index(config: IndexConfig, column: str) -> dict[str, Any]:
    """Check the table and its index, drop stale shards, train the quantizer once, group the new parts."""
    tuning = {"nlist": config.nlist, "nprobe": config.nprobe}
    plan = ann.plan_build(Path(config.table), column, config.shard_rows, config.rebuild, **tuning)
    for note in plan.notes:
        get_run_logger().info("index: %s", note)
    return {"folder": str(plan.folder), "todo": [s.to_record() for s in plan.todo]}


@task(**RETRIED, tags=["elmo-index-shard"])
def index_shard(folder: str, table: str, shard: dict[str, Any]) -> dict[str, Any]:
    """One shard of the index from its parts (on a Dask worker under ``run_on_dask``); its record is written last."""
    import faiss

    faiss.omp_set_num_threads(torch.get_num_threads())  # the worker's share of the cores, as its torch threads
    return ann.build_shard(Path(folder), Path(table), ann.ShardRecord.from_record(shard)).to_record()


def index_table(config: IndexConfig) -> dict[str, Any]:
    """The table's index: shards as tasks (over the flow's workers: a Dask cluster's under ``run_on_dask``), and a
    Prefect artifact with the query to run."""
    started = time.perf_counter()
    table = config.table
    column = ann.pick_column(ann.first_schema(Path(table)).names, config.layer, Path(table))
    with ann.build_lock(Path(table), column, config.wait):
        plan = plan_index(config, column)
        futures = index_shard.map(plan["folder"], unmapped(table), plan["todo"])
        rows = {s["number"]: s["rows"] for s in plan["todo"]}
        with progress_over("index", sum(rows.values()), "rows") as progress:
            for future in as_completed(futures):
                done = future.result()
                progress.advance(rows[done["number"]], f"shard {done['number']}")
        built = [ann.ShardRecord.from_record(f.result()) for f in futures]
        folder = Path(plan["folder"])
        summary = ann.summarize(folder, built, time.perf_counter() - started)
    create_markdown_artifact(
        key="embedding-index",
        markdown=f"## Nearest-neighbour index\n\n{summary.line()}\n\n"
        f"`elmo query` uses it without being asked (`--exact` scans instead):\n\n"
        f"```\nelmo query {table} --token TOKEN --sentence 'THE SENTENCE IT IS IN'\n```\n",
        description="The index beside the embedding table, and a query that uses it",
    )
    return {"index": str(folder), "index_line": summary.line(), "index_shards": summary.shards}


@flow(name="embed", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def embed_flow(config: EmbedConfig) -> dict[str, Any]:
    """Embed ``config.input`` with ``config.model`` into ``config.out`` (a rerun does only what is missing)."""
    started = time.perf_counter()
    with job_lock(config):  # held by the flow's process for the job's life; its tasks may run anywhere
        prepared = prepare_embedding(config)
        units = prepared["units"]
        get_run_logger().info("%d units to embed with %s", len(units), prepared["model_dir"])
        futures = embed_unit.map(
            unmapped(config),
            unmapped(prepared["model_dir"]),
            unmapped(prepared["model_id"]),
            unmapped(prepared["target"]),
            units,
        )
        tokens = {Unit(**u).name: u["tokens"] for u in units}
        with progress_over("embed", sum(tokens.values()), "tokens") as progress:
            for future in as_completed(futures):
                done = future.result()
                progress.advance(tokens[done["name"]], f"{done['name']}: {done['seconds']:.1f} s")
        results = [f.result() for f in futures]
        summary = finish_embedding(config, prepared, results, time.perf_counter() - started)
    print(summary["line"])
    if config.index:
        summary |= index_table(IndexConfig(table=summary["out"], wait=config.wait))
        print(summary["index_line"])
    return summary


@flow(name="index", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def index_flow(config: IndexConfig) -> dict[str, Any]:
    """Index an embedding table for fast nearest-neighbour queries (a rerun adds only parts not covered yet)."""
    summary = index_table(config)
    print(summary["index_line"])
    return summary


def run_on_dask(
    config: EmbedConfig | IndexConfig,
    address: str | None = None,
    n_workers: int = 2,
    torch_threads: int | None = None,
) -> dict[str, Any]:
    """The embed flow (an ``EmbedConfig``) or the index flow (an ``IndexConfig``) with its units or shards spread
    over a Dask cluster: an existing one (``address``) or a local one.

    A local cluster's workers are processes started for the job, each with its share of the cores as torch threads
    (logged by its first unit; ``torch_threads`` sets another count); without a Prefect API configured, one temporary
    Prefect server serves the flow and all of them (not one each) and stops with the job. A unit of a worker that
    dies is redone elsewhere (units are idempotent: unique temporary names, a finished unit is skipped).
    """
    import multiprocessing

    from prefect_dask import DaskTaskRunner

    # a child process being bootstrapped by spawn (its main module re-run) has its name but no parent yet
    if multiprocessing.current_process().name != "MainProcess" and multiprocessing.parent_process() is None:
        raise RuntimeError(
            "run_on_dask was called while a Dask worker process was starting: Dask's local workers re-run the "
            'script that starts them, so put the call under `if __name__ == "__main__":`'
        )
    # each local worker gets cores / n_workers torch threads (cpu.worker_env): torch in every worker taking every
    # core oversubscribes the machine
    cluster = {
        "n_workers": n_workers,
        "threads_per_worker": 1,
        "processes": True,
        "env": cpu.worker_env(n_workers, torch_threads),
    }
    runner = DaskTaskRunner(address=address) if address else DaskTaskRunner(cluster_kwargs=cluster)
    chosen = index_flow if isinstance(config, IndexConfig) else embed_flow
    if address or PREFECT_API_URL.value():
        return chosen.with_options(task_runner=runner)(config)
    return _with_one_server(lambda: chosen.with_options(task_runner=runner)(config))


SERVER_START_TIMEOUT_S = 120  # Prefect waits 20 s by default; a busy machine (training beside) can take longer


def _with_one_server(run: Any) -> Any:
    """Run the flow against one temporary Prefect server that the local cluster's workers inherit (they read
    PREFECT_API_URL from the environment they are spawned with), stopped when the job ends."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import temporary_settings

    server = SubprocessASGIServer()
    server.start(timeout=SERVER_START_TIMEOUT_S)
    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            return run()
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous
        server.stop()


if __name__ == "__main__":
    import sys

    config = json.loads(sys.argv[1])
    if "table" in config:
        run_main(index_flow, IndexConfig.model_validate(config))
    else:
        run_main(embed_flow, EmbedConfig.model_validate(config))
