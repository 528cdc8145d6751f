"""A table that follows a model: the corpus embedded with each model version into a table of its own, and the one in
use switched atomically, so that a reader sees the old table or the new one, never a mix (``elmo refresh``; the
refresh deployment runs it when a version is promoted).

    TABLE/versions/elmo-v3/   an ``elmo embed`` table of models:/elmo/3, with its index (``_index/``)
    TABLE/current.duckdb      a DuckDB database: the view ``vectors`` over the version in use, the table ``version``
    TABLE/current.json        the same for programs (``elmo query TABLE`` follows it): folder, model, input digest

Why a database replaced whole, not a view altered in place: a DuckDB file has one writing process and then no other
reader, so altering the view would lock every reader out during the switch. The new database is written under a
temporary name and renamed over the old one (``os.replace``, atomic on POSIX): a reader that opens it afterwards
sees the new version; one that opened it before keeps the old file and reads the old version's files, which stay
until a later switch (``keep``). The view names the files by absolute path (DuckDB reads a relative one against the
reader's working directory), so a table folder that moves needs ``elmo refresh`` again.

A switch goes only to a complete table of the exact version asked for and, with ``alias``, only while the alias
still names that version: two promotions in quick succession end on the later one, in whichever order their
refreshes finish.
"""

from __future__ import annotations

import datetime
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elmo_core import tracking
from elmo_core.errors import InputError, OutputError, StoreUnreachable, TrackingError
from elmo_core.fileio import FolderLock, publish, temp_path, write_text_atomic
from elmo_core.options import EmbedConfig, EmbedOptions, Options, RefreshConfig
from elmo_core.runtime.reference import REGISTERED, lookup_model, pin_reference
from elmo_core.stage import WholeStage, run_local
from elmo_core.vectors.ann import POINTER, table_job
from elmo_core.vectors.embed import MANIFEST_FILE, EmbedSummary, embed
from elmo_core.vectors.sources import LOCK_NAME, work_dir

log = logging.getLogger(__name__)

VERSIONS, DATABASE, VIEW = "versions", "current.duckdb", "vectors"


def version_name(exact: str, model_id: str | None) -> str:
    """The folder name of ``exact``'s table: ``elmo-v3`` for models:/elmo/3; another model by its content's id, or
    a run's model (not downloaded yet) by its run."""
    match = REGISTERED.match(exact)
    if match is not None and match["version"]:
        return f"{match['name']}-v{match['version']}"
    if model_id is None:
        return "run-" + exact.removeprefix("runs:/").split("/")[0][:12]
    return f"model-{model_id[:12]}"


def read_pointer(table: Path) -> dict[str, Any] | None:
    pointer = table / POINTER
    return json.loads(pointer.read_text()) if pointer.exists() else None


def _alias_names(exact: str, alias: str) -> str | None:
    """The version ``alias`` names now, as models:/NAME/N (None: unset). A store that is away raises (retried)."""
    match = REGISTERED.match(exact)
    if match is None or not match["version"]:
        raise InputError(f"{exact}: an alias is followed only for a registered version (models:/NAME/N)")
    try:
        return pin_reference(f"models:/{match['name']}@{alias}")
    except StoreUnreachable:
        raise
    except TrackingError:  # the alias is not set (any more)
        return None


# ----- the switch: a stage of its own, so that it holds the table's lock -------------------------------------------


class SwitchOptions(Options):
    """What the switch is asked: make ``version`` (a complete table of ``model``) the one ``table`` uses."""

    table: str
    version: str
    model: str
    alias: str | None = None
    keep: int = 2
    wait: bool = True  # a switch takes a moment: a second one queues behind it


@dataclass
class Switched:
    switched: bool
    line: str
    removed: list[str] = field(default_factory=list)


def _complete(folder: Path, model: str) -> dict[str, Any]:
    """The table's job record, where ``folder`` holds a complete table of ``model``; else one line saying why not."""
    job = table_job(folder)
    if job.get("model_version") != model:
        raise OutputError(f"{folder}: holds a table of {job.get('model_version') or 'no known model'}, not {model}")
    manifest = folder / MANIFEST_FILE
    files = json.loads(manifest.read_text())["files"] if manifest.exists() else None
    if files != len(job.get("units", [])):
        raise OutputError(f"{folder}: its table is not complete; run the refresh again to finish it")
    return job


def _sql_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _write_database(table: Path, record: dict[str, Any]) -> None:
    """``current.duckdb`` anew, under a temporary name, then renamed over the old one (module docstring)."""
    import duckdb

    final = table / DATABASE
    tmp = temp_path(final)
    con = duckdb.connect(str(tmp))
    try:
        files = _sql_text(str(Path(record["folder"]) / "part-*.parquet"))
        con.execute(f"CREATE VIEW {VIEW} AS SELECT * FROM read_parquet({files})")
        con.execute(
            "CREATE TABLE version AS SELECT " + ", ".join(f"?::VARCHAR AS {k}" for k in record), [*record.values()]
        )
    finally:
        con.close()
    publish(tmp, final)


def _prune(table: Path, kept: list[str]) -> list[str]:
    """Remove the versions not in ``kept`` (with their work folders) that no job is writing: an embedding in
    progress holds its job's lock (``sources.job_lock``)."""
    removed = []
    for folder in sorted((table / VERSIONS).iterdir()):
        if not folder.is_dir() or folder.name.startswith(".") or folder.name in kept:
            continue
        try:
            with FolderLock(work_dir(folder) / LOCK_NAME, folder):
                shutil.rmtree(folder)
                shutil.rmtree(work_dir(folder), ignore_errors=True)
                removed.append(folder.name)
        except OutputError:
            log.info("%s: in use by another job; kept", folder)
    return removed


