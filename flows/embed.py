"""The ``embed`` flow: a corpus into contextual vectors, one Prefect task per input row group.

    prefect deployment run embed/embed --params '{"config": {"model": "models:/elmo/1", "input": "data/ingest", "out": "data/embed"}}'

Units are independent; with ``run_on_dask`` (prefect-dask) they spread over a Dask cluster's workers.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import flows.common  # noqa: F401  (environment defaults before Prefect loads)
from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from elmo_core.embed import EmbedConfig, Embedder, Unit, UnitResult, prepare, write_manifest

_EMBEDDERS: dict[str, Embedder] = {}  # one loaded model per worker process


@task(retries=2, retry_delay_seconds=5)
def prepare_embedding(config: EmbedConfig) -> dict[str, Any]:
    """Resolve the model (MLflow URIs too), ingest text input, and list the units of work."""
    model_dir, units, corpus = prepare(config)
    return {"model_dir": str(model_dir), "corpus": str(corpus), "units": [asdict(u) for u in units]}


@task(retries=2, retry_delay_seconds=5, tags=["elmo-embed-unit"])
def embed_unit(config: EmbedConfig, model_dir: str, unit: dict[str, Any]) -> dict[str, Any]:
    """One row group in, one Parquet file out (skipped if already written)."""
    key = config.model_dump_json() + model_dir
    if key not in _EMBEDDERS:
        _EMBEDDERS[key] = Embedder(config, Path(model_dir))
    return {**asdict(_EMBEDDERS[key].embed_unit(Unit(**unit), Path(config.out))), "pid": os.getpid()}


@task(retries=2, retry_delay_seconds=5)
def finish_embedding(config: EmbedConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    manifest = write_manifest(Path(config.out), [UnitResult(**{k: v for k, v in r.items() if k != "pid"}) for r in results])
    out = Path(config.out).resolve()
    column = "elmo" if config.layers == "mix" else "layer_2"
    query = (
        f"CREATE VIEW emb AS SELECT * FROM read_parquet('{out}/part-*.parquet');\n"
        f"SELECT token, text, list_cosine_similarity({column}, (SELECT {column} FROM emb WHERE token = 'apples' LIMIT 1)) AS sim\n"
        f"FROM emb WHERE lower(token) LIKE 'apple%' ORDER BY sim DESC LIMIT 5;"
    ) if config.pool == "none" else f"SELECT sentence_id, text FROM read_parquet('{out}/part-*.parquet') LIMIT 5;"
    create_markdown_artifact(
        key="embedding-table",
        markdown=f"## Embedding table\n\n`{out}` — {manifest['rows']:,} rows in {manifest['files']} files.\n\n"
        f"Try it in the `duckdb` shell:\n\n```sql\n{query}\n```\n",
        description="Where the vectors are, and a DuckDB query to try",
    )
    return {"out": str(out), "rows": manifest["rows"], "files": manifest["files"], "query": query,
            "worker_processes": len({r["pid"] for r in results})}


@flow(name="embed", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def embed_flow(config: EmbedConfig) -> dict[str, Any]:
    """Embed ``config.input`` with ``config.model`` into ``config.out`` (resumable; a rerun does only what is missing)."""
    logger = get_run_logger()
    prepared = prepare_embedding(config)
    units = prepared["units"]
    logger.info("%d units to embed with %s", len(units), prepared["model_dir"])
    futures = embed_unit.map(unmapped(config), unmapped(prepared["model_dir"]), units)
    results = [f.result() for f in futures]
    summary = finish_embedding(config, results)
    print(f"embed: {summary['rows']:,} rows -> {summary['out']}")
    return summary


def run_on_dask(config: EmbedConfig, address: str | None = None, n_workers: int = 2) -> dict[str, Any]:
    """The same flow with its units spread over a Dask cluster: an existing one (``address``) or a local one."""
    from prefect_dask import DaskTaskRunner

    runner = DaskTaskRunner(address=address) if address else DaskTaskRunner(
        cluster_kwargs={"n_workers": n_workers, "threads_per_worker": 1, "processes": True})
    return embed_flow.with_options(task_runner=runner)(config)


if __name__ == "__main__":
    import sys

    embed_flow(EmbedConfig.model_validate_json(sys.argv[1]))
