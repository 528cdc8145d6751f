"""A full disk in every stage, on a real small filesystem (a tmpfs this test mounts; skipped where it cannot): one
line naming the folder and the free space, exit 2, no traceback; nothing complete lost; no temporary file or half
folder left once the same command is run again with space; and that rerun's output equal to a run that had space."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import h5py
import numpy as np
import pyarrow.dataset as ds
import pytest
import torch
import yaml

from elmo_core.data.vocab import estimate_vocab
from elmo_core.errors import DiskFullError, disk_full
from elmo_core.fileio import format_bytes, free_bytes, remove_stale_temps, require_space
from elmo_core.ingest import shard_paths
from elmo_core.options import VocabConfig
from elmo_core.train.checkpoint import list_checkpoints, problem, write_checkpoint
from elmo_core.vectors.ann.build import plan_build
from elmo_core.vectors.ann.files import table_bytes
from tests.helpers import ROOT, run_elmo

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODEL = FIXTURES / "allennlp_elmo"  # the tiny AllenNLP test model: width 32, 3 layers
TRAIN_DATA = FIXTURES / "bilm_tf" / "train"


# ----- a real small filesystem ---------------------------------------------------------------------------


@contextmanager
def tmpfs(folder: Path, size_kb: int) -> Iterator[Path]:
    """A tmpfs of ``size_kb`` mounted on ``folder`` for the block (root only, as CI runs); skipped where it cannot."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(mounted.stderr or mounted.stdout).strip()}); needs root")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path, leave: int) -> Path:
    """Another process's file: takes all the free space of ``folder``'s filesystem but ``leave`` bytes.

    The job under test may be writing while this runs, so the free space read can shrink before the allocation:
    then it reads again and tries again, as a second writer racing the first would."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for _ in range(100):
            size = free_bytes(folder) - leave
            assert size > 0, f"{folder} has less than {leave} bytes free already"
            try:
                os.posix_fallocate(fd, 0, size)
                return filler
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                os.ftruncate(fd, 0)
        raise AssertionError(f"{folder}: the free space kept shrinking under the filler")
    finally:
        os.close(fd)


def limit_entries(folder: Path, spare: int | None) -> None:
    """Remount the tmpfs on ``folder`` with room for ``spare`` more files and folders (None: plenty): a write that
    fills the filesystem after the plan found the bytes free (the kernel reports running out of entries as ENOSPC)."""
    stat = os.statvfs(folder)
    entries = stat.f_files - stat.f_ffree + spare if spare is not None else 100_000
    subprocess.run(["mount", "-o", f"remount,nr_inodes={entries}", str(folder)], check=True)


def assert_disk_full_line(result: subprocess.CompletedProcess, command: str, folder: Path) -> str:
    """Exit 2, no traceback, and the last line the one line of a full disk naming ``folder``."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Segmentation" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    prefix = f"elmo {command}: error: {folder}: the disk is full ("
    assert line.startswith(prefix), line
    assert "free on the filesystem holding it); " in line and line.endswith("it continues"), line
    return line


def assert_refused(result: subprocess.CompletedProcess, command: str, folder: Path) -> str:
    """Exit 2, no traceback, and the last line the refusal of an output that does not fit."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"elmo {command}: error: {folder}"), line
    assert " needs about " in line and " free; " in line, line
    return line


def leftovers(folder: Path) -> list[str]:
    """Temporary files and folders (a writer's ``.NAME.<pid>-<hex>.tmp``, a swapped-out ``.old``) under ``folder``."""
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.name.endswith((".tmp", ".old")) or ".tmp" in p.name
    )


