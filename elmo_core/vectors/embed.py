"""Embed: an ingested corpus (or text files) ─► contextual vectors in Parquet, one row per token (or sentence).

The output folder holds one job's table (one model, one set of options, one input) and reads as a plain Parquet
dataset in pyarrow, pandas, Spark and DuckDB (``read_parquet('OUT/*.parquet')``, ``'OUT/**/*.parquet'`` too):

    OUT/part-<shard>-<group>-<row>.parquet   one file per unit of work (about ``unit_tokens`` tokens)
    OUT/_job.json        what is embedded with what: model id, input (shards, rows), options, the units
    OUT/_manifest.json   rows, tokens and seconds per unit; written when every unit is done
    OUT/_index/          the nearest-neighbour index, once the table is indexed (``vectors/ann/``)

Working files live beside OUT, never inside it, in ``.<OUT's name>.elmo/``: the tokenized copy of text input
(Parquet that is not part of the table; ``sources.TokenizeStage``) and, under ``--overwrite``, the next table until
it is complete (a model named by an MLflow URI lives in the runtime's download cache). A unit's file appears only
when complete (hidden temp file, then rename), so after a crash a rerun redoes just the missing units: exactly one
row per input token. The plan (``plan_job``) only reads; a run whose model, options or input differ from the
folder's job is refused there, before anything is written; ``--overwrite`` builds the new table in the work folder
and swaps it in at the end, so old and new parts are never read together.

Rows (token mode): ``doc_id, sentence_id, token_index, token, text`` then either ``layer_0 … layer_L`` or ``elmo``
(a scalar mix), each FLOAT[2P] (float32, or float16), then ``model_id``. ``pool="mean"`` gives one row per
sentence (``doc_id, sentence_id, n_tokens, text``, the vectors averaged over tokens, ``model_id``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from elmo_core.bilm.inference import StateCarry
from elmo_core.config import read_options
from elmo_core.errors import InputError, OutputError
from elmo_core.fileio import atomic_path, files_digest, require_space, space_line, write_text_atomic
from elmo_core.options import EmbedConfig, IndexConfig
from elmo_core.precision import onednn_verbose
from elmo_core.runtime import ModelLookup, ModelRef, Output, Placement, Runtime, gpu_processes, lookup_model, place
from elmo_core.stage import run_local, show_plan
from elmo_core.vectors.ann import JOB_FILE, IndexStage, IndexSummary
from elmo_core.vectors.ann.files import table_bytes
from elmo_core.vectors.sources import (
    TokenizeStage,
    Unit,
    input_shards,
    job_lock,
    needs_tokenizing,
    plan_units,
    work_dir,
)
from elmo_core.vectors.unit_file import open_writer, output_schema, pass_table, writes

__all__ = ["EmbedConfig", "EmbedStage", "EmbedSummary", "Embedder", "Job", "Unit", "embed", "finish", "plan_job"]

log = logging.getLogger(__name__)

MANIFEST_FILE = "_manifest.json"
LEGACY_FILES = ("job.json", "manifest.json", "_input", "_model")  # what earlier versions kept inside OUT


@dataclass
class UnitResult:
    name: str
    rows: int
    tokens: int
    seconds: float
    skipped: bool = False
    pid: int = 0  # the process that ran it, and its torch threads (how a job's work was spread)
    threads: int = 0
    device: str = ""  # what wrote it: "cpu", or "cuda" and the GPU's UUID (``device_of``); "" where skipped


@dataclass
class Job:
    """A planned embedding job (the stage's plan): the model, where and in what precision it runs (resolved once,
    here, by the runtime's ``place``), the units, and where they are written (OUT, or the next table)."""

    config: EmbedConfig
    placement: Placement
    model: ModelRef | ModelLookup  # a lookup until the claim fetches what is not on this machine yet (``_ready``)
    model_id: str | None  # ``model.model_id``: hashed once here, not again by every worker (None: not fetched yet)
    units: list[Unit]
    target: Path
    out: Path
    work: Path
    identity: dict[str, Any]  # what ``_job.json`` records: a rerun with the same identity resumes the job
    processes: list[dict[str, str]] = field(default_factory=list)  # one per GPU (``gpu_processes``), or none
    writes_beside: bool = False  # each pass's table written by a thread beside the model (on a GPU: ``_writes``)

    def bytes_to_write(self) -> int | None:
        """About the bytes of the units still to write (``ann.table_bytes``, its factors measured on real tables);
        None before the model is fetched (its width is in its options.json)."""
        ref = self.model if isinstance(self.model, ModelRef) else self.model.ref
        if ref is None:
            return None
        todo = [u for u in self.units if not (self.target / u.name).exists()]
        lstm = read_options(ref.options).lstm
        rows = sum(u.stop - u.start if self.config.pool == "mean" else u.tokens for u in todo)
        config = self.config
        return table_bytes(
            rows,
            lstm.n_layers + 1,
            2 * lstm.projection_dim,
            config.dtype,
            config.layers,
            config.pool,
            config.compression,
            len(todo),
        )

    def require_room(self) -> None:
        """Refused in one line where the units still to write do not fit (where the model's width is known)."""
        if (size := self.bytes_to_write()) is not None:
            advice = "free some space, or ask for less (--layers mix, --dtype float16)"
            require_space(self.out, size, "the table", advice)

    def lines(self) -> list[str]:
        done = sum((self.target / u.name).exists() for u in self.units)
        size = self.bytes_to_write()
        space = space_line(self.out, size) if size is not None else "its size known once the model is here"
        return [
            self.model.line(),
            f"on {self.placement.line()}{spread_line(self.processes, self.writes_beside)}",
            f"{len(self.units)} units ({done} already done), {sum(u.tokens for u in self.units):,} tokens; {space}",
            f"writes {self.target}" + (f", then swaps it in for {self.out}" if self.replaces else ""),
        ]

    @property
    def replaces(self) -> bool:
        return self.target != self.out


# ----- the output folder -----------------------------------------------------------------------------------


def _read_job(folder: Path) -> dict[str, Any] | None:
    return json.loads((folder / JOB_FILE).read_text()) if (folder / JOB_FILE).exists() else None


def _describe_input(value: dict[str, Any] | None) -> str:
    if not value:
        return "?"
    return f"{value['path']} ({len(value['shards'])} shards, {sum(rows for _, rows in value['shards']):,} rows)"


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What makes ``new`` another job than the folder's ``old`` one. ``new`` may lack ``input`` (the tokenized
    shards, not known before text input is tokenized): then the model, the named source and the options decide."""
    parts = []
    if new["model_id"] is None:  # not fetched yet: its exact version decides now, its content at the claim
        moved = old.get("model_version") not in (None, new.get("model_version"))
        new = {**new, "model_id": old.get("model_id") if not moved else "not on this machine yet"}
    if old.get("model_id") != new["model_id"]:
        was, now = old.get("model_version") or old.get("model"), new.get("model_version") or new.get("model")
        part = f"model {was} (id {old.get('model_id')}) → {now} (id {new['model_id']})"
        if old.get("model") == new.get("model") and was != now and str(was).startswith("models:/"):
            part += f": {new['model']} moved since the table was begun; --model {was} finishes it"
        parts.append(part)
    if "source" in old and old["source"] != new["source"]:  # tables written before "source" was kept lack it
        parts.append(f"input {old['source']} → {new['source']}")
    elif "input" in new and old.get("input") != new["input"]:
        parts.append(f"input {_describe_input(old.get('input'))} → {_describe_input(new['input'])}")
    options = old.get("options") or {}
    fields = EmbedConfig.model_fields  # an option newer than the folder's job, at its default, changes nothing
    changed = [
        f"{k} {options.get(k)!r} → {v!r}"
        for k, v in new["options"].items()
        if options.get(k) != v and not (k not in options and k in fields and fields[k].default == v)
    ]
    if changed:
        parts.append("options " + ", ".join(changed))
    return "; ".join(parts)


def _another_job(out: Path, differs: str) -> OutputError:
    return OutputError(
        f"{out} holds embeddings of another job ({differs}); use a new --out folder, "
        "or --overwrite to replace its table"
    )


def _refuse_another_job_early(out: Path, partial: dict[str, Any]) -> None:
    """Refuse a job whose model, source or options differ from the folder's before its text input is tokenized:
    no work done, one line, and the folder's own working copy of its input left as it is."""
    current = _read_job(out)
    differs = _differences(current, partial) if current is not None else ""
    if differs:
        raise _another_job(out, differs)