def switch(options: SwitchOptions) -> Switched:
    """Make ``options.version`` the table in use (module docstring): checked, the database and the pointer written,
    the versions beyond ``keep`` removed. Under the table's lock (``SwitchStage``)."""
    table, folder = Path(options.table).absolute(), Path(options.version).absolute()
    job = _complete(folder, options.model)
    if options.alias:
        now = _alias_names(options.model, options.alias)
        if now != options.model:
            return Switched(False, f"{table}: not switched to {options.model}: @{options.alias} names {now} now")
    before = read_pointer(table) or {}
    if before.get("folder") == str(folder):
        return Switched(False, f"{table}: {folder.name} ({options.model}) already in use")
    now_utc = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    record = {
        "name": folder.name,
        "folder": str(folder),
        "model_version": options.model,
        "model_id": job.get("model_id"),
        "input_digest": job.get("input_digest"),
        "switched_at": now_utc,
    }
    _write_database(table, record)
    history = [folder.name, *[name for name in before.get("history", []) if name != folder.name]]
    write_text_atomic(table / POINTER, json.dumps({**record, "history": history}, indent=2) + "\n")
    removed = _prune(table, history[: options.keep])
    was = f" (was {before['name']})" if before else ""
    gone = f"; removed {', '.join(removed)}" if removed else ""
    return Switched(True, f"{table}: switched to {folder.name} ({options.model}){was}{gone}", removed)


class SwitchStage(WholeStage):
    """The switch as a stage: its claim locks the table's folder (one switch at a time), its work is ``switch``."""

    name = "switch"

    def writes(self, options: SwitchOptions) -> list[Path]:
        return [Path(options.table)]

    def work(self, options: SwitchOptions) -> Switched:
        return switch(options)


# ----- a refresh: pin, embed the version's table, switch to it ----------------------------------------------------


@dataclass
class RefreshPlan:
    """What a refresh will do, read and decided: the exact version, its table's folder, or why nothing is to do."""

    config: RefreshConfig
    model: str  # models:/elmo/3, pinned
    folder: Path
    skip: str | None = None  # why nothing is to be done

    def embedding(self) -> EmbedConfig:
        options = self.config.model_dump(include=set(EmbedOptions.model_fields))
        return EmbedConfig(**options, model=self.model, input=self.config.input, out=str(self.folder))


def plan_refresh(config: RefreshConfig) -> RefreshPlan:
    """Pin the model, name its table's folder, and skip a version its alias no longer names (reading only)."""
    if config.tracking_uri:
        tracking.use_store(config.tracking_uri)
    found = lookup_model(config.model)  # pinned: models:/elmo/3 for @champion; a folder by its absolute path
    exact = found.exact
    folder = Path(config.table).absolute() / VERSIONS / version_name(exact, found.model_id)
    plan = RefreshPlan(config, exact, folder)
    if config.alias and (now := _alias_names(exact, config.alias)) != exact:
        plan.skip = f"{exact}: @{config.alias} names {now} now; its own refresh embeds and switches"
    return plan


@dataclass
class Refresh:
    plan: RefreshPlan
    table: EmbedSummary | None = None
    switched: Switched | None = None

    def line(self) -> str:
        if self.plan.skip:
            return f"refresh: nothing to do: {self.plan.skip}"
        assert self.table is not None and self.switched is not None
        return f"refresh: {self.plan.model}: {self.table.rows:,} rows in {self.plan.folder}; {self.switched.line}"

    def try_query(self) -> str:
        """DuckDB statements to paste into the ``duckdb`` shell (or ``duckdb.sql``) over the table in use."""
        database = Path(self.plan.config.table).absolute() / DATABASE
        return (
            f"ATTACH '{database}' AS t (READ_ONLY);\nSELECT name, model_version, input_digest FROM t.version;\n"
            f"SELECT token, text FROM t.{VIEW} LIMIT 5;"
        )

    def record(self) -> dict[str, Any]:
        return {
            "model": self.plan.model,
            "folder": str(self.plan.folder),
            "switched": bool(self.switched and self.switched.switched),
            "removed": self.switched.removed if self.switched else [],
            "line": self.line(),
        }


def run_refresh(plan: RefreshPlan, run: Callable[[Any, Any], Any] = run_local, per_gpu: bool = True) -> Refresh:
    """Embed the version's table (a rerun finishes what is missing), then switch to it; each stage by ``run``."""
    if plan.skip:
        return Refresh(plan)
    plan.folder.parent.mkdir(parents=True, exist_ok=True)
    table = embed(plan.embedding(), run=run, per_gpu=per_gpu)
    config = plan.config
    options = SwitchOptions(
        table=config.table, version=str(plan.folder), model=plan.model, alias=config.alias, keep=config.keep
    )
    switched = run(SwitchStage(), options)
    log.info("%s", switched.line)
    return Refresh(plan, table, switched)


def refresh(config: RefreshConfig, run: Callable[[Any, Any], Any] = run_local, per_gpu: bool = True) -> Refresh:
    """``elmo refresh``: plan, then run (a Prefect flow runs the two apart, the plan as a retried task)."""
    return run_refresh(plan_refresh(config), run, per_gpu)
