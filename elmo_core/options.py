"""Every stage's options, defined once: the ``elmo`` CLI, the Prefect flows, MLflow params and checkpoints use these.

Per stage, *options* say what to do and a *config* adds where (input and output paths):

    IngestOptions    + sources, out          = IngestConfig
    VocabOptions     + corpus, db, vocab_file = VocabConfig
    TrainOptions     + data, out, init_from   = TrainConfig
    EmbedOptions     + model, input, out      = EmbedConfig
    EmbedOptions     + model, input, table    = RefreshConfig

The CLI builds one flag per field (help text = the field's description); a ``--config`` YAML/JSON file and
flags merge as: field defaults < config file < flags. Flows take the option models as parameters.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elmo_core.config import ModelConfig, PresetName, budget_seconds, preset
from elmo_core.defaults import DEFAULT_DEVICE, DEFAULT_INFERENCE_PRECISION, DEFAULT_TRAINING_PRECISION
from elmo_core.errors import ConfigError, describe_validation_error, validate  # noqa: F401  (theirs, here too)
from elmo_core.text.tokenize import TokenizerName

log = logging.getLogger(__name__)

Precision = Literal["auto", "fp32", "bf16"]  # training's
# inference's, the same in every command (runtime/placement.py resolves them; int8: CPU only, docs/precision.md)
InferencePrecision = Literal["auto", "fp32", "bf16", "int8"]


class Options(BaseModel):
    """Base of every options model: unknown keys are errors, values never change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def identity(self, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The values that decide what a job makes (JSON-able): every field but the ``RUNTIME`` and ``ALIAS`` ones."""
        skip = tagged(type(self), RUNTIME) | tagged(type(self), ALIAS) | exclude
        return self.model_dump(mode="json", exclude=set(skip))

    def passed_on(self) -> dict[str, Any]:
        """The values to lay over another stage's config: those set (so that config still knows which options were
        given), but the deprecated aliases."""
        return self.model_dump(exclude=set(tagged(type(self), ALIAS)), exclude_unset=True)

    def under(self, given: dict[str, Any]) -> dict[str, Any]:
        """These options as a job's defaults with ``given`` (a few options) laid over them."""
        return {**self.model_dump(exclude_unset=True), **given}


# What a field is beyond its value: tags on the fields (``Field(..., **tags(RUNTIME))``), the sets derived from them.
RUNTIME = "runtime"  # how or where a job runs, or how it meets another job: never a part of what it makes
DATASET = "dataset"  # how text becomes sentences, tokens and splits: every shard of one dataset shares these
ALIAS = "alias"  # a deprecated spelling of another option: read, never passed on


def tags(*names: str) -> dict[str, Any]:
    return {"json_schema_extra": {"tags": list(names)}}


