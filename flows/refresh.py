"""The ``refresh`` flow: a table that follows a model (``elmo_core.vectors.tables``). ``prefect.yaml``'s
``refresh/champion`` deployment runs it on every ``elmo.model.promoted`` event (its trigger fills ``model``,
``alias`` and ``tracking_uri`` from the event), one run at a time (its concurrency limit queues the next):

    prefect deployment run refresh/champion --params '{"model": "models:/elmo/3"}'

The plan (the model pinned, the alias checked) is a retried task, as are the embedding's and the index's units and
the switch: an MLflow server away for a while or a lost worker is retried with backoff (``flows.common.RETRIED``);
a bad parameter fails the run at once, in one line.
"""

import json
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

import flows.common  # noqa: F401  (environment defaults before Prefect loads)
from elmo_core.options import RefreshConfig
from elmo_core.vectors.tables import RefreshPlan, plan_refresh, run_refresh
from flows.common import RETRIED, run_main, run_stage, stage


@task(**RETRIED)
@stage
def plan(config: RefreshConfig) -> RefreshPlan:
    return plan_refresh(config)


@flow(name="refresh", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def refresh_flow(
    config: RefreshConfig, model: str | None = None, alias: str | None = None, tracking_uri: str | None = None
) -> dict[str, Any]:
    """Embed ``config.input`` with ``model`` (default ``config.model``) into a new version of ``config.table``,
    index it and switch to it. ``alias`` and ``tracking_uri``: the promotion event's (an empty value: not given)."""
    given = {"model": model, "alias": alias, "tracking_uri": tracking_uri}
    config = config.model_copy(update={key: value for key, value in given.items() if value})
    refresh = run_refresh(plan(config), run=run_stage, per_gpu=False)
    print(refresh.line())
    create_markdown_artifact(
        key="table-in-use",
        markdown=f"## Table in use\n\n{refresh.line()}\n\nRead it in the `duckdb` shell:\n\n```sql\n"
        f"{refresh.try_query()}\n```\n",
        description="Which model version the table holds now",
    )
    return refresh.record()


if __name__ == "__main__":
    import sys

    run_main(refresh_flow, RefreshConfig.model_validate(json.loads(sys.argv[1])))
