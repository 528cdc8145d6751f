"""The ``elmo`` flow (deployed as ``train``): ingest → vocab → train → export → evaluate → embed the probe sentences.

    python -m flows.pipeline                        # the main job: default corpus, local Prefect and MLflow
    prefect deployment run elmo/train --params '{"params": {"sources": ["/corpus"], "train": {"preset": "small"}}}'

Each stage is one call into elmo_core, configured by that stage's options model (``elmo_core.options``); the
flow's parameters hold those models, and a stage's options given as a dict are laid over the main job's
defaults. A stage writes ``_stage.json`` (its input fingerprint, whether it finished, its result) into its folder:
a rerun with the same inputs skips the finished work, and nothing else decides what is skipped.
"""

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, ConfigDict, Field, field_validator

import flows.common  # noqa: F401  (environment defaults before Prefect loads)
from elmo_core.config import OPTIONS_NAME, WEIGHTS_NAME
from elmo_core.data.vocab import VocabStage
from elmo_core.errors import ConfigError
from elmo_core.ingest import IngestStage, find_sources
from elmo_core.options import (
    CPU_TRAIN_OPTIONS,
    TRACKING_URI_HELP,
    EmbedConfig,
    EmbedOptions,
    ExportConfig,
    IngestConfig,
    IngestOptions,
    Source,
    TrainConfig,
    TrainOptions,
    VocabConfig,
    VocabOptions,
)
from elmo_core.stage import fingerprint_files, run_local, run_once
from elmo_core.text.corpus import write_default_corpus
from elmo_core.tracking import MLflowTracker, resolve_tracking_uri
from elmo_core.train.evaluate import describe_perplexity, evaluate_export
from elmo_core.train.export import ExportStage
from elmo_core.train.launch import TrainStage
from flows.common import PROJECT_ROOT, RETRIED, announce_promotion, mlflow_run_link, run_main, stage
from flows.embed import embed_flow
from flows.summary import print_summary

# The main job's defaults for the default corpus (prose paragraphs): the options a user's dict is laid over.
MAIN_JOB_INGEST = IngestOptions(tokenizer="unicode", split_sentences=True, heldout_fraction=0.05)
MAIN_JOB_VOCAB = VocabOptions(min_count=2)
MAIN_JOB_EMBED = EmbedOptions(tokenizer="unicode")


class PipelineParams(BaseModel):
    """Parameters of the ``elmo`` flow: where things are, and each stage's options."""

    model_config = ConfigDict(extra="forbid")

    sources: list[str | Source] | None = Field(
        None,
        description="corpus files/folders/globs, or {path, split} with split train, heldout or test; "
        "default: Python's own pydoc topics",
    )
    workdir: str = Field("data", description="where every stage writes (relative to the project root)")
    vocab_file: str | None = Field(None, description="keep this vocab.txt (fine-tuning)")
    init_from: str | None = Field(None, description="fine-tune this model directory or MLflow model URI")
    probes: str | None = Field(
        "data/probes/apple.txt", description="sentences to embed at the end, into <workdir>/probe_vectors"
    )
    tracking_uri: str | None = Field(None, description=TRACKING_URI_HELP)
    ingest: IngestOptions = Field(MAIN_JOB_INGEST, description="ingest options (over MAIN_JOB_INGEST)")
    vocab: VocabOptions = Field(MAIN_JOB_VOCAB, description="vocab options (over MAIN_JOB_VOCAB)")
    train: TrainOptions = Field(
        CPU_TRAIN_OPTIONS, description="training options (over CPU_TRAIN_OPTIONS; a preset replaces its model)"
    )
    embed: EmbedOptions = Field(
        MAIN_JOB_EMBED, description="options of the probe sentences' embedding (over MAIN_JOB_EMBED)"
    )

    @field_validator("ingest", "vocab", "train", "embed", mode="before")
    @classmethod
    def _over_defaults(cls, value: Any, info: Any) -> Any:
        """A dict of a few options is laid over the main job's defaults for that stage, not over the bare model's."""
        if not isinstance(value, dict):
            return value
        return cls.model_fields[info.field_name].default.under(value)