def tagged(model: type[BaseModel], tag: str) -> frozenset[str]:
    """The fields of ``model`` that carry ``tag``."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and tag in field.json_schema_extra.get("tags", [])  # type: ignore[operator]
    )


def _deprecated_bf16(data: Any, when_true: str, stage: str) -> Any:
    """Map the old ``bf16`` flag onto ``precision`` (with one warning)."""
    if isinstance(data, dict) and data.get("bf16") is not None:
        data = dict(data)
        value = bool(data.pop("bf16"))
        if "precision" not in data:
            data["precision"] = when_true if value else "fp32"
        log.warning("%s: 'bf16' is deprecated; use precision: %s", stage, data["precision"])
    return data


# ----- ingest ------------------------------------------------------------------------------------------


# the tracking store's default, as tracking.resolve_tracking_uri applies it
TRACKING_URI_HELP = "MLflow store; default $MLFLOW_TRACKING_URI, else sqlite:///<work folder>/mlflow.db (data/)"

SPLITS = ("train", "heldout", "test")  # every split a dataset may hold
SourceSplit = Literal["auto", "train", "heldout", "test"]
Layout = Literal["auto", "none", "1b-word", "flair"]


class Source(Options):
    """One source with the split its sentences go to (``auto``: the hash split, or the records' ``split_field``)."""

    path: str = Field(description="a file, folder (recursive) or glob pattern")
    split: SourceSplit = Field("auto", description="auto, train, heldout or test")


class IngestOptions(Options):
    tokenizer: TokenizerName = Field(
        "whitespace",
        description="whitespace (pre-tokenized text), unicode (words, numbers, punctuation) or chinese (jieba)",
        **tags(DATASET),
    )
    split_sentences: bool = Field(
        False,
        description="inputs hold paragraphs (blank-line separated): split them into sentences",
        **tags(DATASET),
    )
    text_field: str = Field("text", description="JSONL: the field holding the text", **tags(DATASET))
    text_column: str = Field("text", description="Parquet: the column holding the text", **tags(DATASET))
    heldout_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="share of sentences drawn (by a hash of their text) for the heldout split",
        **tags(DATASET),
    )
    split: SourceSplit = Field(
        "auto",
        description="the split of these sources' sentences: auto (by --split-field, else the hash split by "
        "--heldout-fraction), or all of them train, heldout or test",
    )
    split_field: str | None = Field(
        None, description="JSONL field / Parquet column naming each record's split (train, heldout/valid/dev, test)"
    )
    layout: Layout = Field(
        "auto",
        description="a folder laid out as the 1B Word Benchmark (training-/heldout-monolingual…) or as Flair's "
        "corpora (train/, valid.txt, test.txt) ingests with those splits: auto (detected and announced), none, "
        "1b-word or flair",
    )
    drop_overlap: bool = Field(
        False, description="drop from train the sentences that a heldout or test source of the same run also holds"
    )
    max_tokens: int = Field(
        250, gt=0, description="longer sentences are split into pieces of this many tokens", **tags(DATASET)
    )
    dedup: bool = Field(True, description="drop exact duplicate sentences (across all files and runs)", **tags(DATASET))
    memory_limit: str = Field("2GB", description="DuckDB memory limit")
    row_group_size: int = Field(50_000, gt=0, description="rows per Parquet row group (the streaming unit of readers)")
    wait: bool = Field(
        False, description="if another job holds the output folder, wait for it instead of failing", **tags(RUNTIME)
    )


class IngestConfig(IngestOptions):
    sources: list[str | Source] = Field(
        description="files, folders (recursive) or glob patterns; in a config, also {path, split} objects"
    )
    out: str = Field(description="output dataset folder (part-*.parquet + manifest.duckdb)")
    afresh: bool = Field(
        False, description="a dataset read with other options is made anew, not refused", **tags(RUNTIME)
    )


# ----- vocab -------------------------------------------------------------------------------------------


class VocabOptions(Options):
    min_count: int = Field(1, ge=1, description="keep words seen at least this often in the train split")
    max_size: int | None = Field(None, gt=3, description="at most this many entries, <S> </S> <UNK> included")
    memory_limit: str = Field("4GB", description="DuckDB memory limit", **tags(RUNTIME))  # how, not what it makes
    token_ids: bool = Field(True, description="also write token ids per split (what the trainer streams)")


class VocabConfig(VocabOptions):
    corpus: str = Field(description="an ingested dataset folder")
    db: str = Field(description="DuckDB file to write; vocab.txt and token_ids/ go beside it")
    vocab_file: str | None = Field(
        None, description="import this bilm-tf vocab.txt instead of counting one (fine-tuning keeps its vocab)"
    )


# ----- train -------------------------------------------------------------------------------------------


