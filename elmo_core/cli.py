"""The ``elmo`` command. One subcommand per stage; user errors exit non-zero with one clear line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

from elmo_core.errors import ElmoError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PROBES = PROJECT_ROOT / "data" / "probes" / "apple.txt"


def _fixture_model() -> Path | None:
    """The AllenNLP fixture biLM (TF-trained, tiny) that ships with the repository's tests."""
    model = PROJECT_ROOT / "tests" / "fixtures" / "allennlp_elmo"
    return model if (model / "options.json").exists() else None


def _cmd_demo(args: argparse.Namespace) -> None:
    import torch

    from elmo_core import BiLM
    from elmo_core.config import tiny
    from elmo_core.model import init_bilm_tf

    log = logging.getLogger("elmo.demo")
    model_dir = Path(args.model) if args.model else _fixture_model()
    if model_dir is not None:
        bilm = BiLM.from_pretrained(str(model_dir), weight_file=str(model_dir / "lm_weights.hdf5") if (model_dir / "lm_weights.hdf5").exists() else None)
        source = str(model_dir)
    else:
        torch.manual_seed(0)
        fresh = BiLM(tiny())
        init_bilm_tf(fresh)
        out = PROJECT_ROOT / "data" / "models" / "random-tiny"
        fresh.save_pretrained(str(out))
        bilm = BiLM.from_pretrained(str(out))
        source = f"{out} (random weights: no trained model given and no fixture model in this checkout)"
    log.info("model: %s", source)
    sentences = [line.split() for line in Path(args.input).read_text(encoding="utf-8").splitlines() if line.strip()]
    start = time.perf_counter()
    vectors = bilm.embed_sentences(sentences)
    elapsed = time.perf_counter() - start
    n_tokens = sum(len(s) for s in sentences)

    # the polysemy probe: top-layer vectors of every "apple"/苹果 occurrence, compared pairwise
    hits = [(i, t) for i, s in enumerate(sentences) for t, tok in enumerate(s) if tok.lower().startswith("apple") or tok == "苹果"]
    print(f"model        {source}")
    print(f"layers       {bilm.num_layers} x {bilm.output_dim}")
    print(f"embedded     {len(sentences)} sentences, {n_tokens} tokens in {elapsed:.3f} s ({n_tokens / elapsed:,.0f} tokens/s)")
    if hits:
        top = np.stack([vectors[i][-1, t] for i, t in hits])
        top /= np.linalg.norm(top, axis=1, keepdims=True)
        sims = top @ top.T
        print("cosine similarity of the top layer between occurrences of apple / 苹果:")
        labels = [f"s{i}:{sentences[i][t]}" for i, t in hits]
        width = max(len(label) for label in labels)
        print(" " * width + "  " + " ".join(f"{j:>5d}" for j in range(len(hits))))
        for j, label in enumerate(labels):
            print(f"{label:>{width}}  " + " ".join(f"{v:5.2f}" for v in sims[j]))


def _cmd_info(args: argparse.Namespace) -> None:
    from elmo_core import BiLM

    bilm = BiLM.from_pretrained(args.model)
    cfg = bilm.config
    n_params = sum(p.numel() for n, p in bilm.named_parameters() if not n.endswith("bias_hh_l0") and not n.startswith("softmax"))
    print(f"{args.model}: {cfg.lstm.n_layers}x{cfg.lstm.dim}_{cfg.lstm.projection_dim}, {cfg.char_cnn.n_filters} filters, "
          f"{cfg.char_cnn.n_highway} highway, skip={cfg.lstm.use_skip_connections}, clips={cfg.lstm.cell_clip}/{cfg.lstm.proj_clip}, "
          f"{n_params:,} parameters (without softmax), softmax={cfg.n_tokens_vocab or 'none'}, "
          f"vocab={len(bilm.vocab) if bilm.vocab else 'none'}")


def _cmd_ingest(args: argparse.Namespace) -> None:
    from elmo_core.ingest import IngestConfig, ingest

    config = IngestConfig(
        sources=args.sources, out=args.out, tokenizer=args.tokenizer, split_sentences=args.split_sentences,
        text_field=args.text_field, text_column=args.text_column, heldout_fraction=args.heldout_fraction,
        max_tokens=args.max_tokens, dedup=not args.no_dedup, memory_limit=args.memory_limit,
    )
    summary = ingest(config)
    for problem in summary.warnings:
        print(f"warning: {problem}", file=sys.stderr)
    for error in summary.errors:
        print(f"error: {error}", file=sys.stderr)
    print(summary.line() + f" -> {args.out}")
    if summary.files_failed and not summary.files_ingested and not summary.files_skipped:
        raise ElmoError(f"no input could be ingested ({summary.files_failed} failed)")