def _target(out: Path, work: Path, job: dict[str, Any], overwrite: bool) -> Path:
    """Where this job writes its units (reading only): OUT itself (new, empty, or this very job's), or under
    ``overwrite`` the next table in the work folder. Another job's folder, or files ``elmo embed`` did not write, are
    refused in one line."""
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return out
    current = _read_job(out)
    if current is None and not any((out / name).exists() for name in LEGACY_FILES):
        strangers = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
        raise OutputError(
            f"{out}: holds files that `elmo embed` did not write ({strangers}); use a new or empty --out folder"
        )
    differs = _differences(current, job) if current is not None else "written by an earlier version of elmo embed"
    if not differs:
        return out  # the same job: resume it (or find it done)
    if not overwrite:
        raise _another_job(out, differs)
    return work / "next"


def _ready(job: Job) -> None:
    """Under the job's lock, before its first unit: the folder is still as the plan found it (another job may have
    claimed it in between), a replacement left by another job is gone, the job's record is written, and the temp
    files of writers that died are removed. A model the plan found not yet on this machine (a registered version
    not downloaded, a release not converted) is fetched here first, under the lock, and the folder compared with
    its content."""
    if isinstance(job.model, ModelLookup):
        job.model = job.model.fetch()
        job.model_id = job.identity["model_id"] = job.model.model_id
        job.identity["model_identity"] = job.model.identity()
        job.require_room()
    if _target(job.out, job.work, job.identity, job.config.overwrite) != job.target:
        raise OutputError(f"{job.out}: changed by another job since this one was planned; run it again")
    if job.replaces and _read_job(job.target) != job.identity:  # not an interrupted replacement by this very job
        shutil.rmtree(job.target, ignore_errors=True)
    job.target.mkdir(parents=True, exist_ok=True)
    if _read_job(job.target) != job.identity:
        write_text_atomic(job.target / JOB_FILE, json.dumps(job.identity, indent=2) + "\n")
    for stale in job.target.glob(".part-*.tmp"):  # left by writers that died; no other job can be writing here
        stale.unlink(missing_ok=True)


