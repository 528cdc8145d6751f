"""The ``elmo`` flow (deployed as ``train``): ingest → vocab → train → export → evaluate → embed the probes.

    python -m flows.pipeline                        # the main job: default corpus, local Prefect and MLflow
    prefect deployment run elmo/train --params '{"params": {"sources": ["/corpus"], "train": {"preset": "small"}}}'

Each stage is one call into elmo_core. A stage writes ``_stage.json`` (its input fingerprint and result) into its
folder; a rerun with the same inputs skips the work, and from then on Prefect serves it from its cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Literal

import flows.common  # noqa: F401  (environment defaults before Prefect loads)
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext
from pydantic import BaseModel, ConfigDict, Field

from elmo_core.config import ModelConfig
from elmo_core.corpus import write_default_corpus
from elmo_core.embed import EmbedConfig
from elmo_core.ingest import IngestConfig, find_inputs, ingest
from elmo_core.train import TrainConfig, evaluate, export_checkpoint, train
from elmo_core.vocab import VocabConfig, build_vocab
from flows.common import PROJECT_ROOT, fingerprint_files, mlflow_run_link
from flows.embed import embed_flow

# The main job's model: small enough to train in minutes on 2 CPU cores, big enough to learn the corpus.
DEFAULT_MODEL = ModelConfig.model_validate({
    "char_cnn": {"embedding": {"dim": 8}, "filters": [[1, 16], [2, 32], [3, 64], [4, 128]], "n_highway": 1},
    "lstm": {"dim": 256, "projection_dim": 64, "n_layers": 2},
})


class TrainSettings(BaseModel):
    """The training knobs a pipeline run exposes (TrainConfig's names); data/out come from the pipeline."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["tiny", "small", "medium", "original"] | None = Field(None, description="a published size instead of `model`")
    model: ModelConfig | None = Field(DEFAULT_MODEL, description="explicit architecture (default: a CPU-sized one)")
    init_from: str | None = None
    n_epochs: float = 10.0
    max_steps: int | None = None
    batch_size: int = 32
    unroll_steps: int = 20
    n_negative_samples_batch: int = 512
    optimizer: Literal["adagrad", "adamw"] = "adagrad"
    learning_rate: float = 0.2
    dropout: float = 0.1
    device: str = "auto"
    seed: int = 0
    tracking: Literal["mlflow", "none"] = "mlflow"
    register_as: str | None = "elmo"

    def to_config(self, data: Path, out: Path, tracking_uri: str | None) -> TrainConfig:
        values = self.model_dump(exclude={"preset", "model"})
        if self.preset:
            values["preset"] = self.preset
        else:
            values["model"] = self.model
        return TrainConfig(data=str(data), out=str(out), tracking_uri=tracking_uri, resume=True, log_every=20,
                           checkpoint_every=200, **values)


class PipelineParams(BaseModel):
    """Parameters of the ``elmo`` flow: the CLI's ingest/vocab/train/embed options, one stage each."""

    model_config = ConfigDict(extra="forbid")

    sources: list[str] | None = Field(None, description="corpus files/folders/globs; default: Python's own pydoc topics")
    workdir: str = Field("data", description="where every stage writes (relative to the project root)")
    tokenizer: Literal["whitespace", "unicode", "chinese"] = "unicode"
    split_sentences: bool = True
    text_field: str = "text"
    text_column: str = "text"
    heldout_fraction: float = 0.05
    min_count: int = 2
    max_vocab: int | None = None
    vocab_file: str | None = Field(None, description="keep this vocab.txt (fine-tuning)")
    train: TrainSettings = TrainSettings()
    probes: str | None = Field("data/probes/apple.txt", description="sentences to embed at the end")
    tracking_uri: str | None = Field(None, description="MLflow store; default sqlite:///<workdir>/mlflow.db")


def _absolute(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p


# ----- stage bookkeeping: fingerprints and stamps -----------------------------------------------------


def _stamp(directory: Path) -> dict[str, Any] | None:
    path = directory / "_stage.json"
    return json.loads(path.read_text()) if path.exists() else None


def _write_stamp(directory: Path, fingerprint: str, result: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "_stage.json.tmp"
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "result": result}, indent=2, default=str) + "\n")
    os.replace(tmp, directory / "_stage.json")