def _cmd_vocab(args: argparse.Namespace) -> None:
    from elmo_core.vocab import VocabConfig, build_vocab

    config = VocabConfig(corpus=args.corpus, db=args.db, min_count=args.min_count, max_size=args.max_size,
                         vocab_file=args.vocab_file, memory_limit=args.memory_limit)
    stats = build_vocab(config)
    vocab_txt = Path(args.db).with_name("vocab.txt")
    print(f"vocab: {stats['vocab_size']:,} entries from {stats['train_tokens']:,} train tokens ({stats['train_types']:,} types); "
          f"heldout OOV rate {100 * stats['heldout_oov_rate']:.2f}% -> {args.db}, {vocab_txt}")


def _cmd_train(args: argparse.Namespace) -> None:
    from elmo_core.train import TrainConfig, describe_perplexity, train

    overrides = {"data": args.data, "out": args.out, "preset": args.preset, "max_steps": args.max_steps, "device": args.device,
                 "init_from": args.init_from}
    if args.config:
        config = TrainConfig.from_file(args.config, **overrides)
    else:
        if not args.data or not args.out:
            raise ElmoError("give --config FILE, or at least --data and --out")
        config = TrainConfig(**{k: v for k, v in overrides.items() if v is not None})
    updates = {}
    if args.resume:
        updates["resume"] = True
    if args.no_mlflow:
        updates["tracking"] = "none"
    config = config.model_copy(update=updates)
    result = train(config)
    print(f"train: {result.steps} steps, final loss {result.final_loss:.3f}, {describe_perplexity(result.perplexity)} -> {result.model_dir}"
          + (f"; MLflow run {result.run_id}, model {result.model_uri}" if result.run_id else ""))


def _cmd_perplexity(args: argparse.Namespace) -> None:
    import tempfile

    from elmo_core import BiLM
    from elmo_core.ingest import shard_paths
    from elmo_core.tracking import resolve_model_dir
    from elmo_core.train import evaluate
    from elmo_core.vocab import write_token_ids

    bilm = BiLM.from_pretrained(str(resolve_model_dir(args.model)), device=args.device)
    if bilm.softmax is None or bilm.vocab is None:
        raise ElmoError(f"{args.model}: perplexity needs a model with a softmax (softmax/W in weights.hdf5) and its vocab.txt")
    shards = [str(p) for p in shard_paths(args.corpus)]
    if not shards:
        raise ElmoError(f"{args.corpus}: no part-*.parquet shards; run `elmo ingest` first")
    with tempfile.TemporaryDirectory() as tmp:
        write_token_ids(shards, bilm.vocab, Path(tmp))
        result = evaluate(bilm, Path(tmp) / args.split, args.batch_size, 20, args.max_batches)
    print(f"perplexity: {result['perplexity']:.2f} (forward {result['perplexity_forward']:.2f}, backward "
          f"{result['perplexity_backward']:.2f}) on {int(result['eval_tokens']):,} {args.split} tokens of {args.corpus}")


def _cmd_export(args: argparse.Namespace) -> None:
    from elmo_core.train import export_checkpoint

    step, checkpoint = export_checkpoint(args.checkpoint or args.run, args.out)
    print(f"export: step {step} of {checkpoint} -> {args.out} (options.json, weights.hdf5 with softmax, vocab.txt)")


def _cmd_embed(args: argparse.Namespace) -> None:
    from elmo_core.embed import EmbedConfig, embed

    config = EmbedConfig(model=args.model, input=args.input, out=args.out, layers=args.layers, mix_weights=args.mix_weights,
                         gamma=args.gamma, dtype=args.dtype, pool=args.pool, split=args.split, tokenizer=args.tokenizer,
                         max_batch_tokens=args.max_batch_tokens, stateful=args.stateful, device=args.device, bf16=args.bf16)
    print(embed(config).line())