def _model_and_options(config: EmbedConfig) -> tuple[Placement, ModelLookup, dict[str, Any]]:
    """The device and precision, the model, and the job's identity as far as it is known before its input is read;
    a job that differs from the folder's is refused here (reading only), before text input is tokenized."""
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: is a file; --out takes a folder (new, empty, or one this job wrote)")
    placement = place(config.device, config.precision)  # refused here, before anything is written
    model = lookup_model(config.model)  # read only: a download or a conversion waits for the claim
    known = {
        "model_id": model.model_id,
        "model": config.model,
        "model_version": model.exact,  # models:/elmo/3 where models:/elmo/latest was asked: the job's exact model
        "model_identity": model.identity(),
        "source": str(Path(config.input).resolve()),
        "options": config.identity(exclude=frozenset({"model", "input", "out"})),
    }
    if not config.overwrite:
        _refuse_another_job_early(out, known)
    return placement, model, known


def plan_job(config: EmbedConfig, per_gpu: bool = True) -> Job:
    """The stage's plan, reading only: the output folder checked, the model resolved (MLflow URIs through the
    runtime's download cache) and placed, the input's units cut, where they go. Nothing is created or changed: the
    claim (``_ready``, under ``job_lock``) does that; text input is tokenized before, by ``TokenizeStage``."""
    out = Path(config.out)
    work = work_dir(out)
    placement, model, known = _model_and_options(config)
    corpus, shards = input_shards(config, work)
    units = plan_units(shards, config.unit_tokens, config.split)
    if not units:
        raise InputError(f"{config.input}: no {config.split} sentences to embed")
    identity = {
        **known,
        "input": {
            "path": str(corpus.resolve()),
            "shards": [[s.name, pq.ParquetFile(s).metadata.num_rows] for s in shards],
        },
        "units": [u.name for u in units],
        "input_digest": files_digest(shards),  # what a table and its index say they hold (not compared: "input" is)
    }
    target = _target(out, work, identity, config.overwrite)
    processes = unit_processes(config, placement, len(units)) if per_gpu else []
    beside = writes_beside(placement)
    job = Job(config, placement, model, identity["model_id"], units, target, out, work, identity, processes, beside)
    job.require_room()  # where the model is here; else once it is fetched (``_ready``)
    if model.ref is not None:
        job.model = model.ref
    return job


