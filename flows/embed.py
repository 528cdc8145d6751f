"""The ``embed`` flow: a corpus into contextual vectors, one Prefect task per unit of work (about
``unit_tokens`` tokens of one input row group), and the ``index`` flow.

    prefect deployment run embed/embed --params '{"config": {"model": "models:/elmo/latest",
                                                            "input": "data/ingest", "out": "data/embed"}}'
    prefect deployment run index/index --params '{"config": {"table": "data/embed"}}'

Both run the core's stages (``elmo_core.vectors.embed.EmbedStage``, ``elmo_core.vectors.ann.IndexStage``) through
``flows.common.run_stage``: the same units ``elmo embed`` and ``elmo index`` run, as tasks. With ``run_on_dask``
(prefect-dask) they spread over a Dask cluster's workers. The flows add the artifacts.
"""

import json
import os
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.settings import PREFECT_API_URL
from prefect.task_runners import ThreadPoolTaskRunner

import flows.common  # noqa: F401  (environment defaults before Prefect loads)
from elmo_core import cpu
from elmo_core.options import EmbedConfig, IndexConfig
from elmo_core.vectors.ann import IndexStage, IndexSummary
from elmo_core.vectors.embed import EmbedSummary, embed
from flows.common import run_main, run_stage


def _table_artifact(summary: EmbedSummary) -> dict[str, Any]:
    out, query = summary.out.resolve(), summary.try_query()
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
        "worker_processes": summary.processes,
        "worker_threads": summary.threads,  # torch threads per worker process
    }


def _index_artifact(summary: IndexSummary, table: str) -> dict[str, Any]:
    create_markdown_artifact(
        key="embedding-index",
        markdown=f"## Nearest-neighbour index\n\n{summary.line()}\n\n"
        f"`elmo query` uses it without being asked (`--exact` scans instead):\n\n"
        f"```\nelmo query {table} --token TOKEN --sentence 'THE SENTENCE IT IS IN'\n```\n",
        description="The index beside the embedding table, and a query that uses it",
    )
    return {"index": str(summary.folder), "index_line": summary.line(), "index_shards": summary.shards}


@flow(name="embed", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def embed_flow(config: EmbedConfig) -> dict[str, Any]:
    """Embed ``config.input`` with ``config.model`` into ``config.out`` (a rerun does only what is missing)."""
    # the flow's task runner places the units (threads here; Dask's workers under run_on_dask, each with the GPU
    # its cluster gives it), so the job plans no processes of its own
    summary = embed(config, run=run_stage, per_gpu=False)
    print(summary.line())
    record = _table_artifact(summary)
    if summary.index is not None:
        print(summary.index.line())
        record |= _index_artifact(summary.index, config.out)
    return record


@flow(name="index", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def index_flow(config: IndexConfig) -> dict[str, Any]:
    """Index an embedding table for fast nearest-neighbour queries (a rerun adds only parts not covered yet)."""
    summary = run_stage(IndexStage(), config)
    print(summary.line())
    return _index_artifact(summary, config.table)


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


DRAIN_TIMEOUT_S = 30  # what the flow left queued for the server, sent before it stops
SERVER_START_TIMEOUT_S = 120  # Prefect waits 20 s by default; a busy machine (training beside) can take longer


def _with_one_server(run: Any) -> Any:
    """Run the flow against one temporary Prefect server that the local cluster's workers inherit (they read
    PREFECT_API_URL from the environment they are spawned with), stopped when the job ends."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

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
        # the flow's last logs and events go while the server is up: left queued, Prefect's exit handler retries
        # them against the stopped server for over a minute (the job looked hung after its last line)
        APILogWorker.drain_all(timeout=DRAIN_TIMEOUT_S, at_exit=False)
        EventsWorker.drain_all(timeout=DRAIN_TIMEOUT_S, at_exit=False)
        with temporary_settings(updates={PREFECT_LOGGING_TO_API_ENABLED: False}):  # its own "stopping" line too
            server.stop()


if __name__ == "__main__":
    import sys

    config = json.loads(sys.argv[1])
    if "table" in config:
        run_main(index_flow, IndexConfig.model_validate(config))
    else:
        run_main(embed_flow, EmbedConfig.model_validate(config))
