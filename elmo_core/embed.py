"""Embed: an ingested corpus (or a text file) ─► contextual vectors in Parquet, one row per token (or sentence).

Output folder:

    OUT/job.json                      what was embedded with what (model id, options); a rerun must match it
    OUT/part-<shard>-<group>.parquet  one file per input row group (the unit of work), written atomically
    OUT/manifest.json                 units, rows and seconds, written when every unit is done

A unit's file appears only when complete (temp file, then rename), so after a crash a rerun redoes just the
missing units: exactly one row per input token, no duplicates, no gaps; a rerun with nothing missing does
nothing. Units are independent, which is how a Prefect flow maps them over workers (Dask included).

Rows (token mode): ``doc_id, sentence_id, token_index, token, text`` then either ``layer_0 … layer_L`` or ``elmo``
(a scalar mix), each FLOAT[2P] (float32, or float16), then ``model_id``. ``pool="mean"`` gives one row per
sentence (``doc_id, sentence_id, n_tokens, text``, the vectors averaged over tokens, ``model_id``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field

from elmo_core.errors import ConfigError
from elmo_core.ingest import IngestConfig, ingest, shard_paths
from elmo_core.model import BiLM
from elmo_core.tracking import resolve_model_dir

log = logging.getLogger(__name__)

JOB_FILE, MANIFEST_FILE = "job.json", "manifest.json"


class EmbedConfig(BaseModel):
    """Options of ``elmo embed``; the Prefect flow takes the same object."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="model directory (options.json + weights.hdf5) or runs:/ / models:/ URI")
    input: str = Field(description="an ingested dataset folder, or text files (one sentence per line)")
    out: str = Field(description="output dataset folder")
    layers: Literal["all", "mix"] = Field("mix", description="all: layer_0 … layer_L columns; mix: one elmo column")
    mix_weights: list[float] | None = Field(None, description="scalar-mix weights before softmax; default: plain average")
    gamma: float = Field(1.0, description="scalar-mix scale")
    dtype: Literal["float32", "float16"] = "float32"
    pool: Literal["none", "mean"] = Field("none", description="mean: one row per sentence")
    split: Literal["all", "train", "heldout"] = "all"
    tokenizer: Literal["whitespace", "unicode", "chinese"] = Field("whitespace", description="for text input, as ingest")
    max_batch_tokens: int = Field(8192, gt=0, description="tokens per forward pass (sentences bucketed by length)")
    stateful: bool = Field(False, description="carry LSTM state across batches (bilm-tf parity; not deterministic per sentence)")
    device: str = "auto"
    bf16: bool = Field(False, description="bf16 autocast on CUDA")


@dataclass
class Unit:
    """One input row group: the unit of work and of output."""

    shard: str
    row_group: int

    @property
    def name(self) -> str:
        return f"part-{Path(self.shard).stem.removeprefix('part-')}-{self.row_group:05d}.parquet"


@dataclass
class UnitResult:
    name: str
    rows: int
    tokens: int
    seconds: float
    skipped: bool = False