def _cmd_query(args: argparse.Namespace) -> None:
    from elmo_core.query import EmbeddingStore

    store = EmbeddingStore(args.embeddings)
    if args.similar_to:
        results = store.similar_sentences(args.similar_to, args.k, args.layer)
        for n in results:
            print(f"{n.similarity:7.4f}  {n.sentence_id}  {n.text}")
        return
    if not args.token:
        raise ElmoError("give --token (with --sentence or --sentence-id), or --similar-to SENTENCE_ID")
    sid, index, text = store.locate(args.token, args.sentence, args.sentence_id)
    print(f"nearest to {args.token!r} (token {index}) in: {text}")
    for n in store.nearest_tokens(args.token, args.sentence, args.sentence_id, args.k, args.layer, args.like):
        print(f"{n.similarity:7.4f}  {n.token:<15} {n.text}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elmo", description="Train, fine-tune and run ELMo biLMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="embed the probe sentences and print a summary",
        description="Embed data/probes/apple.txt with a biLM and print throughput and the similarity of the "
        "'apple' contexts. Example: elmo demo --model path/to/model_dir",
    )
    demo.add_argument("--model", help="model directory (options.json + weights.hdf5); default: the fixture model in tests/fixtures")
    demo.add_argument("--input", default=str(PROBES), help="whitespace-tokenized sentences, one per line")
    demo.set_defaults(func=_cmd_demo)

    ing = sub.add_parser(
        "ingest",
        help="corpus files -> tokenized, deduplicated Parquet",
        description="Read text (.txt, .gz, .bz2; one sentence per line, or paragraphs with --split-sentences), JSONL "
        "or Parquet files, folders or globs; write OUT/part-*.parquet and OUT/manifest.duckdb. Re-running skips "
        "files already ingested. Example: elmo ingest corpus/*.txt.gz --out data/ingest",
    )
    ing.add_argument("sources", nargs="+", help="files, folders or glob patterns")
    ing.add_argument("--out", required=True, help="output dataset folder")
    ing.add_argument("--tokenizer", choices=["whitespace", "unicode", "chinese"], default="whitespace")
    ing.add_argument("--split-sentences", action="store_true", help="text holds paragraphs: split them into sentences")
    ing.add_argument("--text-field", default="text", help="JSONL field with the text (default: text)")
    ing.add_argument("--text-column", default="text", help="Parquet column with the text (default: text)")
    ing.add_argument("--heldout-fraction", type=float, default=0.01, help="share of sentences held out (default 0.01)")
    ing.add_argument("--max-tokens", type=int, default=250, help="split longer sentences (default 250)")
    ing.add_argument("--no-dedup", action="store_true", help="keep exact duplicate sentences")
    ing.add_argument("--memory-limit", default="2GB", help="DuckDB memory limit (default 2GB)")
    ing.set_defaults(func=_cmd_ingest)

    voc = sub.add_parser(
        "vocab",
        help="vocabulary, char ids and token ids in DuckDB",
        description="Count tokens of an ingested dataset with DuckDB; write tables vocab, char_ids, token_counts, "
        "corpus_stats to --db, vocab.txt beside it, and token ids per split under token_ids/. "
        "Example: elmo vocab --corpus data/ingest --db data/vocab/vocab.duckdb --min-count 3",
    )
    voc.add_argument("--corpus", required=True, help="ingested dataset folder")
    voc.add_argument("--db", required=True, help="DuckDB file to write")
    voc.add_argument("--min-count", type=int, default=1)
    voc.add_argument("--max-size", type=int, default=None, help="at most this many entries (specials included)")
    voc.add_argument("--vocab-file", default=None, help="import an existing bilm-tf vocab.txt instead")
    voc.add_argument("--memory-limit", default="4GB")
    voc.set_defaults(func=_cmd_vocab)

    tr = sub.add_parser(
        "train",
        help="train or fine-tune the biLM",
        description="Train the biLM on the token ids written by `elmo vocab`, tracked in MLflow, checkpointed, and "
        "exported to OUT/model. Multi-GPU / multi-node: torchrun --nproc_per_node N -m elmo_core.cli train ... "
        "Example: elmo train --config train.yaml  or  elmo train --data data/vocab --out data/train --preset small",
    )
    tr.add_argument("--config", help="YAML/JSON file of TrainConfig fields")
    tr.add_argument("--data", help="folder written by `elmo vocab`")
    tr.add_argument("--out", help="run folder")
    tr.add_argument("--preset", choices=["tiny", "small", "medium", "original"])
    tr.add_argument("--init-from", help="fine-tune from a model directory or runs:/ / models:/ URI")
    tr.add_argument("--max-steps", type=int)
    tr.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    tr.add_argument("--no-mlflow", action="store_true", help="do not track in MLflow")
    tr.set_defaults(func=_cmd_train)

    ppl = sub.add_parser("perplexity", help="full-softmax perplexity of a model on a corpus",
                         description="Example: elmo perplexity --model data/train/model --corpus data/ingest")
    ppl.add_argument("--model", required=True, help="model directory with softmax and vocab.txt, or an MLflow URI")
    ppl.add_argument("--corpus", required=True, help="an ingested dataset folder")
    ppl.add_argument("--split", choices=["heldout", "train"], default="heldout")
    ppl.add_argument("--batch-size", type=int, default=64)
    ppl.add_argument("--max-batches", type=int, default=None)
    ppl.add_argument("--device", default="cpu")
    ppl.set_defaults(func=_cmd_perplexity)

    exp = sub.add_parser("export", help="checkpoint -> bilm-tf/AllenNLP model directory",
                         description="Example: elmo export --run data/train --out my_elmo")
    exp.add_argument("--run", help="run folder (uses its newest checkpoint)")
    exp.add_argument("--checkpoint", help="a checkpoint file instead")
    exp.add_argument("--out", required=True)
    exp.set_defaults(func=_cmd_export)

    emb = sub.add_parser(
        "embed",
        help="corpus -> contextual vectors in Parquet",
        description="Embed an ingested dataset (or text files, one sentence per line) with a biLM; write one row per "
        "token (or per sentence with --pool mean) to OUT/part-*.parquet. Resumable: a rerun does only missing units. "
        "Example: elmo embed --model data/train/model --input data/ingest --out data/embed",
    )
    emb.add_argument("--model", required=True, help="model directory, or runs:/RUN/model, or models:/NAME/VERSION")
    emb.add_argument("--input", required=True, help="ingested dataset folder, or text file(s)/glob")
    emb.add_argument("--out", required=True)
    emb.add_argument("--layers", choices=["all", "mix"], default="mix", help="mix (default): one 'elmo' column; all: layer_0..layer_L")
    emb.add_argument("--mix-weights", type=float, nargs="+", help="scalar-mix weights (before softmax); default: plain average")
    emb.add_argument("--gamma", type=float, default=1.0)
    emb.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    emb.add_argument("--pool", choices=["none", "mean"], default="none")
    emb.add_argument("--split", choices=["all", "train", "heldout"], default="all")
    emb.add_argument("--tokenizer", choices=["whitespace", "unicode", "chinese"], default="whitespace", help="for text input")
    emb.add_argument("--max-batch-tokens", type=int, default=8192)
    emb.add_argument("--stateful", action="store_true", help="carry state across batches (bilm-tf parity)")
    emb.add_argument("--device", default="auto")
    emb.add_argument("--bf16", action="store_true", help="bf16 autocast on CUDA")
    emb.set_defaults(func=_cmd_embed)

    qry = sub.add_parser(
        "query",
        help="nearest tokens-in-context / similar sentences with DuckDB",
        description="Example: elmo query data/embed --token apples --sentence 'I like to eat apples .' --like 'apple%%'",
    )
    qry.add_argument("embeddings", help="an `elmo embed` output folder")
    qry.add_argument("--token")
    qry.add_argument("--sentence", help="the sentence text the token is in")
    qry.add_argument("--sentence-id")
    qry.add_argument("--similar-to", help="sentence_id: similar sentences (tables made with --pool mean)")
    qry.add_argument("--like", help="only neighbours whose lower-cased token matches this SQL LIKE pattern")
    qry.add_argument("--layer", help="elmo or layer_N (default: elmo, else the top layer)")
    qry.add_argument("-k", type=int, default=10)
    qry.set_defaults(func=_cmd_query)

    info = sub.add_parser("info", help="describe a model directory", description="Example: elmo info data/models/my_elmo")
    info.add_argument("model", help="model directory (options.json + weights.hdf5 [+ vocab.txt])")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args.func(args)
    except ElmoError as exc:
        print(f"elmo {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"elmo {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