class TrainOptions(Options):
    """bilm-tf's training recipe and option names; CPU_TRAIN_OPTIONS below is the main job's small variant."""

    preset: PresetName = Field(
        "tiny",
        description="model size: tiny (tests), mini (CPU), small 2x1024_128, medium 2x2048_256, original 2x4096_512",
    )
    model: ModelConfig | None = Field(
        None, description="explicit architecture (options.json layout, inline JSON or a file); overrides preset"
    )
    batch_size: int = Field(128, gt=0, description="rows per step per process; bilm-tf used 128 per GPU")
    unroll_steps: int = Field(20, gt=0, description="truncated-BPTT window (tokens per row per step)")
    n_epochs: float = Field(10.0, gt=0, description="passes over the train split")
    max_steps: int | None = Field(None, gt=0, description="stop after this many steps (overrides n_epochs)")
    budget: str | None = Field(
        None,
        description="stop training once this much time is spent, resumes included (30m, 2h, 90s); n_epochs (if "
        "given) or max_steps still stop it first",
    )
    budget_clock: Literal["wall", "cpu"] = Field(  # evaluations and checkpoints are off either clock
        "wall", description="wall (the clock) or cpu (this process's CPU time: the recipe table's with one thread)"
    )
    n_train_tokens: int | None = Field(
        None, gt=0, description="fixes the steps per epoch; default: counted from the data"
    )
    n_negative_samples_batch: int = Field(8192, gt=0, description="sampled-softmax negatives per step (log-uniform)")
    sample_softmax: bool | Literal["auto"] = Field(
        True,
        description="true: the sampled softmax (bilm-tf's default, for large vocabularies); false: the exact softmax "
        "over every word (exact gradients; V x P per token and direction); auto: exact where a step with it costs "
        "at most 1.05x a sampled one on this device, measured at the start (vocabularies up to 50k words)",
    )
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="dropout on each LSTM layer's input and the top output")
    softmax_bias_init: Literal["zeros", "unigram"] = Field(
        "zeros",
        description="a new softmax's bias: zeros (bilm-tf) or unigram (each word's log frequency in the train split, "
        "so rows a sampled softmax seldom samples do not start as likely as common words)",
    )
    optimizer: Literal["adagrad", "adamw"] = Field("adagrad", description="adagrad (bilm-tf) or adamw")
    learning_rate: float = Field(0.2, gt=0.0, description="0.2 for Adagrad (bilm-tf); about 1e-3 for AdamW")
    initial_accumulator_value: float = Field(1.0, ge=0.0, description="Adagrad's initial accumulator (bilm-tf: 1.0)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW only")
    all_clip_norm_val: float = Field(10.0, gt=0.0, description="global gradient-norm clip")
    sparse_softmax: bool | None = Field(
        None, description="sparse softmax gradients; default: on for >50k words with Adagrad in one process"
    )
    seed: int = Field(0, description="seeds the model init, the data order and the sampler")
    device: str = Field(DEFAULT_DEVICE, description="auto, cpu, cuda or cuda:N")
    lr_schedule: Literal["constant", "inverse_sqrt", "cosine"] = Field(
        "constant",
        description="after the warm-up: constant (bilm-tf), inverse_sqrt (lr * sqrt(warmup/step)) or cosine (to 0 at "
        "the last step, or at the budget's end where that comes first)",
    )
    warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up from 0 to learning_rate")
    precision: Precision = Field(
        DEFAULT_TRAINING_PRECISION,
        description="fp32, bf16 (autocast; fp32 master weights, cell state, loss), auto: bf16 where the hardware "
        "computes it natively (CUDA, CPUs with avx512_bf16 or AMX), else fp32",
    )
    bf16: bool | None = Field(
        None, description="deprecated: use --precision (true = bf16, false = fp32)", **tags(ALIAS)
    )
    compile: bool = Field(False, description="torch.compile the token encoder")
    prefetch: int = Field(
        4, ge=0, description="batches made ahead by a background thread per process (0: each made in its step)"
    )
    log_every: int = Field(10, gt=0, description="steps between logged metrics")
    checkpoint_every: int = Field(1250, gt=0, description="steps between checkpoints")
    keep_checkpoints: int = Field(2, gt=0, description="newest checkpoints kept")
    export: Literal["last", "best"] = Field(
        "last",
        description="the model exported at the end: last = the final weights (bilm-tf); best = the weights of the "
        "lowest heldout perplexity among the evaluations after each epoch and at the end",
    )
    eval_batch_size: int = Field(64, gt=0, description="rows per heldout evaluation batch")
    eval_max_batches: int | None = Field(None, gt=0, description="evaluate on at most this many heldout batches")
    on_nan: Literal["stop", "skip"] = Field(
        "stop", description="a NaN loss stops the run (naming the last good checkpoint) or skips the batch"
    )
    resume: bool = Field(False, description="continue from the newest valid checkpoint in out/")
    nproc_per_node: int | Literal["auto"] = Field(
        1, description="processes per machine (torch.distributed.run, started for you): N, or auto = the visible GPUs"
    )
    nnodes: int = Field(1, gt=0, description="machines taking part (run the same command on each)")
    node_rank: int = Field(0, ge=0, description="this machine's number among them, 0 .. nnodes-1")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of node 0, where the machines meet (rank 0 runs on node 0)"
    )
    wait: bool = Field(
        False, description="if another job holds the output folder, wait for it instead of failing", **tags(RUNTIME)
    )
    tracking: Literal["mlflow", "none"] = Field("mlflow", description="track the run in MLflow, or not at all")
    mlflow_experiment: str = Field("elmo", description="MLflow experiment name")
    register_as: str | None = Field("elmo", description="MLflow registered-model name; null: log the model only")
    promote_to: str | None = Field(
        "champion", description="the alias the registered version becomes where its heldout perplexity is better"
    )
    promote_margin: float = Field(0.0, ge=0.0, lt=1.0, description="how much better (0.02: 2% lower) it must be")

    @model_validator(mode="before")
    @classmethod
    def _bf16_alias(cls, data: Any) -> Any:
        return _deprecated_bf16(data, "bf16", "train")

    def under(self, given: dict[str, Any]) -> dict[str, Any]:
        """With a ``budget`` given, these defaults' recipe fields step aside: the budget's measured recipe fills
        what the user did not give (``train.recipe.choose_for_budget``), never a mix of it and these defaults."""
        laid = super().under(given)
        if given.get("budget") is None:
            return laid
        return {k: v for k, v in laid.items() if k not in RECIPE_FIELDS or k in given}

    def architecture(self, n_tokens_vocab: int | None = None) -> ModelConfig:
        """The model to build: ``model`` if given, else the preset; with a softmax over ``n_tokens_vocab`` words."""
        base = self.model or preset(self.preset)
        return base.model_copy(update={"n_tokens_vocab": n_tokens_vocab}) if n_tokens_vocab else base

    @field_validator("budget")
    @classmethod
    def _budget_reads(cls, budget: str | None) -> str | None:
        if budget is not None:
            budget_seconds(budget)  # its ValueError, named by the field
        return budget