def model_id(model_dir: Path) -> str:
    """A short content hash of options.json + weights.hdf5: which model made a vector."""
    from elmo_core.weights import resolve_model_files

    options, weights, _ = resolve_model_files(model_dir, None, None)
    digest = hashlib.sha256()
    for path in (options, weights):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def prepare(config: EmbedConfig) -> tuple[Path, list[Unit], Path]:
    """Resolve the model, ingest text input if needed, write/check job.json; returns (model dir, units, corpus)."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(config.model, out / "_model" if ":/" in config.model else None)
    if not (model_dir / "options.json").exists():
        raise ConfigError(f"{model_dir}: no options.json; --model takes a model directory or an MLflow model URI")
    source = Path(config.input)
    if source.is_dir() and shard_paths(source):
        corpus = source
    else:  # text files: tokenized as ingest does, every line kept (no dedup), into OUT/_input
        corpus = out / "_input"
        summary = ingest(IngestConfig(sources=[config.input], out=str(corpus), tokenizer=config.tokenizer, dedup=False, heldout_fraction=0.0))
        if summary.errors and not shard_paths(corpus):
            raise ConfigError("; ".join(summary.errors))
    shards = shard_paths(corpus)
    if not shards:
        raise ConfigError(f"{config.input}: nothing to embed (no part-*.parquet shards and no text)")
    job = {"model_id": model_id(model_dir), "model": config.model, "corpus": str(corpus.resolve()),
           "options": config.model_dump(mode="json", exclude={"model", "input", "out", "device", "max_batch_tokens"})}
    job_path = out / JOB_FILE
    if job_path.exists():
        previous = json.loads(job_path.read_text())
        if {k: previous.get(k) for k in ("model_id", "options")} != {k: job[k] for k in ("model_id", "options")}:
            raise ConfigError(f"{out} holds embeddings of another job (model {previous.get('model_id')}, options "
                              f"{previous.get('options')}); use a new --out folder")
    else:
        tmp = job_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(job, indent=2) + "\n")
        os.replace(tmp, job_path)
    units = [Unit(str(s), g) for s in shards for g in range(pq.ParquetFile(s).num_row_groups)]
    return model_dir, units, corpus


def output_schema(n_layers: int, width: int, config: EmbedConfig) -> pa.Schema:
    value = pa.float16() if config.dtype == "float16" else pa.float32()
    vector = pa.list_(value, width)
    names = [f"layer_{i}" for i in range(n_layers)] if config.layers == "all" else ["elmo"]
    if config.pool == "mean":
        head = [("doc_id", pa.string()), ("sentence_id", pa.string()), ("n_tokens", pa.int32()), ("text", pa.string())]
    else:
        head = [("doc_id", pa.string()), ("sentence_id", pa.string()), ("token_index", pa.int32()), ("token", pa.string()), ("text", pa.string())]
    return pa.schema([*head, *[(n, vector) for n in names], ("model_id", pa.string())])


class Embedder:
    """Holds the loaded biLM and writes units. Create one per worker process."""

    def __init__(self, config: EmbedConfig, model_dir: Path) -> None:
        self.config = config
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.bilm = BiLM.from_pretrained(str(model_dir), device=device)
        self.model_id = model_id(model_dir)
        n = self.bilm.num_layers
        weights = torch.tensor(config.mix_weights if config.mix_weights is not None else [0.0] * n, dtype=torch.float32)
        if len(weights) != n:
            raise ConfigError(f"--mix-weights has {len(weights)} values; this model has {n} layers")
        self.mix = (config.gamma * torch.softmax(weights, 0)).to(self.bilm.device)
        self.schema = output_schema(n, self.bilm.output_dim, config)

    def embed_unit(self, unit: Unit, out: Path) -> UnitResult:
        target = out / unit.name
        if target.exists():
            return UnitResult(unit.name, pq.ParquetFile(target).metadata.num_rows, 0, 0.0, skipped=True)
        started = time.perf_counter()
        columns = ["doc_id", "sentence_id", "tokens", "text", "split"]
        group = pq.ParquetFile(unit.shard).read_row_group(unit.row_group, columns=columns)
        if self.config.split != "all":
            group = group.filter(pc.equal(group.column("split"), self.config.split))
        sentences = group.column("tokens").to_pylist()
        tokens = sum(len(s) for s in sentences)
        tmp = target.with_name(target.name + ".tmp")
        rows = 0
        with pq.ParquetWriter(tmp, self.schema, compression="zstd", compression_level=1, use_dictionary=["doc_id", "text", "model_id", "token"]) as writer:
            for table in self._tables(group, sentences):
                writer.write_table(table)
                rows += table.num_rows
        os.replace(tmp, target)
        return UnitResult(unit.name, rows, tokens, time.perf_counter() - started)

    @torch.no_grad()
    def _tables(self, group: pa.Table, sentences: list[list[str]]) -> Iterator[pa.Table]:
        """Bucket by length, run the biLM with every distinct word encoded once, and yield output tables."""
        bilm, config = self.bilm, self.config
        vocab = sorted({t for s in sentences for t in s})
        bilm.cache_token_embeddings(vocab)  # the char CNN once per distinct word of the unit
        order = list(range(len(sentences))) if config.stateful else sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
        doc_ids, sentence_ids, texts = (group.column(c).to_pylist() for c in ("doc_id", "sentence_id", "text"))
        use_bf16 = config.bf16 and bilm.device.type == "cuda"
        start = 0
        while start < len(order):
            batch = _take_batch(order, sentences, start, config.max_batch_tokens)
            start += len(batch)
            ids = bilm.batch_to_token_ids([sentences[i] for i in batch])
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
                out = bilm(ids.to(bilm.device), stateful=config.stateful)
            layers = torch.stack([layer.float() for layer in out["activations"]])  # (L+1, B, T, 2P)
            vectors = layers if config.layers == "all" else (self.mix[:, None, None, None] * layers).sum(0, keepdim=True)
            mask = out["mask"]
            yield self._table(batch, sentences, doc_ids, sentence_ids, texts, vectors, mask)

    def _table(self, batch: list[int], sentences: list[list[str]], doc_ids: list[str], sentence_ids: list[str],
               texts: list[str | None], vectors: torch.Tensor, mask: torch.Tensor) -> pa.Table:
        dtype = np.float16 if self.config.dtype == "float16" else np.float32
        width = vectors.shape[-1]
        names = [f"layer_{i}" for i in range(vectors.shape[0])] if self.config.layers == "all" else ["elmo"]
        if self.config.pool == "mean":
            counts = mask.sum(1, keepdim=True).clamp(min=1).to(vectors.dtype)
            pooled = (vectors * mask[None, :, :, None]).sum(2) / counts[None]  # (K, B, 2P)
            data = {"doc_id": [doc_ids[i] for i in batch], "sentence_id": [sentence_ids[i] for i in batch],
                    "n_tokens": [len(sentences[i]) for i in batch], "text": [texts[i] for i in batch]}
            for name, values in zip(names, pooled.cpu().numpy().astype(dtype)):
                data[name] = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)
            data["model_id"] = [self.model_id] * len(batch)
            return pa.table(data, schema=self.schema)
        flat_mask = mask.reshape(-1).cpu()
        picked = vectors.reshape(vectors.shape[0], -1, width)[:, flat_mask.to(vectors.device)].cpu().numpy().astype(dtype)
        rows = [(i, t) for i in batch for t in range(len(sentences[i]))]
        data = {
            "doc_id": [doc_ids[i] for i, _ in rows],
            "sentence_id": [sentence_ids[i] for i, _ in rows],
            "token_index": [t for _, t in rows],
            "token": [sentences[i][t] for i, t in rows],
            "text": [texts[i] for i, _ in rows],
        }
        for name, values in zip(names, picked):
            data[name] = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)
        data["model_id"] = [self.model_id] * len(rows)
        return pa.table(data, schema=self.schema)


def _take_batch(order: list[int], sentences: list[list[str]], start: int, max_tokens: int) -> list[int]:
    """The next sentences (in ``order``) whose padded size stays within ``max_tokens`` (at least one)."""
    batch: list[int] = []
    longest = 0
    for i in order[start:]:
        longest_if = max(longest, len(sentences[i]), 1)
        if batch and longest_if * (len(batch) + 1) > max_tokens:
            break
        batch.append(i)
        longest = longest_if
    return batch


def write_manifest(out: Path, results: list[UnitResult]) -> dict:
    manifest = {"units": [asdict(r) for r in results], "rows": sum(r.rows for r in results),
                "files": len(results), "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = out / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST_FILE)
    return manifest


@dataclass
class EmbedSummary:
    units: int
    units_done_before: int
    rows: int
    tokens: int
    seconds: float
    out: Path

    def line(self) -> str:
        return (f"embed: {self.units} units ({self.units_done_before} already done), {self.rows:,} rows, "
                f"{self.tokens:,} tokens in {self.seconds:.1f} s ({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s) -> {self.out}")


def embed(config: EmbedConfig) -> EmbedSummary:
    """Embed every unit not yet written, in this process (the Prefect flow maps units instead)."""
    started = time.perf_counter()
    model_dir, units, _ = prepare(config)
    out = Path(config.out)
    embedder = Embedder(config, model_dir)
    results = []
    for n, unit in enumerate(units, 1):
        result = embedder.embed_unit(unit, out)
        results.append(result)
        if not result.skipped:
            log.info("[%d/%d] %s: %d rows, %.0f tokens/s", n, len(units), unit.name, result.rows, result.tokens / max(result.seconds, 1e-9))
    write_manifest(out, results)
    return EmbedSummary(len(units), sum(r.skipped for r in results), sum(r.rows for r in results),
                        sum(r.tokens for r in results), time.perf_counter() - started, out)
