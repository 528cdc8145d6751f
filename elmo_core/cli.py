"""The ``elmo`` command: one subcommand per stage, its flags generated from that stage's options model.

Every field of the model (``elmo_core.options``) is a flag with the field's description as help; a field
``batch_size`` is ``--batch-size``, a bool is ``--dedup/--no-dedup``, a list takes several values, null is
``none``. Values merge in one order: field defaults < ``--config FILE`` (YAML or JSON) < flags. User errors
(``ElmoError``, file and MLflow errors) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from elmo_core.errors import ConfigError, ElmoError
from elmo_core.fileio import as_disk_full, output_of
from elmo_core.flags import add_fields, parse_config
from elmo_core.options import (
    AllennlpElmoConfig,
    DemoConfig,
    EmbedConfig,
    ExportConfig,
    IndexConfig,
    InfoConfig,
    IngestConfig,
    OnnxConfig,
    Options,
    PerplexityConfig,
    PromoteConfig,
    QueryConfig,
    RefreshConfig,
    ServeConfig,
    TagConfig,
    TrainConfig,
    VocabConfig,
    WsdConfig,
)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PROBES = PROJECT_ROOT / "data" / "probes" / "apple.txt"
log = logging.getLogger("elmo")


# ----- the commands ---------------------------------------------------------------------------------------


def cmd_demo(config: DemoConfig) -> None:
    from elmo_core.vectors.demo import demo

    print("\n".join(demo(config.model, Path(config.input or PROBES), PROJECT_ROOT / "data")))


def cmd_info(config: InfoConfig) -> None:
    """This machine (the CPU, what torch dispatches to, the precisions and kernels it offers), then the model."""
    from elmo_core.runtime import Runtime, info

    print("\n".join(info.machine_report()))
    if config.model is None:
        return print(f"kernels of the original shape: {info.original_shape_kernels()}")
    runtime = Runtime.open(config.model)  # what every command that runs this model prints, resolved the same way
    print(runtime.line())
    print("\n".join(info.model_report(runtime.bilm, config.model)))


def cmd_ingest(config: IngestConfig) -> None:
    from elmo_core.ingest import IngestStage
    from elmo_core.stage import run_local

    summary = run_local(IngestStage(), config)
    for problem in summary.warnings:
        print(f"warning: {problem}", file=sys.stderr)
    for error in summary.errors:
        print(f"error: {error}", file=sys.stderr)
    print(summary.line() + f" -> {config.out}")
    refused = summary.refusal()
    if refused is not None:
        raise refused


def cmd_vocab(config: VocabConfig) -> None:
    from elmo_core.data.vocab import VocabStage
    from elmo_core.stage import run_local

    stats = run_local(VocabStage(), config)
    vocab_txt = Path(config.db).with_name("vocab.txt")
    print(
        f"vocab: {stats['vocab_size']:,} entries from {stats['train_tokens']:,} train tokens "
        f"({stats['train_types']:,} types); "
        f"OOV rate heldout {100 * stats['heldout_oov_rate']:.2f}% ({stats['heldout_tokens']:,.0f} tokens), "
        f"test {100 * stats['test_oov_rate']:.2f}% ({stats['test_tokens']:,.0f} tokens) -> {config.db}, {vocab_txt}"
    )


def cmd_train(config: TrainConfig) -> None:
    from elmo_core.events import announce_promotion
    from elmo_core.stage import run_local
    from elmo_core.tracking import resolve_tracking_uri
    from elmo_core.train.evaluate import describe_perplexity
    from elmo_core.train.launch import TrainStage

    result = run_local(TrainStage(), config)  # --nproc-per-node N: torch.distributed.run with N ranks
    if result is None:  # a rank of a launch, or a machine other than node 0: the launcher on node 0 reports
        return
    print(
        f"train: {result.steps} steps, final loss {result.final_loss:.3f}, {describe_perplexity(result.perplexity)} "
        f"-> {result.model_dir}" + (f"; MLflow run {result.run_id}, model {result.model_uri}" if result.run_id else "")
    )
    print(result.promotion["line"]) if result.promotion else None
    announce_promotion(result.promotion, resolve_tracking_uri(config.tracking_uri))  # for a deployment to follow


def cmd_perplexity(config: PerplexityConfig) -> None:
    from elmo_core.stage import run_local
    from elmo_core.train.evaluate import PerplexityStage

    result = run_local(PerplexityStage(), config)
    print(
        f"perplexity: {result['perplexity']:.2f} (forward {result['perplexity_forward']:.2f}, backward "
        f"{result['perplexity_backward']:.2f}) on {int(result['eval_tokens']):,} {config.split} tokens "
        f"of {config.corpus}"
    )


def cmd_promote(config: PromoteConfig) -> None:
    from elmo_core.events import announce_promotion
    from elmo_core.tracking import resolve_tracking_uri
    from elmo_core.train.promote import promote

    decision = promote(config.model, config.alias, config.margin, config.force, config.tracking_uri)
    print(decision.line())
    announce_promotion(decision.record(), resolve_tracking_uri(config.tracking_uri))


def cmd_export(config: ExportConfig) -> None:
    from elmo_core.stage import run_local
    from elmo_core.train.export import ExportStage

    print(run_local(ExportStage(), config).line())


def cmd_embed(config: EmbedConfig) -> None:
    from elmo_core.vectors.embed import embed

    summary = embed(config, show_kernels=log.isEnabledFor(logging.DEBUG))
    print(summary.line())
    if summary.index is not None:
        print(summary.index.line())


def cmd_refresh(config: RefreshConfig) -> None:
    from elmo_core.vectors.tables import refresh

    print(refresh(config).line())


def cmd_onnx(config: OnnxConfig) -> None:
    from elmo_core.runtime.onnx_file import export_onnx

    print(export_onnx(config).line())


def cmd_index(config: IndexConfig) -> None:
    from elmo_core.stage import run_local
    from elmo_core.vectors.ann import IndexStage

    print(run_local(IndexStage(), config, workers=config.workers).line())


def cmd_query(config: QueryConfig) -> None:
    from elmo_core.vectors.query import EmbeddingStore

    store = EmbeddingStore(config.embeddings, exact=config.exact, nprobe=config.nprobe)
    if config.similar_to:
        for n in store.similar_sentences(config.similar_to, config.k, config.layer):
            print(f"{n.similarity:7.4f}  {n.sentence_id}  {n.text}")
        return
    if not config.token:
        raise ConfigError("give --token (with --sentence or --sentence-id), or --similar-to SENTENCE_ID")
    sid, index, text = store.locate(config.token, config.sentence, config.sentence_id)
    print(f"nearest to {config.token!r} (token {index}) in: {text}")
    for n in store.nearest_tokens(
        config.token,
        text=config.sentence,
        sentence_id=config.sentence_id,
        k=config.k,
        layer=config.layer,
        like=config.like,
    ):
        print(f"{n.similarity:7.4f}  {n.token:<15} {n.text}")


def cmd_serve(config: ServeConfig) -> None:
    from elmo_core.serve.run import serve

    served = serve(config)  # until SIGTERM or Ctrl-C, which drain the requests in flight
    print(f"elmo serve: stopped ({served.url})")


def cmd_probe(config: WsdConfig | TagConfig) -> None:
    from elmo_core.stage import run_local
    from elmo_core.vectors import probe

    results = run_local(probe.ProbeStage(), config)
    print(probe.results_table(results))
    print(
        f"probe {results['kind']}: -> {Path(config.out) / 'results.json'}, chart.png"
        + (f"; MLflow run {results['mlflow_run_id']}" if results.get("mlflow_run_id") else "")
    )


def cmd_allennlp_elmo(config: AllennlpElmoConfig) -> None:
    from elmo_core.allennlp.commands import run_elmo_command

    print(run_elmo_command(config))


class Command(NamedTuple):
    """One ``elmo`` subcommand: its options model, what runs it, and its help."""

    options: type[Options]
    handler: Callable[[Any], None]
    positional: tuple[str, ...]  # fields taken as positional arguments
    help: str  # one line
    description: str  # with an example


# the one registry of subcommands; "GROUP NAME" is `elmo GROUP NAME` (GROUPS gives the group's own help)
COMMANDS: dict[str, Command] = {
    "demo": Command(
        options=DemoConfig,
        handler=cmd_demo,
        positional=(),
        help="embed the probe sentences and print a summary",
        description=(
            "Embed data/probes/apple.txt with a biLM and print throughput and the similarity of the 'apple' contexts. "
            "Example: elmo demo --model path/to/model_dir"
        ),
    ),
    "ingest": Command(
        options=IngestConfig,
        handler=cmd_ingest,
        positional=("sources",),
        help="corpus files -> tokenized, deduplicated Parquet",
        description=(
            "Read text (.txt, .gz, .bz2; one sentence per line, or paragraphs with --split-sentences), JSONL or "
            "Parquet "
            "files, folders or globs; write OUT/part-*.parquet and OUT/_manifest.duckdb. Re-running skips files "
            "already "
            "ingested. Example: elmo ingest corpus/*.txt.gz --out data/ingest"
        ),
    ),
    "vocab": Command(
        options=VocabConfig,
        handler=cmd_vocab,
        positional=(),
        help="vocabulary, char ids and token ids in DuckDB",
        description=(
            "Count tokens of an ingested dataset with DuckDB; write tables vocab, char_ids, token_counts, "
            "corpus_stats to "
            "--db, vocab.txt beside it, and token ids per split under token_ids/. "
            "Example: elmo vocab --corpus data/ingest --db data/vocab/vocab.duckdb --min-count 3"
        ),
    ),
    "train": Command(
        options=TrainConfig,
        handler=cmd_train,
        positional=(),
        help="train or fine-tune the biLM",
        description=(
            "Train the biLM on the token ids written by `elmo vocab`, tracked in MLflow, checkpointed, and exported to "
            "OUT/model. Several GPUs or processes: --nproc-per-node N (or auto: one rank per visible GPU) starts "
            "PyTorch's launcher itself; several machines: the same command on each with --nnodes, --node-rank and "
            "--rdzv-endpoint. "
            "Example: elmo train --config train.yaml  or  elmo train --data data/vocab --out data/train --preset small"
        ),
    ),
    "perplexity": Command(
        options=PerplexityConfig,
        handler=cmd_perplexity,
        positional=(),
        help="full-softmax perplexity of a model on a corpus",
        description="Example: elmo perplexity --model data/train/model --corpus data/ingest",
    ),
    "promote": Command(
        options=PromoteConfig,
        handler=cmd_promote,
        positional=("model",),
        help="make a registered version the champion where its heldout perplexity is better",
        description="Example: elmo promote models:/elmo/4 --alias champion --margin 0.01",
    ),
    "export": Command(
        options=ExportConfig,
        handler=cmd_export,
        positional=(),
        help="checkpoint -> bilm-tf/AllenNLP model directory",
        description=(
            "Writes the newest checkpoint whose checksum verifies, or a run's best weights where it trained with "
            "export: best. Example: elmo export --run data/train --out my_elmo"
        ),
    ),
    "embed": Command(
        options=EmbedConfig,
        handler=cmd_embed,
        positional=(),
        help="corpus -> contextual vectors in Parquet",
        description=(
            "Embed an ingested dataset (or text files, one sentence per line) with a biLM; write one row per token "
            "(or per "
            "sentence with --pool mean) to OUT/part-*.parquet. Resumable: a rerun does only missing units. "
            "Example: elmo embed --model data/train/model --input data/ingest --out data/embed"
        ),
    ),
    "refresh": Command(
        options=RefreshConfig,
        handler=cmd_refresh,
        positional=(),
        help="a table that follows a model: embed a version's table, index it, switch to it",
        description=(
            "Embed the corpus with a model version into TABLE/versions/NAME-vN (resumable), index it, then switch "
            "TABLE/current.duckdb (view: vectors) and TABLE/current.json to it atomically; the version before is "
            "kept until the next switch. The refresh deployment runs it on each promotion. "
            "Example: elmo refresh --model models:/elmo@champion --input data/ingest --table data/tables/news"
        ),
    ),
    "onnx": Command(
        options=OnnxConfig,
        handler=cmd_onnx,
        positional=("model",),
        help="a model as one ONNX file, for ONNX Runtime, Triton or another language",
        description=(
            "Write MODEL (a folder, the published files, runs:/ or models:/) as one ONNX file: input char_ids "
            "(batch, tokens, 50) as AllenNLP's batch_to_ids gives them, outputs layers (L+1, batch, tokens, 2P) and "
            "mask; batch and length dynamic; each weight stored once (docs/onnx.md). "
            "Example: elmo onnx models:/elmo@champion --out elmo.onnx"
        ),
    ),
    "query": Command(
        options=QueryConfig,
        handler=cmd_query,
        positional=("embeddings",),
        help="nearest tokens-in-context / similar sentences with DuckDB",
        description=(
            "Example: elmo query data/embed --token apples --sentence 'I like to eat apples .' --like 'apple%%'"
        ),
    ),
    "index": Command(
        options=IndexConfig,
        handler=cmd_index,
        positional=("table",),
        help="a nearest-neighbour index beside an embedding table, for fast `elmo query`",
        description=(
            "Index one vector column of the table (faiss IVF, 8-bit codes, exact re-ranking) in TABLE/_index/. "
            "A rerun adds only parts the index does not cover; `elmo query` uses it by itself. "
            "Example: elmo index data/embed --workers 2"
        ),
    ),
    "serve": Command(
        options=ServeConfig,
        handler=cmd_serve,
        positional=("model",),
        help="vectors on request over HTTP: concurrent requests batched by tokens",
        description=(
            "Serve a biLM: POST /embed (layers, mix or mean), POST /v1/embeddings (OpenAI's schema), /health, "
            "/ready, /info, /metrics. Example: elmo serve data/export  then  curl -s localhost:8080/embed "
            "-H 'content-type: application/json' -d '{\"sentences\": [\"I ate an apple .\"]}'"
        ),
    ),
    "info": Command(
        options=InfoConfig,
        handler=cmd_info,
        positional=("model",),
        help="what this machine runs (CPU, precisions, kernels) and, given one, a model directory",
        description="Example: elmo info data/export  (without a model: the machine alone)",
    ),
    "probe wsd": Command(
        options=WsdConfig,
        handler=cmd_probe,
        positional=(),
        help="word-sense 1-NN per layer (WordNet's examples by default)",
        description=(
            "Example: elmo probe wsd --model data/export --out data/probe_wsd  (--data senses.jsonl, or a WordNet "
            "folder)"
        ),
    ),
    "probe tag": Command(
        options=TagConfig,
        handler=cmd_probe,
        positional=(),
        help="a linear tagging probe per layer and over a learned scalar mix",
        description=(
            "Example: elmo probe tag --model data/export --train train.conllu --dev dev.conllu --out data/probe_tag"
        ),
    ),
    "allennlp-elmo": Command(
        options=AllennlpElmoConfig,
        handler=cmd_allennlp_elmo,
        positional=("input_file", "output_file"),
        help="AllenNLP 0.9's `allennlp elmo`: sentences -> HDF5 (--all, --top or --average)",
        description=(
            "Embed whitespace-tokenized sentences, one a line, into HDF5 datasets keyed by line number, as "
            "`allennlp elmo` did (plus sentence_to_index). Example: elmo allennlp-elmo sentences.txt out.hdf5 --top "
            "--options-file options.json --weight-file weights.hdf5"
        ),
    ),
}


GROUPS = {  # name: (one-line help, description)
    "probe": (
        "judge a model: word-sense 1-NN and a tagging probe, per layer",
        "Probes write results.json and chart.png to --out and log an MLflow run.",
    )
}


# what `elmo <command> --plan` prints: a stage (its plan's lines) or a function of the options giving the lines
PLANS = {
    "ingest": "elmo_core.ingest:IngestStage",
    "vocab": "elmo_core.data.vocab:VocabStage",
    "train": "elmo_core.train.launch:TrainStage",
    "perplexity": "elmo_core.train.evaluate:PerplexityStage",
    "export": "elmo_core.train.export:ExportStage",
    "embed": "elmo_core.vectors.embed:plan_lines",
    "index": "elmo_core.vectors.ann:IndexStage",
    "probe wsd": "elmo_core.vectors.probe:ProbeStage",
    "probe tag": "elmo_core.vectors.probe:ProbeStage",
}


def print_plan(name: str, config: Options) -> None:
    """The plan of ``name`` for ``config``, each line printed; nothing on disk changes (plans only read)."""
    import importlib
    import inspect

    from elmo_core.stage import show_plan

    module, _, attr = PLANS[name].partition(":")
    found = getattr(importlib.import_module(module), attr)
    print("\n".join(show_plan(found(), config) if inspect.isclass(found) else found(config)))


def build_parser() -> argparse.ArgumentParser:
    # no prefix abbreviations: `elmo ingest --split heldout` must never be read as --split-sentences
    parser = argparse.ArgumentParser(
        prog="elmo", description="Train, fine-tune and run ELMo biLMs.", allow_abbrev=False
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (and the kernels that ran)")
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, Any] = {}
    for name, (model, _, positional, help_text, description) in COMMANDS.items():
        group, _, leaf = name.rpartition(" ")
        if group and group not in groups:
            group_help, group_description = GROUPS[group]
            parent = sub.add_parser(group, help=group_help, description=group_description, allow_abbrev=False)
            groups[group] = parent.add_subparsers(dest="kind", required=True)
        command = (groups[group] if group else sub).add_parser(
            leaf, help=help_text, description=description, allow_abbrev=False
        )
        command.add_argument("--config", help="YAML or JSON file of these options; flags override it")
        if name in PLANS:
            command.add_argument(
                "--plan", action="store_true", help="print what this run would do and change nothing on disk"
            )
        add_fields(command, model, positional)
        if model is AllennlpElmoConfig:  # `allennlp elmo`'s own spelling of --output-format
            for kind in ("all", "top", "average"):
                description = model.model_fields["output_format"].description
                command.add_argument(
                    f"--{kind}",
                    dest="output_format",
                    action="store_const",
                    const=kind,
                    default=argparse.SUPPRESS,
                    help=f"{description}: as --output-format {kind}",
                )
    return parser


def _configure_logging(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        logging.basicConfig(
            level=level, format="%(message)s", handlers=[RichHandler(show_path=False, rich_tracebacks=False)]
        )
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("alembic", "urllib3", "git", "httpx", "faiss.loader"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _user_error(exc: Exception) -> str | None:
    """The one line of an error the user can act on, or None for a bug (its traceback is wanted)."""
    if isinstance(exc, ElmoError):
        return str(exc)
    if isinstance(exc, OSError):  # a file the user named: missing, unreadable, a folder where a file was expected
        return _one_line(exc)
    if type(exc).__module__.startswith("mlflow"):  # the store or a model URI: a setup problem, not a bug
        return f"MLflow: {_one_line(exc)}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    name = f"{args.command} {args.kind}" if args.command in GROUPS else args.command
    config: Options | None = None
    try:
        model, handler, _, _, _ = COMMANDS[name]
        config = parse_config(model, args)
        if getattr(args, "plan", False):
            print_plan(name, config)
        else:
            handler(config)
    except KeyboardInterrupt:
        print(f"elmo {name}: interrupted (a rerun continues where it stopped)", file=sys.stderr)
        return 130
    except Exception as exc:
        full = as_disk_full(exc, output_of(config))  # in any library: one line, the folder, the free space
        if full is not None and args.verbose:
            traceback.print_exception(exc)
        line = str(full) if full is not None else _user_error(exc)
        if line is None:
            raise
        print(f"elmo {name}: error: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