class TrainConfig(TrainOptions):
    data: str = Field(description="folder written by `elmo vocab` (vocab.txt, token_ids/train, token_ids/heldout)")
    out: str = Field(description="run folder: checkpoints/, model/ (the export), metrics.jsonl")
    init_from: str | None = Field(None, description="fine-tune: a model directory, runs:/ or models:/ URI")
    tracking_uri: str | None = Field(None, description=TRACKING_URI_HELP)


# the fields a budget's measured recipe sets (elmo_core/train/recipe.py) where the user left them unset
RECIPE_FIELDS = (
    *("preset", "batch_size", "unroll_steps", "n_negative_samples_batch", "sample_softmax", "optimizer"),
    *("learning_rate", "lr_schedule", "warmup_steps", "dropout", "softmax_bias_init"),
)


# The main job's training on 2 CPU cores: the mini model, smaller batches and fewer negatives than bilm-tf, and the
# export of the best heldout weights (bench/cpu_recipe.py: a small corpus overfits within minutes).
CPU_TRAIN_OPTIONS = TrainOptions(
    preset="mini",
    batch_size=32,
    n_negative_samples_batch=512,
    log_every=20,
    checkpoint_every=200,
    resume=True,
    export="best",
)


# ----- embed -------------------------------------------------------------------------------------------