def unit_processes(config: EmbedConfig, placement: Placement, n_units: int) -> list[dict[str, str]]:
    """The processes a job of ``n_units`` runs its units in, each taking the next as it finishes one: one per GPU
    (``gpu_processes``), or on a CPU the ``workers`` asked for, each with its share of the cores as torch threads,
    each reading, embedding and writing its own units (one process's writer thread is its cap where the model is
    fast); [] for this process alone."""
    if n_units < 2:
        return []
    gpus = gpu_processes(placement.device)
    if gpus or placement.torch_device.type != "cpu":
        return gpus
    return [{} for _ in range(min(config.workers, n_units))] if config.workers > 1 else []


def writes_beside(placement: Placement) -> bool:
    """Whether a thread beside the model writes the tables: on a GPU, so that it never waits on the disk; a CPU's
    cores are the model's, and a writer thread would take one."""
    return placement.torch_device.type == "cuda"


def spread_line(processes: list[dict[str, str]], beside: bool, units_known: bool = True) -> str:
    """Where the units run beside the placement, where the plan decided more than the placement says (before the
    text is cut into units, the processes it would take for more than one)."""
    spread = ""
    if processes and "CUDA_VISIBLE_DEVICES" in processes[0]:
        gpus = ", ".join(p["CUDA_VISIBLE_DEVICES"] for p in processes)
        spread += f"; one process per GPU ({gpus}), each taking units as it finishes one"
    elif processes:
        spread += f"; {len(processes)} processes, each with its share of the cores, taking units as they finish one"
    if processes and not units_known:
        spread += ", where the text makes more than one unit"
    return spread + ("; tables written by a thread beside the model" if beside else "")


# ----- the work ------------------------------------------------------------------------------------------


def device_of(device: torch.device) -> str:
    """What a unit ran on, for the manifest: ``cpu``, or ``cuda`` and the GPU's UUID, which names the same GPU in
    every process whatever ``CUDA_VISIBLE_DEVICES`` numbers it as, so the manifest shows how units spread over GPUs."""
    if device.type != "cuda":
        return device.type
    return f"cuda {torch.cuda.get_device_properties(device).uuid}"