def _run_stage(directory: Path, fingerprint: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Skip the work when the stage folder holds a stamp with the same input fingerprint."""
    stamp = _stamp(directory)
    if stamp and stamp["fingerprint"] == fingerprint:
        get_run_logger().info("%s: inputs unchanged (fingerprint %s…), skipped", directory.name, fingerprint[:12])
        return stamp["result"]
    result = work()
    _write_stamp(directory, fingerprint, result)
    return result


def _stage_cache_key(directory_param: str, fingerprint_param: str) -> Callable[[TaskRunContext, dict[str, Any]], str | None]:
    """Prefect cache key = the input fingerprint, once the stage's stamp on disk confirms its outputs exist."""

    def key(context: TaskRunContext, parameters: dict[str, Any]) -> str | None:
        directory, fingerprint = Path(parameters[directory_param]), parameters[fingerprint_param]
        stamp = _stamp(directory)
        if stamp and stamp["fingerprint"] == fingerprint:
            return hashlib.sha256(f"{directory.resolve()}:{fingerprint}".encode()).hexdigest()  # a file name in result storage
        return None

    return key


# ----- tasks: one call into elmo_core each -----------------------------------------------------------------


@task(retries=2, retry_delay_seconds=5)
def default_corpus(workdir: str) -> list[str]:
    path, paragraphs = write_default_corpus(Path(workdir) / "corpus" / "pydoc_topics.txt")
    get_run_logger().info("default corpus: %d paragraphs of Python's pydoc topics -> %s", paragraphs, path)
    return [str(path)]


@task(retries=2, retry_delay_seconds=5, cache_key_fn=_stage_cache_key("out", "fingerprint"), persist_result=True)
def ingest_stage(config: IngestConfig, out: str, fingerprint: str) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        summary = ingest(config)
        if summary.files_failed and not summary.files_ingested and not summary.files_skipped:
            raise RuntimeError("; ".join(summary.errors))
        return {"line": summary.line(), "sentences": summary.sentences, "tokens": summary.tokens, "duplicates": summary.duplicates,
                "rejected_lines": summary.rejected_lines, "failed_files": summary.errors, "warnings": summary.warnings}

    result = _run_stage(Path(out), fingerprint, work)
    create_markdown_artifact(key="ingest-summary", markdown=f"## Ingest\n\n{result['line']}\n", description="Ingest counts")
    return result


@task(retries=2, retry_delay_seconds=5, cache_key_fn=_stage_cache_key("out", "fingerprint"), persist_result=True)
def vocab_stage(config: VocabConfig, out: str, fingerprint: str) -> dict[str, Any]:
    result = _run_stage(Path(out), fingerprint, lambda: {k: float(v) for k, v in build_vocab(config).items()})
    create_table_artifact(key="corpus-stats", table=[{"statistic": k, "value": v} for k, v in result.items()],
                          description="Corpus and vocabulary statistics (DuckDB corpus_stats)")
    return result


@task(cache_key_fn=_stage_cache_key("out", "fingerprint"), persist_result=True)
def train_stage(config: TrainConfig, out: str, fingerprint: str) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        started = Path(out) / "_started.json"
        if started.exists() and json.loads(started.read_text())["fingerprint"] != fingerprint:
            shutil.rmtree(out)  # checkpoints of another configuration: start this one afresh
        Path(out).mkdir(parents=True, exist_ok=True)
        started.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
        result = train(config)  # resume=True: an interrupted run with these inputs continues
        return {"steps": result.steps, "final_loss": result.final_loss, "perplexity": result.perplexity,
                "model_dir": str(result.model_dir), "run_id": result.run_id, "model_uri": result.model_uri}

    result = _run_stage(Path(out), fingerprint, work)
    link = mlflow_run_link(config.tracking_uri, result["run_id"]) if config.tracking == "mlflow" else None
    if link:
        create_markdown_artifact(key="mlflow-run", markdown=f"## MLflow run\n\n[{result['run_id']}]({link}) — model `{result['model_uri']}`\n",
                                 description="The training run in the MLflow UI")
    result["mlflow_link"] = link
    return result


@task(retries=2, retry_delay_seconds=5)
def export_stage(run_dir: str, out: str) -> str:
    step, checkpoint = export_checkpoint(run_dir, out)
    get_run_logger().info("exported step %d of %s to %s", step, checkpoint, out)
    return out


@task
def evaluate_stage(model_dir: str, heldout: str, unigram: float | None) -> dict[str, float]:
    from elmo_core import BiLM

    result = evaluate(BiLM.from_pretrained(model_dir), heldout)
    table = [{"direction": d, "perplexity": round(result[f"perplexity_{d}" if d != "average" else "perplexity"], 2)}
             for d in ("forward", "backward", "average")]
    if unigram:
        table.append({"direction": "unigram baseline", "perplexity": round(unigram, 2)})
    create_table_artifact(key="heldout-perplexity", table=table, description="Heldout perplexity of the exported model (full softmax)")
    return result


# ----- the flow -------------------------------------------------------------------------------------------


@flow(name="elmo", log_prints=True)
def elmo_pipeline(params: PipelineParams = PipelineParams()) -> dict[str, Any]:
    """Train an ELMo biLM on a corpus and embed the probe sentences with it."""
    workdir = _absolute(params.workdir)
    tracking_uri = params.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{workdir / 'mlflow.db'}"
    sources = [str(_absolute(s)) for s in params.sources] if params.sources else default_corpus(str(workdir))

    ingest_dir, vocab_dir, train_dir, export_dir = workdir / "ingest", workdir / "vocab", workdir / "train", workdir / "export"
    ingest_config = IngestConfig(sources=sources, out=str(ingest_dir), tokenizer=params.tokenizer, split_sentences=params.split_sentences,
                                 text_field=params.text_field, text_column=params.text_column, heldout_fraction=params.heldout_fraction)
    ingested = ingest_stage(ingest_config, str(ingest_dir), fingerprint_files(find_inputs(sources), ingest_config.model_dump()))

    vocab_config = VocabConfig(corpus=str(ingest_dir), db=str(vocab_dir / "vocab.duckdb"), min_count=params.min_count,
                               max_size=params.max_vocab, vocab_file=params.vocab_file)
    stats = vocab_stage(vocab_config, str(vocab_dir), fingerprint_files(ingest_dir.glob("part-*.parquet"), vocab_config.model_dump()))

    train_config = params.train.to_config(vocab_dir, train_dir, tracking_uri)
    trained = train_stage(train_config, str(train_dir), fingerprint_files([vocab_dir / "token_ids", vocab_dir / "vocab.txt"],
                                                                           train_config.model_dump(mode="json")))
    model_dir = export_stage(str(train_dir), str(export_dir))
    heldout = vocab_dir / "token_ids" / "heldout"
    perplexity = evaluate_stage(model_dir, str(heldout), trained["perplexity"].get("perplexity_unigram")) if stats["heldout_tokens"] else {}

    embedded = None
    if params.probes:
        embedded = embed_flow(EmbedConfig(model=model_dir, input=str(_absolute(params.probes)), out=str(workdir / "embed"),
                                          tokenizer=params.tokenizer))
    summary = {
        "ingest": ingested["line"], "vocab_size": stats["vocab_size"], "perplexity": perplexity, "model_dir": model_dir,
        "mlflow_run_id": trained["run_id"], "mlflow_model_uri": trained["model_uri"], "mlflow_link": trained.get("mlflow_link"),
        "tracking_uri": tracking_uri, "embeddings": embedded["out"] if embedded else None, "query": embedded["query"] if embedded else None,
    }
    _print_summary(summary)
    return summary


def _print_summary(s: dict[str, Any]) -> None:
    ppl = s["perplexity"]
    lines = ["", "ELMo pipeline finished.", f"  corpus      {s['ingest']}", f"  vocabulary  {int(s['vocab_size']):,} entries"]
    if ppl:
        lines.append(f"  heldout     perplexity {ppl['perplexity']:.1f} (forward {ppl['perplexity_forward']:.1f}, backward {ppl['perplexity_backward']:.1f})")
    lines.append(f"  model       {s['model_dir']}  (bilm-tf/AllenNLP format: options.json, weights.hdf5, vocab.txt)")
    if s["mlflow_run_id"]:
        store = s["tracking_uri"]
        lines += [f"  MLflow run  {s['mlflow_run_id']} ({s['mlflow_model_uri']})",
                  f"              see it: .venv/bin/mlflow ui --backend-store-uri {store} --port 5000  then {s['mlflow_link']}"]
    if s["embeddings"]:
        lines += [f"  embeddings  {s['embeddings']}",
                  f"  query them  .venv/bin/elmo query {s['embeddings']} --token apples --sentence 'I like to eat apples with a little honey .'",
                  "  or in the duckdb shell:", *("    " + q for q in s["query"].splitlines())]
    print("\n".join(lines))


if __name__ == "__main__":
    import sys

    elmo_pipeline(PipelineParams.model_validate_json(sys.argv[1]) if len(sys.argv) > 1 else PipelineParams())