class EmbedOptions(Options):
    layers: Literal["all", "mix"] = Field(
        "mix", description="mix: one 'elmo' column (scalar mix); all: layer_0 ... layer_L columns"
    )
    mix_weights: list[float] | None = Field(
        None, description="scalar-mix weights before softmax, one per layer; default: plain average"
    )
    gamma: float = Field(1.0, description="scalar-mix scale")
    dtype: Literal["float32", "float16"] = Field("float32", description="storage type of the vectors")
    compression: Literal["none", "zstd", "lz4", "snappy"] = Field("none", description="of the vector columns")
    pool: Literal["none", "mean"] = Field("none", description="none: one row per token; mean: one row per sentence")
    split: Literal["all", "train", "heldout", "test"] = Field("all", description="which split of an ingested dataset")
    tokenizer: TokenizerName = Field("whitespace", description="how text input is tokenized (as ingest does)")
    max_batch_tokens: int | None = Field(
        None, gt=0, description="padded tokens a forward pass; default: the runtime's for the device", **tags(RUNTIME)
    )
    unit_tokens: int = Field(
        40_000, gt=0, description="tokens per unit of work (one output file; the unit of resume and of parallelism)"
    )
    stateful: bool = Field(False, description="carry LSTM state across batches (bilm-tf parity; order-dependent)")
    device: str = Field(DEFAULT_DEVICE, description="auto, cpu, cuda or cuda:N", **tags(RUNTIME))
    precision: InferencePrecision = Field(
        DEFAULT_INFERENCE_PRECISION,
        description="fp32 (bilm-tf exact), auto (bf16 where native, else fp32), bf16 (matmuls in bfloat16, cell "
        "state in fp32) or int8 (CPU: the LSTM step's products on int8 weights)",
    )
    bf16: bool | None = Field(None, description="deprecated: use --precision bf16", **tags(ALIAS))
    overwrite: bool = Field(
        False, description="replace a table of another job in --out (swapped in when complete)", **tags(RUNTIME)
    )
    workers: int = Field(
        1, ge=1, description="processes over the units on a CPU, each with its share of the cores", **tags(RUNTIME)
    )
    wait: bool = Field(
        False, description="if another job holds the output folder, wait for it instead of failing", **tags(RUNTIME)
    )
    index: bool = Field(
        False, description="then build the table's nearest-neighbour index (as `elmo index OUT`)", **tags(RUNTIME)
    )

    @model_validator(mode="before")
    @classmethod
    def _bf16_alias(cls, data: Any) -> Any:
        return _deprecated_bf16(data, "bf16", "embed")


class EmbedConfig(EmbedOptions):
    model: str = Field(
        description="model directory (options.json + weights.hdf5), runs:/RUN/model or models:/NAME/VERSION"
    )
    input: str = Field(
        description="an ingested dataset folder, or text files / a folder / a glob (one sentence per line)"
    )
    out: str = Field(description="output dataset folder: part-*.parquet, read with DuckDB, pandas, pyarrow or Spark")


class RefreshConfig(EmbedOptions):
    """``elmo refresh``: a table that follows a model (``vectors.tables``): the corpus embedded with a version into a
    table of its own, indexed, then switched to as the table in use."""

    model: str = Field("models:/elmo@champion", description="the version: models:/NAME/N, or @ALIAS (pinned first)")
    input: str = Field(description="the corpus: an ingested dataset folder, or text files / a folder / a glob")
    table: str = Field(description="the table's folder: versions/ (one table per model version), current.duckdb")
    alias: str | None = Field(None, description="switch only while this alias still names the version")
    keep: int = Field(2, ge=1, description="table versions kept: the one in use and those switched away from")
    index: bool = Field(True, description="build each version's nearest-neighbour index before it is switched to")
    tracking_uri: str | None = Field(None, description=TRACKING_URI_HELP)