class Embedder:
    """Writes units with the job's model, opened once in this process by the runtime. Create one per worker."""

    def __init__(self, job: Job, show_kernels: bool = False) -> None:
        config = job.config
        self.config, self.model_id, self.show_kernels = config, job.model_id, show_kernels
        self.writes_beside = job.writes_beside
        self.runtime = Runtime.open(job.model, placement=job.placement, max_batch_tokens=config.max_batch_tokens)
        seconds = self.runtime.warm_up()  # not in the first unit's seconds, nor its ETA
        log.info("weights prepared for %s in %.1f s, before the first unit", job.placement.line(), seconds)
        if show_kernels:
            log.info("%s; oneDNN's log of the first batch follows", self.runtime.bilm.kernels)
        self.output = Output.of(config.layers, config.pool, config.mix_weights, config.gamma, config.dtype)
        n = self.runtime.num_layers
        self.factors = self.output.factors(n) if config.layers == "mix" else None
        self.schema = output_schema(n, self.runtime.output_dim, config)
        self.names = self.output.columns(n)
        self.device = device_of(self.runtime.bilm.device)

    def embed_unit(self, unit: Unit, out: Path) -> UnitResult:
        target = out / unit.name
        if target.exists():
            rows = pq.ParquetFile(target).metadata.num_rows
            return UnitResult(unit.name, rows, 0, 0.0, True, os.getpid(), torch.get_num_threads())  # not written here
        started = time.perf_counter()
        group = pq.ParquetFile(unit.shard).read_row_group(
            unit.row_group, columns=["doc_id", "sentence_id", "tokens", "text", "split"]
        )
        group = group.slice(unit.start, unit.stop - unit.start)
        if self.config.split != "all":
            group = group.filter(pc.equal(group.column("split"), self.config.split))
        sentences = group.column("tokens").to_pylist()
        rows = 0
        with atomic_path(target) as tmp:
            with (
                open_writer(tmp, self.schema, self.config.compression) as writer,
                writes(writer, self.writes_beside) as write,
            ):
                for table in self._tables(group, sentences):
                    write(table)
                    rows += table.num_rows
        seconds = time.perf_counter() - started
        tokens = sum(len(s) for s in sentences)
        return UnitResult(unit.name, rows, tokens, seconds, False, os.getpid(), torch.get_num_threads(), self.device)

    def _tables(self, group: pa.Table, sentences: list[list[str]]) -> Iterator[pa.Table]:
        """The unit's sentences through the runtime (length-sorted passes under its token budget, or in order when
        stateful), each pass shaped by the job's output and written as a table."""
        carry = StateCarry() if self.config.stateful else None
        batches = self.runtime.run(sentences, carry=carry)
        with onednn_verbose(self.show_kernels):  # one batch is enough to see the kernels
            first = next(batches, None)
        self.show_kernels = False
        for batch, stacked, counts in itertools.chain([first] if first is not None else [], batches):
            vectors = self.output.apply(stacked, counts, self.factors).to(self.output.torch_dtype())
            yield pass_table(
                self.schema, self.names, group, np.asarray(batch), counts.cpu().numpy(), vectors, self.model_id
            )


# what the summary offers to try on a table (shown, never run: the folder is part of the text on purpose)
TRY_TOKENS = """CREATE VIEW emb AS SELECT * FROM read_parquet('{folder}/*.parquet');
SELECT token, text, list_cosine_similarity({column}, (SELECT {column} FROM emb LIMIT 1)) AS similarity
FROM emb ORDER BY similarity DESC LIMIT 5;"""
TRY_SENTENCES = "SELECT sentence_id, text FROM read_parquet('{folder}/*.parquet') LIMIT 5;"


@dataclass
class EmbedSummary:
    units: int
    units_done_before: int
    rows: int
    tokens: int
    seconds: float
    out: Path
    unit_seconds: list[float]
    processes: int = 1  # how many processes ran the units, and their torch threads
    threads: list[int] = field(default_factory=list)
    column: str = "elmo"
    pooled: bool = False
    index: IndexSummary | None = None  # the index built after the table, where the job asked for one

    def line(self) -> str:
        per_unit = (
            f"; {np.mean(self.unit_seconds):.1f} s per unit (slowest {max(self.unit_seconds):.1f} s)"
            if self.unit_seconds
            else ""
        )
        return (
            f"embed: {self.units} units ({self.units_done_before} already done), {self.rows:,} rows, "
            f"{self.tokens:,} tokens in {self.seconds:.1f} s ({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s"
            f"{per_unit}) -> {self.out}"
        )

    def try_query(self) -> str:
        """A DuckDB query to paste into the ``duckdb`` shell over this table."""
        template = TRY_SENTENCES if self.pooled else TRY_TOKENS
        return template.format(folder=Path(self.out).resolve(), column=self.column)