def digests(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` by relative path (but names in ``skip``)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def rows(table: Path, keys: tuple[str, ...]) -> list[dict]:
    """A Parquet dataset's rows, sorted by ``keys`` (so two tables of the same rows compare equal)."""
    data = ds.dataset(table, format="parquet").to_table().to_pylist()
    return sorted(data, key=lambda r: tuple(r[k] for k in keys))


def assert_same_table(table: Path, reference: Path) -> None:
    """The same rows (ids, tokens, text, model) and the same vectors, to the 1e-6 that ``test_stage`` holds two runs
    of one model to (a kernel may be chosen afresh per run)."""
    got, expected = rows(table, EMBED_KEYS), rows(reference, EMBED_KEYS)
    vector_columns = [name for name in expected[0] if name == "elmo" or name.startswith("layer_")]
    for name in vector_columns:
        vectors, wanted = [r.pop(name) for r in got], [r.pop(name) for r in expected]
        np.testing.assert_allclose(np.array(vectors), np.array(wanted), atol=1e-6, rtol=0, err_msg=name)
    assert got == expected


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 9,000 tokens of English prose: the start of the default corpus (Python's pydoc topics)."""
    from elmo_core.text.corpus import write_default_corpus

    folder = tmp_path_factory.mktemp("text")
    path, _ = write_default_corpus(folder / "corpus.txt")
    small = folder / "small.txt"
    small.write_bytes(path.read_bytes()[:60_000].rsplit(b"\n", 1)[0] + b"\n")
    return small


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory, text: Path) -> Path:
    out = tmp_path_factory.mktemp("ref") / "ingest"
    assert run_elmo("ingest", str(text), "--out", str(out), "--split-sentences").returncode == 0
    return out


# ----- one test per stage --------------------------------------------------------------------------------


def test_ingest(tmp_path, text, dataset):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    lines = text.read_text().splitlines(keepends=True)
    first.write_text("".join(lines[: len(lines) // 2]))
    second.write_text("".join(lines[len(lines) // 2 :]))
    reference = tmp_path / "reference"
    for source in (first, second):
        assert run_elmo("ingest", str(source), "--out", str(reference), "--split-sentences").returncode == 0
    with tmpfs(tmp_path / "disk", 2048) as disk:
        out = disk / "ingest"
        assert run_elmo("ingest", str(first), "--out", str(out), "--split-sentences").returncode == 0
        before = digests(out, skip=("_manifest.duckdb", "_manifest.duckdb.wal", ".ingest.lock"))
        filler = fill(disk, 16_000)
        result = run_elmo("ingest", str(second), "--out", str(out), "--split-sentences")
        assert_disk_full_line(result, "ingest", out)
        after = digests(out, skip=("_manifest.duckdb", "_manifest.duckdb.wal", ".ingest.lock"))
        assert {k: after.get(k) for k in before} == before  # the parts of the first input: all there, unchanged
        filler.unlink()
        assert run_elmo("ingest", str(second), "--out", str(out), "--split-sentences").returncode == 0
        assert leftovers(disk) == []
        keys = ("sentence_id",)
        assert rows(out, keys) == rows(reference, keys)


def test_vocab(tmp_path, dataset):
    """Refused by its plan where the estimate does not fit, before any file appears; failing anyway (the entries run
    out as DuckDB opens its WAL, the issue's ``Could not write file "vocab.duckdb.wal"``), the one line and no
    ``vocab.duckdb``, half or whole, nor a temporary; a dead writer's temporary folder removed by the next claim, and
    an earlier version's half database and its WAL replaced; the rerun equal to a run that had room all along."""
    reference = tmp_path / "reference" / "vocab.duckdb"
    assert run_elmo("vocab", "--corpus", str(dataset), "--db", str(reference)).returncode == 0
    with tmpfs(tmp_path / "disk", 4096) as disk:
        corpus = disk / "ingest"
        shutil.copytree(dataset, corpus)
        kept = digests(corpus)
        db = disk / "vocab" / "vocab.duckdb"
        vocab = ("vocab", "--corpus", str(corpus), "--db", str(db))
        estimate = estimate_vocab(VocabConfig(corpus=str(corpus), db=str(db)), shard_paths(corpus)).total
        filler = fill(disk, 200_000)
        line = assert_refused(run_elmo(*vocab), "vocab", db.parent)
        assert f" needs about {format_bytes(estimate)} for the vocabulary and its token ids; " in line
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "ingest"]  # not even the lock beside it
        filler.unlink()
        limit_entries(disk, 4)  # the lock, the folder, the temporary folder and its database; not the WAL
        line = assert_disk_full_line(run_elmo(*vocab), "vocab", db.parent)
        assert f"; no half of {db} was left; its inputs are untouched; " in line
        assert not db.exists() and leftovers(disk) == [] and digests(corpus) == kept
        limit_entries(disk, None)
        dead = db.parent / f".vocab.duckdb.{_dead_pid()}-0badc0de.tmp"  # what a writer killed mid-build leaves
        dead.mkdir()
        (dead / "vocab.duckdb").write_bytes(b"half")
        (dead / "vocab.duckdb.wal").write_bytes(b"log")
        db.write_bytes(b"half")  # and what a failed run of earlier versions left: half a database, and its log
        Path(f"{db}.wal").write_bytes(b"log")
        assert run_elmo(*vocab).returncode == 0
        assert leftovers(disk) == [] and sorted(p.name for p in db.parent.iterdir()) == sorted(
            p.name for p in reference.parent.iterdir()
        )
        assert (db.parent / "vocab.txt").read_bytes() == (reference.parent / "vocab.txt").read_bytes()
        for split in ("train", "heldout"):
            keys = ("sentence_id",)
            assert rows(db.parent / "token_ids" / split, keys) == rows(reference.parent / "token_ids" / split, keys)
        with duckdb.connect(str(db), read_only=True) as a, duckdb.connect(str(reference), read_only=True) as b:
            for table in ("vocab", "token_counts", "char_ids", "corpus_stats"):
                query = f"SELECT * FROM {table} ORDER BY ALL"
                assert a.execute(query).fetchall() == b.execute(query).fetchall(), table


def test_the_vocab_database_is_built_where_the_next_claim_cleans_up(tmp_path, dataset, monkeypatch):
    """``vocab.duckdb`` is built in a temporary folder of this writer beside it (``fileio.temp_path``), the one a
    claim removes once its writer is gone (killed mid-build: no ``finally`` ran), and renamed into place whole."""
    from elmo_core.data import vocab as module

    built = []
    fill_tables = module._fill

    def spy(con, config, shards, progress):
        built.append(Path(con.execute("SELECT path FROM duckdb_databases() WHERE NOT internal").fetchone()[0]))
        return fill_tables(con, config, shards, progress)

    monkeypatch.setattr(module, "_fill", spy)
    db = tmp_path / "vocab" / "vocab.duckdb"
    module.build_vocab(VocabConfig(corpus=str(dataset), db=str(db)))
    work = built[0].parent
    assert built[0].name == db.name and work.parent == db.parent and not work.exists() and db.exists()
    dead = db.parent / work.name.replace(f".{os.getpid()}-", f".{_dead_pid()}-")  # the same writer, killed
    (dead / "spill").mkdir(parents=True)
    (dead / "vocab.duckdb.wal").write_bytes(b"log")
    assert remove_stale_temps(db.parent) == [dead] and not dead.exists()


@pytest.fixture(scope="module")
def fixture_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bilm-tf's training fixture, ingested and counted (its own vocab.txt)."""
    root = tmp_path_factory.mktemp("fixture")
    ingest = run_elmo("ingest", str(TRAIN_DATA / "data.txt"), "--out", str(root / "ingest"), "--heldout-fraction", "0")
    assert ingest.returncode == 0, ingest.stderr
    vocab = run_elmo(
        "vocab", "--corpus", str(root / "ingest"), "--db", str(root / "vocab" / "vocab.duckdb"),
        "--vocab-file", str(TRAIN_DATA / "vocab.txt"),
    )  # fmt: skip
    assert vocab.returncode == 0, vocab.stderr
    return root / "vocab"


def _train_config(folder: Path, data: Path) -> Path:
    from tests.test_train import FIXTURE_OPTIONS

    config = folder / "train.yaml"
    options = {**FIXTURE_OPTIONS, "data": str(data), "checkpoint_every": 10, "keep_checkpoints": 2, "seed": 3}
    config.write_text(yaml.safe_dump(options))
    return config


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_train(tmp_path, fixture_vocab):
    """A resume its plan finds no room for is refused before a byte changes; one another process fills the disk under
    stops at its next checkpoint naming the last verified one; the rerun with ``--resume`` trains as a run that had
    room all along."""
    config = _train_config(tmp_path, fixture_vocab)
    reference = tmp_path / "reference"
    assert run_elmo("train", "--config", str(config), "--out", str(reference), "--max-steps", "30").returncode == 0
    with tmpfs(tmp_path / "disk", 3072) as disk:
        out = disk / "run"
        assert run_elmo("train", "--config", str(config), "--out", str(out), "--max-steps", "10").returncode == 0
        first = list_checkpoints(out)[-1]
        kept = digests(out)
        resume = ("train", "--config", str(config), "--out", str(out), "--max-steps", "30", "--resume")
        filler = fill(disk, 150_000)  # less than one checkpoint of 390 kB
        line = assert_refused(run_elmo(*resume), "train", out)
        assert " for the checkpoints (keep 2) and the export; " in line and digests(out) == kept
        filler.unlink()
        command = [sys.executable, "-m", "elmo_core.cli", *resume]
        job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said = []
        for said_line in job.stderr:  # type: ignore[union-attr]
            said.append(said_line)
            if "resumed from " in said_line:
                break  # the plan found room: now another process takes it, before the checkpoint of step 20
        fill(disk, 150_000)
        stdout, stderr = job.communicate(timeout=300)
        result = subprocess.CompletedProcess(command, job.returncode, stdout, "".join(said) + stderr)
        line = assert_refused(result, "train", out / "checkpoints")
        assert f"the last verified checkpoint {first} (step 10) is kept" in line and "--resume" in line
        assert list_checkpoints(out) == [first] and problem(first) is None
        (disk / "filler").unlink()
        resumed = run_elmo(*resume)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert leftovers(disk) == []
        assert _losses(out) == _losses(reference) and len(_losses(reference)) == 30
        model, expected = digests(out / "model"), digests(reference / "model")
        assert model == expected


def test_a_checkpoint_write_that_fails_names_the_last_verified(tmp_path):
    """torch's own writer on a full disk (``unexpected pos``, ``file write failed``): one ``DiskFullError`` naming the
    checkpoint a rerun resumes from; the failed write leaves no temporary file."""
    with tmpfs(tmp_path / "disk", 512) as disk:
        first = write_checkpoint(disk, 10, {"step": 10, "weights": torch.zeros(16_000)}, keep=2)
        # an estimate that is wrong (a numpy array, which it does not count): the room check passes, the write runs
        # out of space in torch's writer
        with pytest.raises(DiskFullError) as failed:
            write_checkpoint(disk, 20, {"step": 20, "blob": np.zeros(75_000)}, keep=2)
        message = str(failed.value)
        assert message.startswith(f"{disk / 'checkpoints'}: the disk is full (")
        assert f"the last verified checkpoint {first} (step 10) is kept" in message and "--resume" in message
        assert disk_full(failed.value.__cause__)  # torch's error, as torch raised it, is kept as the cause
        assert list_checkpoints(disk) == [first] and problem(first) is None
        assert leftovers(disk) == []


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, fixture_vocab: Path) -> Path:
    root = tmp_path_factory.mktemp("trained")
    config = _train_config(root, fixture_vocab)
    result = run_elmo("train", "--config", str(config), "--out", str(root / "run"), "--max-steps", "20")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.slow
def test_export(tmp_path, trained_run):
    reference = tmp_path / "reference"
    assert run_elmo("export", "--run", str(trained_run), "--out", str(reference)).returncode == 0
    step_10 = str(list_checkpoints(trained_run)[0])
    with tmpfs(tmp_path / "disk", 1024) as disk:
        model = disk / "model"
        assert run_elmo("export", "--checkpoint", step_10, "--out", str(model)).returncode == 0
        kept = digests(model)
        filler = fill(disk, 100_000)  # less than the weights (199 kB)
        assert_refused(run_elmo("export", "--run", str(trained_run), "--out", str(model)), "export", model)
        assert digests(model) == kept  # the model that was there: whole, unchanged
        fresh = disk / "fresh"
        assert_refused(run_elmo("export", "--run", str(trained_run), "--out", str(fresh)), "export", fresh)
        assert not fresh.exists() and leftovers(disk) == []  # refused before any file appeared
        # what an export killed mid-write leaves: a temporary folder beside the model, a temporary file in it
        dead = _dead_pid()
        (disk / f".model.{dead}-0badc0de.tmp").mkdir()
        (disk / f".model.{dead}-0badc0de.tmp" / "options.json").write_text("{}")
        (model / f".weights.hdf5.{dead}-0badc0de.tmp").write_bytes(b"half")
        filler.unlink()
        assert run_elmo("export", "--run", str(trained_run), "--out", str(model)).returncode == 0
        assert leftovers(disk) == []
        assert digests(model) == digests(reference)


@pytest.mark.slow
def test_an_export_that_fails_anyway_leaves_the_model_as_it_was(tmp_path, trained_run):
    """A write that fills the disk after the room was checked (here the filesystem's file entries, which the kernel
    reports as ENOSPC too): the one line, the model folder that was there unchanged, nothing half-made."""
    reference = tmp_path / "reference"
    assert run_elmo("export", "--run", str(trained_run), "--out", str(reference)).returncode == 0
    step_10 = str(list_checkpoints(trained_run)[0])
    with tmpfs(tmp_path / "disk", 2048) as disk:
        model = disk / "model"
        assert run_elmo("export", "--checkpoint", step_10, "--out", str(model)).returncode == 0
        kept = digests(model)
        stat = os.statvfs(disk)
        used = stat.f_files - stat.f_ffree
        # two entries left: the temporary folder and its options.json, not the weights beside them
        subprocess.run(["mount", "-o", f"remount,nr_inodes={used + 2}", str(disk)], check=True)
        line = assert_disk_full_line(
            run_elmo("export", "--run", str(trained_run), "--out", str(model)), "export", model
        )
        assert f"; {model} is as it was; " in line
        assert digests(model) == kept and leftovers(disk) == []
        subprocess.run(["mount", "-o", f"remount,nr_inodes={used + 100}", str(disk)], check=True)
        assert run_elmo("export", "--run", str(trained_run), "--out", str(model)).returncode == 0
        assert leftovers(disk) == [] and digests(model) == digests(reference)


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory, dataset: Path) -> Path:
    """The reference embedding table: 9,000 tokens of the dataset, in units of about 1,000 tokens."""
    out = tmp_path_factory.mktemp("emb") / "table"
    result = run_elmo(
        "embed", "--model", str(MODEL), "--input", str(dataset), "--out", str(out), "--unit-tokens", "1000"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


EMBED_KEYS = ("sentence_id", "token_index")


@pytest.mark.slow
def test_embed(tmp_path, dataset, table):
    """A table that does not fit is refused by the plan before any file appears; one that fits but meets a disk
    another process fills while it runs ends in the one line, its finished units complete; a rerun with space
    finishes the table as a run with space all along."""
    with tmpfs(tmp_path / "disk", 4096) as disk:
        out = disk / "table"
        embed = ("embed", "--model", str(MODEL), "--input", str(dataset), "--out", str(out), "--unit-tokens", "1000")
        filler = fill(disk, 400_000)  # about a third of the table's 1.1 MB
        assert_refused(run_elmo(*embed), "embed", out)
        assert not out.exists() and leftovers(disk) == []
        filler.unlink()
        command = [sys.executable, "-m", "elmo_core.cli", *embed]
        job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while not list(out.glob("part-*.parquet")) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polls for the job's first finished unit, then another process takes the space
        fill(disk, 20_000)
        stdout, stderr = job.communicate(timeout=300)
        line = assert_disk_full_line(subprocess.CompletedProcess(command, job.returncode, stdout, stderr), "embed", out)
        parts = sorted(out.glob("part-*.parquet"))
        assert parts and f"its {len(parts)} finished part file" in line
        for part in parts:  # each finished unit complete: the reference's rows, not one fewer
            assert_same_table(part, table / part.name)
        (disk / "filler").unlink()  # space freed
        resumed = run_elmo(*embed)
        assert resumed.returncode == 0 and f"({len(parts)} already done)" in resumed.stdout, resumed.stderr[-3000:]
        assert leftovers(disk) == []
        assert_same_table(out, table)


def test_index(tmp_path, table):
    """Refused by its plan where the index does not fit, before any file of it appears; failing anyway (the entries
    run out in the middle of a shard), the one line, the table untouched; the rerun with room equal to a run that had
    room all along."""
    reference = tmp_path / "reference"
    shutil.copytree(table, reference)
    assert run_elmo("index", str(reference), "--shard-rows", "3000").returncode == 0
    with tmpfs(tmp_path / "disk", 1400) as disk:  # the table (1.1 MB), not its index (2.1 MB) too
        out = disk / "table"
        shutil.copytree(table, out)
        kept = digests(out)
        estimate = plan_build(out, None, 3000).bytes_to_write()
        line = assert_refused(run_elmo("index", str(out), "--shard-rows", "3000"), "index", out / "_index" / "elmo")
        assert f" needs about {format_bytes(estimate)} for the index; " in line
        assert not (out / "_index").exists() and digests(out) == kept
        subprocess.run(["mount", "-o", "remount,size=5120k", str(disk)], check=True)  # the estimate's 2.4 MB free
        limit_entries(disk, 8)  # the folders, the lock, the quantizer, the header, three of the first shard's files
        assert_disk_full_line(run_elmo("index", str(out), "--shard-rows", "3000"), "index", out)
        assert {k: v for k, v in digests(out).items() if not k.startswith("_index")} == kept
        limit_entries(disk, None)
        assert run_elmo("index", str(out), "--shard-rows", "3000").returncode == 0
        assert leftovers(disk) == []
        assert digests(out / "_index", skip=("lock",)) == digests(reference / "_index", skip=("lock",))


def test_verbose_shows_the_traceback_of_the_full_disk(tmp_path, dataset):
    with tmpfs(tmp_path / "disk", 4096) as disk:
        db = disk / "vocab" / "vocab.duckdb"
        limit_entries(disk, 4)  # DuckDB cannot open its WAL
        result = run_elmo("-v", "vocab", "--corpus", str(dataset), "--db", str(db))
        assert result.returncode == 2 and "Traceback" in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"elmo vocab: error: {db.parent}: the disk is full")


# ----- looking before writing ----------------------------------------------------------------------------


def test_require_space_refuses_what_does_not_fit_in_one_line(tmp_path):
    with tmpfs(tmp_path / "disk", 1024) as disk:
        require_space(disk / "out", 500_000, "the table")
        with pytest.raises(
            Exception, match=r"out needs about 2\.0 MB for the table; the filesystem holding it has 1\.0"
        ):
            require_space(disk / "out", 2_000_000, "the table")
        assert not (disk / "out").exists()


@pytest.mark.parametrize(
    "layers, dtype, compression", [("mix", "float32", "none"), ("all", "float16", "none"), ("all", "float32", "zstd")]
)
@pytest.mark.slow
def test_the_table_estimate_against_real_parquet(tmp_path, dataset, layers, dtype, compression):
    """A real table: the estimate is never short, and within 10% where nothing is compressed (``files.py`` has the
    measurements of every ``--layers`` × ``--dtype`` × ``--pool`` × ``--compression``; under zstd layer 0, one vector
    per word type, compresses far better on a small table, and the estimate counts it in full)."""
    out = tmp_path / "table"
    result = run_elmo(
        "embed", "--model", str(MODEL), "--input", str(dataset), "--out", str(out), "--layers", layers,
        "--dtype", dtype, "--compression", compression,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    parts = list(out.glob("part-*.parquet"))
    written = sum(p.stat().st_size for p in parts)
    n_rows = ds.dataset(out, format="parquet").count_rows()
    estimate = table_bytes(n_rows, 3, 32, dtype, layers, "none", compression, parts=len(parts))
    assert written <= estimate <= written * (1.1 if compression == "none" else 1.5)


def test_the_weights_are_made_in_memory_and_equal_to_the_fixture(tmp_path):
    """The weight file written without HDF5 touching the disk reads back bit for bit (no segfault path left)."""
    from elmo_core import BiLM

    bilm = BiLM.from_pretrained(str(MODEL / "options.json"), str(MODEL / "lm_weights.hdf5"))
    bilm.save_pretrained(str(tmp_path / "m"))
    with h5py.File(MODEL / "lm_weights.hdf5") as a, h5py.File(tmp_path / "m" / "weights.hdf5") as b:
        names: list[str] = []
        a.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in names:
            assert np.asarray(b[name]).tobytes() == np.asarray(a[name], dtype=np.float32).tobytes(), name


# ----- the plans' estimates against what real runs write --------------------------------------------------
#
# Each estimate is checked both ways: a filesystem with exactly the estimate free (rounded up to its pages) is room
# enough for the run, at its largest (a WAL beside its database, a new shard beside the old); and it is not more than
# three times what the run leaves written.


def _written(folder: Path) -> int:
    """The bytes of the files under ``folder`` (its lock left out: a claim's, not the stage's output)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name not in ("lock", ".lock"))


def _just_room(disk: Path, estimate: int) -> Path:
    """Another process's file leaving ``estimate`` bytes free, rounded up to the filesystem's pages."""
    page = os.statvfs(disk).f_frsize
    return fill(disk, -(-estimate // page) * page)


@pytest.fixture(scope="module")
def default_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All of the repo's default corpus (40,291 tokens, 6,258 types: the vocab estimate's WAL at 2 MB)."""
    from elmo_core.text.corpus import write_default_corpus

    folder = tmp_path_factory.mktemp("default")
    path, _ = write_default_corpus(folder / "corpus.txt")
    assert run_elmo("ingest", str(path), "--out", str(folder / "ingest"), "--split-sentences").returncode == 0
    return folder / "ingest"


@pytest.mark.parametrize("corpus", ["dataset", "default_dataset"])
def test_the_vocab_estimate_is_room_enough(tmp_path, request, corpus):
    """``--plan`` prints the estimate and writes nothing; a disk with just that free holds the run (its database
    and WAL at their largest); the estimate is at most 3x what the run leaves written."""
    source = request.getfixturevalue(corpus)
    with tmpfs(tmp_path / "disk", 8192) as disk:
        db = disk / "vocab" / "vocab.duckdb"
        vocab = ("vocab", "--corpus", str(source), "--db", str(db))
        estimate = estimate_vocab(VocabConfig(corpus=str(source), db=str(db)), shard_paths(source)).total
        planned = run_elmo(*vocab, "--plan")
        assert planned.returncode == 0 and f": about {format_bytes(estimate)} to write (vocab.duckdb " in planned.stdout
        assert list(disk.iterdir()) == []
        _just_room(disk, estimate)
        done = run_elmo(*vocab)
        assert done.returncode == 0, done.stderr[-3000:]
        assert estimate <= 3 * _written(db.parent)


@pytest.mark.parametrize(
    "options",
    [{}, {"max_size": 100}, {"token_ids": False}, {"vocab_file": str(TRAIN_DATA / "vocab.txt")}],
    ids=["counted", "max-size", "no-token-ids", "imported"],
)
def test_the_vocab_estimate_against_real_builds(tmp_path, dataset, options):
    """Never short of what a build leaves written, nor more than 3x it (``vocab.py`` has the measurements)."""
    from elmo_core.data.vocab import build_vocab

    config = VocabConfig(corpus=str(dataset), db=str(tmp_path / "vocab" / "vocab.duckdb"), **options)
    estimate = estimate_vocab(config, shard_paths(dataset)).total
    build_vocab(config)
    written = _written(tmp_path / "vocab")
    assert written <= estimate <= 3 * written


def test_the_vocab_plan_of_nothing_to_count_is_one_line(tmp_path):
    """No shards yet: the plan estimates an empty database and the work says there is nothing to count; a missing
    vocabulary file to import: refused by the plan in its own line, not an ``OSError``."""
    from elmo_core.data.vocab import VocabStage
    from elmo_core.errors import InputError

    empty = VocabConfig(corpus=str(tmp_path / "none"), db=str(tmp_path / "vocab" / "vocab.duckdb"))
    assert "0 tokens, about 0 types: about 1.5 MB to write" in VocabStage().plan(empty).lines()[1]
    missing = empty.model_copy(update={"vocab_file": str(tmp_path / "vocab.txt")})
    with pytest.raises(InputError, match="vocabulary file not found"):
        VocabStage().plan(missing)
    assert not (tmp_path / "vocab").exists()


def _index_estimate(table: Path, shard_rows: int) -> int:
    return plan_build(table, None, shard_rows).bytes_to_write()


def test_the_index_estimate_is_room_enough(tmp_path, table):
    """``--plan`` prints the estimate and writes nothing; a disk with just that free holds the index."""
    with tmpfs(tmp_path / "disk", 8192) as disk:
        out = disk / "table"
        shutil.copytree(table, out)
        estimate = _index_estimate(out, 3000)
        planned = run_elmo("index", str(out), "--shard-rows", "3000", "--plan")
        assert planned.returncode == 0 and f"; about {format_bytes(estimate)} to write, " in planned.stdout
        assert not (out / "_index").exists()
        _just_room(disk, estimate)
        done = run_elmo("index", str(out), "--shard-rows", "3000")
        assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("shard_rows", [3000, 100_000])
def test_the_index_estimate_against_real_builds(tmp_path, table, shard_rows):
    """Never short of the index a build writes, nor more than 3x it (``files.py`` has the measurements); a rebuild
    counts what it removes first."""
    from elmo_core.vectors.ann.build import build_index

    copy = tmp_path / "table"
    shutil.copytree(table, copy)
    estimate = _index_estimate(copy, shard_rows)
    summary = build_index(copy, shard_rows=shard_rows)
    written = _written(summary.folder)
    assert written <= estimate <= 3 * written
    assert plan_build(copy, None, shard_rows).bytes_to_write() == 0  # up to date: nothing to write
    assert plan_build(copy, None, shard_rows, rebuild=True).bytes_to_write() <= estimate - written // 2


@pytest.mark.slow
def test_the_training_plan_looks_before_writing(tmp_path, fixture_vocab):
    """``--plan`` prints the estimate; a run it does not fit is refused in one line before any file appears; one with
    just that free runs to the end (its checkpoints, export and metrics), the estimate at most 3x what it wrote."""
    from elmo_core.options import TrainConfig
    from elmo_core.train.plan import plan_training

    config = _train_config(tmp_path, fixture_vocab)
    with tmpfs(tmp_path / "disk", 3072) as disk:
        out = disk / "run"
        train = ("train", "--config", str(config), "--out", str(out), "--max-steps", "20")
        options = TrainConfig(**yaml.safe_load(config.read_text()), out=str(out), max_steps=20)
        estimate = plan_training(options).space.total
        planned = run_elmo(*train, "--plan")
        assert (
            planned.returncode == 0 and f"about {format_bytes(estimate)} to write (2 checkpoints of" in planned.stdout
        )
        filler = fill(disk, estimate // 2)
        line = assert_refused(run_elmo(*train), "train", out)
        assert f" needs about {format_bytes(estimate)} for the checkpoints (keep 2) and the export; " in line
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
        filler.unlink()
        _just_room(disk, estimate)
        done = run_elmo(*train)
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(list_checkpoints(out)) == 2 and (out / "model" / "weights.hdf5").exists()
        assert estimate <= 3 * _written(out)


# ----- the tracking store, and the flows' runner ---------------------------------------------------------


@pytest.mark.slow
def test_a_full_tracking_store_is_a_warning_and_the_training_goes_on(tmp_path, fixture_vocab, trained_run):
    config = _train_config(tmp_path, fixture_vocab)
    with tmpfs(tmp_path / "store", 1400) as store:  # the store's tables, not the checkpoint, model and code too
        out = tmp_path / "run"
        result = run_elmo(
            "train", "--config", str(config), "--out", str(out), "--max-steps", "20", "--tracking", "mlflow",
            "--tracking-uri", f"sqlite:///{store}/mlflow.db",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        warning = next(line for line in result.stderr.splitlines() if "could not store" in line)
        assert "(the disk holding it is full) for part of the run; not logged: " in warning
        assert "No space left on device" in warning or "database or disk is full" in warning
        assert digests(out / "model") == digests(trained_run / "model")  # trained as a run without tracking


@pytest.mark.slow
@pytest.mark.prefect
def test_the_embed_flow_says_the_same_line(tmp_path, dataset, table, prefect_home):
    """The flows' runner maps a full disk as the command does: the flow fails with the one line, no traceback."""
    from elmo_core.options import EmbedConfig
    from tests.helpers import run_module

    with tmpfs(tmp_path / "disk", 4096) as disk:  # the table fits: another process fills the disk as it runs
        out = disk / "table"
        config = EmbedConfig(model=str(MODEL), input=str(dataset), out=str(out), unit_tokens=1000)
        # the flow's own temporary Prefect server
        env = {**os.environ, "PREFECT_HOME": str(prefect_home(tmp_path / "prefect"))}
        command = [sys.executable, "-m", "flows.embed", config.model_dump_json()]
        job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not list(out.glob("part-*.parquet")) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polls for the flow's first finished unit
        fill(disk, 20_000)
        stdout, stderr = job.communicate(timeout=300)
        flow = subprocess.CompletedProcess(command, job.returncode, stdout, stderr)
        assert flow.returncode == 1 and "Traceback" not in flow.stderr, flow.stderr[-3000:]
        line = next(line for line in flow.stderr.splitlines() if line.startswith("embed: failed: "))
        assert line.startswith(
            f"embed: failed: Flow run encountered an exception: DiskFullError: {out}: the disk is full ("
        )
        parts = sorted(out.glob("part-*.parquet"))
        assert parts and f"its {len(parts)} finished part file" in line
        (disk / "filler").unlink()  # space freed
        assert run_module("flows.embed", config.model_dump_json(), env=env).returncode == 0
        assert leftovers(disk) == []
        assert_same_table(out, table)


def test_the_flows_boundary_maps_a_real_full_disk(tmp_path):
    """``flows.common.disk_full_as_one_line``, around every task of the main job and every ``run_stage``: the kernel's
    ENOSPC becomes the one line naming the stage's folder, the original kept as its cause."""
    from flows.common import disk_full_as_one_line

    with tmpfs(tmp_path / "disk", 64) as disk:
        with pytest.raises(DiskFullError) as failed, disk_full_as_one_line(disk / "out"):
            (disk / "big").write_bytes(b"x" * 200_000)
        assert str(failed.value).startswith(f"{disk / 'out'}: the disk is full (")
        assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.errno == 28