# ----- the smaller commands ------------------------------------------------------------------------------


class PromoteConfig(Options):
    """``elmo promote``: a registered version made the alias's, by evidence (``train.promote``)."""

    model: str = Field(description="the version: models:/NAME/N, or models:/NAME/latest (pinned first)")
    alias: str = Field("champion", description="the alias it becomes, where better than the version it names now")
    margin: float = Field(0.0, ge=0.0, lt=1.0, description="how much lower its heldout perplexity must be (0.02: 2%)")
    force: bool = Field(False, description="move the alias without a comparison (the version's tags say so)")
    tracking_uri: str | None = Field(None, description=TRACKING_URI_HELP)


class OnnxConfig(Options):
    """``elmo onnx``: a model as one ONNX file (``runtime.onnx_file``)."""

    model: str = Field(description="model directory, the published files' folder, runs:/RUN/model or models:/NAME/N")
    out: str | None = Field(None, description="the .onnx file to write (whole, or not at all)")
    triton: str | None = Field(None, description="or a Triton model repository: DIR/NAME/config.pbtxt, 1/model.onnx")
    overwrite: bool = Field(False, description="replace an existing file")


class PerplexityConfig(Options):
    model: str = Field(description="model directory with its softmax and vocab.txt, or an MLflow model URI")
    corpus: str = Field(description="an ingested dataset folder")
    split: Literal["heldout", "train", "test"] = Field("heldout", description="which split to score")
    batch_size: int = Field(64, gt=0, description="rows per batch")
    max_batches: int | None = Field(None, gt=0, description="score at most this many batches")
    device: str = Field(DEFAULT_DEVICE, description="auto, cpu, cuda or cuda:N")


class ExportConfig(Options):
    run: str | None = Field(
        None,
        description="run folder: its newest valid checkpoint (its best weights where it trained with export: best)",
    )
    checkpoint: str | None = Field(None, description="a checkpoint file instead")
    out: str = Field(description="model directory to write (options.json, weights.hdf5 with softmax, vocab.txt)")

    @model_validator(mode="after")
    def _one_source(self) -> ExportConfig:
        if (self.run is None) == (self.checkpoint is None):
            raise ValueError("give exactly one of run and checkpoint")
        return self


class QueryConfig(Options):
    embeddings: str = Field(description="an `elmo embed` output folder")
    token: str | None = Field(None, description="the token whose contexts to compare")
    sentence: str | None = Field(None, description="the sentence text the token is in")
    sentence_id: str | None = Field(None, description="or the sentence's id")
    similar_to: str | None = Field(None, description="a sentence_id: similar sentences (tables made with --pool mean)")
    like: str | None = Field(None, description="only neighbours whose lower-cased token matches this SQL LIKE pattern")
    layer: str | None = Field(None, description="elmo or layer_N (default: elmo, else the top layer)")
    k: int = Field(10, gt=0, description="how many neighbours")
    exact: bool = Field(False, description="scan the whole table even where an index is (`elmo index`)")
    nprobe: int | None = Field(None, gt=0, description="inverted lists an indexed query visits (default: the index's)")


class IndexConfig(Options):
    """``elmo index``: an approximate-nearest-neighbour index of one vector column, beside the table."""

    table: str = Field(description="an embedding table folder (`elmo embed` output, or Parquet with its columns)")
    layer: str | None = Field(None, description="the column to index: elmo or layer_N (default: elmo, else the top)")
    shard_rows: int = Field(  # a shard's codes, metadata and sort fit in about 1.5 GiB at width 1024
        2_000_000, gt=0, description="rows per shard (whole part files; shards build in parallel)"
    )
    workers: int = Field(1, gt=0, description="processes building shards at once (each with its share of the cores)")
    nlist: int | None = Field(None, gt=0, description="inverted lists (default: about sqrt(rows), a power of two)")
    nprobe: int | None = Field(None, gt=0, description="lists a query visits by default (nlist/32, at least 16)")
    rebuild: bool = Field(False, description="build it anew instead of adding the parts it does not cover")
    wait: bool = Field(
        False, description="if another build holds the index, wait for it instead of failing", **tags(RUNTIME)
    )