def _absolute(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p


def _absolute_source(source: str | Source) -> str | Source:
    if isinstance(source, str):
        return str(_absolute(source))
    return source.model_copy(update={"path": str(_absolute(source.path))})


# ----- tasks: one call into elmo_core each -----------------------------------------------------------------


@task(**RETRIED)
def default_corpus(workdir: str) -> list[str]:
    path, paragraphs = write_default_corpus(Path(workdir) / "corpus" / "pydoc_topics.txt")
    get_run_logger().info("default corpus: %d paragraphs of Python's pydoc topics -> %s", paragraphs, path)
    return [str(path)]


@task(**RETRIED)
@stage
def ingest_stage(config: IngestConfig, out: str, fingerprint: str) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        summary = run_local(IngestStage(), config)
        refused = summary.refusal()
        if refused is not None:
            raise refused
        return {
            "line": summary.line(),
            "sentences": summary.sentences,
            "tokens": summary.tokens,
            "duplicates": summary.duplicates,
            "rejected_lines": summary.rejected_lines,
            "failed_files": summary.errors,
            "warnings": summary.warnings,
        }

    result = run_once(Path(out), fingerprint, work)
    create_markdown_artifact(
        key="ingest-summary", markdown=f"## Ingest\n\n{result['line']}\n", description="Ingest counts"
    )
    return result


@task(**RETRIED)
@stage
def vocab_stage(config: VocabConfig, out: str, fingerprint: str) -> dict[str, Any]:
    result = run_once(Path(out), fingerprint, lambda: {k: float(v) for k, v in run_local(VocabStage(), config).items()})
    create_table_artifact(
        key="corpus-stats",
        table=[{"statistic": k, "value": v} for k, v in result.items()],
        description="Corpus and vocabulary statistics (DuckDB corpus_stats)",
    )
    return result


@task
@stage
def train_stage(config: TrainConfig, out: str, fingerprint: str) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        # resume=True: an interrupted run with these inputs continues; nproc_per_node > 1: torchrun, rank 0's lines
        result = run_local(TrainStage(on_line=get_run_logger().info), config)
        assert result is not None  # the pipeline runs on node 0 (checked in _stage_configs)
        announce_promotion(result.promotion, config.tracking_uri)  # once, as it is decided: a skipped rerun is silent
        return {
            "steps": result.steps,
            "exported_step": result.exported_step,  # export: best (the main job's) may pick an earlier one
            "final_loss": result.final_loss,
            "perplexity": result.perplexity,
            "model_dir": str(result.model_dir),
            "run_id": result.run_id,
            "model_uri": result.model_uri,
            "promotion": result.promotion,
        }

    result = run_once(Path(out), fingerprint, work, fresh_start=True)  # another configuration starts afresh
    link = mlflow_run_link(config.tracking_uri, result["run_id"]) if config.tracking == "mlflow" else None
    if link:
        create_markdown_artifact(
            key="mlflow-run",
            markdown=f"## MLflow run\n\n[{result['run_id']}]({link}): registered model `{result['model_uri']}`\n",
            description="The training run in the MLflow UI",
        )
    result["mlflow_link"] = link
    return result


@task(**RETRIED)
@stage
def export_stage(run_dir: str, out: str, fingerprint: str) -> str:
    def work() -> dict[str, Any]:
        exported = run_local(ExportStage(), ExportConfig(run=run_dir, out=out))
        get_run_logger().info(exported.line())
        return {"model_dir": out, "step": exported.step, "checkpoint": str(exported.source)}

    return run_once(Path(out), fingerprint, work)["model_dir"]


@task
@stage
def evaluate_stage(
    model_dir: str, data: str, config: TrainConfig, run_id: str | None, out: str, fingerprint: str
) -> dict[str, dict[str, float]]:
    """Full-softmax perplexity of the exported model on heldout and test, into the training's MLflow run as
    ``heldout/…`` and ``test/…`` (once per exported model: a rerun with nothing changed logs nothing again) and
    into one artifact table."""

    def work() -> dict[str, Any]:
        if not (run_id and config.tracking == "mlflow"):
            return evaluate_export(model_dir, data, device=config.device)
        tracker = MLflowTracker(config.mlflow_experiment, tracking_uri=config.tracking_uri, run_id=run_id)
        try:
            return evaluate_export(model_dir, data, tracker, config.device)
        finally:
            tracker.close()

    results = run_once(Path(out), fingerprint, work)
    table = [
        {
            "split": split,
            "forward": round(r["perplexity_forward"], 2),
            "backward": round(r["perplexity_backward"], 2),
            "average": round(r["perplexity"], 2),
            "unigram baseline": round(r["perplexity_unigram"], 2),
            "tokens": int(r["eval_tokens"]),
        }
        for split, r in results.items()
    ]
    create_table_artifact(
        key="perplexity",
        table=table,
        description="Perplexity of the exported model per split (full softmax; add-one unigram baseline of train)",
    )
    for split, result in results.items():
        get_run_logger().info("%s", describe_perplexity(result, split))
    return results


# ----- the flow -------------------------------------------------------------------------------------------


@flow(name="elmo", log_prints=True)
def elmo_pipeline(params: PipelineParams = PipelineParams()) -> dict[str, Any]:
    """Train an ELMo biLM on a corpus and embed the probe sentences with it."""
    workdir = _absolute(params.workdir)
    tracking_uri = resolve_tracking_uri(params.tracking_uri, home=workdir)
    sources = [_absolute_source(s) for s in params.sources] if params.sources else default_corpus(str(workdir))

    ingest_dir, vocab_dir, train_dir, export_dir = (workdir / name for name in ("ingest", "vocab", "train", "export"))
    ingest_config, vocab_config, train_config = _stage_configs(params, workdir, sources, tracking_uri)
    ingested = ingest_stage(
        ingest_config,
        str(ingest_dir),
        fingerprint_files(
            [i.path for i in find_sources(sources, ingest_config.split, ingest_config.layout)],
            IngestStage().identity(ingest_config),  # each stage says what a rerun compares
        ),
    )
    stats = vocab_stage(
        vocab_config,
        str(vocab_dir),
        fingerprint_files(ingest_dir.glob("part-*.parquet"), VocabStage().identity(vocab_config)),
    )
    trained = train_stage(
        train_config,
        str(train_dir),
        fingerprint_files([vocab_dir / "token_ids", vocab_dir / "vocab.txt"], TrainStage().identity(train_config)),
    )
    # export and evaluate skip as the stages before them do: the training's result (its run, steps and the step
    # exported) is export's input, the exported files and the vocab's token ids are evaluate's
    model_dir = export_stage(str(train_dir), str(export_dir), fingerprint_files([train_dir / "_stage.json"], trained))
    perplexity = evaluate_stage(
        model_dir,
        str(vocab_dir),
        train_config,
        trained["run_id"],
        str(workdir / "evaluate"),
        fingerprint_files(
            [export_dir / OPTIONS_NAME, export_dir / WEIGHTS_NAME, vocab_dir / "token_ids"], trained["run_id"]
        ),
    )

    embedded = _embed_probes(params, model_dir, workdir) if params.probes else None
    summary = {
        "ingest": ingested["line"],
        "vocab_size": stats["vocab_size"],
        "perplexity": perplexity,
        "model_dir": model_dir,
        "mlflow_run_id": trained["run_id"],
        "mlflow_model_uri": trained["model_uri"],
        "mlflow_link": trained.get("mlflow_link"),
        "tracking_uri": tracking_uri,
        "embeddings": embedded["out"] if embedded else None,
        "query": embedded["query"] if embedded else None,
        "register_as": params.train.register_as,
    }
    print_summary(summary)
    return summary


def _embed_probes(params: PipelineParams, model_dir: str, workdir: Path) -> dict[str, Any]:
    """The probe sentences' own table, replaced whenever the model changes."""
    return embed_flow(
        EmbedConfig(
            model=model_dir,
            input=str(_absolute(params.probes)),
            out=str(workdir / "probe_vectors"),
            **{**params.embed.passed_on(), "overwrite": True},
        )
    )


def _stage_configs(
    params: PipelineParams, workdir: Path, sources: list[str | Source], tracking_uri: str
) -> tuple[IngestConfig, VocabConfig, TrainConfig]:
    """Each stage's options laid over the folders the main job gives it."""
    if params.train.node_rank > 0:
        raise ConfigError(
            f"train.node_rank {params.train.node_rank}: the pipeline runs on node 0; another machine joins its "
            "training with `elmo train --config SAME --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`"
        )
    vocab_dir = workdir / "vocab"
    # the main job's dataset follows its options: one read with others is made anew (afresh), not refused
    ingest = IngestConfig(sources=sources, out=str(workdir / "ingest"), afresh=True, **params.ingest.model_dump())
    vocab = VocabConfig(
        corpus=str(workdir / "ingest"),
        db=str(vocab_dir / "vocab.duckdb"),
        vocab_file=params.vocab_file,
        **params.vocab.model_dump(),
    )
    train = TrainConfig(
        data=str(vocab_dir),
        out=str(workdir / "train"),
        init_from=params.init_from,
        tracking_uri=tracking_uri,
        **params.train.passed_on(),
    )
    return ingest, vocab, train


if __name__ == "__main__":
    import sys

    run_main(elmo_pipeline, PipelineParams.model_validate_json(sys.argv[1]) if len(sys.argv) > 1 else PipelineParams())
