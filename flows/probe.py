"""The ``probe`` flow: judge a model with the word-sense or the tagging probe, per layer.

    prefect deployment run probe/probe --params '{"kind": "wsd", "wsd": {"model": "models:/elmo/latest",
                                                  "out": "data/probe_wsd"}}'
    prefect deployment run probe/probe --params '{"kind": "tag", "tag": {"model": "data/export",
        "train": "data/probes/tagging/train.tsv", "dev": "data/probes/tagging/dev.tsv", "out": "data/probe_tag"}}'

The run's markdown artifact is the per-layer table; the MLflow run holds the metrics and the chart.
"""

from typing import Any, Literal

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

import flows.common  # noqa: F401  (environment defaults before Prefect loads)
from elmo_core.errors import ConfigError
from elmo_core.options import TagConfig, WsdConfig
from elmo_core.stage import run_local
from elmo_core.vectors.probe import ProbeStage, results_table
from flows.common import RETRIED, run_main, stage


@task(**{**RETRIED, "retries": 1})  # a probe is long: one retry
@stage
def probe_task(kind: str, config: WsdConfig | TagConfig) -> dict[str, Any]:
    results = run_local(ProbeStage(), config)
    create_markdown_artifact(
        key=f"probe-{kind}",
        markdown=f"## {kind} probe of `{config.model}`\n\n{results_table(results)}\n",
        description=f"The {kind} probe's scores per layer",
    )
    return results


@flow(name="probe", log_prints=True)
def probe_flow(
    kind: Literal["wsd", "tag"], wsd: WsdConfig | None = None, tag: TagConfig | None = None
) -> dict[str, Any]:
    """Run the ``kind`` probe with its configuration (``wsd`` or ``tag``)."""
    config = wsd if kind == "wsd" else tag
    if config is None:
        raise ConfigError(f"kind {kind!r} needs the {kind!r} parameter (its model, data and out)")
    results = probe_task(kind, config)
    print(results_table(results))
    return results


if __name__ == "__main__":
    import json
    import sys

    params = json.loads(sys.argv[1])
    run_main(
        probe_flow,
        params["kind"],
        WsdConfig.model_validate(params["wsd"]) if params.get("wsd") else None,
        TagConfig.model_validate(params["tag"]) if params.get("tag") else None,
    )