class ServeConfig(Options):
    """``elmo serve``: a biLM answering HTTP requests, concurrent requests packed into shared forward passes."""

    model: str = Field(
        description="model directory, models:/NAME/VERSION, models:/NAME@ALIAS, models:/NAME/latest, runs:/RUN/model, "
        "or a published options.json (with --weight-file); resolved once, at start (SIGHUP, POST /reload: again)"
    )
    weight_file: str | None = Field(None, description="the weights.hdf5 of a published options.json given as MODEL")
    follow_alias: float | None = Field(None, gt=0, description="every SECONDS, reload: move with MODEL's alias")
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface; then set an API key)")
    port: int = Field(8080, ge=0, le=65535, description="port to listen on (0: a free one, printed)")
    device: str = Field(DEFAULT_DEVICE, description="auto, cpu, cuda or cuda:N")
    precision: InferencePrecision = Field(DEFAULT_INFERENCE_PRECISION, description="fp32 (exact), auto, bf16 or int8")
    tokenizer: TokenizerName = Field("unicode", description="how raw text is split, as `elmo embed --tokenizer` does")
    max_batch_tokens: int = Field(4096, gt=0, description="tokens per forward pass (tokens/s is flat from ~2,500)")
    max_wait_ms: float = Field(2.0, ge=0, description="how long a forward pass with room left waits for company")
    max_queue_tokens: int = Field(16_384, gt=0, description="tokens admitted, not answered (2-3 s of work); then 429")
    max_sentence_tokens: int = Field(512, gt=0, description="tokens of one sentence; longer: 413 (or truncated)")
    max_sentences: int = Field(2048, gt=0, description="sentences (inputs) of one request, OpenAI's limit; more: 413")
    max_request_tokens: int = Field(131_072, gt=0, description="tokens of one request (more than a queue: when empty)")
    max_answer_floats: int = Field(1 << 24, gt=0, description="floats one answer may carry (64 MiB); more: 413")
    auto_truncate: bool = Field(False, description="cut sentences past --max-sentence-tokens, not a 413")
    max_body_bytes: int = Field(4 << 20, gt=0, description="bytes of one request body, checked before it is parsed")
    workers: int = Field(1, gt=0, description="model processes, each with its share of the cores")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' (or ELMO_API_KEY, unseen by ps)")
    metrics_open: bool = Field(False, description="serve /metrics without the API key (to a Prometheus scraper)")
    batching: bool = Field(True, description="pack concurrent requests together (off: one request per forward pass)")
    drain_delay: float = Field(5.0, ge=0, description="on SIGTERM, seconds /ready is 503 and requests still served")
    drain_seconds: float = Field(30.0, gt=0, description="then, how long requests in flight may take to finish")
    batch_timeout: float = Field(60.0, gt=0, description="seconds a model process may take on a batch (a hang: kill)")
    access_log: bool = Field(True, description="one JSON line per request on stdout (id, status, tokens, times)")

    @model_validator(mode="after")
    def _sentence_fits_a_batch(self) -> ServeConfig:
        if self.max_sentence_tokens > self.max_batch_tokens:
            raise ValueError(
                f"max_sentence_tokens ({self.max_sentence_tokens}) is larger than max_batch_tokens "
                f"({self.max_batch_tokens}): a sentence must fit one forward pass"
            )
        if self.max_sentence_tokens > self.max_queue_tokens:
            raise ValueError("max_sentence_tokens is larger than max_queue_tokens: a sentence must fit the queue")
        return self