def finish(job: Job, results: list[UnitResult], seconds: float) -> EmbedSummary:
    """Write the manifest; under ``--overwrite`` swap the new table in for the old one (then delete the old)."""
    manifest = {
        "units": [asdict(r) for r in results],
        "rows": sum(r.rows for r in results),
        "files": len(results),
        "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_text_atomic(job.target / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
    if job.replaces:
        old = job.work / f"replaced-{time.strftime('%Y%m%d%H%M%S')}"
        job.out.rename(old)
        job.target.rename(job.out)
        shutil.rmtree(old)
        log.info("replaced the table in %s", job.out)
    done = [r for r in results if not r.skipped]
    return EmbedSummary(
        len(results),
        len(results) - len(done),
        manifest["rows"],
        sum(r.tokens for r in done),
        seconds,
        job.out,
        [r.seconds for r in done],
        processes=len({r.pid for r in results}),
        threads=sorted({r.threads for r in results}),
        column="elmo" if job.config.layers == "mix" else "layer_1",
        pooled=job.config.pool == "mean",
    )


_LOADED: dict[tuple[str, str], Embedder] = {}  # the model a process has loaded, for the units it runs after the first


class EmbedStage:
    """Embedding as a stage (``elmo_core.stage``): plan the units (reading only), claim the folder (the lock, then the
    folder readied: ``_ready``), embed each unit, finish the table. A process loads the model with its first unit
    and keeps it for the job's next ones."""

    name, counts = "embed", "tokens"

    def __init__(self, show_kernels: bool = False, per_gpu: bool = True) -> None:
        self.show_kernels = show_kernels  # log the kernels, and oneDNN's log of the first batch
        self.per_gpu = per_gpu  # plan one process per GPU (``Job.processes``); False where a task runner places units

    def identity(self, config: EmbedConfig) -> dict[str, Any]:
        return plan_job(config, self.per_gpu).identity

    def plan(self, config: EmbedConfig) -> Job:
        return plan_job(config, self.per_gpu)

    @contextlib.contextmanager
    def claim(self, job: Job) -> Iterator[None]:
        with job_lock(job.config):
            _ready(job)
            yield

    def run_unit(self, job: Job, unit: Unit, report: Callable[[int], None] | None = None) -> UnitResult:
        key = (job.model_id, job.config.model_dump_json() + job.placement.line())
        if key not in _LOADED:
            _LOADED.clear()
            _LOADED[key] = Embedder(job, self.show_kernels)
        return _LOADED[key].embed_unit(unit, job.target)

    def finish(self, job: Job, results: list[UnitResult], seconds: float) -> EmbedSummary:
        return finish(job, results, seconds)


def stages(config: EmbedConfig, show_kernels: bool = False, per_gpu: bool = True) -> list[tuple[Any, Any]]:
    """The stages an embedding job runs, in order, each with its options: text tokenized first where it has to be,
    the table (``per_gpu``: one process per GPU, see ``plan_job``), then (``index``) its nearest-neighbour index."""
    steps: list[tuple[Any, Any]] = []
    if needs_tokenizing(config):  # another job's folder is refused in its plan, before any text is tokenized
        steps.append((TokenizeStage(check=_model_and_options), config))
    steps.append((EmbedStage(show_kernels, per_gpu), config))
    if config.index:
        steps.append((IndexStage(), IndexConfig(table=config.out, wait=config.wait)))
    return steps


def plan_lines(config: EmbedConfig) -> list[str]:
    """``elmo embed --plan``: each stage's plan, reading only. Text input not yet tokenized has no units to show
    until it is: its tokenizing is planned, and the model and where it runs are resolved as the job would."""
    lines: list[str] = []
    for stage, options in stages(config):
        if isinstance(stage, EmbedStage) and needs_tokenizing(config):
            placement, model, _ = _model_and_options(config)
            spread = spread_line(unit_processes(config, placement, 2), writes_beside(placement), units_known=False)
            lines += ["embed: units are cut once the text is tokenized", model.line(), f"on {placement.line()}{spread}"]
        elif isinstance(stage, IndexStage) and not Path(config.out).is_dir():
            lines.append("index: built once the table is written")
        else:
            lines += show_plan(stage, options)
    return lines


def embed(
    config: EmbedConfig,
    show_kernels: bool = False,
    run: Callable[[Any, Any], Any] = run_local,
    per_gpu: bool = True,
) -> EmbedSummary:
    """An embedding job (``stages``), each stage driven by ``run`` (this process by default; the embed flow passes
    ``flows.common.run_stage``, which maps the units over Prefect tasks). A rerun does only what is missing.
    ``show_kernels``: log what runs, and oneDNN's log of the first batch. ``per_gpu``: plan one process per GPU of
    the machine (``run_local`` starts them); a runner whose task runner places the units itself passes False."""
    results = [run(stage, options) for stage, options in stages(config, show_kernels, per_gpu)]
    table: EmbedSummary = next(r for r in results if isinstance(r, EmbedSummary))
    if config.index:
        table.index = results[-1]
    return table