class InfoConfig(Options):
    model: str | None = Field(None, description="model directory (options.json + weights.hdf5) or an MLflow model URI")


class AllennlpElmoConfig(Options):
    """AllenNLP 0.9's ``allennlp elmo`` command: sentences, one a line, into HDF5 (``allennlp.ElmoEmbedder``)."""

    input_file: str = Field(description="whitespace-tokenized sentences, one a line")
    output_file: str = Field(description="the HDF5 file to write")
    output_format: Literal["all", "top", "average"] = Field(
        "all", description="the three layers (3, n, D), the top one (n, D) or their average (n, D)"
    )
    options_file: str | None = Field(None, description="the biLM's options.json (default: AllenNLP's original model)")
    weight_file: str | None = Field(None, description="its weights.hdf5")
    batch_size: int = Field(64, gt=0, description="sentences per batch (at most; stateless batches sort by length)")
    cuda_device: int = Field(-1, description="GPU index, -1 for the CPU")
    forget_sentences: bool = Field(False, description="leave out the sentence_to_index dataset")
    use_sentence_keys: bool = Field(False, description="key datasets by the sentence instead of its line number")
    stateful: bool = Field(False, description="carry the LSTM state from batch to batch, as AllenNLP did")
    precision: InferencePrecision = Field(DEFAULT_INFERENCE_PRECISION, description="fp32 (exact), bf16 or int8 (CPU)")


class DemoConfig(Options):
    model: str | None = Field(
        None, description="model directory; default: data/export (the main job's), else a random tiny model"
    )
    input: str | None = Field(
        None, description="whitespace-tokenized sentences, one per line; default: data/probes/apple.txt"
    )


# ----- probe -------------------------------------------------------------------------------------------


class ProbeOptions(Options):
    """What every probe shares: how the vectors are made and where the run is tracked."""

    precision: InferencePrecision = Field(DEFAULT_INFERENCE_PRECISION, description="precision of the embedding step")
    device: str = Field(DEFAULT_DEVICE, description="auto, cpu, cuda or cuda:N")
    tracking: Literal["mlflow", "none"] = Field("mlflow", description="log the probe as an MLflow run, or not")
    mlflow_experiment: str = Field("elmo-probe", description="MLflow experiment name")


class WsdOptions(ProbeOptions):
    mix_weights: list[float] | None = Field(
        None, description="scalar-mix weights before softmax; default: plain average"
    )


class TagOptions(ProbeOptions):
    column: str = Field("upos", description="CoNLL-U column with the tags: upos, xpos or a 1-based number")
    epochs: int = Field(20, gt=0, description="passes over the training tokens (the best dev epoch is reported)")
    min_steps: int = Field(
        2000, ge=0, description="at least this many optimizer steps: a small training set gets more passes"
    )
    learning_rate: float = Field(0.005, gt=0.0, description="Adam's learning rate")
    batch_tokens: int = Field(1024, gt=0, description="tokens per optimizer step")
    seed: int = Field(0, description="seeds initialisation and token order (the probe is deterministic)")


class WsdConfig(WsdOptions):
    model: str = Field(description="model directory, runs:/RUN/model or models:/NAME/VERSION")
    data: str | None = Field(
        None, description="sense-annotated JSONL/TSV, or a WordNet 3.0 folder (default /usr/share/wordnet)"
    )
    out: str = Field(description="folder for results.json, the chart and the examples used")
    tracking_uri: str | None = Field(None, description=TRACKING_URI_HELP)


class TagConfig(TagOptions):
    model: str = Field(description="model directory, runs:/RUN/model or models:/NAME/VERSION")
    train: str = Field(description="tagged sentences to train the probe on: CoNLL-U, or token/tag columns")
    dev: str = Field(description="tagged sentences to choose the epoch on and report")
    test: str | None = Field(None, description="tagged sentences to report on as well")
    out: str = Field(description="folder for results.json and the chart")
    tracking_uri: str | None = Field(None, description=TRACKING_URI_HELP)
